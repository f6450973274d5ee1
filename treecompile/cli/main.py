"""The ``treecompile`` command line.

Example::

    treecompile stats sample:tau_bench --tokenizer sample
    treecompile stats trajectories.json --samples assistant_turns --json

Each subcommand is two functions, ``_add_<name>_parser(subparsers)`` (its arguments) and
``cmd_<name>(args) -> int`` (the work), registered in :data:`COMMANDS`. Errors in the
input (:class:`TreeInputError`, a bad option, a missing optional package) print one line
and exit with status 2, not a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

from treecompile.core.advice import low_por_advice
from treecompile.cli.args import _installed, check_cuda, device_name, int_at_least, por_value, progress_bar, require_plot
from treecompile.core.errors import TreeInputError
from treecompile.cli.inputs import CHAT_KINDS, DEFAULT_CHAT_TOKENIZER, load_input_trees

__all__ = ["COMMANDS", "build_parser", "cmd_bench", "cmd_stats", "main"]

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


# ---------------------------------------------------------------------------- argument checks
# Checked while parsing, before any command imports torch: a bad value costs no start-up time.


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line: ``treecompile CMD: error: ...``, status 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


# ---------------------------------------------------------------------------- stats


def _add_stats_parser(sub: argparse._SubParsersAction) -> None:
    from treecompile.data.chat import SAMPLES, THINK

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
        help=f"for chat input: cl100k, sample, bytes or a tokenizer.json path (default {DEFAULT_CHAT_TOKENIZER})",
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
    p.set_defaults(func=cmd_stats)


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


def cmd_stats(args: argparse.Namespace) -> int:
    """``treecompile stats FILE``: per-tree and total size and overlap of a file's trees."""
    from rich.console import Console

    if args.plot is not None:
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
    console = Console(highlight=False)
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

#: Subcommands: each adds its parser and sets ``func``.
def _add_plan_parser(sub: argparse._SubParsersAction) -> None:
    from treecompile.cli.plan import add_plan_command

    add_plan_command(sub)


def _add_inspect_parser(sub: argparse._SubParsersAction) -> None:
    from treecompile.cli.inspect_cmd import add_inspect_command

    add_inspect_command(sub)


def _add_tune_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "tune",
        help="time FlexAttention kernel options on this GPU and print a new options table",
        description=(
            "Times FlexAttention forward + backward on a tree mask for candidate tile sizes, warps and stages "
            "per head dim and dtype, and prints the fastest as the table for treecompile/kernels/flex_options.py. "
            "Needs a CUDA GPU (exit status 2 without one)."
        ),
    )
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 128], metavar="D")
    p.add_argument("--dtypes", nargs="+", default=["bfloat16"], choices=["bfloat16", "float16", "float32"])
    p.add_argument("--rows", type=int, default=16384, metavar="S", help="tree rows (default 16384)")
    p.add_argument("--repeats", type=int, default=10, metavar="N")
    p.add_argument("--json", default=None, metavar="FILE", help="also write every timing to FILE")
    p.add_argument("--write", default=None, metavar="FILE",
                   help="also write the table as JSON: TREECOMPILE_FLEX_OPTIONS=FILE makes treecompile use it")
    p.add_argument("--time-budget", type=float, default=None, metavar="S",
                   help="start no new candidate after S seconds")
    p.set_defaults(func=cmd_tune)


def cmd_tune(args: argparse.Namespace) -> int:
    """Times FlexAttention kernel options on this GPU (treecompile/kernels/flex_options.py)."""
    from treecompile.kernels.flex_options import cmd_tune as tune

    return tune(args)


