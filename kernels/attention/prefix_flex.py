"""A streamed part's attention over ``[prefix ; own]`` keys as one FlexAttention call.

The mask of `treecompile.kernels.attention.prefix_attention` (query ``i`` of the part sits at
concatenated index ``c_i = P + i``; key ``j`` is visible iff ``j <= c_i < kv_end[j]``, with a
window also ``q_pos[i] - kv_pos[j] < window``) as a ``mask_mod`` over ``S`` queries and
``L = P + S`` keys, and its ``BlockMask`` built from ``kv_end`` without visiting the S x L
pairs: `treecompile.kernels.attention.blockmask.block_classes` with the queries the last ``S`` of the
``L`` rows (``q_len=S``); with a window no block is known full.
The gradients reach the prefix keys and values as any key's: the stack's K/V get theirs
from the same call. `prefix_flex_hop` is what a streamed part's (or a context-parallel
rank's) graph calls on CUDA: FlexAttention's higher-order op with the tables of
`prefix_block_mask`, as `treecompile.kernels.attention.flex` calls it for the whole tree (it runs
forward and backward on CPU too, over every pair: how the tests check it). The per-block
loop of `treecompile.kernels.attention.prefix_attention` stays the CPU kernel.
"""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from treecompile.kernels.attention.blockmask import block_classes, block_mask_from_classes
from treecompile.kernels.attention.flex import BLOCK_SIZE, call_flex_hop, softcap_score_mod, split_block_mask

__all__ = ["prefix_mask_mod", "prefix_block_mask", "prefix_flex_attention", "prefix_flex_hop"]


def prefix_mask_mod(window: int = 0):
    """``mask_mod(b, h, q, kv, kv_end, kv_pos, q_pos, offset)``: the rule above (``offset``:
    ``[1]`` holding ``P``, a tensor so that parts of other prefix lengths share a graph)."""

    def prefix_tree_mask(b, h, q_idx, kv_idx, kv_end, kv_pos, q_pos, offset):
        c = q_idx + offset[0]
        ok = (kv_idx <= c) & (c < kv_end[kv_idx])
        if window > 0:
            ok = ok & (q_pos[q_idx] - kv_pos[kv_idx] < window)
        return ok

    prefix_tree_mask.__name__ = f"prefix_tree_mask_w{window}" if window else "prefix_tree_mask"
    return prefix_tree_mask


def prefix_block_mask(kv_end: torch.Tensor, kv_pos: torch.Tensor, q_pos: torch.Tensor, *, block_size: int = 128,
                      window: int = 0) -> BlockMask:
    """The ``BlockMask`` of a part: ``S = len(q_pos)`` queries over ``L = len(kv_end)`` keys."""
    q_len, total = q_pos.shape[0], kv_end.shape[0]
    partial, full = block_classes(kv_end, block_size, q_len=q_len)
    if window > 0:  # the window restricts the rule further: no block is known full
        partial, full = partial | full, torch.zeros_like(full)
    offset = kv_end.new_full((1,), total - q_len)
    rule = prefix_mask_mod(window)

    def mask_mod(b, h, q_idx, kv_idx):
        return rule(b, h, q_idx, kv_idx, kv_end, kv_pos, q_pos, offset)

    mask_mod.__name__ = rule.__name__
    return block_mask_from_classes(partial, full, q_len, block_size, mask_mod, kv_len=total)


def prefix_flex_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_end: torch.Tensor,
                          kv_pos: torch.Tensor, q_pos: torch.Tensor, *, scale: float, softcap: float = 0.0,
                          window: int = 0, block_size: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [1, Hq, S, Dv], lse [1, Hq, S])`` of `treecompile.kernels.attention.prefix_attention`'s op,
    as one FlexAttention call (grouped-query heads, soft-cap as a ``score_mod``)."""
    block_mask = prefix_block_mask(kv_end, kv_pos, q_pos, block_size=block_size, window=window)

    def capped(score, b, h, q_idx, kv_idx):
        return softcap * torch.tanh(score / softcap)

    out, lse = flex_attention(q, k, v, block_mask=block_mask, scale=scale, score_mod=capped if softcap > 0 else None,
                              enable_gqa=q.shape[1] != k.shape[1], return_lse=True)
    return out, lse


def prefix_flex_hop(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_end: torch.Tensor, kv_pos: torch.Tensor,
                    q_pos: torch.Tensor, *, scale: float, softcap: float = 0.0, window: int = 0,
                    block_size: int = BLOCK_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """`prefix_flex_attention` through FlexAttention's higher-order op (what a compiled part
    graph calls: `treecompile.kernels.attention.flex.call_flex_hop`), the rule's tensors passed as mask
    buffers so that one graph serves every part. ``(out [1, Hq, S, Dv], lse [1, Hq, S])``,
    the log-sum-exp natural."""
    tables, layout = split_block_mask(prefix_block_mask(kv_end, kv_pos, q_pos, block_size=block_size, window=window))
    offset = kv_end.new_full((1,), kv_end.shape[0] - q_pos.shape[0])
    return call_flex_hop(q, k, v, score_mod=softcap_score_mod(softcap or None), mask_mod=prefix_mask_mod(window),
                         block_tensors=tables, layout=layout, mask_buffers=(kv_end, kv_pos, q_pos, offset),
                         scale=scale, return_lse=True)
