"""Scans along the sequence become scans along each row's root path (run by the conv context
pass, which owns the reads along the path).

``cumsum``, ``cumprod``, ``logcumsumexp``, ``cummax`` and ``cummin`` over the sequence dim
(linear attention's running sums of ``k v^T``, GLA-style running gates, minGRU, running
means) combine, per path, each token with every token before it on its path. In the packed
row those are the row's ancestors, not the rows before it; ``treecompile::path_scan``
(`treecompile.kernels.scans.path_scan`) combines exactly those, in order, forward and backward, by
pointer jumping along ``pred_index`` (O(S log depth), no O(S^2)). ``cummax`` / ``cummin``
return the index of each value along the sequence: on a path that is the value's offset on
the path, which in the tree is the position of the row it comes from.

Integer ``cumsum`` under the interval mask (RoBERTa's positions) is the positions pass's
(`treecompile.kernels.scans.path_scan.path_cumsum`). The in-place forms (``x.cumsum_(d)``,
``x.cumprod_(d)``) keep their write: the scan runs along the path on a copy of ``x`` and is
copied back into ``x``.

Counter (``ctx.counters["rewrite_conv_context_pass"]``): ``path_scan``.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from treecompile.kernels.scans import path_scan as _path_scan  # noqa: F401  (registers treecompile::path_scan)
from treecompile.kernels.scans.path_scan import PATH_SCANS
from treecompile.passes._graph import PassContext, bind, describe, op_name, same_size, source_of, value

__all__ = ["rewrite_scans", "SCAN_SPELLINGS"]

#: The scans, by the names Dynamo records for them (function or method); each result is one
#: tensor, or for cummax / cummin ``(values, indices)``.
SCAN_SPELLINGS = {name: name for name in PATH_SCANS}


#: The scans that write their result into their input: ``x.cumsum_(d)``, ``x.cumprod_(d)``.
IN_PLACE_SCANS = {"cumsum_": "cumsum", "cumprod_": "cumprod"}


def _scan_of(node: fx.Node, ctx: PassContext) -> tuple[str, fx.Node, int, fx.Node | None] | None:
    """``(op, x, dim, written)`` if ``node`` scans ``x`` along the rows; ``written`` is the tensor
    an in-place form writes the result into (None: the result is new)."""
    if node.op not in ("call_function", "call_method") or node in ctx.created:
        return None
    name = op_name(node)
    if name not in SCAN_SPELLINGS and name not in IN_PLACE_SCANS:
        return None
    a = bind(node, ["input", "dim"], {})
    x, dim = a.get("input"), a.get("dim")
    xv = value(x)
    if not isinstance(xv, torch.Tensor) or not isinstance(dim, int):
        return None
    dim %= xv.dim()
    if not same_size(xv.shape[dim], ctx.seq_len):
        return None
    if name in IN_PLACE_SCANS:
        return IN_PLACE_SCANS[name], x, dim, x
    if node.kwargs.get("out") is not None:  # autograd refuses out= on a tensor that needs grad
        return None
    return SCAN_SPELLINGS[name], x, dim, None


def rewrite_scans(gm: fx.GraphModule, ctx: PassContext, needs_structure) -> None:
    """Replaces each scan along the rows by ``treecompile::path_scan``; ``needs_structure(node)``
    raises when the call has no ``pred_index``."""
    for node in list(gm.graph.nodes):
        found = _scan_of(node, ctx)
        if found is None:
            continue
        if ctx.pred_index is None:
            needs_structure(node)
        op, x, dim, written = found
        result = value(node) if PATH_SCANS[op][1] is None else value(node)[0]
        g = gm.graph
        with g.inserting_before(node):
            if written is not None:  # the scan keeps its input for its backward: not the tensor written
                x = ctx.mark(g.call_method("clone", (x,)), like=node)
                x.meta["example_value"] = value(written)
            if value(x).dtype != result.dtype:  # a dtype= argument, or torch's promotion (bool, int32 -> int64)
                x = ctx.mark(g.call_method("to", (x, result.dtype)), like=node)
                x.meta["example_value"] = result
            scan = ctx.mark(g.call_function(torch.ops.treecompile.path_scan.default,
                                            (x, dim, ctx.pred_index, ctx.node_table, op)), like=node)
            vals = ctx.mark(g.call_function(operator.getitem, (scan, 0)), like=node)
            vals.meta["example_value"] = value(node) if PATH_SCANS[op][1] is None else value(node)[0]
        if written is not None:
            # The write stays, as a copy of the path scan into the same tensor: the node (an
            # in-place op the pipeline keeps) becomes ``written.copy_(scan)``, and the row rules
            # judge it as any other copy.
            node.op, node.target, node.args, node.kwargs = "call_method", "copy_", (written, vals), {}
        elif PATH_SCANS[op][1] is None:
            node.replace_all_uses_with(vals)
            gm.graph.erase_node(node)
        else:
            _replace_pair(gm, ctx, node, scan, vals)
            gm.graph.erase_node(node)
        ctx.count("path_scan")


def _replace_pair(gm: fx.GraphModule, ctx: PassContext, node: fx.Node, scan: fx.Node, vals: fx.Node) -> None:
    """cummax / cummin: the values, and the indices as each value's offset on its path (the
    position of the row it comes from)."""
    g = gm.graph
    indices = None
    for user in list(node.users):
        key = user.args[1] if user.op == "call_function" and user.target is operator.getitem else (
            {"values": 0, "indices": 1}.get(user.args[1]) if user.op == "call_function" and user.target is getattr
            else None)
        if key == 0:
            user.replace_all_uses_with(vals)
        elif key == 1:
            if indices is None:
                with g.inserting_before(user):
                    rows = ctx.mark(g.call_function(operator.getitem, (scan, 1)), like=node)
                    indices = ctx.mark(g.call_function(operator.getitem, (ctx.positions, rows)), like=node)
                    indices = ctx.mark(g.call_method("to", (indices, torch.int64)), like=node)
                    indices.meta["example_value"] = value(user)
            user.replace_all_uses_with(indices)
        else:
            raise_unknown(node, user)
        g.erase_node(user)


def raise_unknown(node: fx.Node, user: fx.Node) -> None:
    from treecompile.core.errors import UnsupportedModelError

    raise UnsupportedModelError(
        f"treecompile cannot make this model exact on a tree: {describe(node)}'s result is read by {describe(user)}, "
        f"which is neither its values nor its indices.\n  at {source_of(user)}")
