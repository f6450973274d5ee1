"""BlockMask build time: treecompile.kernels.attention.blockmask.tree_block_mask vs create_block_mask.

    python benchmarks/blockmask_build.py            # 8k, 32k, 128k tokens

``create_block_mask`` evaluates the mask on all S x S pairs, so it is timed at 8k only.
The tree is synthetic: 64-token nodes in a random tree (each node's parent drawn among the
earlier ones), packed depth-first, as `treecompile.pack` lays trees out.
"""

from __future__ import annotations

import datetime
import platform
import statistics
import sys
import time

import numpy as np
import torch
from torch.nn.attention.flex_attention import create_block_mask

from treecompile.core.batch import pack
from treecompile.kernels.attention.blockmask import tree_block_mask
from treecompile.kernels.attention.masks import bind_buffers, interval_mask_mod
from treecompile.core.tree import TrajectoryTree


def random_tree(tokens: int, node_len: int = 64, seed: int = 0) -> TrajectoryTree:
    rng = np.random.default_rng(seed)
    n = tokens // node_len
    parent = [-1] + [int(rng.integers(0, i)) for i in range(1, n)]
    toks = {i: rng.integers(0, 1000, node_len).tolist() for i in range(n)}
    for i in range(1, n):  # distinct first tokens so siblings never merge
        toks[i][0] = 1000 + i
    children = {i: [] for i in range(n)}
    for i in range(1, n):
        children[parent[i]].append(i)
    seqs, stack = [], [(0, toks[0])]
    while stack:
        v, seq = stack.pop()
        if not children[v]:
            seqs.append(seq)
        stack.extend((c, seq + toks[c]) for c in children[v])
    return TrajectoryTree.from_sequences(seqs)


def timed(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    print(f"device: CPU {platform.machine()}, {torch.get_num_threads()} threads; torch {torch.__version__}")
    print(f"command: python {' '.join(sys.argv)}")
    print(f"date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}")
    print("| tokens | tree_block_mask | create_block_mask | identical |")
    print("|---|---|---|---|")
    for s in (8192, 32768, 131072):
        batch = pack(random_tree(s))
        se = batch.subtree_end
        ours = timed(lambda: tree_block_mask(se), 5)
        if s <= 8192:
            mm = bind_buffers(interval_mask_mod(), se)
            ref_t = timed(lambda: create_block_mask(mm, 1, 1, se.shape[0], se.shape[0], device="cpu"), 1)
            a, b = tree_block_mask(se), create_block_mask(mm, 1, 1, se.shape[0], se.shape[0], device="cpu")
            same = all(torch.equal(x, y) for x, y in zip(a.as_tuple(), b.as_tuple()) if isinstance(x, torch.Tensor))
            ref, same = f"{ref_t * 1e3:.0f} ms", str(same)
        else:
            ref, same = "not run (O(S^2))", "-"
        print(f"| {batch.num_tokens} | {ours * 1e3:.1f} ms | {ref} | {same} |")


if __name__ == "__main__":
    main()
