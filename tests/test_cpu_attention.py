"""The block-sparse CPU tree attention against SDPA over the dense tree mask (float64)."""

import contextlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import path_sets
from testing import dense_tree_attention, examples, tree_visibility

from treecompile import TrajectoryTree, pack
from treecompile.kernels.attention.blockmask import tree_block_mask
from treecompile.kernels.attention import cpu_attention
from treecompile.kernels.attention.cpu_attention import tree_attention_cpu


@contextlib.contextmanager
def fused_calls():
    """Counts the calls of SDPA's fused CPU kernel (forward, backward) inside the block."""
    calls = {"forward": 0, "backward": 0}
    saved = cpu_attention._FLASH, cpu_attention._FLASH_BACKWARD

    def counted(fn, key):
        def call(*args, **kwargs):
            calls[key] += 1
            return fn(*args, **kwargs)
        return call

    cpu_attention._FLASH, cpu_attention._FLASH_BACKWARD = counted(saved[0], "forward"), counted(saved[1], "backward")
    try:
        yield calls
    finally:
        cpu_attention._FLASH, cpu_attention._FLASH_BACKWARD = saved


def run_case(batch, *, hq=4, hkv=2, d=8, block=4, softcap=0.0, window=0, kind="interval", seed=0, fused=False,
             transposed=False):
    """``fused``: values as wide as keys, which the fused kernel takes (else one wider: the
    block-by-block softmax); the test checks which one ran. ``transposed``: q, k and v are
    ``[1, H, D, S]`` tensors transposed (their last dim not contiguous, as a model's key
    ``'b s (h d) -> b h d s'`` repeated over the query heads is)."""
    s = batch.num_tokens
    g = torch.Generator().manual_seed(seed)

    def leaf(h, width):
        if not transposed:
            return torch.randn(1, h, s, width, dtype=torch.float64, generator=g, requires_grad=True)
        return torch.randn(1, h, width, s, dtype=torch.float64, generator=g, requires_grad=True).transpose(-1, -2)

    q, k, v = leaf(hq, d), leaf(hkv, d), leaf(hkv, d if fused else d + 1)
    bm = tree_block_mask(batch.subtree_end, block_size=block)
    buffers = [batch.subtree_end] if kind == "interval" else [batch.tree_ids, batch.path_bits]
    chunks = 0 if kind == "interval" else batch.path_bits.shape[1]
    if window:
        buffers.append(batch.position_ids)
    with fused_calls() as calls:
        out, _ = tree_attention_cpu(q, k, v, buffers, bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks,
                                    bm.full_kv_indices, kind, block, 0.3, softcap, window, chunks)
        ref = dense_tree_attention(q, k, v, tree_visibility(batch, window), 0.3, softcap)
        _assert_matches(out, ref, (q, k, v), g)
    assert (calls["forward"] > 0, calls["backward"] > 0) == (fused and not softcap,) * 2, calls


CASES = {
    "plain": {},
    "mqa": dict(hq=4, hkv=1),
    "softcap": dict(softcap=2.0),
    "window3": dict(window=3),
    "bitmask": dict(kind="bitmask"),
    "bitmask-window-softcap": dict(kind="bitmask", window=2, softcap=1.5),
    "block1": dict(block=1),
    "block128": dict(block=128),
    "fused": dict(fused=True),
    "fused-mqa": dict(hq=4, hkv=1, fused=True),
    "fused-window3": dict(window=3, fused=True),
    "fused-bitmask-window": dict(kind="bitmask", window=2, fused=True),
    "fused-block1": dict(block=1, fused=True),
    "fused-softcap": dict(softcap=2.0, fused=True),  # soft-capping: the block-by-block softmax
    "transposed": dict(transposed=True),
    "fused-transposed": dict(fused=True, transposed=True),
    "fused-mqa-transposed": dict(hq=4, hkv=1, fused=True, transposed=True),
}


