"""The ``treecompile plan`` command: partitioning and sharding of a file's trees.

Example::

    treecompile plan ../shared/data/tau_bench/gpt-4o-airline-even-tasks.json --capacity 12000 --ranks 4

Prints, per tree, its parts under the token capacity C with POR and ERR (Tree Training
§4.1); the totals; then one global step over K ranks as `treecompile.planning.dataloader.plan_step`
builds it (paths sharded by AReaL-DTA Algorithm 4, partitioned, packed into micro-batches):
per-rank load and duplicated tokens, compared with greedy sharding by token count.

Registered by ``treecompile.cli.main`` as ``add_command(subparsers)``; ``run(args)``
does the work. Inputs are read as ``treecompile stats`` reads them.
"""

from __future__ import annotations

import argparse
import sys
import json
import time
from typing import Any

__all__ = ["add_command", "run"]


def add_command(sub: argparse._SubParsersAction) -> None:
    """Adds the ``plan`` subcommand to the CLI's subparsers."""
    from treecompile.chat.to_tree import SAMPLES, THINK
    from treecompile.cli.args import int_at_least
    from treecompile.planning.partition import METHODS
    from treecompile.distributed.shard import SHARD_METHODS

    p = sub.add_parser(
        "plan",
        help="split trees under a token capacity and shard them across ranks (POR, ERR, loads)",
        description=(
            "Partitions each tree into parts of at most --capacity tokens and plans one global step over "
            "--ranks ranks; prints the parts, POR = 1 - tree_tokens / path_tokens, "
            "ERR = 1 - partition_tokens / path_tokens, per-rank load and the duplicated tokens."
        ),
    )
    p.add_argument("file", help="the same inputs as 'treecompile stats' (tau-bench JSON, JSONL, sample:tau_bench)")
    p.add_argument(
        "--capacity", type=int_at_least(1), default=None, metavar="N",
        help="tokens per part / micro-batch (default: half the largest tree, at least the longest path)",
    )
    p.add_argument(
        "--budget-bytes", type=_bytes_amount, default=None, metavar="B",
        help="instead of --capacity: memory per part or micro-batch in bytes (e.g. 80e9); C is the largest that "
        "treecompile.planning.budget's cost model of --config predicts within B",
    )
    p.add_argument("--config", default=None, metavar="PATH",
                   help="with --budget-bytes: the model's Hugging Face config (a directory with config.json, or it)")
    # Defaults None: an option given without --budget-bytes would be ignored, so it is refused.
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32", "float64"), default=None,
                   help="with --budget-bytes: parameter dtype (default bfloat16)")
    p.add_argument("--optimizer", default=None,
                   help="with --budget-bytes: the optimizer whose state B holds (default adamw)")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None,
                   help="with --budget-bytes: where the step runs (its attention kernel; default cuda)")
    p.add_argument("--ranks", type=int_at_least(1), default=1, metavar="K", help="data-parallel ranks (default 1)")
    p.add_argument(
        "--cp", type=int_at_least(1), default=None, metavar="K",
        help="instead: split each tree's packed row over K context-parallel ranks by work (attention pairs, dense "
        "and LM-head rows weighed by --config's FLOPs; default Qwen3-8B's) and print each rank's share and the "
        "K/V bytes it receives per layer (treecompile.distributed.cp_split)",
    )
    p.add_argument("--cp-align", type=int_at_least(1), default=None, metavar="N",
                   help="with --cp: cut the row on multiples of N rows (an attention block; default 1)")
    p.add_argument("--method", choices=list(METHODS), default="greedy", help="partitioning method")
    p.add_argument("--shard", choices=list(SHARD_METHODS), default="dfs", help="sharding method")
    p.add_argument("--tokenizer", default=None, help="for chat input, as stats takes it: a tokenizer folder with a "
                   "chat template renders chats by it (default cl100k)")
    p.add_argument("--samples", choices=SAMPLES, default="conversation", help="paths per conversation (chat input)")
    p.add_argument("--think", choices=THINK, default="last", help="which turns keep their reasoning (chat input)")
    p.add_argument("--keep-tool-call-ids", action="store_true", help="keep tool-call ids as they are (chat input)")
    p.add_argument("--group-by", choices=("task", "all"), default="task", help="one tree per task, or one in all")
    p.add_argument("--limit", type=int_at_least(1), default=None, metavar="N", help="only the first N trees")
    p.add_argument("--rows", type=int_at_least(0), default=60, metavar="N", help="table rows to print")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.add_argument(
        "--stream", choices=("keep", "recompute", "auto"), default=None,
        help="plan streaming with a KV stack instead (treecompile.stream.options): parts of --capacity rows, no path limit; "
        "with --budget-bytes, per tree the largest parts whose whole streamed step fits B, and its predicted peak "
        "(auto: the mode with less work, too)",
    )
    p.add_argument(
        "--aux-loss", action="store_true",
        help="with --stream: the model adds a router auxiliary loss (MoE), whose gradient costs one more forward "
        "pass over every tree without a graph; counted in the forward rows and the ERR",
    )
    p.set_defaults(func=run)


