"""Context parallelism on CPU: rows, bytes moved and step time over 1, 2 and 4 ranks.

    python benchmarks/context_parallel.py --ranks 1 2 4 --prompt 512 --turn 256 --leaf 128 --fanout 4 4

One training step (forward, backward, SGD) of a small Qwen3-shaped model (float32, random
weights) on one two-level tree (a prompt, ``fanout[0]`` turns, each with ``fanout[1]``
leaves), with ``tree_compile(model, cp=group)`` over K gloo processes on this machine, for
each K given. Per K: the largest rank's rows and its share of the work
(`treecompile.distributed.cp_split.split_for_cp`), the keys and values a rank receives per layer (the
root path of its first row: what the exchange moves) and sends (its rows on later ranks'
paths), against what an all-gather would move (every other rank's rows padded to the
longest), the median step time over ``--steps`` steps after a warm-up step
that compiles, and the largest rank's peak memory, measured (CPU allocator) and predicted
(`CPSplit.peak_bytes`). The loss is printed for each K: it must not change.

The ranks share this machine's cores (each rank gets ``cores // K`` torch threads, at least
one): a CPU run shows what the split and the collectives cost, not the speed-up of K
devices. Prints a Markdown table and the environment.

With ``--stream-rows B``: the same tree streamed, B rows per rank
(``tree_compile(model, cp=group, stream=StreamOptions(budget_rows=B))``; on 1 rank,
streaming alone, the baseline): the parts, the stack's depth, the step time and each rank's
peak, measured and predicted (`treecompile.distributed.stream_cp.stream_cp_peak_bytes`).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

CONFIG = dict(vocab_size=1024, hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
              num_key_value_heads=2, head_dim=32)


def _worker(rank: int, world: int, init: str, out: str, args) -> None:
    import gc

    import transformers

    from stream_memory import _tree  # the same tree shape (benchmarks/stream_memory.py)

    from treecompile import pack, tree_compile
    from treecompile.planning.budget import CostModel
    from treecompile.planning.peak_memory import measure_peak_bytes

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    cfg = transformers.Qwen3Config(**CONFIG)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    batch = pack(_tree(args.prompt, args.turn, args.leaf, tuple(args.fanout), cfg.vocab_size), warn_por=False)
    stream = None
    if args.stream_rows:
        from treecompile.stream.options import StreamOptions

        stream = StreamOptions(budget_rows=args.stream_rows, mode=args.stream_mode)
    # Streamed on one rank: plain streaming (the baseline), no CP.
    compiled = tree_compile(model, stream=stream) if stream and world == 1 else tree_compile(
        model, cp=dist.group.WORLD, stream=stream)

    def step():
        loss = compiled(batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    loss = step()  # compiles
    times = []
    for _ in range(args.steps):
        dist.barrier()
        t0 = time.perf_counter()
        step()
        dist.barrier()
        times.append(time.perf_counter() - t0)
    gc.collect()
    live = sum(p.untyped_storage().nbytes() for p in model.parameters())
    measured = live + measure_peak_bytes(step)
    cost = CostModel.from_config(cfg, dtype="float32", device="cpu", optimizer="sgd")
    if stream is not None:
        row = dict(loss=loss, time=statistics.median(times), measured=measured, tokens=batch.num_tokens,
                   **_streamed(compiled, batch, cost, stream.mode, rank))
        torch.save(row, os.path.join(out, f"rank{rank}.pt"))
        dist.barrier()
        dist.destroy_process_group()
        return
    split = compiled._cp.split
    row = dict(loss=loss, time=statistics.median(times), measured=measured,
               predicted=int(split.peak_bytes(cost)[rank]))
    gathered = split.kv_bytes(cfg.num_key_value_heads, cfg.head_dim, 4, gather="all")
    needed = split.kv_bytes(cfg.num_key_value_heads, cfg.head_dim, 4, gather="needed")
    per_row = 2 * cfg.num_key_value_heads * cfg.head_dim * 4
    if rank == 0:
        row.update(rows=split.rows.tolist(), shares=split.shares(), gathered=int(gathered.max()),
                   needed=int(needed.max()), sent=int(split.sent_rows.max()) * per_row, tokens=batch.num_tokens)
    torch.save(row, os.path.join(out, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def _streamed(compiled, batch, cost, mode: str, rank: int) -> dict:
    """The parts of a streamed step, the stack's depth, the most rows a rank holds of a part
    and this rank's predicted peak (`stream_cp_peak_bytes`; one process: `stream_peak_bytes`)."""
    import numpy as np

    from treecompile.stream.plan import stream_peak_bytes
    from treecompile.distributed.stream_cp import stream_cp_peak_bytes

    if compiled._cp is None:  # streaming on one process
        runner = compiled._stream
        plan = runner.choose(batch).plan
        return dict(parts=plan.num_parts, depth=plan.stack_depth, part_rows=int(np.diff(plan.starts).max()),
                    predicted=int(stream_peak_bytes(plan, cost, mode)))
    runner = compiled._cp
    plan = runner.choose(batch).plan
    return dict(parts=plan.num_parts, depth=plan.stack_depth,
                part_rows=int(max(np.diff(s.bounds).max() for s in runner.splits)),
                predicted=int(stream_cp_peak_bytes(plan, runner.splits, runner.kept_rows, cost, mode)[rank]))