@pytest.mark.parametrize("name", list(CASES))
def test_matches_dense_reference(name):
    trees = [TrajectoryTree.from_sequences([[1, 2, 3, 4, 5], [1, 2, 3, 6, 7, 8, 9], [1, 2, 10], [1, 2, 10], [1, 11]]),
             TrajectoryTree.from_sequences([[5, 6, 7], [5, 8]])]
    run_case(pack(trees, path_bits=True), **CASES[name])


@pytest.mark.parametrize("name", ["fused", "fused-mqa", "fused-window3", "fused-bitmask-window"])
def test_masked_keys_in_pieces_match_dense_reference(name, monkeypatch):
    """Masked keys one block per call (`_MASKED_KEYS` at the block size): many pieces, some that
    a query sees none of, merged by their log-sum-exps, forward and backward."""
    from treecompile.kernels.attention import cpu_attention

    monkeypatch.setattr(cpu_attention, "_MASKED_KEYS", 4)
    trees = [TrajectoryTree.from_sequences([[1, 2, 3, 4, 5], [1, 2, 3, 6, 7, 8, 9], [1, 2, 10], [1, 2, 10], [1, 11]]),
             TrajectoryTree.from_sequences([[5, 6, 7], [5, 8]])]
    run_case(pack(trees, path_bits=True), **CASES[name])


@settings(max_examples=examples(30))
@given(path_sets(max_paths=6), st.sampled_from([1, 2, 3, 16]), st.sampled_from([0, 2]), st.booleans())
def test_matches_dense_reference_on_generated_trees(case, block, window, fused):
    seqs, _, _ = case
    run_case(pack(TrajectoryTree.from_sequences(seqs), path_bits=True), block=block, window=window, fused=fused)


@pytest.mark.parametrize("block", [1, 4, 7])
def test_query_groups_cover_every_block_once_with_its_keys(block):
    """Blocks share a fused call when their keys nearly agree (a long path's), never costing more
    than the slack in masked pairs, and each call holds every key its blocks see."""
    seqs = [list(range(1, 200)), list(range(1, 60)) + [900 + t for t in range(30)], [1, 2, 3, 500, 501]]
    batch = pack(TrajectoryTree.from_sequences(seqs))
    s = batch.num_tokens
    bm = tree_block_mask(batch.subtree_end, block_size=block)
    nums, idxs = cpu_attention._plan(bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices)
    visible = tree_visibility(batch)
    groups = list(cpu_attention._groups(s, block, nums, idxs, 64, "cpu"))
    assert [g[0] for g in groups] == [0, *[g[1] for g in groups[:-1]]] and groups[-1][1] == s
    assert any(q1 - q0 > block for q0, q1, *_ in groups)  # the long path's blocks were merged
    assert any(full is not None for *_, full, _ in groups)
    for q0, q1, keys, full, partial in groups:
        rows = keys.rows
        assert q1 - q0 <= max(64, block) and q0 % block == 0
        seen = visible[q0:q1].any(0).nonzero().flatten()
        assert set(seen.tolist()) <= set(rows.tolist())
        # full: seen by every query of the call (no mask); with partial, exactly the keys
        full_rows = set() if full is None else set(full.rows.tolist())
        partial_rows = set() if partial is None else set(partial.rows.tolist())
        assert not full_rows & partial_rows and full_rows | partial_rows == set(rows.tolist())
        if full is not None:
            assert visible[q0:q1][:, full.rows].all()
        for part in (keys, full, partial):
            if part is not None and part.span is not None:
                assert part.rows.tolist() == list(range(part.span.start, part.span.stop))
        own = 0  # pairs the blocks hold on their own: their queries times their live blocks' keys
        for i in range(q0 // block, -(-q1 // block)):
            live = {b for num, idx in zip(nums, idxs) for b in idx[i, : num[i]].tolist()}
            own += sum(min(block, s - b * block) for b in live) * (min(q1, (i + 1) * block) - i * block)
        assert rows.numel() * (q1 - q0) <= cpu_attention._GROUP_SLACK * own + 1e-9


def test_opcheck():
    batch = pack(TrajectoryTree.from_sequences([[1, 2, 3], [1, 2, 4, 5]]))
    bm = tree_block_mask(batch.subtree_end, block_size=2)
    q = torch.randn(1, 2, 5, 4, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 1, 5, 4, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 1, 5, 4, dtype=torch.float64, requires_grad=True)
    args = (q, k, v, [batch.subtree_end], bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks,
            bm.full_kv_indices, "interval", 2, 0.5, 0.0, 0, 0)
    torch.library.opcheck(torch.ops.treecompile.tree_attention_cpu.default, args)


@pytest.mark.parametrize("kind", ["interval", "bitmask"])
def test_alibi_bias_is_in_path_positions(kind):
    """ALiBi adds ``slope[h] * (positions[kv] - positions[q])``: against dense SDPA with that bias."""
    trees = [TrajectoryTree.from_sequences([[1, 2, 3, 4, 5], [1, 2, 3, 6, 7, 8, 9], [1, 2, 10], [1, 11]])]
    batch = pack(trees, path_bits=True)
    s, hq, hkv, d = batch.num_tokens, 4, 2, 8
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, hq, s, d, dtype=torch.float64, generator=g, requires_grad=True)
    k = torch.randn(1, hkv, s, d, dtype=torch.float64, generator=g, requires_grad=True)
    v = torch.randn(1, hkv, s, d, dtype=torch.float64, generator=g, requires_grad=True)
    slopes = [0.5, 0.25, 0.125, 0.0625]
    bm = tree_block_mask(batch.subtree_end, block_size=4)
    rule = [batch.subtree_end] if kind == "interval" else [batch.tree_ids, batch.path_bits]
    chunks = 0 if kind == "interval" else batch.path_bits.shape[1]
    out, _ = tree_attention_cpu(q, k, v, [*rule, batch.position_ids], bm.kv_num_blocks, bm.kv_indices,
                                bm.full_kv_num_blocks, bm.full_kv_indices, kind, 4, 0.3, 0.0, 0, chunks, slopes)
    pos = batch.position_ids.to(torch.float64)
    bias = torch.tensor(slopes, dtype=torch.float64)[:, None, None] * (pos[None, :] - pos[:, None])
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    scores = (q @ kk.transpose(-1, -2)) * 0.3 + bias
    ref = torch.softmax(scores.masked_fill(~tree_visibility(batch), float("-inf")), -1) @ vv
    _assert_matches(out, ref, (q, k, v), g)


