"""Tree FlexAttention (kernels/attention/flex.py) against the dense reference, and the BlockMask builders."""

import pytest
import torch
from testing import COMPILE_TOL as TOL
from testing import dense_tree_attention, tree_visibility

import treecompile as tc
from treecompile.kernels.attention import flex
from treecompile.kernels.attention.masks import interval_mask_mod, tree_mask_mod

SEQS = {
    # 1-token nodes and a prefix path.
    "tiny": [[1, 2, 3], [1, 2], [1, 4], [5]],
    # Awkward sizes around the block size 16: 63 and 65 token paths sharing 17 tokens.
    "blocks": [list(range(63)), list(range(17)) + [99] * 48, [7] * 30],
}


def _batch(name):
    return tc.pack(tc.TrajectoryTree.from_sequences(SEQS[name]), path_bits=True)


def _dense_reference(q, k, v, batch, window, softcap):
    return dense_tree_attention(q, k, v, tree_visibility(batch, window), q.shape[-1] ** -0.5, softcap)


@pytest.mark.parametrize("mask", ["interval", "bitmask"])
@pytest.mark.parametrize("window,softcap", [(None, None), (3, None), (None, 2.5), (5, 4.0)],
                         ids=["plain", "window3", "softcap", "window5-softcap"])
@pytest.mark.parametrize("name,heads", [("tiny", (4, 4)), ("blocks", (6, 2)), ("blocks", (3, 1))],
                         ids=["tiny-MHA", "blocks-GQA3", "blocks-MQA"])
def test_tree_attention_matches_dense_reference(mask, window, softcap, name, heads):
    batch = _batch(name)
    s = batch.num_tokens
    bm = flex.interval_block_mask(batch.subtree_end, 16)
    tensors, layout = flex.split_block_mask(bm)
    spec = flex.AttentionSpec(mask, None, window, softcap, batch.path_bits.shape[1], layout)
    fn = flex.tree_attention_fn(spec)
    g = torch.Generator().manual_seed(1)
    hq, hkv = heads
    q, k, v = (torch.randn(1, h, s, 12, generator=g, dtype=torch.float64, requires_grad=True)
               for h in (hq, hkv, hkv))
    buffers = [batch.subtree_end] if mask == "interval" else [batch.tree_ids, batch.path_bits]
    out = fn(q, k, v, batch.position_ids, *buffers, *tensors)
    ref = _dense_reference(q, k, v, batch, window, softcap)
    grad = torch.randn(out.shape, generator=g, dtype=torch.float64)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(ref, (q, k, v), grad)
    rtol, atol = TOL["pure"]
    torch.testing.assert_close(out, ref, rtol=rtol, atol=atol)
    for n, a, b in zip("qkv", got, want):
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol, msg=lambda m, n=n: f"d{n}: {m}")


@pytest.mark.parametrize("mask", ["interval", "bitmask"])
@pytest.mark.parametrize("window,alibi", [(None, (0.5, 0.125)), (3, (0.5, 0.125)), (3, None)],
                         ids=["alibi", "window3-alibi", "window3"])
def test_flex_branch_takes_the_buffers_its_mods_read(mask, window, alibi):
    """The CUDA branch of the tree attention function (FlexAttention's op, eager on CPU) hands
    the mask_mod and the ALiBi score_mod the buffers each reads, and equals the CPU op."""
    batch = _batch("tiny")
    s = batch.num_tokens
    tensors, layout = flex.split_block_mask(flex.interval_block_mask(batch.subtree_end, 16))
    spec = flex.AttentionSpec(mask, None, window, None, batch.path_bits.shape[1], layout, alibi=alibi)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, s, 8, generator=g, dtype=torch.float64) for _ in range(3))
    buffers = (batch.subtree_end,) if mask == "interval" else (batch.tree_ids, batch.path_bits)
    tables = flex.demote_full_blocks(tensors) if window is not None else tensors
    got, _ = flex._flex_hop_attention(spec, tree_mask_mod(mask, chunks=spec.chunks, window=window),
                                      flex.softcap_score_mod(None), q, k, v, batch.position_ids, buffers, tables, 0.3)
    spec_scaled = flex.AttentionSpec(mask, 0.3, window, None, spec.chunks, layout, alibi=alibi)
    want = flex.tree_attention_fn(spec_scaled)(q, k, v, batch.position_ids, *buffers, *tensors)
    rtol, atol = TOL["pure"]
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol)


@pytest.mark.parametrize("name", list(SEQS))
@pytest.mark.parametrize("block", [4, 16, 128])
def test_interval_block_mask_equals_create_block_mask(name, block):
    from torch.nn.attention.flex_attention import create_block_mask

    batch = _batch(name)
    se, s = batch.subtree_end, batch.num_tokens
    ours = flex.interval_block_mask(se, block)
    ref = create_block_mask(lambda b, h, q, kv: (kv <= q) & (q < se[kv]), 1, 1, s, s, device="cpu",
                            BLOCK_SIZE=block)
    assert torch.equal(ours.to_dense(), ref.to_dense())
    # Full blocks must be exact (they skip the mask_mod); partial ones may be a superset.
    assert torch.equal(ours.full_kv_num_blocks, ref.full_kv_num_blocks)


