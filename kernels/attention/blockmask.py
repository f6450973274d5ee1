"""The tree's FlexAttention ``BlockMask``, built from ``subtree_end`` without visiting S x S pairs.

``create_block_mask`` evaluates the mask on every (query, key) pair: O(S^2) work, seconds
at 8k tokens and minutes at 64k. The tree rule ``k <= q < subtree_end[k]`` lets each
(query block, key block) pair be classified from two numbers per key block. For a key
block ``K`` whose keys are all no later than the first query ``q0`` of a query block
``Q = [q0, q1)``, every ``k`` in ``K`` is ``<= q``, so

* some pair is visible iff ``max(subtree_end[K]) > q0`` (take ``q = q0``), and
* every pair is visible iff ``min(subtree_end[K]) >= q1`` (the hardest query is ``q1 - 1``).

Rows past S in the last block count as padding that sees nothing, so that block is never
full, exactly as ``create_block_mask`` classifies it.

A key block reaching further into the query block holds visible pairs (``k = q``) and
a key after some query: partial. Blocks after the query block are empty (``k > q``). The
result is identical to ``create_block_mask``'s, in O(S + blocks^2) tensor work on the
batch's device. The queries may be the last rows of the keys only (a streamed part after
its prefix keys, `treecompile.kernels.attention.prefix_flex`): ``block_classes(..., q_len=S)``.
"""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import BlockMask

from treecompile.kernels.attention.masks import MaskMod, bind_buffers, interval_mask_mod

__all__ = ["tree_block_mask", "block_classes", "block_mask_from_classes"]


def block_classes(subtree_end: torch.Tensor, block_size: int, *,
                  q_len: int | None = None, min_blocks: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``(partial, full)``: ``[nq, nk]`` bool over (query block, key block) pairs.

    Args:
        subtree_end: ``[L]`` int64, each key's subtree end.
        block_size: rows per block (the same for queries and keys).
        q_len: the queries are the last ``q_len`` rows (a streamed part's own rows after
            its ``L - q_len`` prefix keys, `treecompile.kernels.attention.prefix_flex`); default all L.
        min_blocks: at least this many blocks on each side: the blocks past the rows are empty
            (they hold padding rows only).
    """
    total = subtree_end.shape[0]
    q_len = total if q_len is None else q_len
    p = total - q_len
    nq, nk = max(-(-q_len // block_size), min_blocks), max(-(-total // block_size), min_blocks)
    # Padding rows past the end see nothing and are seen by nothing, as create_block_mask
    # evaluates them: they never make a pair visible, and a block holding one is never full.
    end = torch.nn.functional.pad(subtree_end.to(torch.int64), (0, nk * block_size - total), value=-1)
    end = end.view(nk, block_size)
    hi, lo = end.amax(dim=1), end.amin(dim=1)
    dev = subtree_end.device
    k0 = torch.arange(nk, device=dev) * block_size
    k_last = torch.clamp(k0 + block_size, max=total) - 1          # the block's last real key
    q0 = p + torch.arange(nq, device=dev) * block_size               # its first query's row
    q1 = torch.clamp(q0 + block_size, max=total)                     # past its last real query
    # Keys no later than the block's first query are <= every query of it: some pair is
    # visible iff a subtree reaches past the first query, all iff every one reaches past the
    # last (a block with padding never is).
    before = k_last[None, :] <= q0[:, None]
    live = before & (hi[None, :] > q0[:, None])
    full = before & (lo[None, :] >= q1[:, None]) & ((q1 - q0) == block_size)[:, None]
    # Key blocks reaching further into the query block hold a key after some query: partial
    # (each query sees itself); later ones are empty.
    reaching = ~before & (k0[None, :] <= (q1 - 1)[:, None])
    return (live & ~full) | reaching, full


def _to_indices(classes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``([1, 1, nb], [1, 1, nb, nb])`` counts and member columns of each row, members first.

    Each row's members go to slots ``0..count-1`` in increasing column order and the other
    columns fill the remaining slots: one cumsum and one scatter, no sort.
    """
    classes = classes.contiguous()
    nb = classes.shape[1]
    cum = classes.to(torch.int32).cumsum(dim=1, dtype=torch.int32)
    counts = cum[:, -1:]
    cols = torch.arange(nb, dtype=torch.int32, device=classes.device).expand_as(cum)
    slots = torch.where(classes, cum - 1, counts + cols - cum).to(torch.int64)
    order = torch.empty_like(cum).scatter_(1, slots, cols)
    return counts[:, 0].contiguous()[None, None], order[None, None]


def tree_block_mask(
    subtree_end: torch.Tensor, *, block_size: int = 128, mask_mod: MaskMod | None = None, min_blocks: int = 1
) -> BlockMask:
    """The ``BlockMask`` of the tree rule for one packed row (batch 1, shared by all heads).

    Args:
        subtree_end: ``[S]`` int64, from `treecompile.TreeBatch`.
        block_size: FlexAttention block size for queries and keys.
        mask_mod: ``mask_mod(b, h, q, kv)``, evaluated inside partial blocks; defaults to the
            interval rule over ``subtree_end``. Pass another
            rule only if it is the same relation (the bitmask rule, or one restricted further,
            as by a sliding window, in which case extra blocks are merely partial).
        min_blocks: at least this many query and key blocks (`block_classes`).

    Returns:
        A ``BlockMask`` equal to ``create_block_mask(mask_mod, 1, 1, S, S, BLOCK_SIZE=block_size)``.
    """
    partial, full = block_classes(subtree_end, block_size, min_blocks=min_blocks)
    return block_mask_from_classes(
        partial, full, subtree_end.shape[0], block_size, mask_mod or bind_buffers(interval_mask_mod(), subtree_end)
    )


def block_mask_from_classes(
    partial: torch.Tensor, full: torch.Tensor, seq_len: int, block_size: int, mask_mod: MaskMod | None = None,
    *, kv_len: int | None = None,
) -> BlockMask:
    """A ``BlockMask`` from ``[nq, nk]`` bool tables of partial and full (query, key) blocks.

    Args:
        partial: blocks where ``mask_mod`` decides each pair.
        full: blocks where every pair is visible (``mask_mod`` is skipped); disjoint from ``partial``.
        seq_len: S, the queries (and the keys, without ``kv_len``).
        block_size: rows per block.
        mask_mod: the rule evaluated in partial blocks.
        kv_len: the keys, where they are not the queries.
    """
    kv_num, kv_idx = _to_indices(partial)
    full_num, full_idx = _to_indices(full)
    # The query-side tables are the same classes transposed; building them here is ~20x
    # faster than from_kv_blocks' generic transpose (3 ms vs 99 ms at S=128k on 2 CPU cores).
    q_num, q_idx = _to_indices(partial.T)
    full_q_num, full_q_idx = _to_indices(full.T)
    kwargs = {} if mask_mod is None else {"mask_mod": mask_mod}
    return BlockMask(
        seq_lengths=(seq_len, seq_len if kv_len is None else kv_len),
        kv_num_blocks=kv_num,
        kv_indices=kv_idx,
        full_kv_num_blocks=full_num,
        full_kv_indices=full_idx,
        q_num_blocks=q_num,
        q_indices=q_idx,
        full_q_num_blocks=full_q_num,
        full_q_indices=full_q_idx,
        BLOCK_SIZE=(block_size, block_size),
        **kwargs,
    )
