"""The tree attention rule as FlexAttention ``mask_mod`` functions.

Two equivalent encodings of "query row ``q`` may see key row ``k``":

* interval (default): ``k <= q < subtree_end[k]``. One gather per pair; the rows of a
  node's subtree are contiguous in DFS order, so this is exactly "``k``'s node is an
  ancestor-or-self of ``q``'s node, and ``k`` is not later in the same node".
* bitmask (Prompt Trees): ``k <= q``, the same tree, and ``k``'s path vector is a subset
  of ``q``'s: ``(bits[q] & bits[k]) == bits[k]`` in every 64-bit chunk.

Both take index tensors of any broadcastable shape, so the same function serves
FlexAttention and dense evaluation in tests.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["interval_rule", "bitmask_rule", "interval_mask_mod", "bitmask_mask_mod"]

MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def interval_rule(q_idx: torch.Tensor, kv_idx: torch.Tensor, subtree_end: torch.Tensor) -> torch.Tensor:
    """True where key ``kv_idx`` is visible to query ``q_idx``: ``kv <= q < subtree_end[kv]``."""
    return (kv_idx <= q_idx) & (q_idx < subtree_end[kv_idx])


def bitmask_rule(
    q_idx: torch.Tensor, kv_idx: torch.Tensor, tree_ids: torch.Tensor, path_bits: torch.Tensor, chunks: int
) -> torch.Tensor:
    """True where ``kv <= q``, both are in one tree, and ``kv``'s path vector is a subset of ``q``'s.

    ``chunks`` (``path_bits.shape[1]``) is a Python int so that the loop unrolls in a kernel.
    """
    ok = (kv_idx <= q_idx) & (tree_ids[q_idx] == tree_ids[kv_idx])
    for c in range(chunks):
        kb = path_bits[kv_idx, c]
        ok = ok & ((path_bits[q_idx, c] & kb) == kb)
    return ok


def interval_mask_mod(subtree_end: torch.Tensor) -> MaskMod:
    """The interval rule over ``subtree_end`` (``[S]`` int64)."""

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        return interval_rule(q_idx, kv_idx, subtree_end)

    mask_mod.__name__ = f"tree_interval_mask_s{subtree_end.shape[0]}"
    return mask_mod


def bitmask_mask_mod(path_bits: torch.Tensor, tree_ids: torch.Tensor) -> MaskMod:
    """The path-vector rule over ``path_bits`` (``[S, C]`` int64) and ``tree_ids`` (``[S]``)."""
    chunks = path_bits.shape[1]

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        return bitmask_rule(q_idx, kv_idx, tree_ids, path_bits, chunks)

    mask_mod.__name__ = f"tree_bitmask_mask_c{chunks}"
    return mask_mod
