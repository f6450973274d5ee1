"""Gated Linear Attention (a decay per key channel, no delta rule): its ops.

The recurrence, per batch row and head, with state ``S`` ``[Dk, Dv]`` (Yang et al., 2024,
"Gated Linear Attention Transformers with Hardware-Efficient Training"):

    S   <- diag(exp(g_t)) S + k_t v_t^T       # decay one rate per key channel, then write
    o_t  = S^T q_t                            # read (``q`` scaled beforehand)

The plain form of :mod:`treecompile.kernels.scans.recurrence` with ``g`` ``[B, S, H, Dk]`` and
``beta = 1``, which computes it (chunked, and on a tree by depth levels, the torch scan) and
registers ``treecompile::gla_scan(q, k, v, g, beta, initial_state)``,
``treecompile::tree_gla_scan(..., node_table, scan_kernel)`` and their backward.
flash-linear-attention's ``chunk_gla`` / ``fused_chunk_gla`` / ``fused_recurrent_gla`` /
``naive_recurrent_gla`` are swapped for drop-ins calling it (:mod:`treecompile.capture.library_drop_ins`);
the loop token by token is `recurrence_reference` in :mod:`treecompile.kernels.scans.naive`
(``delta=False`` with a gate per key channel).
"""

from __future__ import annotations

from treecompile.kernels.scans.recurrence_ops import register

__all__ = ["gla_scan", "tree_gla_scan"]

gla_scan, tree_gla_scan = register("gla_scan", delta=False)
