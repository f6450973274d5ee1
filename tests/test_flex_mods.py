"""A model's own FlexAttention score_mod / mask_mod on the tree (kernels/attention/flex_mods.py): the
CPU kernel against FlexAttention's own op over the same functions, the learned tensors'
gradients through the lowering, and the refusals (streaming, document ids)."""

from __future__ import annotations

import pytest
import torch
import zoo
import zoo_custom as zc

import treecompile as tc
from treecompile.core.errors import UnsupportedModelError
from treecompile.kernels.attention.blockmask import tree_block_mask
from treecompile.kernels.attention.flex import BLOCK_SIZE, AttentionSpec, _flex_hop_attention, split_block_mask, tree_attention_fn
from treecompile.kernels.attention.flex_mods import register_mods
from treecompile.kernels.attention.masks import tree_mask_mod
from treecompile.kernels.attention.flex import softcap_score_mod
from treecompile.stream.options import StreamOptions


def _chunked(b, h, q_idx, kv_idx, chunk):
    return (q_idx >= kv_idx) & (q_idx // chunk == kv_idx // chunk)


def _bias(score, b, h, q_idx, kv_idx, table):
    return score + table[h, (q_idx - kv_idx).clamp(0, 7)]


@pytest.mark.parametrize("window", [None, 3], ids=["", "window3"])
@pytest.mark.parametrize("which", ["score", "mask", "both"])
def test_cpu_kernel_matches_flexattention_over_the_same_functions(which, window):
    """The CPU kernel (blocks, the functions by vmap on tiles) and FlexAttention's own op on CPU
    (every pair, the functions composed as on a GPU: `_with_user_mods`) agree in float64, the
    functions reading path positions and their tensors (a head-indexed table, a chunk size)."""
    batch = zoo.batches()[1][1]
    s = batch.num_tokens
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, s, 8, dtype=torch.float64, generator=g) for _ in range(3))
    table = torch.randn(4, 8, dtype=torch.float64, generator=g)
    chunk = torch.tensor(3)
    score = _bias if which in ("score", "both") else None
    mask = _chunked if which in ("mask", "both") else None
    key = register_mods(score, mask, 1 if score else 0, 1 if mask else 0)
    tables, layout = split_block_mask(tree_block_mask(batch.subtree_end, block_size=BLOCK_SIZE))
    spec = AttentionSpec(kind="interval", scale=None, window=window, softcap=None, chunks=0, layout=layout, mods=key)
    bufs = ([table] if score else []) + ([chunk] if mask else [])
    cpu = tree_attention_fn(spec)(q, k, v, batch.position_ids, batch.subtree_end, *tables, mod_buffers=bufs)
    from treecompile.kernels.attention.flex import BlockTensors, demote_full_blocks

    hop, _ = _flex_hop_attention(spec, tree_mask_mod("interval", window=window), softcap_score_mod(None), q, k, v,
                                 batch.position_ids,
                                 (batch.subtree_end,), demote_full_blocks(BlockTensors(*tables)), 8 ** -0.5,
                                 tuple(bufs))
    torch.testing.assert_close(cpu, hop, rtol=1e-12, atol=1e-12)


@pytest.mark.full
def test_a_learned_bias_gets_its_gradient_through_the_lowering():
    """The default lowering (AOTAutograd): loss and every gradient, the bias table's included,
    equal per-path training with the model's FlexAttention computed densely."""
    model = zoo.perturb(zc.FlexLearnedBiasLM().double().eval())
    compiled = tc.tree_compile(model)
    for _, batch, trees in zoo.batches():
        zoo.compare(model, compiled, batch, trees, zc.dense_flex_reference)
    assert compiled.counters["rewrite_attention_pass"]["flex_mods"] == 2


@pytest.mark.full
def test_streaming_a_model_with_its_own_mods_is_refused_by_name():
    model = zoo.perturb(zc.FlexSoftcapLM().double().eval())
    compiled = tc.tree_compile(model, backend="eager", stream=StreamOptions(budget_rows=8))
    with pytest.raises(UnsupportedModelError, match=r"cannot stream this model: .* runs a score_mod or mask_mod of the model's own"):
        compiled(zoo.batches()[1][1])