def _add_bench_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help="time tree training against per-path training with sequence packing",
        description=(
            "Trains a small Qwen3-shaped model (random weights) one step at a time on synthetic trees of "
            "controlled POR and on the bundled tau-bench / GSM8K samples, per-path packed ('packed') and as "
            "trees ('bitmask', 'interval' masks); prints step time, path tokens/s, speedup over packed and "
            "its fraction of the FLOP bound 1/(1-POR), and checks each method's loss against the packed loss."
        ),
    )
    p.add_argument("--quick", action="store_true", help="the quick configuration (default; a few minutes on CPU)")
    p.add_argument("--tiny", action="store_true", help="a seconds-long configuration (smoke test)")
    p.add_argument("--path-tokens", type=int_at_least(4), default=None, metavar="N",
                   help="path tokens per synthetic workload")
    p.add_argument("--paths", type=int_at_least(2), default=None, metavar="P", help="paths per synthetic tree")
    p.add_argument("--por", type=por_value, nargs="+", default=None, metavar="X", help="synthetic POR values")
    p.add_argument("--repeats", type=int_at_least(1), default=None, metavar="N", help="timed steps (median reported)")
    p.add_argument("--methods", nargs="+", default=None, metavar="M", help="subset of: packed bitmask interval")
    p.add_argument("--device", type=device_name, default=None,
                   help="cpu, cuda or cuda:N (default: cuda when available)")
    p.add_argument("--arch", default=None, choices=("qwen3", "qwen3_next"),
                   help="model family: qwen3 (default) or qwen3_next (Gated DeltaNet + attention)")
    p.add_argument("--markdown", action="store_true", help="print a Markdown table instead of a rich one")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.set_defaults(func=cmd_bench)


def cmd_bench(args: argparse.Namespace) -> int:
    """Runs the benchmark; exit status 1 if some method's loss differs from the per-path loss."""
    check_cuda(args.device)  # before the model and the workloads are built
    if not _installed("transformers"):
        raise ImportError("treecompile bench trains a Hugging Face Qwen3 model: pip install 'treecompile[hf]'")
    if args.device == "cuda":  # real model shapes and HF baselines: treecompile/bench/cuda.py
        from treecompile.bench.cuda import cmd_bench_cuda

        return cmd_bench_cuda(args)

    from rich.console import Console

    from treecompile.bench import trees as bench

    cfg = bench.with_overrides(
        bench.TINY if args.tiny else bench.QUICK,
        path_tokens=args.path_tokens, paths=args.paths, repeats=args.repeats,
        pors=tuple(args.por) if args.por else None, methods=tuple(args.methods) if args.methods else None,
        arch=args.arch,
    )
    err = Console(stderr=True)
    quiet = args.json or args.markdown
    bar = progress_bar("bench", _bench_measurements(cfg), min_total=1)
    with bar:
        def step(text: str) -> None:
            # One call per (workload, method) measurement: a line in logs, a bar on a terminal.
            if bar.disable:
                err.print(f"[dim]{text}")
            else:
                bar.update(bar.task_ids[0], description=text)
                bar.advance(bar.task_ids[0])

        result = bench.run_bench(cfg, device=args.device, progress=None if quiet else step)
    if args.json:
        print(json.dumps(result.as_dict(), indent=2))
    elif args.markdown:
        print(bench.markdown_table(result))
    else:
        # Wide enough for every column even when the output is not a terminal (rich assumes 80).
        Console(width=max(Console().width, 150)).print(bench.render_table(result))
    for line in bench.noise_warnings(result):
        print(f"treecompile bench: warning: {line}", file=sys.stderr)
    bad = [f"{r.workload}/{r.method}" for r in result.rows if not r.exact]
    if bad:
        print(f"treecompile bench: loss differs from per-path training: {', '.join(bad)}", file=sys.stderr)
        return 1
    return 0


def _bench_measurements(cfg: Any) -> int:
    """How many (workload, method) measurements ``bench.run_bench(cfg)`` makes."""
    from treecompile.data import samples as data

    workloads = len(cfg.pors) + min(cfg.tau_tasks, len(data.sample_tau_bench())) + (1 if cfg.gsm8k_groups else 0)
    return workloads * len(cfg.methods)


COMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [
    _add_stats_parser, _add_plan_parser, _add_inspect_parser, _add_bench_parser, _add_tune_parser
]


def build_parser() -> argparse.ArgumentParser:
    from treecompile.core.version import __version__

    parser = _Parser(
        prog="treecompile", description="Exact language-model training on prefix trees of trajectories."
    )
    parser.add_argument("--version", action="version", version=f"treecompile {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for add in COMMANDS:
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line; returns the exit status (0 ok, 2 bad input)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (TreeInputError, ValueError, ImportError, OSError) as exc:
        print(f"treecompile {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
