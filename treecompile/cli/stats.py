"""``treecompile stats``: what sharing a set of trajectories offers (POR, tokens, paths per tree)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from treecompile.cli.args import check_output_file, int_at_least, output_console, require_plot
from treecompile.cli.inputs import CHAT_KINDS, DEFAULT_CHAT_TOKENIZER, load_input_trees
from treecompile.core.advice import low_por_advice

__all__ = ["add_command", "run"]


# Tables longer than this show the first rows and a count of the rest (--rows changes it).
_DEFAULT_ROWS = 60

_KIND_LABELS = {
    "sequences": "token sequences JSONL",
    "conversations": "conversations JSONL",
    "trees": "trees JSONL",
    "tau_bench": "tau-bench JSON",
    "tau2": "tau2 simulation JSON",
    "gsm8k": "GSM8K model solutions JSONL",
}


def add_command(sub: argparse._SubParsersAction) -> None:
    from treecompile.chat.to_tree import SAMPLES, THINK

    p = sub.add_parser(
        "stats",
        help="size and overlap (POR) of the trees a file makes",
        description=(
            "Builds one tree per group (tau-bench / tau2 task, 'group' field of JSONL records) and prints "
            "per-tree paths, nodes, tokens, POR = 1 - tree_tokens / path_tokens, depth and branching, "
            "with a total row (total POR = 1 - sum(tree tokens) / sum(path tokens))."
        ),
    )
    p.add_argument(
        "file",
        help="JSONL of token sequences, conversations or trees; a tau-bench or tau2 JSON file; "
        "GSM8K example_model_solutions.jsonl; or sample:tau_bench / sample:gsm8k / sample:think",
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        help=f"for chat input: cl100k, sample, bytes, a tokenizer.json path, or a Hugging Face tokenizer folder (its "
             f"chat template renders the chats, as in training) (default {DEFAULT_CHAT_TOKENIZER})",
    )
    p.add_argument("--samples", choices=SAMPLES, default="conversation", help="paths per conversation (chat input)")
    p.add_argument("--think", choices=THINK, default="last", help="which turns keep their reasoning (chat input)")
    p.add_argument(
        "--keep-tool-call-ids",
        action="store_true",
        help="render tool-call ids as they are instead of call_0, call_1, ... (chat input)",
    )
    p.add_argument(
        "--group-by",
        choices=("task", "all"),
        default="task",
        help="task: one tree per task / group (default); all: the whole file as one tree",
    )
    p.add_argument("--limit", type=int_at_least(1), default=None, metavar="N", help="only the first N trees")
    p.add_argument("--rows", type=int_at_least(0), default=_DEFAULT_ROWS, metavar="N", help="table rows to print (all with --json)")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON instead of a table")
    p.add_argument(
        "--plot", metavar="FILE.png", default=None,
        help="also draw histograms of the trees' POR, depth and branching as a PNG (needs the [plot] extra)",
    )
    p.set_defaults(func=run)


def _total(stats: list[Any]) -> dict[str, Any]:
    tree_tokens = sum(s.tree_tokens for s in stats)
    path_tokens = sum(s.path_tokens for s in stats)
    return {
        "tree_tokens": tree_tokens,
        "path_tokens": path_tokens,
        "por": 1.0 - tree_tokens / path_tokens if path_tokens else 0.0,
        "n_trees": len(stats),
        "n_paths": sum(s.n_paths for s in stats),
        "n_nodes": sum(s.n_nodes for s in stats),
        "depth_nodes": max(s.depth_nodes for s in stats),
        "depth_tokens": max(s.depth_tokens for s in stats),
        "max_branching": max(s.max_branching for s in stats),
    }


def _drift_total(trees: list[Any], names: list[str]) -> dict[str, Any] | None:
    reports = [(n, t.metadata.get("drift")) for n, t in zip(names, trees)]
    reports = [(n, r) for n, r in reports if r]
    if not reports:
        return None
    examples = [{"tree": n, **ex} for n, r in reports for ex in r["examples"]][:5]
    return {
        "tokenizer": reports[0][1]["tokenizer"],
        "conversations": sum(r["conversations"] for _, r in reports),
        "drifting": sum(r["drifting"] for _, r in reports),
        "trees_drifting": sum(1 for _, r in reports if r["drifting"]),
        "examples": examples,
    }


def run(args: argparse.Namespace) -> int:
    """``treecompile stats FILE``: per-tree and total size and overlap of a file's trees."""

    if args.plot is not None:  # before any work: a wrong name costs nothing, and never an input file
        args.plot = str(check_output_file("--plot", args.plot, ".png", inputs=[args.file, args.tokenizer]))
        require_plot("--plot")
    inputs = load_input_trees(args)
    path, kind, tokenizer, names, trees = inputs.path, inputs.kind, inputs.tokenizer, inputs.names, inputs.trees
    chat_input = kind in CHAT_KINDS
    stats = [t.stats() for t in trees]
    total = _total(stats)
    drift = _drift_total(trees, names)
    header = {
        "file": str(path),
        "kind": kind,
        "records": inputs.records,
        "tokenizer": tokenizer.name if tokenizer is not None else None,
        "tokenizer_default": chat_input and args.tokenizer is None,
        "samples": args.samples if chat_input else None,
        "think": args.think if chat_input else None,
        "group_by": args.group_by,
        "seconds": round(inputs.seconds, 3),
    }
    if args.plot is not None:
        from treecompile.cli.plots import save_png, stats_figure

        save_png(stats_figure(names, stats, total, title=str(path)), args.plot)
        header["plot"] = str(args.plot)
    if args.json:
        out = {
            **header,
            "trees": [{"name": n, **s.as_dict()} for n, s in zip(names, stats)],
            "total": total,
            "drift": drift,
            "advice": low_por_advice(total["por"]),
        }
        print(json.dumps(out, indent=1))
        return 0
    console = output_console()
    _print_stats(console, header, names, stats, total, drift, args)
    return 0