def test_sinks_through_the_log_sum_exp():
    """A sink logit per head in every softmax denominator (gpt-oss): the kernel output times
    ``sigmoid(lse - sink)``, gradients through ``lse`` included, against dense softmax with a sink column."""
    from treecompile.kernels.attention.flex import _with_sinks

    trees = [TrajectoryTree.from_sequences([[1, 2, 3, 4, 5], [1, 2, 3, 6, 7, 8, 9], [1, 2, 10], [1, 11]])]
    batch = pack(trees)
    s, h, d = batch.num_tokens, 2, 8
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, h, s, d, dtype=torch.float64, generator=g, requires_grad=True) for _ in range(3))
    sinks = torch.randn(h, dtype=torch.float64, generator=g, requires_grad=True)
    bm = tree_block_mask(batch.subtree_end, block_size=4)
    out, lse = tree_attention_cpu(q, k, v, [batch.subtree_end], bm.kv_num_blocks, bm.kv_indices,
                                  bm.full_kv_num_blocks, bm.full_kv_indices, "interval", 4, 0.3, 0.0, 0, 0)
    got_out = _with_sinks(out, lse, sinks.view(1, -1, 1))
    scores = ((q @ k.transpose(-1, -2)) * 0.3).masked_fill(~tree_visibility(batch), float("-inf"))
    sink = sinks.view(1, -1, 1, 1).expand(1, h, s, 1)
    ref = torch.softmax(torch.cat([scores, sink], -1), -1)[..., :-1] @ v
    dout = torch.randn(ref.shape, dtype=torch.float64, generator=g)
    got = torch.autograd.grad(got_out, (q, k, v, sinks), dout)
    want = torch.autograd.grad(ref, (q, k, v, sinks), dout)
    torch.testing.assert_close(got_out, ref, rtol=1e-12, atol=1e-12)
    for name, a, b in zip(("q", "k", "v", "sinks"), got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=lambda m, n=name: f"d{n}: {m}")


