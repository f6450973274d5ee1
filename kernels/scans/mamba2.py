"""Mamba2's selective state space scan (SSD): its ops.

Per batch row and head, with state ``h`` ``[P, N]`` (head dim x state size) and the
discretised step ``dt_t`` (after bias, softplus and clamping):

    h_t = exp(dt_t * A) * h_{t-1} + (dt_t * x_t) B_t^T
    y_t = h_t C_t + D * x_t

This is the plain (no delta rule) form of :mod:`treecompile.kernels.scans.recurrence` with
``q = C``, ``k = B``, ``v = x``, ``g = dt * A``, ``beta = dt`` and state ``S = h^T``, which
computes it and registers the ops ``treecompile::ssd_scan(q, k, v, g, beta, initial_state)``
``-> (out, final_state)``, ``treecompile::tree_ssd_scan(..., node_table) -> out`` (what the
SSM state pass puts in place of the former) and their backward. The scan token by token is
`ssd_scan_reference` in :mod:`treecompile.kernels.scans.naive`.

The drop-ins for Hugging Face's ``mamba2_chunk_scan`` and its fused training kernel are in
:mod:`treecompile.capture.drop_ins`.
"""

from __future__ import annotations

from treecompile.kernels.scans.recurrence_ops import register

__all__ = ["ssd_scan", "tree_ssd_scan"]

ssd_scan, tree_ssd_scan = register("ssd_scan", delta=False)
