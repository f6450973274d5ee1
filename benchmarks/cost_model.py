"""The cost model's prediction against the CPU allocator's measured peak of one training step.

For each of `tests/test_budget.py`'s tiny float32 configs (attention-bound, head-bound,
layer-bound) and each length S: one path of S random tokens, one accumulation micro-step
(forward, backward into existing gradients) plus AdamW's step, measured as the test
measures it (`measure_peak_bytes` plus the live parameters, gradients and optimizer
state), against `CostModel.peak_bytes(S)` and the branch that sets it. Prints a Markdown
table and the environment (the table in docs/partitioning.md).

    python benchmarks/cost_model.py [--lengths 64 512 1024]
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import platform
import sys

import torch
import transformers

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from test_budget import CONFIGS, _config, _live_bytes  # the test's configs and measurement

import treecompile
from treecompile.compile.wrapper import tree_compile
from treecompile.planning.budget import CostModel, measure_peak_bytes


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[64, 512, 1024])
    args = ap.parse_args(argv)
    print("| config | S | measured bytes | predicted bytes | error | largest branch |")
    print("|---|---|---|---|---|---|")
    for name in CONFIGS:
        cfg = _config(name)
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(cfg).float()
        compiled = tree_compile(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        cost = CostModel.from_config(cfg, dtype="float32", device="cpu", optimizer="adamw")
        for s in args.lengths:
            ids = torch.randint(0, cfg.vocab_size, (s,), generator=torch.Generator().manual_seed(s)).tolist()
            batch = treecompile.pack(treecompile.TrajectoryTree.from_sequences([ids]), warn_por=False)

            def step(compiled=compiled, batch=batch, opt=opt):
                compiled(batch).loss.backward()
                opt.step()

            step()  # compiles; creates the gradients and the optimizer state
            gc.collect()
            measured = _live_bytes(model, opt) + measure_peak_bytes(step)
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
