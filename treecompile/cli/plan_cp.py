"""``treecompile plan FILE --cp K``: each tree's packed row split over K context-parallel ranks.

Prints, per tree, the split by work (`treecompile.distributed.cp_split.split_for_cp`: attention pairs,
dense rows and LM-head rows weighed by the model's FLOPs) against the split by row count,
each rank's share, and the K and V bytes a rank receives per layer: the root path of its
first row (what its queries see, and what treecompile's exchange moves), against every other
rank's rows under an all-gather (what a flat-sequence CP moves). With ``--stream MODE
--capacity C``: each tree streamed over the ranks, C rows per rank (`plan_stream_cp_report`).
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import numpy as np

__all__ = ["DEFAULT_DIMS", "plan_cp_report", "plan_stream_cp_report"]

#: The work model without --config: Qwen3-8B's dimensions.
DEFAULT_DIMS = dict(layers=36, hidden=4096, intermediate=12288, heads=32, kv_heads=8, head_dim=128, vocab=151936)


def _cost_model(args: argparse.Namespace) -> tuple[Any, str]:
    """The cost model of --config (else of Qwen3-8B's dimensions) and the step's options."""
    from treecompile.cli.args import load_config
    from treecompile.planning.budget import CostModel, ModelDims

    if getattr(args, "config", None):
        path, config = load_config(args.config)
        source = str(path)
    else:
        config, source = ModelDims(**DEFAULT_DIMS), "Qwen3-8B dimensions (--config for your model's)"
    return CostModel.from_config(config, dtype=args.dtype, optimizer=args.optimizer, device=args.device), source


def plan_cp_report(names: list[str], trees: list[Any], header: dict[str, Any], args: argparse.Namespace,
                   start: float) -> int:
    """Splits each tree's row over ``args.cp`` ranks; prints the table (or JSON)."""
    from treecompile.core.batch import pack
    from treecompile.distributed.cp_split import RowWork, equal_rows_split, split_for_cp

    cost, source = _cost_model(args)
    dims, dtype_bytes = cost.dims, cost.dtype_bytes
    work = RowWork.from_dims(dims)
    out_trees = []
    for name, tree in zip(names, trees):
        batch = pack(tree, warn_por=False)
        if batch.num_tokens < args.cp:
            raise ValueError(f"tree {name} has {batch.num_tokens} tokens, fewer than --cp {args.cp} ranks")
        split = split_for_cp(batch, args.cp, work, align=args.cp_align or 1)
        rows = equal_rows_split(batch, args.cp, work, align=args.cp_align or 1)
        out_trees.append({
            "name": name,
            "tokens": batch.num_tokens,
            "bounds": split.bounds.tolist(),
            "rows": split.rows.tolist(),
            "attention_pairs": split.attention_pairs.tolist(),
            "head_rows": split.head_rows.tolist(),
            "work_share": [round(x, 4) for x in split.shares()],
            "imbalance": round(split.imbalance(), 4),
            "imbalance_by_rows": round(rows.imbalance(), 4),
            "kv_bytes_needed": split.kv_bytes(dims.kv_heads, dims.head_dim, dtype_bytes).tolist(),
            "kv_bytes_all_gather": split.kv_bytes(dims.kv_heads, dims.head_dim, dtype_bytes, gather="all").tolist(),
            "peak_bytes": split.peak_bytes(cost).tolist(),
            "peak_bytes_all_gather": split.peak_bytes(cost, gather="all").tolist(),
            "peak_bytes_one_rank": int(split_for_cp(batch, 1, work).peak_bytes(cost)[0]),
        })
    out = {**header, "cp": args.cp, "align": args.cp_align or 1, "work_model": source, "dtype": args.dtype,
           "optimizer": args.optimizer, "device": args.device,
           "trees": out_trees, "seconds": round(time.perf_counter() - start, 3)}
    return _emit(out, args, _print)


def _print(out: dict[str, Any], rows: int) -> None:
    _table(out, rows, [f"[bold]treecompile plan[/bold] {out['file']}: each tree's row over {out['cp']} CP ranks",
                       f"work model: {out['work_model']}; K/V in {out['dtype']}; cuts on multiples of {out['align']} "
                       "rows"],
           ["tokens", "rank rows", "work share", "max/mean", "by rows", "K/V in per layer", "all-gather",
            "peak GB/rank", "1 rank"],
           lambda t: (str(t["tokens"]), " ".join(map(str, t["rows"])), " ".join(f"{x:.2f}" for x in t["work_share"]),
                      f"{t['imbalance']:.3f}", f"{t['imbalance_by_rows']:.3f}", f"{max(t['kv_bytes_needed']):,}",
                      f"{max(t['kv_bytes_all_gather']):,}", f"{max(t['peak_bytes']) / 1e9:.2f}",
                      f"{t['peak_bytes_one_rank'] / 1e9:.2f}"),
           "max/mean: the largest rank's work over the mean, split by work; by rows: split into equal row "
           "counts. K/V in per layer: the most any rank receives, the root path of its first row (what "
           "it moves); all-gather: every other rank's rows, padded to the longest (for comparison). "
           "Peak: the largest rank's predicted "
           f"step ({out['optimizer']}, {out['device']}; parameters, gradients and optimizer state on every "
           "rank, its rows' activations, the K/V it received for every layer), against one rank's")


def plan_stream_cp_report(names: list[str], trees: list[Any], header: dict[str, Any], args: argparse.Namespace,
                          start: float) -> int:
    """``--cp K --stream MODE --capacity C``: per tree, streamed parts of at most ``K x C``
    rows, each split over the K ranks (`treecompile.distributed.stream_cp`): the parts, the stack's
    depth, the rows a rank gathers per layer and the rows every rank keeps on the stack at
    most, and each rank's predicted peak (`stream_cp_peak_bytes`) against one process
    streaming parts of as many rows as a rank holds. A tree whose split gives no rank more
    than C rows runs as one CP call (its row: ``parts`` 1). With ``--budget-bytes B`` instead
    of C: one CP call where every rank's predicted peak is within B, else the parts (and, for
    ``auto``, the mode) `choose_stream` picks within B."""
    from treecompile.core.batch import pack
    from treecompile.distributed.cp_split import RowWork, split_for_cp
    from treecompile.stream.plan import plan_stream, stream_peak_bytes
    from treecompile.distributed.stream_cp import choose_stream_cp, split_parts, stream_cp_peak_bytes

    budget = getattr(args, "budget_bytes", None)
    if budget is None and args.capacity is None:
        raise ValueError("--cp with --stream needs --capacity C (the rows one rank holds at once) or --budget-bytes B "
                         "with --config (one rank's step)")
    cost, source = _cost_model(args)
    work = RowWork.from_dims(cost.dims)
    k, mode = args.cp, args.stream
    c = None if budget is not None else args.capacity
    out_trees = []
    for name, tree in zip(names, trees):
        batch = pack(tree, warn_por=False)
        row = {"name": name, "tokens": batch.num_tokens, "mode": mode}
        whole = split_for_cp(batch.padded(k), k, work)
        if int(whole.peak_bytes(cost).max()) <= budget if budget is not None else int(whole.rows.max()) <= c:
            row.update(parts=1, stack_depth=1, rows_per_rank=int(whole.rows.max()),
                       gathered_rows=int(whole.ancestor_rows.max()), kept_rows=0,
                       peak_bytes=whole.peak_bytes(cost).tolist(),
                       peak_bytes_one_process=int(split_for_cp(batch, 1).peak_bytes(cost)[0]))
            out_trees.append(row)
            continue
        if budget is not None:
            choice, splits, kept = choose_stream_cp(batch, cost, budget, mode, "subtree", k)
            plan, row["mode"] = choice.plan, choice.mode
        else:
            plan = plan_stream(batch, k * c)
            splits, kept = split_parts(batch, plan, k)
        per_rank = int(max(np.diff(s.bounds).max() for s in splits))
        row.update(parts=plan.num_parts, stack_depth=plan.stack_depth, rows_per_rank=per_rank,
                   gathered_rows=int(max(len(x) for s in splits for x in s.inside)),
                   kept_rows=int(max((len(x) for x in kept), default=0)),
                   peak_bytes=stream_cp_peak_bytes(plan, splits, kept, cost, row["mode"]).tolist(),
                   peak_bytes_one_process=int(stream_peak_bytes(plan_stream(batch, per_rank), cost, row["mode"])))
        out_trees.append(row)
    out = {**header, "cp": k, "stream": mode, "capacity": c, "work_model": source, "dtype": args.dtype,
           "optimizer": args.optimizer, "device": args.device, "trees": out_trees,
           "seconds": round(time.perf_counter() - start, 3)}
    return _emit(out, args, _print_streamed)


def _emit(out: dict[str, Any], args: argparse.Namespace, printer) -> int:
    """``out`` as JSON (``--json``) or through ``printer(out, rows)``."""
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        printer(out, args.rows)
    return 0


def _table(out: dict[str, Any], rows: int, heading: list[str], columns: list[str], cells, notes: str) -> None:
    """The report: ``heading`` lines, a table of the first ``rows`` trees (``cells(tree)``
    under ``columns``, after the tree's name), ``notes`` and the planning time."""
    from rich.table import Table

    from treecompile.cli.args import output_console

    console = output_console()
    for line in heading:
        console.print(line)
    table = Table(pad_edge=False)
    table.add_column("tree", overflow="fold")
    for col in columns:
        table.add_column(col, justify="right")
    for t in out["trees"][: max(rows, 0)]:
        table.add_row(t["name"], *cells(t))
    if len(out["trees"]) > rows:
        table.add_row(f"... {len(out['trees']) - rows} more (--rows, --json)", *[""] * len(columns))
    console.print(table)
    console.print(notes)
    console.print(f"planned in {out['seconds']:.2f} s")


def _print_streamed(out: dict[str, Any], rows: int) -> None:
    limit = (f"{out['capacity']} rows per rank" if out["capacity"] is not None
             else f"{out['budget']['budget_bytes']:,} bytes per rank")
    _table(out, rows, [f"[bold]treecompile plan[/bold] {out['file']}: each tree streamed over {out['cp']} CP ranks, "
                       f"{limit}, {out['stream']} mode", f"work model: {out['work_model']}; K/V in {out['dtype']}"],
           ["tokens", "parts", "mode", "depth", "rows/rank", "gathered", "kept", "peak GB/rank", "1 process"],
           lambda t: (str(t["tokens"]), str(t["parts"]), t["mode"], str(t["stack_depth"]), str(t["rows_per_rank"]),
                      str(t["gathered_rows"]), str(t["kept_rows"]), f"{max(t['peak_bytes']) / 1e9:.2f}",
                      f"{t['peak_bytes_one_process'] / 1e9:.2f}"),
           "parts: 1 where the tree's CP split gives no rank more than the capacity (one CP call). "
           "rows/rank: the most rows a rank holds of a part; gathered: the most rows of a part a rank "
           "gathers from the part's earlier ranks per layer (K and V); kept: the most rows of one part "
           "every rank keeps on the stack. Peak: the largest rank's predicted step "
           f"({out['optimizer']}, {out['device']}), against one process streaming parts of a rank's rows "
           "(one call: the whole tree)")
