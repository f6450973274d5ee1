"""A streamed part's attention over ``[prefix ; own]`` keys as one FlexAttention call.

The mask of `treecompile.kernels.prefix_attention` (query ``i`` of the part sits at
concatenated index ``c_i = P + i``; key ``j`` is visible iff ``j <= c_i < kv_end[j]``, with a
window also ``q_pos[i] - kv_pos[j] < window``) as a ``mask_mod`` over ``S`` queries and
``L = P + S`` keys, and its ``BlockMask`` built from ``kv_end`` without visiting the S x L
pairs. For a (query block ``[q0, q1)``, key block ``K``) pair whose keys all come before
the block's first query (``max K < P + q0``), every key is ``<= c`` for every query, so

* some pair is visible iff ``max(kv_end[K]) > P + q0`` (take the first query), and
* every pair is visible iff ``min(kv_end[K]) >= P + q1`` (the last one),

as in `treecompile.kernels.blockmask`; a key block reaching the query block is partial if
it has a key not after the block's last query, else empty. Rows past ``S`` or ``L`` in a
last block see nothing, so such a block is never full; with a window no block is full.
The gradients reach the prefix keys and values as any key's: the stack's K/V get theirs
from the same call. The per-block loop of `treecompile.kernels.prefix_attention` stays the
CPU kernel (FlexAttention has no CPU backward).
"""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from treecompile.kernels.blockmask import _to_indices

__all__ = ["prefix_block_classes", "prefix_mask_mod", "prefix_block_mask", "prefix_flex_attention"]


def prefix_block_classes(kv_end: torch.Tensor, q_len: int, block_size: int, *,
                         windowed: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(partial, full)``: ``[nq, nk]`` bool over (query block, key block) pairs.

    Args:
        kv_end: ``[L]`` int64, each key's subtree end in concatenated coordinates.
        q_len: S, the part's rows (the last ``S`` keys); the prefix holds ``P = L - S``.
        block_size: rows per block, queries and keys alike.
        windowed: a window restricts the rule further: no block is full.
    """
    total = kv_end.shape[0]
    p = total - q_len
    nq, nk = -(-q_len // block_size), -(-total // block_size)
    end = torch.nn.functional.pad(kv_end.to(torch.int64), (0, nk * block_size - total), value=-1)
    end = end.view(nk, block_size)
    hi, lo = end.amax(dim=1), end.amin(dim=1)
    dev = kv_end.device
    k0 = torch.arange(nk, device=dev) * block_size
    k_last = torch.clamp(k0 + block_size, max=total) - 1          # the block's last real key
    q0 = p + torch.arange(nq, device=dev) * block_size               # first query, concatenated
    q1 = torch.clamp(q0 + block_size, max=p + q_len)                 # past the last real query
    before = k_last[None, :] < q0[:, None]
    live = before & (hi[None, :] > q0[:, None])
    full = before & (lo[None, :] >= q1[:, None])
    # A query block with padding rows (past S) is never full, as its padding sees nothing.
    full = full & ((q1 - q0) == block_size)[:, None]
    reaching = ~before & (k0[None, :] <= (q1 - 1)[:, None])
    partial = (live & ~full) | reaching
    if windowed:
        partial, full = partial | full, torch.zeros_like(full)
    return partial, full


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
    partial, full = prefix_block_classes(kv_end, q_len, block_size, windowed=window > 0)
    offset = torch.tensor([total - q_len], dtype=torch.int64, device=kv_end.device)
    rule = prefix_mask_mod(window)

    def mask_mod(b, h, q_idx, kv_idx):
        return rule(b, h, q_idx, kv_idx, kv_end, kv_pos, q_pos, offset)

    mask_mod.__name__ = rule.__name__
    kv_num, kv_idx = _to_indices(partial)
    full_num, full_idx = _to_indices(full)
    q_num, q_idx = _to_indices(partial.T)
    full_q_num, full_q_idx = _to_indices(full.T)
    return BlockMask(seq_lengths=(q_len, total), kv_num_blocks=kv_num, kv_indices=kv_idx,
                     full_kv_num_blocks=full_num, full_kv_indices=full_idx, q_num_blocks=q_num, q_indices=q_idx,
                     full_q_num_blocks=full_q_num, full_q_indices=full_q_idx,
                     BLOCK_SIZE=(block_size, block_size), mask_mod=mask_mod)


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
