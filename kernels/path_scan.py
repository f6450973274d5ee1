"""Running sums along each token's root path (RoBERTa-style positions on a tree).

A model that numbers its tokens with a running sum over the sequence
(``cumsum(input_ids != pad) + pad``, RoBERTa's ``create_position_ids_from_input_ids``,
fairseq's ``make_positions``) counts, on a path, the tokens before it on that path. On a
packed tree row those are the row's ancestors-or-self: the rows ``k <= r`` whose subtree
still contains ``r`` (``subtree_end[k] > r``). So

    path_cumsum(x)[r] = sum(x[k] for k <= r) - sum(x[k] for k with subtree_end[k] <= r)

(every row whose subtree ended at or before ``r`` lies before ``r``): two running sums,
O(S). Exact for integer and boolean inputs (the only ones the positions pass rewrites);
floating-point sums would cancel large partial sums, so they are left refused.
"""

from __future__ import annotations

import torch

__all__ = ["path_cumsum", "path_cumsum_reference"]


def path_cumsum(x: torch.Tensor, dim: int, subtree_end: torch.Tensor) -> torch.Tensor:
    """``x.cumsum(dim)`` along each row's root path (``x`` integer or bool, ``x.shape[dim] == S``).

    Args:
        x: ``[..., S, ...]`` with the rows on ``dim``.
        dim: the rows' dim.
        subtree_end: ``[S]`` exclusive end row of each row's subtree.

    Returns:
        ``[..., S, ...]`` int64 (as ``cumsum`` of an integer tensor).
    """
    xs = x.movedim(dim, -1).to(torch.int64)
    s = xs.shape[-1]
    ended = xs.new_zeros(*xs.shape[:-1], s + 1).index_add_(-1, subtree_end.to(torch.int64), xs)
    out = xs.cumsum(-1) - ended.cumsum(-1)[..., :s]
    return out.movedim(-1, dim)


def path_cumsum_reference(x: torch.Tensor, dim: int, subtree_end: torch.Tensor) -> torch.Tensor:
    """The definition, a loop over pairs: row ``r`` sums its ancestors-or-self ``k``
    (``k <= r < subtree_end[k]``)."""
    xs = x.movedim(dim, -1).to(torch.int64)
    out = torch.zeros_like(xs)
    end = subtree_end.tolist()
    for r in range(xs.shape[-1]):
        for k in range(r + 1):
            if r < end[k]:
                out[..., r] += xs[..., k]
    return out.movedim(-1, dim)
