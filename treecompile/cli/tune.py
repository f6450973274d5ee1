"""``treecompile tune``: FlexAttention kernel options timed on this GPU (`treecompile.kernels.attention.flex_options`)."""

from __future__ import annotations

import argparse
import json
import sys
import time

__all__ = ["add_command", "run"]


def add_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "tune",
        help="time FlexAttention kernel options on this GPU and print a new options table",
        description=(
            "Times FlexAttention forward + backward on a tree mask for candidate tile sizes, warps and stages "
            "per head dim and dtype, and prints the fastest as the table for treecompile/kernels/attention/flex_options.py. "
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
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Times FlexAttention kernel options on this GPU (treecompile/kernels/attention/flex_options.py)."""
    import torch

    from treecompile.kernels.attention.flex_options import format_table, save_table, tune

    if not torch.cuda.is_available():
        print("treecompile tune: no CUDA device; kernel options are tuned on the GPU they run on", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    best, timings = tune(
        args.head_dims, [getattr(torch, d) for d in args.dtypes], rows=args.rows, repeats=args.repeats,
        time_budget_s=getattr(args, "time_budget", None), progress=lambda s: print(s, file=sys.stderr, flush=True),
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(timings, f, indent=2)
    device = torch.cuda.get_device_name()
    note = f"measured by `treecompile tune --rows {args.rows}` on {device}, torch {torch.__version__}, " \
           f"{time.perf_counter() - t0:.0f} s; keys where torch's default won are absent"
    if getattr(args, "write", None):
        save_table(best, args.write, note)
    print(format_table(best, note))
    return 0
