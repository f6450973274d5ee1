"""Gated DeltaNet (the gated delta rule): ops and drop-ins for the kernels models call.

The recurrence, per batch row and head, with state ``S`` ``[Dk, Dv]`` (Yang et al., 2025):

    S   <- exp(g_t) * S                       # decay
    u_t  = beta_t * (v_t - S^T k_t)           # delta-rule correction
    S   <- S + k_t u_t^T                      # write
    o_t  = S^T q_t                            # read

the delta form of :mod:`treecompile.kernels.recurrence`, which computes it (chunked, and
on a tree by depth levels) and registers the ops:

* ``treecompile::gated_delta_rule(q, k, v, g, beta, initial_state)`` ``-> (out, final_state)``:
  the linear-sequence core of Hugging Face's ``torch_chunk_gated_delta_rule`` and
  flash-linear-attention's ``chunk_gated_delta_rule`` (after their head repeat, L2 norm and
  query scaling, which the drop-ins below do outside the op). The wrapper swaps a model's
  kernel for a drop-in before capture, so each GDN layer is one node the SSM state pass
  can find.
* ``treecompile::tree_gated_delta_rule(q, k, v, g, beta, initial_state, node_table)``
  ``-> out``: what the pass puts in its place; each tree node runs from its parent node's
  final state.
* ``treecompile::gated_delta_rule_backward``: both ops' backward.

`gated_delta_rule_reference` is the loop above, token by token.
"""

from __future__ import annotations

from typing import Any

import torch

from treecompile.kernels.dtypes import compute_dtype
from treecompile.kernels.recurrence import recurrence_reference
from treecompile.kernels.recurrence_ops import register

__all__ = ["gated_delta_rule_reference", "gated_delta_rule", "tree_gated_delta_rule", "hf_chunk_gated_delta_rule",
           "fla_chunk_gated_delta_rule"]

Tensor = torch.Tensor


def gated_delta_rule_reference(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """The gated delta rule, token by token, in the inputs' dtype: ``(out [B, S, H, Dv], final [B, H, Dk, Dv])``."""
    return recurrence_reference(q, k, v, g, beta, initial_state, delta=True)


gated_delta_rule, tree_gated_delta_rule = register("gated_delta_rule", delta=True)


# ----------------------------------------------------------------------------- HF adapter


def _l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    # HF's (and fla's) l2norm: x / sqrt(sum(x^2) + eps), over the head dim only (token-wise).
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def hf_chunk_gated_delta_rule(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    g: Tensor,
    beta: Tensor,
    chunk_size: int = 64,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    **kwargs: Any,
) -> tuple[Tensor, Tensor | None]:
    """Drop-in for HF's ``torch_chunk_gated_delta_rule`` / ``torch_recurrent_gated_delta_rule``.

    Same arguments and result (``[B, S, Hv, Dv]`` and the final state or None); the chunk size
    only changes how HF's kernel sums, not what it computes. The token-wise preparation
    (head repeat, L2 norm, ``Dk^-0.5`` query scaling, in at least float32 as HF does) runs
    here, the recurrence in ``treecompile::gated_delta_rule``.
    """
    return _gated_delta_rule(query, key, value, g, beta, None, initial_state, output_final_state,
                             use_qk_l2norm_in_kernel, kwargs)


def fla_chunk_gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    **kwargs: Any,
) -> tuple[Tensor, Tensor | None]:
    """Drop-in for flash-linear-attention's ``chunk_gated_delta_rule`` / ``fused_recurrent_gated_delta_rule``.

    Same arguments and result: ``q, k`` ``[B, T, H, K]``, ``v`` ``[B, T, HV, V]`` (``HV`` a
    multiple of ``H``), ``g`` (log decay) and ``beta`` ``[B, T, HV]``; ``scale`` defaults to
    ``K^-0.5``. Returns ``o`` and the final state (None unless asked for).
    """
    return _gated_delta_rule(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                             kwargs)


def _gated_delta_rule(query, key, value, g, beta, scale, initial_state, output_final_state, l2norm, kwargs):
    """The token-wise preparation (head repeat, L2 norm, query scaling, in at least float32),
    then ``treecompile::gated_delta_rule``."""
    if kwargs.get("cu_seqlens") is not None:
        raise ValueError("treecompile's gated delta rule keeps packed sequences apart itself: pass no cu_seqlens")
    if kwargs.get("head_first"):
        raise ValueError("treecompile's gated delta rule takes [B, T, H, D] inputs: head_first=True is not supported")
    dtype = query.dtype
    ct = compute_dtype(dtype)
    hk, hv = key.shape[2], value.shape[2]
    if hk != hv:
        query = query.repeat_interleave(hv // hk, dim=2)
        key = key.repeat_interleave(hv // hk, dim=2)
    query, key, value, g, beta = (x.to(ct) for x in (query, key, value, g, beta))
    if l2norm:
        query, key = _l2norm(query), _l2norm(key)
    query = query * (query.shape[-1] ** -0.5 if scale is None else scale)
    out, final = torch.ops.treecompile.gated_delta_rule(query, key, value, g, beta, initial_state)
    return out.to(dtype), (final if output_final_state else None)
