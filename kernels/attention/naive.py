"""The plain reference implementations of the attention family's kernels: written densely, used by
the tests as the ground truth the fast kernels beside them are compared with.

* `prefix_attention_reference`: the attention of a streamed part's queries over its prefix keys and
  its own (:mod:`treecompile.kernels.attention.prefix_attention`) as one dense ``[S, L]`` softmax:
  O(S x L) time and memory.
* `tree_pair_sum_reference`: attention without a softmax on the tree
  (:mod:`treecompile.kernels.attention.pair_sum`) as one dense ``[S, S]`` product: O(S^2) memory.

The dense reference of the whole-tree attention is SDPA over ``TreeBatch.reference_attention_mask``
(``[S, S]``), and the per-path ground truth of a model is :mod:`treecompile.core.reference`.
"""

from __future__ import annotations

import torch

__all__ = ["prefix_attention_reference", "tree_pair_sum_reference"]

Tensor = torch.Tensor


def prefix_attention_reference(
    q: Tensor, k: Tensor, v: Tensor, kv_end: Tensor, kv_pos: Tensor, q_pos: Tensor, *, scale: float,
    softcap: float = 0.0, window: int = 0,
) -> Tensor:
    """Dense ``[S, L]`` reference of `prefix_tree_attention` (tests only: O(S x L) memory)."""
    s, total = q.shape[-2], k.shape[-2]
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    sc = (q @ k.transpose(-2, -1)) * scale
    if softcap > 0:
        sc = torch.tanh(sc / softcap) * softcap
    c = torch.arange(total - s, total)
    j = torch.arange(total)
    ok = (j[None, :] <= c[:, None]) & (c[:, None] < kv_end[None, :])
    if window > 0:
        ok &= q_pos[:, None] - kv_pos[None, :] < window
    return torch.softmax(sc.masked_fill(~ok, float("-inf")), -1) @ v


def tree_pair_sum_reference(q: Tensor, k: Tensor, v: Tensor, table: Tensor, positions: Tensor,
                            subtree_end: Tensor, scale: float, normalize: int = 0, eps: float = 0.0,
                            high: float = 0.0, qtable: Tensor | None = None) -> Tensor:
    """Dense ``[S, S]`` reference of `tree_pair_sum` (tests only: O(S^2) memory)."""
    s = q.shape[-2]
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    r = torch.arange(s)
    seen = (r[None, :] <= r[:, None]) & (subtree_end[None, :] > r[:, None])
    dist = (positions[:, None] - positions[None, :]).clamp(min=0, max=table.shape[-1] - 1)
    factor = table.to(q.dtype)[:, dist] * seen.to(q.dtype)  # [L, S, S]
    if qtable is not None:
        factor = factor * qtable.to(q.dtype)[:, positions.clamp(max=qtable.shape[-1] - 1)][..., None]
    w = (q @ k.transpose(-2, -1)) * scale * factor
    if not normalize:
        return w @ v
    if normalize == 3:
        return (w @ v) / w.detach().abs().sum(-1, keepdim=True).clamp(min=eps, max=high if high > 0 else None)
    total = w.sum(-1, keepdim=True)
    return (w @ v) / (total + eps if normalize == 1 else total.clamp(min=eps))
