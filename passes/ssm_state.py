"""route_ssm_state_pass: each tree node's recurrence starts from its parent node's final state.

A Gated DeltaNet, Mamba2 or Mamba layer carries a recurrent state from token to token. Per
path, the state at a node's first token is the state after the last token of its parent
node; in the packed row, the row before a node's first token can be the end of a sibling's
subtree (DFS order), whose state must not leak in. The wrapper swaps the models' scan
kernels (Hugging Face's ``torch_chunk_gated_delta_rule``, ``mamba2_chunk_scan`` and
``mamba_selective_scan``, flash-linear-attention's ``chunk_gated_delta_rule``) for drop-ins
calling ``treecompile::gated_delta_rule`` / ``ssd_scan`` (see
:mod:`treecompile.kernels.scans.recurrence`) or ``treecompile::selective_scan`` (Mamba-1, see
:mod:`treecompile.kernels.scans.selective_scan`); this pass replaces each such node with its tree
form ``treecompile::tree_<kind>(<the op's inputs>, initial_state, node_table, scan_kernel)``,
which runs each node's rows from its parent's final state (roots from the call's initial
state, zero without one), nodes of one depth together, and, backward, adds the gradients of
all children into the parent's state. ``scan_kernel`` is ``ctx.scan_kernel``, the scan kernel
asked for by name (``tree_compile(scan_kernel=...)``).

Why exact: by induction over the nodes in preorder, a node's initial state is the state
after the whole root path before it, which is what per-path training has at that token;
the recurrence inside a node is the same rule. Every row's inputs (``q, k, v, g, beta``, or
``u, dt, B, C``) equal the per-path rows (by induction over layers), and the inputs that are
not rows (Mamba's ``A``) are the model's parameters. A sibling's subtree never enters: its
rows write only its own nodes' states.

Refused: a layer whose final state is read (a cache being filled) — on a tree there is one
final state per leaf, not per call — or a call whose input is not one packed row
(``[1, S, H, D]``; ``[1, S, D]`` for the selective scan).

Counters (``ctx.counters["route_ssm_state_pass"]``): ``gated_delta_rule``, ``ssd_scan``,
``selective_scan`` (rewritten layers).
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from treecompile.core.errors import UnsupportedModelError
from treecompile.kernels.scans.table import SCANS
from treecompile.passes._graph import PassContext, describe, is_op, same_size, source_of, value

__all__ = ["route_ssm_state_pass"]

#: The linear-sequence scan ops this pass rewrites, by counter name: the rank of their
#: first input, one packed row (``[1, S, H, D]``, or ``[1, S, D]`` for the selective scan).
SCAN_OPS = {kind: scan.rank for kind, scan in SCANS.items()}


def route_ssm_state_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Replaces each ``treecompile::gated_delta_rule`` / ``ssd_scan`` / ``selective_scan`` with its tree form.

    Counters (``ctx.counters["route_ssm_state_pass"]``): ``gated_delta_rule``, ``ssd_scan``,
    ``selective_scan``.
    """
    calls = [(n, kind) for n in gm.graph.nodes for kind in SCAN_OPS
             if is_op(n, getattr(torch.ops.treecompile, kind))]
    if not calls:
        return gm
    if ctx.node_table is None:
        raise RuntimeError("treecompile: a recurrent scan op is in the graph but the wrapper passed no node table")
    for node, kind in calls:
        # (q, k, v, g, beta, initial_state), or (u, dt, A, B, C, initial_state) for the selective scan.
        inputs = node.args
        qv = value(inputs[0])
        if not (isinstance(qv, torch.Tensor) and qv.dim() == SCAN_OPS[kind] and qv.shape[0] == 1
                and same_size(qv.shape[1], ctx.seq_len)):
            shape = "[1, S, D]" if SCAN_OPS[kind] == 3 else "[1, S, H, D]"
            raise UnsupportedModelError(
                f"treecompile: {describe(node)} is a recurrent scan whose input is not {shape} over the packed "
                f"sequence.\n  at {source_of(node)}"
            )
        outs = {}
        for user in list(node.users):
            if not (user.op == "call_function" and user.target is operator.getitem and user.args[1] in (0, 1)):
                raise UnsupportedModelError(f"treecompile: {describe(user)} uses {describe(node)} as a whole")
            outs.setdefault(user.args[1], []).append(user)
        if any(u.users for u in outs.get(1, [])):
            raise UnsupportedModelError(
                f"treecompile cannot make this model exact on a tree: the final recurrent state of {describe(node)} "
                "is read (a cache being filled?); a tree has one final state per leaf, not one per call. "
                f"Call the model with use_cache=False.\n  at {source_of(node)}"
            )
        tree_op = getattr(torch.ops.treecompile, f"tree_{kind}").default
        with gm.graph.inserting_before(node):
            new = gm.graph.call_function(tree_op, (*inputs, ctx.node_table, ctx.scan_kernel))
        new.meta["example_value"] = value(node)[0]
        ctx.mark(new, like=node)
        for user in outs.get(0, []):
            user.replace_all_uses_with(new)
            gm.graph.erase_node(user)
        for user in outs.get(1, []):
            gm.graph.erase_node(user)
        gm.graph.erase_node(node)
        ctx.count(kind)
    return gm
