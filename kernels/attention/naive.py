"""The plain reference implementations of the attention family's kernels: written densely, used by
the tests as the ground truth the fast kernels beside them are compared with.

* `prefix_attention_reference`: the attention of a streamed part's queries over its prefix keys and
  its own (:mod:`treecompile.kernels.attention.prefix_attention`) as one dense ``[S, L]`` softmax:
  O(S x L) time and memory.

The dense reference of the whole-tree attention is SDPA over ``TreeBatch.reference_attention_mask``
(``[S, S]``), and the per-path ground truth of a model is :mod:`treecompile.core.reference`.
"""

from __future__ import annotations

import torch

__all__ = ["prefix_attention_reference"]

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
