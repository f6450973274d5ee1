"""Kimi Delta Attention (the gated delta rule with a decay per key channel): its ops.

The recurrence, per batch row and head, with state ``S`` ``[Dk, Dv]`` (Kimi Linear, 2025):

    S   <- diag(exp(g_t)) S                   # decay, one rate per key channel
    u_t  = beta_t * (v_t - S^T k_t)           # delta-rule correction
    S   <- S + k_t u_t^T                      # write
    o_t  = S^T q_t                            # read

Gated DeltaNet's rule (:mod:`treecompile.kernels.scans.gdn`) with ``g`` ``[B, S, H, Dk]`` in
place of ``[B, S, H]``; :mod:`treecompile.kernels.scans.recurrence` computes both (chunked,
and on a tree by depth levels; the torch scan only, the variable-length kernels take a gate per
head) and registers the ops ``treecompile::kimi_delta_rule(q, k, v, g, beta, initial_state)``,
``treecompile::tree_kimi_delta_rule(..., node_table, scan_kernel)`` and their backward. Hugging
Face's ``chunk_kimi_delta_attention`` / ``recurrent_kimi_delta_attention`` (Kimi Linear, Bailing
hybrid) are swapped for the gated delta rule's drop-in in :mod:`treecompile.capture.drop_ins`,
which picks this op by the gate's shape; the loop above, token
by token, is `channel_delta_rule_reference` in :mod:`treecompile.kernels.scans.naive`.
"""

from __future__ import annotations

from treecompile.kernels.scans.recurrence_ops import register

__all__ = ["kimi_delta_rule", "tree_kimi_delta_rule"]

kimi_delta_rule, tree_kimi_delta_rule = register("kimi_delta_rule", delta=True)