def _print_stats(
    console: Any,
    header: dict[str, Any],
    names: list[str],
    stats: list[Any],
    total: dict[str, Any],
    drift: dict[str, Any] | None,
    args: argparse.Namespace,
) -> None:
    from rich.table import Table

    console.print(f"[bold]treecompile stats[/bold] {header['file']}")
    line = f"{_KIND_LABELS[header['kind']]}: {header['records']} records -> {total['n_trees']} trees"
    if header["tokenizer"] is not None:
        default = " (default for chat input)" if header["tokenizer_default"] else ""
        line += f"; tokenizer {header['tokenizer']}{default}; samples={header['samples']}, think={header['think']}"
    console.print(line)

    table = Table(show_footer=False, pad_edge=False)
    table.add_column("tree", overflow="fold")
    for col in ("paths", "nodes", "tree tok", "path tok", "POR", "depth", "depth tok", "max br"):
        table.add_column(col, justify="right")

    def row(name: str, s: dict[str, Any], style: str | None = None) -> None:
        table.add_row(
            name,
            str(s["n_paths"]),
            str(s["n_nodes"]),
            str(s["tree_tokens"]),
            str(s["path_tokens"]),
            f"{s['por']:.3f}",
            str(s["depth_nodes"]),
            str(s["depth_tokens"]),
            str(s["max_branching"]),
            style=style,
        )

    shown = max(args.rows, 0)
    for name, s in zip(names[:shown], stats[:shown]):
        row(name, s.as_dict())
    if len(names) > shown:
        table.add_row(f"... {len(names) - shown} more (--rows, --json)", *[""] * 8)
    table.add_section()
    row("total", total, style="bold")
    console.print(table)
    pors = [s.por for s in stats]
    console.print(
        f"total POR {total['por']:.3f} (per tree {min(pors):.3f} to {max(pors):.3f}); "
        f"speed-up bound 1/(1-POR) = {1 / max(1 - total['por'], 1e-12):.2f}x; built in {header['seconds']:.2f} s"
    )
    advice = low_por_advice(total["por"])
    if advice is not None:
        console.print(f"[yellow]advice:[/yellow] {advice}")
    if "plot" in header:
        console.print(f"charts of POR, depth and branching written to {header['plot']}")
    console.print(_drift_line(drift))


def _drift_line(drift: dict[str, Any] | None) -> str:
    if drift is None:
        return "drift: not applicable (token input)"
    text = (
        f"drift ({drift['tokenizer']}): {drift['drifting']} of {drift['conversations']} conversations tokenize "
        "differently as a whole than message by message"
    )
    if drift["examples"]:
        ex = drift["examples"][0]
        text += (
            f"; first: tree {ex['tree']}, conversation {ex['conversation']}, message {ex['message']}, "
            f"near {json.dumps(ex['excerpt'], ensure_ascii=False)}"
        )
    return text


# ---------------------------------------------------------------------------- entry point
