"""Long paths on the CPU: a tree step against the unmodified model run on each path.

    python benchmarks/long_paths.py                    # paths of 10,000 and 30,000 tokens
    python benchmarks/long_paths.py --tokens 10000     # one length

The model is the `treecompile bench` one (Qwen3-shaped, 2 layers, hidden 128, 4 query / 2 key
heads of 32, float32, random weights). Three trees per length N:

- ``one path``: a single path of N tokens (POR 0: the tree's attention is the path's);
- ``two paths``: two paths of N tokens sharing the first N/2 (POR 0.25);
- ``branchy``: one path of N tokens with 16 side branches of 256 tokens leaving it at evenly
  spaced points (an agent's retried tool calls): the branches' key rows are not one run.

Methods: ``per path`` runs the unmodified model on each path (`treecompile.per_path_loss`:
SDPA, each path separately, the ground truth), ``interval`` and ``bitmask`` the tree-compiled
model with each mask. One warm-up step (the compile), then the median of ``--repeats`` timed
forward + backward steps; speedups are against ``per path`` on the same tree in the same run,
and each tree step's loss is checked against it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time

import torch

import treecompile as tc
from treecompile.bench.trees import QUICK, _model
from treecompile.core.reference import per_path_loss

METHODS = ("per path", "interval", "bitmask")
BRANCHES, BRANCH_LEN = 16, 256


def trees(n: int, vocab: int) -> dict[str, tc.TrajectoryTree]:
    g = torch.Generator().manual_seed(n)
    trunk = torch.randint(3, vocab, (n,), generator=g).tolist()
    second = trunk[: n // 2] + [1] + torch.randint(3, vocab, (n - n // 2 - 1,), generator=g).tolist()
    branchy = [trunk]
    for b in range(BRANCHES):
        at = (b + 1) * (n - BRANCH_LEN) // (BRANCHES + 1)
        branchy.append(trunk[:at] + [2] + torch.randint(3, vocab, (BRANCH_LEN - 1,), generator=g).tolist())
    return {"one path": tc.TrajectoryTree.from_sequences([trunk]),
            "two paths": tc.TrajectoryTree.from_sequences([trunk, second]),
            "branchy": tc.TrajectoryTree.from_sequences(branchy)}


def _timed(step, repeats: int) -> tuple[float, float]:
    loss = step()  # warm-up: the compile, the first allocations
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        loss = step()
        times.append(time.perf_counter() - start)
    return statistics.median(times), loss


def measure(n: int, repeats: int) -> list[dict]:
    model = _model(QUICK)
    rows = []
    for name, tree in trees(n, QUICK.vocab).items():
        stats = tree.stats()

        def per_path():
            model.zero_grad(set_to_none=True)
            loss = per_path_loss(model, [tree]).loss
            loss.backward()
            return loss.item()

        base_s, base_loss = _timed(per_path, repeats)
        rows.append({"tree": name, "tokens": n, "paths": stats.n_paths, "rows": stats.tree_tokens,
                     "path_tokens": stats.path_tokens, "method": "per path", "step_s": base_s, "speedup": 1.0,
                     "loss_rel_diff": 0.0})
        for mask in METHODS[1:]:
            compiled = tc.tree_compile(model, mask=mask)
            batch = tc.pack([tree], path_bits=mask == "bitmask", warn_por=False)

            def tree_step():
                model.zero_grad(set_to_none=True)
                loss = compiled(batch).loss
                loss.backward()
                return loss.item()

            step_s, loss = _timed(tree_step, repeats)
            rows.append({"tree": name, "tokens": n, "paths": stats.n_paths, "rows": stats.tree_tokens,
                         "path_tokens": stats.path_tokens, "method": mask, "step_s": step_s,
                         "speedup": base_s / step_s, "loss_rel_diff": abs(loss - base_loss) / abs(base_loss)})
        for r in rows[-3:]:
            print(f"| {r['tokens']} | {r['tree']} | {r['paths']} | {r['rows']} | {r['method']} | {r['step_s']:.2f} | "
                  f"{r['speedup']:.2f}x | {r['loss_rel_diff']:.1e} |")
            sys.stdout.flush()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[10000, 30000], help="path lengths N")
    ap.add_argument("--repeats", type=int, default=1, help="timed steps per measurement (median)")
    ap.add_argument("--out", default=None, help="also write the rows as JSON")
    args = ap.parse_args()
    import transformers

    print(f"device: CPU {platform.machine()}, {torch.get_num_threads()} threads; torch {torch.__version__}, "
          f"transformers {transformers.__version__}, python {platform.python_version()}")
    print(f"command: python benchmarks/long_paths.py {' '.join(sys.argv[1:])}".rstrip())
    print(f"date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC")
    print("| N | tree | paths | rows | method | step s | speedup | loss Δrel |")
    print("|---|---|---|---|---|---|---|---|")
    rows = [r for n in args.tokens for r in measure(n, args.repeats)]
    if args.out:
        from treecompile.data.io import write_json

        write_json(args.out, rows)


if __name__ == "__main__":
    main()