def _bytes_amount(text: str) -> int:
    try:
        value = int(float(text))
    except (ValueError, OverflowError):
        raise argparse.ArgumentTypeError(f"expected a number of bytes (e.g. 80e9), got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 byte, got {text}")
    return value


#: Options that describe the step --budget-bytes is measured on, and their defaults.
BUDGET_OPTIONS = {"config": None, "dtype": "bfloat16", "optimizer": "adamw", "device": "cuda"}


def _budget_options(args: argparse.Namespace) -> None:
    """Refuses --config / --dtype / --optimizer / --device without --budget-bytes (they would be
    ignored); fills in their defaults."""
    given = [f"--{name}" for name in BUDGET_OPTIONS if getattr(args, name, None) is not None]
    if getattr(args, "cp", None) is not None:  # --cp reads the model and the step from them too
        given = []
    if given and getattr(args, "budget_bytes", None) is None:
        verb = "describes" if len(given) == 1 else "describe"
        raise ValueError(f"{', '.join(given)} {verb} the step that --budget-bytes is measured on, and no "
                         "--budget-bytes was given: add it, or leave it out")
    for name, default in BUDGET_OPTIONS.items():
        if getattr(args, name, None) is None:
            setattr(args, name, default)


def capacity_from_budget(args: argparse.Namespace) -> dict[str, Any]:
    """``--budget-bytes B --config PATH``: ``args.capacity`` becomes the largest C whose step
    `treecompile.planning.budget.CostModel` predicts within B; returns what the report says of it.

    Raises:
        ValueError: both --capacity and --budget-bytes, no --config, or a config that is not
            a Hugging Face config; `treecompile.planning.budget.BudgetError` if B does not fit one token.
    """
    from treecompile.planning.budget import CostModel

    if args.capacity is not None:
        raise ValueError("give --capacity (rows) or --budget-bytes (bytes), not both")
    if not args.config:
        raise ValueError("--budget-bytes needs --config PATH: the model's Hugging Face config (directory or file)")
    from treecompile.cli.args import load_config

    path, config = load_config(args.config)
    cost = CostModel.from_config(config, dtype=args.dtype, optimizer=args.optimizer, device=args.device)
    args.capacity = cost.capacity(args.budget_bytes)
    args.cost_model = cost  # --stream plans each tree's parts with it
    return {"budget_bytes": args.budget_bytes, "config": str(path), "dtype": args.dtype, "optimizer": args.optimizer,
            "device": args.device, "capacity": args.capacity}


def _load_trees(args: argparse.Namespace) -> tuple[list[str], list[Any], dict[str, Any]]:
    # The reading and tree building of `treecompile stats`, so both commands see the same trees.
    from treecompile.cli.inputs import load_input_trees

    inputs = load_input_trees(args)
    tokenizer = inputs.tokenizer
    header = {"file": str(inputs.path), "kind": inputs.kind, "tokenizer": tokenizer.name if tokenizer is not None else None}
    return inputs.names, inputs.trees, header


def run(args: argparse.Namespace) -> int:
    """``treecompile plan FILE``: partition, POR, ERR, per-rank load and duplicated tokens."""
    start = time.perf_counter()
    _check_options(args)
    _budget_options(args)
    budget = capacity_from_budget(args) if getattr(args, "budget_bytes", None) is not None else None
    names, trees, header = _load_trees(args)
    if budget is not None:
        header["budget"] = budget
    if getattr(args, "stream", None) and getattr(args, "cp", None) is not None:
        from treecompile.cli.plan_cp import plan_stream_cp_report

        return plan_stream_cp_report(names, trees, header, args, start)
    if getattr(args, "stream", None):
        from treecompile.stream.options import plan_stream_report

        return plan_stream_report(names, trees, header, args, start)
    if getattr(args, "cp", None) is not None:
        from treecompile.cli.plan_cp import plan_cp_report

        return plan_cp_report(names, trees, header, args, start)
    return _partition_report(names, trees, header, args, start)


