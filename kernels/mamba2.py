"""Mamba2's selective state space scan (SSD): ops and drop-ins for the kernels models call.

Per batch row and head, with state ``h`` ``[P, N]`` (head dim x state size) and the
discretised step ``dt_t`` (after bias, softplus and clamping):

    h_t = exp(dt_t * A) * h_{t-1} + (dt_t * x_t) B_t^T
    y_t = h_t C_t + D * x_t

This is the plain (no delta rule) form of :mod:`treecompile.kernels.recurrence` with
``q = C``, ``k = B``, ``v = x``, ``g = dt * A``, ``beta = dt`` and state ``S = h^T``, which
computes it and registers the ops ``treecompile::ssd_scan(q, k, v, g, beta, initial_state)``
``-> (out, final_state)``, ``treecompile::tree_ssd_scan(..., node_table) -> out`` (what the
SSM state pass puts in place of the former) and their backward.

`hf_mamba2_chunk_scan` is the drop-in the wrapper swaps in for Hugging Face's
``mamba2_chunk_scan`` (Mamba2, Bamba, FalconH1, NemotronH, Zamba2, GraniteMoeHybrid):
the token-wise preparation runs there, the scan in the op, so each layer is one node.
`hf_mamba2_split_conv1d_scan_combined` stands in for the fused training kernel
(conv + scan + norm + projection in one call, which would hide the conv and the scan
from the passes): it returns None, which sends HF's mixer down its unfused path.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from treecompile.kernels.dtypes import compute_dtype
from treecompile.kernels.recurrence import recurrence_reference
from treecompile.kernels.recurrence_ops import register

__all__ = ["ssd_scan_reference", "ssd_scan", "tree_ssd_scan", "hf_mamba2_chunk_scan",
           "hf_mamba2_split_conv1d_scan_combined"]

Tensor = torch.Tensor


def ssd_scan_reference(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """The scan token by token, in the recurrence's notation: ``(out [B, S, H, Dv], final [B, H, Dk, Dv])``."""
    return recurrence_reference(q, k, v, g, beta, initial_state, delta=False)


ssd_scan, tree_ssd_scan = register("ssd_scan", delta=False)


def hf_mamba2_chunk_scan(
    hidden_states: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    chunk_size: int = 256,
    D: Tensor | None = None,
    dt_bias: Tensor | None = None,
    initial_states: Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    return_final_states: bool = False,
    **kwargs: Any,
) -> Tensor | tuple[Tensor, Tensor]:
    """Drop-in for HF's ``mamba2_chunk_scan``: same arguments and result.

    ``hidden_states`` ``[B, S, H, P]``, ``dt`` ``[B, S, H]``, ``A`` ``[H]``, ``B, C``
    ``[B, S, G, N]`` (``G`` groups shared by ``H / G`` heads each), ``D`` ``[H]``; states
    ``[B, H, P, N]``. Returns ``y`` in at least float32, as HF's does (and the final state
    when asked). The chunk size only changes how HF's kernel sums, not what it computes.
    """
    if kwargs.get("seq_idx") is not None or kwargs.get("cu_seqlens") is not None:
        raise ValueError("treecompile's Mamba2 scan keeps packed sequences apart itself: pass no seq_idx / cu_seqlens")
    if kwargs.get("z") is not None:
        raise ValueError("treecompile's Mamba2 scan does not gate inside the kernel: pass z=None")
    ct = compute_dtype(hidden_states.dtype)
    heads = hidden_states.shape[2]
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)
    if dt_softplus:
        dt = F.softplus(dt)
    dt = torch.clamp(dt, min=dt_limit[0], max=dt_limit[1]).to(ct)
    x = hidden_states.to(ct)
    groups = B.shape[2]
    k = B.to(ct).repeat_interleave(heads // groups, dim=2)
    q = C.to(ct).repeat_interleave(heads // groups, dim=2)
    init = None if initial_states is None else initial_states.transpose(-1, -2).to(ct)
    y, final = torch.ops.treecompile.ssd_scan(q, k, x, dt * A.to(ct), dt, init)
    if D is not None:
        y = y + D.to(ct)[:, None] * x
    return (y, final.transpose(-1, -2)) if return_final_states else y


def hf_mamba2_split_conv1d_scan_combined(*args: Any, **kwargs: Any) -> None:
    """Stands in for HF's fused ``mamba2_split_conv1d_scan_combined``: None, the unfused path."""
    return None
