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

torch's recurrent layers (``nn.RNN``, ``nn.LSTM``, ``nn.GRU``, captured as ``treecompile::rnn``,
see :mod:`treecompile.kernels.scans.rnn`) become ``treecompile::tree_rnn`` the same way: each
node's rows from its parent node's final ``h`` (and ``c``) of every layer. Refused: a
bidirectional layer (it reads later tokens), dropout between layers in training (a draw per
packed row), an initial state read from the tokens, a final state that is read.

Counters (``ctx.counters["route_ssm_state_pass"]``): ``gated_delta_rule``, ``ssd_scan``,
``selective_scan``, ``rnn`` (rewritten layers).
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from treecompile.core.errors import UnsupportedModelError
from treecompile.kernels.scans import rnn as _rnn  # noqa: F401  (registers treecompile::rnn, tree_rnn)
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
    _route_rnns(gm, ctx)
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


def _refuse(node: fx.Node, why: str) -> UnsupportedModelError:
    return UnsupportedModelError(f"treecompile cannot make this model exact on a tree: {describe(node)} is a "
                                 f"recurrent layer {why}.\n  at {source_of(node)}")


def _route_rnns(gm: fx.GraphModule, ctx: PassContext) -> None:
    """Replaces each ``treecompile::rnn`` over the packed rows by ``treecompile::tree_rnn``."""
    from treecompile.passes._mask_eval import reads_tokens
    from treecompile.passes.conv_context import NeedsStructure

    for node in [n for n in gm.graph.nodes if is_op(n, torch.ops.treecompile.rnn)]:
        x, hx, weights, mode, has_biases, num_layers, dropout, train, bidirectional, batch_first = node.args
        xv = value(x)
        rows, batch = (1, 0) if batch_first else (0, 1)
        if not (isinstance(xv, torch.Tensor) and xv.dim() == 3 and same_size(xv.shape[rows], ctx.seq_len)):
            # Not over the packed rows: torch's own call again, which the row rules judge.
            node.target = getattr(torch, mode)
            node.args = (x, tuple(hx) if mode == "lstm" else hx[0], weights, *node.args[4:])
            continue
        if xv.shape[batch] != 1:
            raise _refuse(node, "whose input is not one packed row")
        if bidirectional:
            raise _refuse(node, "that is bidirectional: its backward direction reads the tokens after each token")
        if dropout > 0 and train:
            raise _refuse(node, f"with dropout {dropout} between its layers in training (a draw per packed row, "
                                "not per path); call model.eval() or set dropout=0")
        if any(reads_tokens(ctx, h) for h in hx):
            raise _refuse(node, "whose initial state is read from the tokens (every root would start from the "
                                "packed row's)")
        if any(u.op != "call_function" or u.target is not operator.getitem for u in node.users):
            raise UnsupportedModelError(f"treecompile: {describe(node)}'s results are used as a whole")
        if any(u.args[1] != 0 and u.users for u in node.users):
            raise _refuse(node, "whose final state is read: a tree has one final state per leaf, not one per call")
        if ctx.node_table is None:
            raise NeedsStructure(f"treecompile cannot make this model exact on a tree: {describe(node)} is a "
                                 "recurrent layer, and this call has no path structure to run it along (a streamed "
                                 f"or context-parallel call).\n  at {source_of(node)}")
        with gm.graph.inserting_before(node):
            new = gm.graph.call_function(torch.ops.treecompile.tree_rnn.default,
                                         (x, hx, weights, mode, has_biases, num_layers, batch_first, ctx.node_table))
        new.meta["example_value"] = value(node)[0]
        ctx.mark(new, like=node)
        for user in list(node.users):
            if user.args[1] == 0:
                user.replace_all_uses_with(new)
            gm.graph.erase_node(user)
        gm.graph.erase_node(node)
        ctx.count("rnn")
