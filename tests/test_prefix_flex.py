"""A streamed part's attention as one FlexAttention call (`treecompile.kernels.attention.prefix_flex`):
its block mask against create_block_mask for every part of a tree at several block sizes,
and its output against the dense reference of `treecompile.kernels.attention.prefix_attention`."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask
from test_blockmask import assert_same_block_mask
from test_stream import BRANCHY
from testing import COMPILE_TOL

from treecompile import TrajectoryTree, pack
from treecompile.kernels.attention.naive import prefix_attention_reference
from treecompile.kernels.attention.prefix_flex import prefix_block_mask, prefix_flex_attention, prefix_flex_hop, prefix_mask_mod
from treecompile.stream.options import plan_stream


def _parts(budget: int):
    """``(kv_end, kv_pos, q_pos)`` of every part of the BRANCHY tree streamed at ``budget`` rows,
    in the concatenated coordinates the stream runner hands the attention."""
    batch = pack(TrajectoryTree.from_sequences(BRANCHY), warn_por=False)
    plan = plan_stream(batch, budget)
    sub, pos = batch.subtree_end, batch.position_ids
    for j in range(plan.num_parts):
        a, b = int(plan.starts[j]), int(plan.starts[j + 1])
        pre = plan.prefix[j]
        p = len(pre)
        kv_end = torch.cat([p + sub[pre].clamp(max=b) - a, p + sub[a:b].clamp(max=b) - a])
        yield kv_end, torch.cat([pos[pre], pos[a:b]]), pos[a:b]


def _dense(kv_end, kv_pos, q_pos, window):
    s, total = q_pos.shape[0], kv_end.shape[0]
    rule = prefix_mask_mod(window)
    q, kv = torch.arange(s)[:, None], torch.arange(total)[None, :]
    return rule(0, 0, q, kv, kv_end, kv_pos, q_pos, torch.tensor([total - s]))


@pytest.mark.parametrize("budget", [3, 7, 20])
@pytest.mark.parametrize("block", [1, 2, 4, 16])
def test_block_mask_equals_create_block_mask(budget, block):
    """Built from kv_end in O(blocks), it is what evaluating the rule on every pair gives."""
    for kv_end, kv_pos, q_pos in _parts(budget):
        s, total = q_pos.shape[0], kv_end.shape[0]
        dense = _dense(kv_end, kv_pos, q_pos, 0)
        # The rule itself: a query sees its own row, never a later one.
        p = total - s
        assert dense[torch.arange(s), p + torch.arange(s)].all() and not dense.triu(p + 1).any()
        ours = prefix_block_mask(kv_end, kv_pos, q_pos, block_size=block)
        ref = create_block_mask(ours.mask_mod, 1, 1, s, total, device="cpu", BLOCK_SIZE=block)
        assert_same_block_mask(ours, ref)


@pytest.mark.parametrize("block", [1, 4])
def test_a_windowed_block_mask_has_no_full_block_and_every_visible_pair(block):
    for kv_end, kv_pos, q_pos in _parts(7):
        dense = _dense(kv_end, kv_pos, q_pos, 3)
        mask = prefix_block_mask(kv_end, kv_pos, q_pos, block_size=block, window=3)
        assert int(mask.full_kv_num_blocks.sum()) == 0
        present = mask.to_dense()[0, 0].repeat_interleave(block, 0).repeat_interleave(block, 1)
        assert not (dense & ~present[: dense.shape[0], : dense.shape[1]].bool()).any()


@pytest.mark.parametrize("softcap,window", [(0.0, 0), (2.0, 3)], ids=["plain", "softcap-w3"])
def test_one_flex_call_matches_the_dense_reference(softcap, window):
    torch.manual_seed(0)
    rtol, atol = COMPILE_TOL["pure"]
    for kv_end, kv_pos, q_pos in _parts(7):
        s, total = q_pos.shape[0], kv_end.shape[0]
        q = torch.randn(1, 4, s, 8, dtype=torch.float64)
        k = torch.randn(1, 2, total, 8, dtype=torch.float64)
        v = torch.randn(1, 2, total, 8, dtype=torch.float64)
        out, lse = prefix_flex_attention(q, k, v, kv_end, kv_pos, q_pos, scale=0.3, softcap=softcap, window=window,
                                         block_size=4)
        ref = prefix_attention_reference(q, k, v, kv_end, kv_pos, q_pos, scale=0.3, softcap=softcap, window=window)
        torch.testing.assert_close(out, ref, rtol=rtol, atol=atol)
        assert torch.isfinite(lse).all()


@pytest.mark.parametrize("softcap,window", [(0.0, 0), (2.0, 3)], ids=["plain", "softcap-w3"])
def test_the_graphs_flex_call_matches_the_dense_reference_forward_and_backward(softcap, window):
    """`prefix_flex_hop`, what a part graph calls on CUDA, through FlexAttention's higher-order
    op (forward and backward on CPU, over every pair): output and the gradients of q, k and v,
    the prefix keys and values included."""
    torch.manual_seed(0)
    rtol, atol = COMPILE_TOL["pure"]
    prefix_grads = []
    for kv_end, kv_pos, q_pos in _parts(7):
        s, total = q_pos.shape[0], kv_end.shape[0]
        q, k, v = (torch.randn(1, h, n, 8, dtype=torch.float64, requires_grad=True)
                   for h, n in ((4, s), (2, total), (2, total)))
        grad_out = torch.randn(1, 4, s, 8, dtype=torch.float64)
        out, lse = prefix_flex_hop(q, k, v, kv_end, kv_pos, q_pos, scale=0.3, softcap=softcap, window=window,
                                   block_size=4)
        got = torch.autograd.grad(out, (q, k, v), grad_out)
        ref = prefix_attention_reference(q, k, v, kv_end, kv_pos, q_pos, scale=0.3, softcap=softcap, window=window)
        want = torch.autograd.grad(ref, (q, k, v), grad_out)
        torch.testing.assert_close(out, ref, rtol=rtol, atol=atol)
        for name, g, w in zip("qkv", got, want):
            torch.testing.assert_close(g, w, rtol=rtol, atol=atol, msg=lambda m, name=name: f"d{name}: {m}")
        if total > s:
            prefix_grads.append(float(got[1][:, :, : total - s].abs().sum()))
    assert len(prefix_grads) >= 2 and all(g > 0 for g in prefix_grads)  # every prefix's keys get theirs
