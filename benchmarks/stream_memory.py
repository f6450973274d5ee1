"""Peak memory, step time and ERR of streaming against whole-tree packing and partitioning.

    python benchmarks/stream_memory.py --prompt 1024 --turn 512 --leaf 256 --fanout 8 8 --budget 2048

One forward + backward step of a small Qwen3-shaped model (float32, random weights) on one
two-level tree (a prompt, ``fanout[0]`` turns, each with ``fanout[1]`` leaves), four ways:

* ``whole``: the tree packed in one call (``tree_compile`` without a budget);
* ``stream-keep`` / ``stream-recompute``: ``tree_compile(stream=StreamOptions(budget))``;
* ``partition``: ``treecompile.planning.partition`` at the same budget, each part one call, ancestors
  recomputed in every part that needs them (the baseline streaming replaces).

With ``--budget-bytes B`` the streamed methods get ``StreamOptions(budget_bytes=B)`` (the
whole step's memory: parts chosen per batch, ``stream-auto`` also picks the mode) and
partitioning gets the rows one call fits in ``B`` (`CostModel.capacity`, SGD: no optimizer
state); the peak column then adds the parameters' bytes, so that it compares with ``B``.

Peak memory is the CPU allocator's peak above the bytes live before the step
(`treecompile.planning.budget.measure_peak_bytes`, torch's allocator events), after one warm-up step
that compiles. Step time is wall-clock and process CPU time (all threads; on a shared
machine the CPU time is the steadier of the two). ERR is ``1 - rows computed forward / path
tokens``. The losses of the four
are printed to show that they agree. Prints a Markdown table and the environment.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys
import time

import numpy as np
import torch


def _tree(prompt: int, turn: int, leaf: int, fanout: tuple[int, int], vocab: int):
    from treecompile import TrajectoryTree

    rng = np.random.default_rng(0)
    root = rng.integers(0, vocab, prompt).tolist()
    seqs = []
    for _ in range(fanout[0]):
        mid = rng.integers(0, vocab, turn).tolist()
        for _ in range(fanout[1]):
            seqs.append(root + mid + rng.integers(0, vocab, leaf).tolist())
    return TrajectoryTree.from_sequences(seqs)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--turn", type=int, default=512)
    ap.add_argument("--leaf", type=int, default=256)
    ap.add_argument("--fanout", type=int, nargs=2, default=(8, 8))
    ap.add_argument("--budget", type=int, default=2048, help="rows per part (or give --budget-bytes)")
    ap.add_argument("--budget-bytes", type=int, default=None,
                    help="StreamOptions(budget_bytes=...) instead: the whole step's memory; partitioning gets the "
                         "rows the cost model fits in it")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--cuts", choices=("subtree", "rows"), default="subtree", help="StreamOptions.cuts")
    ap.add_argument("--no-warmup", action="store_true",
                    help="time the first step, compile included (large trees: one step fewer per method)")
    ap.add_argument("--methods", nargs="+", default=["whole", "stream-keep", "stream-recompute", "partition"],
                    help="whole, stream-keep, stream-recompute, stream-auto (needs --budget-bytes), partition")
    args = ap.parse_args(argv)

    import transformers

    import treecompile
    from treecompile import pack, tree_compile
    from treecompile.planning.budget import measure_peak_bytes
    from treecompile.planning.partition import loss_denominator, partition_tree
    from treecompile.stream.options import StreamOptions

    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                                   num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                                   head_dim=args.hidden // 4, max_position_embeddings=1 << 16)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().train()
    tree = _tree(args.prompt, args.turn, args.leaf, tuple(args.fanout), args.vocab)
    batch = pack(tree)
    stats = tree.stats()
    path_tokens, rows = stats.path_tokens, batch.num_tokens
    cost = None
    if args.budget_bytes is not None:
        from treecompile.planning.budget import CostModel

        cost = CostModel.from_config(cfg, dtype="float32", device="cpu", optimizer="sgd")
        args.budget = cost.capacity(args.budget_bytes)  # what partitioning's parts may hold
        print(f"budget {args.budget_bytes:,} bytes: the whole tree is predicted at "
              f"{cost.peak_bytes(rows):,} bytes ({cost.peak_bytes(rows) / args.budget_bytes:.1f}x); one call fits "
              f"{args.budget} rows", file=sys.stderr)
    print(f"tree: {rows} rows, {tree.num_paths} paths, "
          f"{path_tokens} path tokens, POR {stats.por:.3f}; budget {args.budget} rows ({rows / args.budget:.1f}x)",
          file=sys.stderr)

    def step_of(method):
        if method == "whole":
            compiled = tree_compile(model)
            return (lambda: compiled(batch).loss.backward()), (lambda: rows), compiled
        if method.startswith("stream"):
            mode = method.split("-")[1]
            options = (StreamOptions(budget_bytes=args.budget_bytes, mode=mode, cuts=args.cuts, optimizer="sgd")
                       if args.budget_bytes is not None else StreamOptions(args.budget, mode, args.cuts))
            compiled = tree_compile(model, stream=options)
            return (lambda: compiled(batch).loss.backward()), (lambda: compiled._stream.stats.forward_rows), compiled
        part = partition_tree(tree, args.budget)
        denom = loss_denominator(tree, "token-mean")
        batches = [pack(t, denominator=denom) for t in part.parts]
        compiled = tree_compile(model)

        def run():
            for b in batches:
                compiled(b).loss.backward()

        return run, (lambda: part.partition_tokens), compiled

    results = []
    from treecompile.planning.budget import BudgetError

    for method in args.methods:
        step, forward_rows, compiled = step_of(method)
        model.zero_grad(set_to_none=True)
        try:
            if not args.no_warmup:
                step()  # warm-up: compiles
                model.zero_grad(set_to_none=True)
            t0, c0 = time.perf_counter(), time.process_time()
            step()
            seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
        except BudgetError as e:  # e.g. keep mode cannot hold this tree's stack in --budget-bytes
            print(f"{method}: {e}", file=sys.stderr)
            continue
        grad_norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters() if p.grad is not None))
        model.zero_grad(set_to_none=True)
        peak = measure_peak_bytes(step)
        if args.budget_bytes is not None:  # the budget holds the parameters and their gradients too
            peak += sum(p.untyped_storage().nbytes() for p in model.parameters())
        model.zero_grad(set_to_none=True)
        fr = forward_rows()
        st = compiled._stream.stats if method.startswith("stream") else None
        depth = f"{st.stack_depth} ({st.parts})" if st else ""
        if st is not None and st.peak_bytes is not None:
            print(f"{method}: {st.why}", file=sys.stderr)
            depth += f"; {st.mode}, parts of {st.budget_rows} rows, predicted {st.peak_bytes / 2**20:.1f} MiB"
        results.append((method, peak, seconds, cpu, fr, 1 - fr / path_tokens, depth, float(grad_norm)))
        print(results[-1], file=sys.stderr)

    print(f"- device: CPU {platform.machine()}, {torch.get_num_threads()} threads; torch {torch.__version__}, "
          f"transformers {transformers.__version__}, treecompile {treecompile.__version__}, "
          f"python {platform.python_version()}")
    print(f"- command: python benchmarks/stream_memory.py {' '.join(argv if argv is not None else sys.argv[1:])}")
    print(f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC")
    print(f"- tree: {rows} rows, {tree.num_paths} paths, {path_tokens} path tokens, POR {stats.por:.3f}; "
          + (f"budget {args.budget_bytes:,} bytes ({args.budget} rows in one call); " if args.budget_bytes else "")
          + f"budget {args.budget} rows; model Qwen3-shaped, {args.layers} layers, hidden {args.hidden}, "
          f"vocab {args.vocab}, float32")
    print()
    print("| method | peak MiB | step s (wall) | step s (CPU) | rows forward | ERR | stack depth (parts) | grad norm |")
    print("|---|---|---|---|---|---|---|---|")
    for method, peak, seconds, cpu, fr, err, depth, gn in results:
        print(f"| {method} | {peak / 2**20:.1f} | {seconds:.2f} | {cpu:.2f} | {fr} | {err:.3f} | {depth} | {gn:.6e} |")


if __name__ == "__main__":
    main()
