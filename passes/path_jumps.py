"""The steps of an associative scan (`treecompile.kernels.scans.associative`) along each path.

``treecompile::row_earlier(x, dim, hop)`` reads row ``r - 2**hop`` of the packed row and
``treecompile::row_has_earlier`` says whether it exists; per path "the row ``2**hop`` before" is
the ``2**hop``-th ancestor. Each op becomes a gather of that ancestor (``pred_index`` followed
``2**hop`` times, built by squaring: the ``2**(h + 1)``-th ancestor is the ``2**h``-th ancestor's
``2**h``-th ancestor, -1 past the root) and a test that it exists. The scan's step at row ``r``
then combines the fold of the ``2**hop`` rows before ``r`` on its path with the fold of the
``2**hop`` rows ending at ``r``: after the steps, the fold of the path up to ``r``, as per path.
A scan over a dim that is not the tokens' (a fixed size) is the step along that dim, spelled out.
Counter ``path_jump`` of ``rewrite_conv_context_pass``.
"""

from __future__ import annotations

import operator
from typing import Callable

import torch
from torch import fx

from treecompile.kernels.scans import associative as _assoc  # noqa: F401  (registers the ops)
from treecompile.passes._graph import PassContext, is_op, same_size, value

__all__ = ["rewrite_path_jumps"]


def rewrite_path_jumps(gm: fx.GraphModule, ctx: PassContext, no_structure: Callable[[fx.Node], None]) -> None:
    """Replaces each scan step along the row by the same step along the row's path."""
    ops = torch.ops.treecompile
    nodes = [n for n in gm.graph.nodes if is_op(n, ops.row_earlier) or is_op(n, ops.row_has_earlier)]
    for n in [n for n in nodes if not same_size(value(n.args[0]).shape[n.args[1]], ctx.seq_len)]:
        _along_a_fixed_axis(gm.graph, ctx, n)
        nodes.remove(n)
    if not nodes:
        return
    if ctx.pred_index is None:
        no_structure(nodes[0])
    g = gm.graph
    first = next(n for n in g.nodes if n.op != "placeholder")
    jumps: dict[int, fx.Node] = {}

    def mark(n: fx.Node, like: fx.Node) -> fx.Node:
        return ctx.mark(n, like=like)

    with g.inserting_before(first):
        ids = mark(g.call_function(operator.sub, (mark(g.call_method("cumsum", (
            mark(g.call_function(torch.ones_like, (ctx.pred_index,)), nodes[0]), 0)), nodes[0]), 1)), nodes[0])

        def jump(hop: int) -> fx.Node:
            if hop not in jumps:
                if hop == 0:
                    jumps[0] = ctx.pred_index
                else:
                    half = jump(hop - 1)
                    hopped = mark(g.call_function(torch.index_select, (
                        half, 0, mark(g.call_method("clamp", (half,), {"min": 0}), nodes[0]))), nodes[0])
                    jumps[hop] = mark(g.call_method("masked_fill", (
                        hopped, mark(g.call_method("lt", (half, 0)), nodes[0]), -1)), nodes[0])
            return jumps[hop]

        for n in nodes:
            jump(n.args[2])
    for n in nodes:
        x, dim, hop = n.args
        with g.inserting_before(n):
            if is_op(n, ops.row_earlier):
                rows = mark(g.call_function(torch.where, (mark(g.call_method("lt", (jumps[hop], 0)), n), ids,
                                                          jumps[hop])), n)
                new = mark(g.call_function(torch.index_select, (x, dim, rows)), n)
            else:
                new = mark(g.call_method("ge", (jumps[hop], 0)), n)
        new.meta["example_value"] = value(n)
        n.replace_all_uses_with(new)
        g.erase_node(n)
        ctx.count("path_jump")


def _along_a_fixed_axis(g: fx.Graph, ctx: PassContext, n: fx.Node) -> None:
    """A scan step over a dim that is not the tokens' (a fixed size): the step along that dim, as
    the op's own definition, spelled out (``arange`` over the fixed size)."""
    x, dim, hop = n.args
    size = value(x).shape[dim]
    with g.inserting_before(n):
        src = ctx.mark(g.call_function(operator.sub, (ctx.mark(g.call_function(
            torch.arange, (size,), {"device": value(x).device}), like=n), 1 << hop)), like=n)
        if is_op(n, torch.ops.treecompile.row_earlier):
            own = ctx.mark(g.call_function(torch.arange, (size,), {"device": value(x).device}), like=n)
            rows = ctx.mark(g.call_function(torch.where, (ctx.mark(g.call_method("lt", (src, 0)), like=n), own, src)),
                            like=n)
            new = ctx.mark(g.call_function(torch.index_select, (x, dim, rows)), like=n)
        else:
            new = ctx.mark(g.call_method("ge", (src, 0)), like=n)
    new.meta["example_value"] = value(n)
    n.replace_all_uses_with(new)
    g.erase_node(n)