def _check_options(args: argparse.Namespace) -> None:
    """Refuses an option given without the one it works with."""
    if getattr(args, "cp_align", None) is not None and getattr(args, "cp", None) is None:
        raise ValueError("--cp-align sets where a context-parallel split cuts the row: give it with --cp")
    if getattr(args, "aux_loss", False) and not getattr(args, "stream", None):
        raise ValueError("--aux-loss counts the extra forward pass of a streamed step: give it with --stream")
    if getattr(args, "stream", None) == "auto" and getattr(args, "budget_bytes", None) is None:  # (with --cp too)
        raise ValueError("--stream auto chooses the mode by memory: give --budget-bytes (and --config)")
    if getattr(args, "cp", None) is not None and getattr(args, "budget_bytes", None) and not getattr(args, "stream", None):
        raise ValueError("--cp plans a context-parallel split of each whole row: --budget-bytes plans streamed parts, "
                         "give it with --stream")


def _partition_report(names: list[str], trees: list[Any], header: dict, args: argparse.Namespace, start: float) -> int:
    """The data-parallel plan: each tree partitioned under the capacity, the step's micro-batches
    sharded over the ranks (against greedy token balancing), printed or as JSON."""
    from treecompile.cli.args import progress_bar
    from treecompile.planning.dataloader import plan_step
    from treecompile.planning.partition import partition_tree, path_lengths
    from treecompile.distributed.shard import shard_paths

    if args.ranks < 1:
        raise ValueError(f"--ranks must be at least 1, got {args.ranks}")
    n_paths = sum(t.num_paths for t in trees)
    if args.ranks > n_paths:
        print(f"treecompile plan: warning: --ranks {args.ranks} is more than the {n_paths} paths: "
              f"{args.ranks - n_paths} ranks get no work", file=sys.stderr)
    longest = max(int(path_lengths(t).max()) for t in trees)
    capacity = args.capacity
    if capacity is None:
        capacity = max(-(-max(t.num_tokens for t in trees) // 2), longest)
    check_capacity_all(names, trees, capacity)
    parts = []
    with progress_bar("partitioning", len(trees)) as bar:
        for t in trees:
            parts.append(partition_tree(t, capacity, method=args.method))
            bar.advance(bar.task_ids[0])
    step = plan_step(trees, capacity=capacity, ranks=args.ranks, method=args.method, shard_method=args.shard)
    baseline = shard_paths(trees, args.ranks, method="greedy_tokens") if args.ranks > 1 else None
    tree_tokens = sum(p.tree_tokens for p in parts)
    path_tokens = sum(p.path_tokens for p in parts)
    partition_tokens = sum(p.partition_tokens for p in parts)
    total = {
        "n_trees": len(trees),
        "n_parts": sum(len(p.parts) for p in parts),
        "tree_tokens": tree_tokens,
        "path_tokens": path_tokens,
        "partition_tokens": partition_tokens,
        "duplicated_tokens": partition_tokens - tree_tokens,
        "por": 1 - tree_tokens / path_tokens,
        "err": 1 - partition_tokens / path_tokens,
    }
    ranks = {
        "ranks": args.ranks,
        "shard_method": args.shard,
        "micro_steps": step.micro_steps,
        "rank_tokens": step.rank_tokens,
        "micro_tokens": step.micro_tokens(),
        "sharding": step.sharding.summary(),
        "duplicated_tokens": step.duplicated_tokens,
        "err": step.err,
        "baseline": baseline.summary() if baseline is not None else None,
    }
    out = {
        **header,
        "capacity": capacity,
        "capacity_default": args.capacity is None,
        "longest_path": longest,
        "method": args.method,
        "trees": [{"name": n, "n_paths": p.tree.num_paths, **p.summary()} for n, p in zip(names, parts)],
        "total": total,
        "step": ranks,
        "seconds": round(time.perf_counter() - start, 3),
    }
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    _print_plan(out, args.rows)
    return 0


def check_capacity_all(names: list[str], trees: list[Any], capacity: int) -> None:
    """Raises `CapacityError` if a path of any tree is longer than ``capacity``.

    The advice covers every tree: how many trees and paths do not fit, the worst few trees,
    and the one capacity that fits every path of every tree.
    """
    from treecompile.planning.partition import CapacityError, path_lengths

    lengths = [path_lengths(t) for t in trees]
    over = [
        (name, int((ls > capacity).sum()), int(ls.max())) for name, ls in zip(names, lengths) if ls.max() > capacity
    ]
    if not over:
        return
    longest = max(m for _, _, m in over)
    n_paths = sum(len(ls) for ls in lengths)
    over.sort(key=lambda o: -o[2])
    shown = ", ".join(f"{name} ({k} path(s), longest {m})" for name, k, m in over[:5])
    shown += f", and {len(over) - 5} more" if len(over) > 5 else ""
    raise CapacityError(
        f"--capacity {capacity}: {len(over)} of {len(trees)} trees have paths longer than C "
        f"({sum(k for _, k, _ in over)} of {n_paths} paths; a path is never split): {shown}. "
        f"--capacity {longest} fits every path of every tree."
    )


def _print_plan(out: dict[str, Any], rows: int) -> None:
    from treecompile.cli.args import output_console
    from rich.table import Table

    console = output_console()
    cap = f"C = {out['capacity']} tokens" + (" (default: half the largest tree)" if out["capacity_default"] else "")
    if out.get("budget"):
        cap += f" (the cost model's tokens within --budget-bytes {out['budget']['budget_bytes']:,})"
    console.print(f"[bold]treecompile plan[/bold] {out['file']}")
    console.print(f"{cap}; longest path {out['longest_path']}; partitioning: {out['method']}")
    table = Table(pad_edge=False)
    table.add_column("tree", overflow="fold")
    for col in ("paths", "tree tok", "path tok", "parts", "max part", "dup tok", "POR", "ERR"):
        table.add_column(col, justify="right")
    for t in out["trees"][: max(rows, 0)]:
        shown = str(max(t["part_tokens"]))
        table.add_row(
            t["name"], str(t["n_paths"]), str(t["tree_tokens"]), str(t["path_tokens"]),
            str(t["n_parts"]), shown, str(t["duplicated_tokens"]), f"{t['por']:.3f}", f"{t['err']:.3f}",
        )
    if len(out["trees"]) > rows:
        table.add_row(f"... {len(out['trees']) - rows} more (--rows, --json)", *[""] * 8)
    tot = out["total"]
    table.add_section()
    table.add_row(
        "total", str(sum(t["n_paths"] for t in out["trees"])), str(tot["tree_tokens"]), str(tot["path_tokens"]), str(tot["n_parts"]), "",
        str(tot["duplicated_tokens"]), f"{tot['por']:.3f}", f"{tot['err']:.3f}", style="bold",
    )
    console.print(table)
    console.print(
        f"POR {tot['por']:.3f}, ERR {tot['err']:.3f}: partitioning duplicates {tot['duplicated_tokens']} tokens "
        f"({tot['duplicated_tokens'] / max(tot['tree_tokens'], 1):.1%} of the tree tokens)"
    )
    st = out["step"]
    console.print(
        f"\n[bold]one step over {st['ranks']} rank(s)[/bold] (sharding: {st['shard_method']}, then partitioning, "
        f"micro-batches of <= C tokens): {st['micro_steps']} micro-step(s) per rank"
    )
    ranks = Table(pad_edge=False)
    for col in ("rank", "paths", "tree tok", "micro-batches (tokens)"):
        ranks.add_column(col, justify="right")
    for r, (tok, micro) in enumerate(zip(st["rank_tokens"], st["micro_tokens"])):
        ranks.add_row(str(r), str(st["sharding"]["rank_paths"][r]), str(tok), " ".join(str(m) for m in micro))
    console.print(ranks)
    loads = st["rank_tokens"]
    mean = sum(loads) / len(loads)
    console.print(
        f"duplicated tokens {st['duplicated_tokens']} (sharding {st['sharding']['duplicated_tokens']}, "
        f"the rest partitioning); load max {max(loads)} / mean {mean:.0f} = {max(loads) / mean:.3f}; "
        f"ERR of the step {st['err']:.3f}"
    )
    base = st["baseline"]
    if base is not None:
        sh = st["sharding"]
        console.print(
            f"sharding alone: {sh['method']} duplicates {sh['duplicated_tokens']} tokens, max/mean "
            f"{sh['imbalance']:.3f}; greedy by token count duplicates {base['duplicated_tokens']}, "
            f"max/mean {base['imbalance']:.3f}"
        )
    console.print(f"planned in {out['seconds']:.2f} s")