MIB = 2 ** 20


def _markdown(columns: list[str], results, cells) -> None:
    """A Markdown table: per group size, ``[ranks, *cells(rank 0's row, every rank's rows), step, peak,
    predicted, loss]`` under ``["ranks", *columns, ...]``."""
    print("| " + " | ".join(["ranks", *columns, "step (s)", "peak, largest rank (MiB)", "predicted (MiB)", "loss"])
          + " |")
    print("|" + "---|" * (len(columns) + 5))
    for world, rows in results:
        r0 = rows[0]
        print("| " + " | ".join([str(world), *cells(r0, rows), f"{max(r['time'] for r in rows):.2f}",
                                 f"{max(r['measured'] for r in rows) / MIB:.1f}",
                                 f"{max(r['predicted'] for r in rows) / MIB:.1f}", f"{r0['loss']:.6f}"]) + " |")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--turn", type=int, default=256)
    ap.add_argument("--leaf", type=int, default=128)
    ap.add_argument("--fanout", type=int, nargs=2, default=(4, 4))
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--stream-rows", type=int, default=0, metavar="B",
                    help="stream instead, B rows per rank (tree_compile(cp=..., stream=StreamOptions(budget_rows=B)); "
                    "1 rank: streaming alone)")
    ap.add_argument("--stream-mode", choices=("keep", "recompute"), default="keep")
    args = ap.parse_args(argv)
    results = []
    for world in args.ranks:
        with tempfile.TemporaryDirectory() as tmp:
            mp.spawn(_worker, args=(world, os.path.join(tmp, "init"), tmp, args), nprocs=world, join=True)
            rows = [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False) for r in range(world)]
        results.append((world, rows))
        print(f"{world} ranks: loss {rows[0]['loss']:.6f}, step {rows[0]['time']:.2f} s", file=sys.stderr)
    print(f"Tree: {results[0][1][0]['tokens']} rows (prompt {args.prompt}, {args.fanout[0]} turns of {args.turn}, "
          f"{args.fanout[1]} leaves of {args.leaf} each); model: Qwen3-shaped {CONFIG}, float32, SGD.\n")
    if args.stream_rows:
        print(f"Streamed, {args.stream_rows} rows per rank, {args.stream_mode} mode (1 rank: streaming alone, "
              "no CP).\n")
        _markdown(["parts", "stack depth", "most rows of a part per rank"], results,
                  lambda r0, rows: [str(r0["parts"]), str(r0["depth"]), str(max(r["part_rows"] for r in rows))])
    else:
        _markdown(["rows per rank", "largest share of the work", "K/V received per layer (MiB)",
                   "K/V sent per layer (MiB)", "an all-gather would move (MiB)"], results,
                  lambda r0, rows: [", ".join(map(str, r0["rows"])), f"{max(r0['shares']):.2f}",
                                    f"{r0['needed'] / MIB:.2f}", f"{r0['sent'] / MIB:.2f}",
                                    f"{r0['gathered'] / MIB:.2f}"])
    _environment(argv)


def _environment(argv) -> None:
    print(f"\nDevice: CPU, {os.cpu_count()} cores ({platform.processor() or platform.machine()}); torch "
          f"{torch.__version__}, Python {platform.python_version()}; {datetime.date.today()}; "
          f"command: python benchmarks/context_parallel.py {' '.join(argv if argv is not None else sys.argv[1:])}")


if __name__ == "__main__":
    main()
