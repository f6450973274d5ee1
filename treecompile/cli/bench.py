"""``treecompile bench``: tree training against per-path training (``--device cuda``: `treecompile.bench.cuda`)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from treecompile.cli.args import _installed, check_cuda, check_output_file, device_name, int_at_least, por_value, progress_bar
from treecompile.core.interrupt import raise_if_interrupted
from treecompile.data.io import write_json

__all__ = ["add_command", "measurements", "run"]



#: The methods ``--methods`` takes (`treecompile.bench.trees.METHODS`, named here so that the
#: help needs no torch).
BENCH_METHODS = ("packed", "bitmask", "interval", "fused")

def add_command(sub: argparse._SubParsersAction) -> None:
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
    size = p.add_mutually_exclusive_group()  # one configuration: giving both is a mistake, not a choice
    size.add_argument("--quick", action="store_true", help="the quick configuration (default; a few minutes on CPU)")
    size.add_argument("--tiny", action="store_true", help="a seconds-long configuration (smoke test)")
    p.add_argument("--path-tokens", type=int_at_least(4), default=None, metavar="N",
                   help="path tokens per synthetic workload")
    p.add_argument("--paths", type=int_at_least(2), default=None, metavar="P", help="paths per synthetic tree")
    p.add_argument("--por", type=por_value, nargs="+", default=None, metavar="X", help="synthetic POR values")
    p.add_argument("--repeats", type=int_at_least(1), default=None, metavar="N", help="timed steps (median reported)")
    p.add_argument("--methods", nargs="+", default=None, metavar="M", help=f"subset of: {' '.join(BENCH_METHODS)}")
    p.add_argument("--device", type=device_name, default=None,
                   help="cpu, cuda or cuda:N (default: cuda when available)")
    p.add_argument("--arch", default=None, choices=("qwen3", "qwen3_next"),
                   help="model family: qwen3 (default) or qwen3_next (Gated DeltaNet + attention)")
    p.add_argument("--out", default=None, metavar="FILE.json",
                   help="also write the results as JSON to FILE.json, rewritten after every measurement: "
                        "a run stopped with Ctrl-C keeps the rows it measured")
    output = p.add_mutually_exclusive_group()
    output.add_argument("--markdown", action="store_true", help="print a Markdown table instead of a rich one")
    output.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Runs the benchmark; exit status 1 if some method's loss differs from the per-path loss."""
    check_cuda(args.device)  # before the model and the workloads are built
    if args.out is not None:
        args.out = str(check_output_file("--out", args.out, ".json"))
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
    bar = progress_bar("bench", measurements(cfg), min_total=1)
    with bar:
        def step(text: str) -> None:
            # One call per (workload, method) measurement: a line in logs, a bar on a terminal;
            # a Ctrl-C that a callback inside the last one swallowed stops the run here.
            raise_if_interrupted()
            if quiet:
                return
            if bar.disable:
                err.print(f"[dim]{text}")
            else:
                bar.update(bar.task_ids[0], description=text)
                bar.advance(bar.task_ids[0])

        def save(result: Any) -> None:  # whole or not at all, after each measurement
            write_json(args.out, result.as_dict())

        result = bench.run_bench(cfg, device=args.device, progress=step, on_row=save if args.out else None)
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


def measurements(cfg: Any) -> int:
    """How many (workload, method) measurements ``bench.run_bench(cfg)`` makes."""
    from treecompile.data import samples as data

    workloads = len(cfg.pors) + min(cfg.tau_tasks, len(data.sample_tau_bench())) + (1 if cfg.gsm8k_groups else 0)
    return workloads * len(cfg.methods)
