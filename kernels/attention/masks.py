"""The tree attention rule, and the one family of FlexAttention ``mask_mod`` functions over it.

Two equivalent encodings of "query row ``q`` may see key row ``k``":

* interval (default): ``k <= q < subtree_end[k]``. One gather per pair; the rows of a
  node's subtree are contiguous in DFS order, so this is exactly "``k``'s node is an
  ancestor-or-self of ``q``'s node, and ``k`` is not later in the same node".
* bitmask (Prompt Trees): ``k <= q``, the same tree, and ``k``'s path vector is a subset
  of ``q``'s: ``(bits[q] & bits[k]) == bits[k]`` in every 64-bit chunk.

Every ``mask_mod`` here reads the tree tensors as *mask buffers* (extra arguments after
``b, h, q_idx, kv_idx``, in :data:`MASK_KINDS` order, then ``positions`` under a sliding
window), not as closure constants, so one traced graph serves every batch.
:func:`bind_buffers` closes one over a batch's tensors, giving the plain
``mask_mod(b, h, q_idx, kv_idx)`` that ``create_block_mask`` and dense evaluation take.
All take index tensors of any broadcastable shape.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = [
    "MASK_KINDS",
    "interval_rule",
    "bitmask_rule",
    "interval_mask_mod",
    "bitmask_mask_mod",
    "tree_mask_mod",
    "bind_buffers",
    "dense_tree_mask",
]

#: ``mask_mod(b, h, q_idx, kv_idx, *buffers) -> bool`` tensor.
MaskMod = Callable[..., torch.Tensor]

#: Mask encodings and the tree tensors their ``mask_mod`` reads, in buffer order.
MASK_KINDS: dict[str, tuple[str, ...]] = {
    "interval": ("subtree_end",),
    "bitmask": ("tree_ids", "path_bits"),
}


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


def interval_mask_mod(window: int | None = None) -> MaskMod:
    """``mask_mod(b, h, q, kv, subtree_end[, positions])`` for the interval rule.

    Key ``kv`` is visible to query ``q`` iff ``kv <= q < subtree_end[kv]``: the rows of a
    node's subtree are contiguous in DFS order, so this says "kv's node is an ancestor
    of (or is) q's node and kv is not later in it", i.e. kv lies on q's root path. With a
    sliding window the distance is measured along that path, ``positions[q] -
    positions[kv] < window``, the distance per-path training sees (HF's rule
    ``kv > q - window`` in path coordinates).
    """
    if window is None:

        def mask_mod(b, h, q_idx, kv_idx, subtree_end):
            return interval_rule(q_idx, kv_idx, subtree_end)

        mask_mod.__name__ = "tree_interval_mask"
        return mask_mod

    def windowed(b, h, q_idx, kv_idx, subtree_end, positions):
        on_path = interval_rule(q_idx, kv_idx, subtree_end)
        return on_path & (positions[q_idx] - positions[kv_idx] < window)

    windowed.__name__ = f"tree_interval_mask_w{window}"
    return windowed


def bitmask_mask_mod(chunks: int, window: int | None = None) -> MaskMod:
    """``mask_mod(b, h, q, kv, tree_ids, path_bits[, positions])`` for the path-bit rule.

    Key ``kv`` is visible iff it is in the same tree, not later than ``q``, and its path
    vector is a subset of ``q``'s (``kv``'s node is on ``q``'s root path). ``chunks`` is
    static (``path_bits.shape[1]``) so the loop unrolls in the generated kernel.
    """

    def on_path(q_idx, kv_idx, tree_ids, path_bits):
        return bitmask_rule(q_idx, kv_idx, tree_ids, path_bits, chunks)

    if window is None:

        def mask_mod(b, h, q_idx, kv_idx, tree_ids, path_bits):
            return on_path(q_idx, kv_idx, tree_ids, path_bits)

        mask_mod.__name__ = f"tree_bitmask_mask_c{chunks}"
        return mask_mod

    def windowed(b, h, q_idx, kv_idx, tree_ids, path_bits, positions):
        near = positions[q_idx] - positions[kv_idx] < window
        return on_path(q_idx, kv_idx, tree_ids, path_bits) & near

    windowed.__name__ = f"tree_bitmask_mask_c{chunks}_w{window}"
    return windowed


def tree_mask_mod(kind: str, *, chunks: int = 0, window: int | None = None) -> MaskMod:
    """The ``mask_mod`` of mask encoding ``kind`` (a key of :data:`MASK_KINDS`).

    Raises:
        ValueError: an unknown ``kind``, naming the valid ones.
    """
    if kind == "interval":
        return interval_mask_mod(window)
    if kind == "bitmask":
        return bitmask_mask_mod(chunks, window)
    raise ValueError(f"unknown mask kind {kind!r}; valid kinds: {', '.join(MASK_KINDS)}")


def bind_buffers(mask_mod: MaskMod, *buffers: torch.Tensor) -> Callable[..., torch.Tensor]:
    """``mask_mod`` with its buffers bound: ``bound(b, h, q_idx, kv_idx)``.

    The form ``create_block_mask`` and dense evaluation take, e.g.
    ``bind_buffers(interval_mask_mod(), subtree_end)``.
    """

    def bound(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        return mask_mod(b, h, q_idx, kv_idx, *buffers)

    bound.__name__ = f"{mask_mod.__name__}_s{buffers[0].shape[0]}" if buffers else mask_mod.__name__
    return bound


def dense_tree_mask(kind: str, chunks: int, *buffers: torch.Tensor) -> torch.Tensor:
    """The tree mask as a dense ``[S, S]`` bool tensor (query, key): ``S^2`` memory, for a model
    that itself computes on ``[T, T]`` tensors beyond what a kernel takes
    (`treecompile.passes.attention.dense_pairs`)."""
    rows = torch.arange(buffers[0].shape[0], device=buffers[0].device)
    return tree_mask_mod(kind, chunks=chunks)(0, 0, rows[:, None], rows[None, :], *buffers)