def _assert_matches(out, ref, inputs, g) -> None:
    """``out`` equals ``ref`` to float64 rounding, and so do their gradients to ``inputs``
    (q, k, v) under one random output gradient."""
    dout = torch.randn(out.shape, dtype=torch.float64, generator=g)
    got = torch.autograd.grad(out, inputs, dout)
    want = torch.autograd.grad(ref, inputs, dout)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    for name, a, b in zip("qkv", got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=lambda m, n=name: f"d{n}: {m}")


def test_the_long_path_benchmark_trees_are_as_documented():
    """benchmarks/long_paths.py: one path, two sharing half, a path with 16 side branches, and
    the branchy tree's blocks of queries split into full keys and masked ones."""
    import importlib.util
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "long_paths.py"
    spec = importlib.util.spec_from_file_location("long_paths", script)
    lp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lp)
    n = 1200
    trees = lp.trees(n, 2048)
    stats = {name: t.stats() for name, t in trees.items()}
    assert (stats["one path"].n_paths, stats["one path"].tree_tokens) == (1, n)
    assert (stats["two paths"].n_paths, stats["two paths"].tree_tokens) == (2, n + n - n // 2)
    assert stats["branchy"].n_paths == lp.BRANCHES + 1
    assert stats["branchy"].tree_tokens == n + lp.BRANCHES * lp.BRANCH_LEN
    assert all(t.stats().depth_tokens == n for t in trees.values())
    batch = pack([trees["branchy"]])
    bm = tree_block_mask(batch.subtree_end, block_size=128)
    nums, idxs = cpu_attention._plan(bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices)
    groups = list(cpu_attention._groups(batch.num_tokens, 128, nums, idxs, cpu_attention._GROUP_ROWS, "cpu"))
    assert any(full is not None and partial is not None for *_, full, partial in groups)


def test_bfloat16_keeps_a_float32_log_sum_exp_for_its_backward():
    """A bfloat16 call returns (and saves) its log-sum-exp in float32, as FlexAttention does: the
    fused backward recomputes probabilities from it, so rounding it to bfloat16 doubled the
    gradients' error (4.0% against 1.8% of the float64 gradients' norm on this case)."""
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, 200, (300,), generator=g).tolist()]
    seqs += [seqs[0][:150] + torch.randint(3, 200, (100,), generator=g).tolist()]
    batch = pack(TrajectoryTree.from_sequences(seqs), warn_por=False)
    s = batch.num_tokens
    q = torch.randn(1, 4, s, 16, generator=g, dtype=torch.float64) * 3
    k = torch.randn(1, 2, s, 16, generator=g, dtype=torch.float64) * 3
    v = torch.randn(1, 2, s, 16, generator=g, dtype=torch.float64)
    dout = torch.randn(1, 4, s, 16, generator=g, dtype=torch.float64)
    bm = tree_block_mask(batch.subtree_end, block_size=128)

    def grads(dtype):
        leaves = [x.to(dtype).detach().requires_grad_() for x in (q, k, v)]
        out, lse = tree_attention_cpu(*leaves, [batch.subtree_end], bm.kv_num_blocks, bm.kv_indices,
                                      bm.full_kv_num_blocks, bm.full_kv_indices, "interval", 128, 0.25, 0.0, 0, 0)
        out.backward(dout.to(dtype))
        return lse.dtype, [x.grad.double() for x in leaves]

    _, want = grads(torch.float64)
    with fused_calls() as calls:
        dtype, got = grads(torch.bfloat16)
    assert calls["backward"] > 0 and dtype == torch.float32
    for a, b in zip(got, want):
        assert ((a - b).norm() / b.norm()).item() < 0.025
