"""A streamed part's attention over ``[prefix ; own]`` keys as one FlexAttention call.

The mask of `treecompile.kernels.prefix_attention` (query ``i`` of the part sits at
concatenated index ``c_i = P + i``; key ``j`` is visible iff ``j <= c_i < kv_end[j]``, with a
window also ``q_pos[i] - kv_pos[j] < window``) as a ``mask_mod`` over ``S`` queries and
``L = P + S`` keys, and its ``BlockMask`` built from ``kv_end`` without visiting the S x L
pairs: `treecompile.kernels.blockmask.block_classes` with the queries the last ``S`` of the
``L`` rows (``q_len=S``); with a window no block is known full.
The gradients reach the prefix keys and values as any key's: the stack's K/V get theirs
from the same call. The per-block loop of `treecompile.kernels.prefix_attention` stays the
CPU kernel (FlexAttention has no CPU backward).
"""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from treecompile.kernels.blockmask import block_classes, block_mask_from_classes

__all__ = ["prefix_mask_mod", "prefix_block_mask", "prefix_flex_attention"]


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
    offset = torch.tensor([total - q_len], dtype=torch.int64, device=kv_end.device)
    rule = prefix_mask_mod(window)

    def mask_mod(b, h, q_idx, kv_idx):
        return rule(b, h, q_idx, kv_idx, kv_end, kv_pos, q_pos, offset)

    mask_mod.__name__ = rule.__name__
    return block_mask_from_classes(partial, full, q_len, block_size, mask_mod, kv_len=total)


def prefix_flex_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_end: torch.Tensor,
                          kv_pos: torch.Tensor, q_pos: torch.Tensor, *, scale: float, softcap: float = 0.0,
                          window: int = 0, block_size: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [1, Hq, S, Dv], lse [1, Hq, S])`` of `treecompile.kernels.prefix_attention`'s op,
    as one FlexAttention call (grouped-query heads, soft-cap as a ``score_mod``)."""
    block_mask = prefix_block_mask(kv_end, kv_pos, q_pos, block_size=block_size, window=window)

    def capped(score, b, h, q_idx, kv_idx):
        return softcap * torch.tanh(score / softcap)

    out, lse = flex_attention(q, k, v, block_mask=block_mask, scale=scale, score_mod=capped if softcap > 0 else None,
                              enable_gqa=q.shape[1] != k.shape[1], return_lse=True)
    return out, lse
