"""The cost model's prediction against the CPU allocator's measured peak of one training step.

For each of `tests/test_budget.py`'s tiny configs (attention-bound, head-bound, layer-bound,
tied embeddings), in float32 or another dtype, with or without gradient checkpointing, and
each length S: one path of S random tokens, one accumulation micro-step
(forward, backward into existing gradients) plus AdamW's step, measured as the test
measures it (`measure_peak_bytes` plus the live parameters, gradients and optimizer
state), against `CostModel.peak_bytes(S)` and the branch that sets it. Prints a Markdown
table and the environment (the table in docs/partitioning.md).

    python benchmarks/cost_model.py [--lengths 64 512 1024] [--dtype bfloat16] [--checkpointing layer]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys

import torch
import transformers

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from test_budget import CONFIGS, cpu_training, measured_step_peak, one_path  # the test's configs and measurement

from treecompile.compile.wrapper import tree_compile


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[64, 512, 1024])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--checkpointing", default="none", choices=["none", "layer"])
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    args = ap.parse_args(argv)
    print(f"{args.dtype}, checkpointing={args.checkpointing}\n")
    print("| config | S | measured bytes | predicted bytes | error | largest branch |")
    print("|---|---|---|---|---|---|")
    for name in args.configs:
        cfg, model, opt, cost = cpu_training(name, args.dtype, args.checkpointing)
        compiled = tree_compile(model)
        for s in args.lengths:
            measured = measured_step_peak(compiled, one_path(cfg.vocab_size, s), model, opt)
            predicted = cost.peak_bytes(s)
            branches = [int(p.eval(s)) for p in cost.polynomials()]
            branch = cost.branches[branches.index(max(branches))].name
            print(f"| {name} | {s} | {measured:,} | {predicted:,} | {predicted / measured - 1:+.1%} | {branch} |",
                  flush=True)
    print(f"\nDevice: CPU, {os.cpu_count()} cores ({platform.processor() or platform.machine()}); torch "
          f"{torch.__version__}, transformers {transformers.__version__}, Python {platform.python_version()}; "
          f"{datetime.date.today()}; command: python benchmarks/cost_model.py "
          f"{' '.join(argv if argv is not None else sys.argv[1:])}")


if __name__ == "__main__":
    main()