def test_split_block_mask_round_trips():
    batch = _batch("blocks")
    bm = flex.interval_block_mask(batch.subtree_end, 16)
    tensors, layout = flex.split_block_mask(bm)
    assert all(isinstance(t, torch.Tensor) for t in tensors)
    kinds = [slot[0] for slot in layout.slots]
    assert kinds[:2] == ["q_len", "kv_len"] and kinds[-1] == "mask_mod"


@pytest.mark.parametrize("block", [4, 16])
def test_windowed_layers_get_no_full_blocks(block):
    """A full block skips the mask_mod; with a sliding window that would drop the window
    inside full blocks (on kernels that honour block sparsity). Windowed calls must see the
    same live blocks with none full."""
    batch = _batch("blocks")
    bm = flex.interval_block_mask(batch.subtree_end, block)
    tensors, layout = flex.split_block_mask(bm)
    assert int(bm.full_kv_num_blocks.sum()) > 0, "the test tree must have full blocks"
    demoted = flex.demote_full_blocks(tensors)
    rebuilt = flex._block_tuple(layout, demoted, batch.num_tokens, batch.num_tokens, lambda *a: None)
    from torch.nn.attention.flex_attention import BlockMask

    merged = BlockMask.from_kv_blocks(rebuilt[2], rebuilt[3], rebuilt[4], rebuilt[5], BLOCK_SIZE=block,
                                      seq_lengths=(batch.num_tokens, batch.num_tokens))
    assert int(merged.full_kv_num_blocks.sum()) == 0
    assert torch.equal(merged.to_dense(), bm.to_dense())
    # q-side tables are the transpose of the kv side.
    assert torch.equal(demoted[4], merged.q_num_blocks)
    for row, count in enumerate(demoted[4][0, 0].tolist()):
        assert demoted[5][0, 0, row, :count].tolist() == merged.q_indices[0, 0, row, :count].tolist()


def test_flex_path_alibi_and_sinks_match_dense_reference():
    """The FlexAttention branch (the CUDA path; its higher-order op also runs eagerly on CPU):
    the ALiBi score_mod in path positions, the natural log-sum-exp it returns, and sinks
    through that log-sum-exp, forward and every gradient, against dense softmax."""
    batch = _batch("tiny")
    s, h = batch.num_tokens, 2
    bm = flex.interval_block_mask(batch.subtree_end, 16)
    tensors, layout = flex.split_block_mask(bm)
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, h, s, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    sinks = torch.randn(h, generator=g, dtype=torch.float64, requires_grad=True)
    slopes = torch.tensor([0.5, 0.125], dtype=torch.float64)
    pos = batch.position_ids
    out, lse = flex.call_flex_hop(
        q, k, v, score_mod=flex.alibi_score_mod(flex.softcap_score_mod(None)), mask_mod=interval_mask_mod(),
        block_tensors=tensors, layout=layout, mask_buffers=[batch.subtree_end], scale=0.3,
        score_buffers=(slopes, pos), return_lse=True,
    )
    got_out = flex._with_sinks(out, lse, sinks.view(1, -1, 1))
    bias = slopes[:, None, None] * (pos[None, :] - pos[:, None]).to(torch.float64)
    scores = ((q @ k.transpose(-1, -2)) * 0.3 + bias).masked_fill(~tree_visibility(batch), float("-inf"))
    ref = torch.softmax(torch.cat([scores, sinks.view(1, -1, 1, 1).expand(1, h, s, 1)], -1), -1)[..., :-1] @ v
    dout = torch.randn(ref.shape, generator=g, dtype=torch.float64)
    got = torch.autograd.grad(got_out, (q, k, v, sinks), dout)
    want = torch.autograd.grad(ref, (q, k, v, sinks), dout)
    rtol, atol = TOL["pure"]
    torch.testing.assert_close(got_out, ref, rtol=rtol, atol=atol)
    for n, a, b in zip(("q", "k", "v", "sinks"), got, want):
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol, msg=lambda m, n=n: f"d{n}: {m}")


def test_no_custom_op_argument_shadows_inductors_fallback_lowering():
    """Inductor lowers an opaque op through ``FallbackKernel.create(kernel, *args, **kwargs)``:
    an op argument with one of its parameter names fails to lower ("got multiple values for
    argument 'kernel'", which broke every Mamba2 hybrid on CUDA)."""
    import inspect

    from torch._inductor.ir import FallbackKernel

    # What registers every treecompile:: op: the wrapper (capture, drop-ins, passes) and streaming.
    import treecompile.compile.wrapper  # noqa: F401
    import treecompile.stream.runner  # noqa: F401

    reserved = {n for n, p in inspect.signature(FallbackKernel.create).parameters.items()
                if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    assert reserved == {"kernel"}
    names = sorted({n.split(".")[0] for n in torch._C._dispatch_get_all_op_names() if n.startswith("treecompile::")})
    assert {"treecompile::tree_ssd_scan", "treecompile::ssd_scan_backward", "treecompile::grouped_mm"} <= set(names)
    ops = [getattr(torch.ops.treecompile, n.removeprefix("treecompile::")) for n in names]
    clashes = [(op._qualified_op_name, a.name) for op in ops for o in op.overloads()
               for a in getattr(op, o)._schema.arguments if a.name in reserved]
    assert not clashes, clashes
