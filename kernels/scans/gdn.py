"""Gated DeltaNet (the gated delta rule): its ops.

The recurrence, per batch row and head, with state ``S`` ``[Dk, Dv]`` (Yang et al., 2025):

    S   <- exp(g_t) * S                       # decay
    u_t  = beta_t * (v_t - S^T k_t)           # delta-rule correction
    S   <- S + k_t u_t^T                      # write
    o_t  = S^T q_t                            # read

the delta form of :mod:`treecompile.kernels.scans.recurrence`, which computes it (chunked, and
on a tree by depth levels) and registers the ops:

* ``treecompile::gated_delta_rule(q, k, v, g, beta, initial_state)`` ``-> (out, final_state)``:
  the linear-sequence core of Hugging Face's ``torch_chunk_gated_delta_rule`` and
  flash-linear-attention's ``chunk_gated_delta_rule`` (after their head repeat, L2 norm and
  query scaling, which the drop-ins in :mod:`treecompile.capture.drop_ins` do outside the op). The
  wrapper swaps a model's kernel for a drop-in before capture, so each GDN layer is one node
  the SSM state pass can find.
* ``treecompile::tree_gated_delta_rule(q, k, v, g, beta, initial_state, node_table)``
  ``-> out``: what the pass puts in its place; each tree node runs from its parent node's
  final state.
* ``treecompile::gated_delta_rule_backward``: both ops' backward.

The loop above, token by token, is `gated_delta_rule_reference` in
:mod:`treecompile.kernels.scans.naive`.
"""

from __future__ import annotations

from treecompile.kernels.scans.recurrence_ops import register

__all__ = ["gated_delta_rule", "tree_gated_delta_rule"]

gated_delta_rule, tree_gated_delta_rule = register("gated_delta_rule", delta=True)
