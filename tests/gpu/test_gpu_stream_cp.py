"""Streamed parts and context parallelism on CUDA, through Inductor, against per-path training.

* A streamed part's attention on CUDA is one FlexAttention call over ``[prefix ; own]``
  (`treecompile.kernels.attention.prefix_flex`): float32, a dense and a windowed + soft-capped model,
  parts that cut nodes, checked as the whole-tree exactness tests are (tests/gpu_exactness.py:
  the tree's difference from the per-path run within the per-path run's own float32 error).
* CP over a group of one rank (NCCL) on the GPU: the same check, and equal to the whole-tree
  call to float32 rounding, the ranks' batch check reading back from the GPU on the first
  call only; streamed under CP (one model, recompute mode): the same check.
* CP over 2 CPU ranks (gloo) on this machine: the CPU test, rehearsed where the GPU runs.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

import treecompile as tc
from gpu_exactness import build_model, copy_as, exactness_trees, fp32_check, run_paths, run_tree

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

transformers = pytest.importorskip("transformers")

FAMILIES = ("qwen3", "gemma2")


def _check(compiled, name: str, trees) -> None:
    ref64 = run_paths(copy_as(compiled.model, torch.float64, "cpu"), trees)
    path = run_paths(compiled.model, trees)
    tree = run_tree(compiled, tc.pack(trees, device="cuda"))
    chk = fp32_check(tree, path, ref64)
    assert not chk.failures(), (name, chk.failures(), chk.budget)


@pytest.mark.parametrize("name", FAMILIES)
def test_streamed_parts_on_cuda_run_one_flex_call_each_and_are_exact(name, monkeypatch):
    import treecompile.passes.stream as stream_passes
    from treecompile.stream.options import StreamOptions

    calls = []
    real = stream_passes.prefix_flex_hop
    monkeypatch.setattr(stream_passes, "prefix_flex_hop", lambda *a, **k: calls.append(1) or real(*a, **k))
    model = copy_as(build_model(name), torch.float32, "cuda")
    compiled = tc.tree_compile(model, stream=StreamOptions(budget_rows=100))  # parts cut inside nodes
    trees = exactness_trees()
    _check(compiled, name, trees)
    assert compiled._stream.stats.parts > 2 and calls, "the parts did not run the FlexAttention kernel"


def test_a_streamed_call_on_a_cpu_batch_reads_nothing_back_from_the_gpu(record_property):
    """A streamed call cuts its parts from the batch on the host and moves each part without
    blocking: given the batch on the CPU (as a DataLoader hands it over), neither the parts'
    inputs nor the plan read a tensor back from the GPU, and no whole-batch copy waits."""
    from treecompile.bench.profile_cuda import host_syncs
    from treecompile.stream.options import StreamOptions

    model = copy_as(build_model("qwen3"), torch.float32, "cuda")
    compiled = tc.tree_compile(model, stream=StreamOptions(budget_rows=100))
    batch = tc.pack(exactness_trees())  # on the CPU

    def step():
        compiled.zero_grad()
        compiled(batch).loss.backward()

    step()  # compiles
    syncs = host_syncs(step)
    record_property("syncs", len(syncs))
    reads = [s for s in syncs if any(f in s for f in ("stream/parts.py", "stream/plan.py", "core/batch.py",
                                                       "planning/"))]
    assert reads == [], reads


@pytest.fixture
def nccl_rank():
    import torch.distributed as dist

    dist.init_process_group("nccl", init_method=f"file://{tempfile.mkdtemp()}/init", rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def _batch_check_syncs(syncs: list[str]) -> list[str]:
    """The host syncs among ``syncs`` (`treecompile.bench.profile_cuda.host_syncs`) made inside
    `treecompile.distributed.context_parallel.check_same_batch`."""
    import inspect

    from treecompile.distributed.context_parallel import check_same_batch

    lines, start = inspect.getsourcelines(check_same_batch)
    file = inspect.getsourcefile(check_same_batch)
    return [s for s in syncs if s.startswith(f"{file}:") and start <= int(s.split(":")[1]) < start + len(lines)]


@pytest.mark.parametrize("name", FAMILIES)
def test_cp_of_one_rank_on_cuda_is_exact_and_equals_the_whole_tree(name, nccl_rank):
    """... and the check that every rank has the same batch reads its answer back from the GPU
    on the first call only."""
    from treecompile.bench.profile_cuda import host_syncs

    base = build_model(name)
    trees = exactness_trees()
    batch = tc.pack(trees, device="cuda")
    whole = run_tree(tc.tree_compile(copy_as(base, torch.float32, "cuda")), batch)
    compiled = tc.tree_compile(copy_as(base, torch.float32, "cuda"), cp=nccl_rank)
    first = host_syncs(lambda: _check(compiled, name, trees))  # the first call waits for the check
    runs = []
    later = host_syncs(lambda: runs.append(run_tree(compiled, batch)))
    assert _batch_check_syncs(first) and not _batch_check_syncs(later), (first, later)
    cp = runs[0]
    torch.testing.assert_close(cp.loss, whole.loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(cp.logprobs, whole.logprobs, rtol=1e-5, atol=1e-5)


def test_streamed_cp_of_one_rank_on_cuda_is_exact(nccl_rank):
    """Streaming under CP (`treecompile.distributed.stream_cp`) on one NCCL rank: the streamed part
    graph with the CP exchange through Inductor, the kept rows' all-gather and the gradients'
    all-reduce through NCCL, parts that cut nodes."""
    from treecompile.stream.options import StreamOptions

    model = copy_as(build_model("qwen3"), torch.float32, "cuda")
    compiled = tc.tree_compile(model, cp=nccl_rank, stream=StreamOptions(budget_rows=100, mode="recompute"))
    _check(compiled, "qwen3", exactness_trees())
    assert compiled._cp.stats.parts > 2, compiled._cp.stats


def test_cp_over_two_cpu_ranks_rehearsed_on_this_machine():
    from test_context_parallel import test_context_parallel_step_equals_per_path_training_on_every_rank as cp_test

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    cp_test(2)
