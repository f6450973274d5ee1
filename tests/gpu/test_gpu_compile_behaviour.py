"""Compiled-step behaviour on CUDA: how often it recompiles, and that it does not sync per layer."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import treecompile as tc
from treecompile.bench.profile_cuda import host_syncs
from gpu_exactness import VOCAB, build_model, copy_as, exactness_trees

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

transformers = pytest.importorskip("transformers")

#: Compiles for any sequence of batches with the interval mask (docs/gpu.md): one graph for a
#: batch within one 128-row block, one dynamic graph for every larger batch.
MAX_COMPILES = 2


def _batches(n: int = 10, seed: int = 0) -> list[tc.TreeBatch]:
    """``n`` batches of different sizes (60 to ~6000 rows) and shapes (1 to 6 paths, forests)."""
    rng = np.random.default_rng(seed)
    out = []
    # 100 rows first: one 128-row block whose graph compiles for that size, where rows x query
    # heads per key head (2) exceed 128, which FlexAttention's decoding kernel cannot tile.
    for i, rows in enumerate([100, 333, 1000, 4097, 777, 2100, 60, 5000, 1500, 3001][:n]):
        paths = 1 + i % 6
        prefix = rng.integers(0, VOCAB, rows // 2).tolist()
        tail = max(1, (rows - len(prefix)) // paths)
        seqs = [prefix + rng.integers(0, VOCAB, tail).tolist() for _ in range(paths)]
        trees = [tc.TrajectoryTree.from_sequences(seqs)]
        if i % 3 == 2:  # a forest
            trees.append(tc.TrajectoryTree.from_sequences([rng.integers(0, VOCAB, 17).tolist()]))
        out.append(tc.pack(trees, device="cuda"))
    return out


def _step(compiled, batch):
    compiled.zero_grad()
    out = compiled(batch)
    out.loss.backward()
    return out.loss.detach()


@pytest.mark.parametrize("lm_head", ["gather", "fused"])
def test_ten_batch_shapes_compile_at_most_twice(lm_head, record_property):
    from torch._dynamo.utils import counters

    model = copy_as(build_model("qwen3"), torch.bfloat16, "cuda")
    compiled = tc.tree_compile(model, lm_head=lm_head)
    counters.clear()
    for batch in _batches():
        _step(compiled, batch)
    torch.cuda.synchronize()
    seq_lens = [r.seq_len for r in compiled.compile_records]
    record_property("compiles", len(seq_lens))
    record_property("dynamo_unique_graphs", counters["stats"]["unique_graphs"])
    assert len(seq_lens) <= MAX_COMPILES, f"{len(seq_lens)} compiles for 10 batches: S = {seq_lens}"
    # Every graph Dynamo compiled went through treecompile's backend: no graph break, no side graph.
    assert counters["stats"]["unique_graphs"] == len(seq_lens), dict(counters["stats"])


def _syncs(name: str, layers: int, lm_head: str) -> list[str]:
    model = copy_as(build_model(name, layers=layers), torch.bfloat16, "cuda")
    compiled = tc.tree_compile(model, lm_head=lm_head)
    batch = tc.pack(exactness_trees(), device="cuda")
    _step(compiled, batch)  # compiles, and the scan kernels' one-time checks
    torch.cuda.synchronize()
    return host_syncs(lambda: _step(compiled, batch))


@pytest.mark.parametrize("name,lm_head", [("qwen3", "gather"), ("qwen3", "fused"), ("bamba", "gather")])
def test_host_syncs_do_not_grow_with_layers(name, lm_head, record_property):
    """The step's host syncs (batch preparation: the predicting rows, the block tables) are a
    constant: doubling the layers adds none."""
    # 1 and 2 layers (small graphs compile fastest); Bamba's second layer is its attention layer.
    one, two = _syncs(name, 1, lm_head), _syncs(name, 2, lm_head)
    record_property("syncs_1_layer", len(one))
    record_property("syncs_2_layers", len(two))
    assert len(two) <= len(one), f"1 layer: {len(one)} syncs, 2 layers: {len(two)}: {two}"


def test_moving_a_packed_batch_to_the_gpu_does_not_wait_for_queued_work():
    """`TreeBatch.to("cuda")` copies through pinned memory without blocking the host, so the next
    batch moves while the GPU still runs this step; the values arrive intact and checked."""
    batch = tc.pack(exactness_trees())  # on the CPU, as a DataLoader hands it over
    a = torch.randn(4096, 4096, device="cuda")
    for _ in range(8):  # queued work the copy must not wait for
        a = a @ a / 64
    syncs = host_syncs(lambda: batch.to("cuda"))
    moved = batch.to("cuda")
    torch.cuda.synchronize()
    assert syncs == [], syncs
    for name, v in vars(batch).items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(getattr(moved, name).cpu(), v), name
    assert moved._fresh_check() is not None
