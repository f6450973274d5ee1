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
from treecompile.passes.shifts import row_ids

__all__ = ["rewrite_path_jumps"]


def rewrite_path_jumps(gm: fx.GraphModule, ctx: PassContext, no_structure: Callable[[fx.Node], None]) -> None:
    """Replaces each scan step along the row by the same step along the row's path."""
    ops = torch.ops.treecompile
    g = gm.graph
    nodes = [n for n in g.nodes if is_op(n, ops.row_earlier) or is_op(n, ops.row_has_earlier)]
    along_rows = [n for n in nodes if same_size(value(n.args[0]).shape[n.args[1]], ctx.seq_len)]
    for n in nodes:
        if n not in along_rows:  # a fixed axis: the step along it, as the op defines it
            x, dim, hop = n.args
            with g.inserting_before(n):
                own = ctx.mark(g.call_function(torch.arange, (value(x).shape[dim],), {"device": value(x).device}),
                               like=n)
                src = ctx.mark(g.call_function(operator.sub, (own, 1 << hop)), like=n)
            _replace(g, ctx, n, src, own)
    if not along_rows:
        return
    if ctx.pred_index is None:
        no_structure(along_rows[0])
    jumps: dict[int, fx.Node] = {0: ctx.pred_index}
    with g.inserting_before(next(n for n in g.nodes if n.op != "placeholder")):
        ids = row_ids(g, ctx, along_rows[0])
        for hop in range(1, 1 + max(n.args[2] for n in along_rows)):
            half = jumps[hop - 1]  # the 2**(hop - 1)-th ancestor, -1 past the root
            hopped = g.call_function(torch.index_select, (half, 0, g.call_method("clamp", (half,), {"min": 0})))
            jumps[hop] = g.call_method("masked_fill", (hopped, g.call_method("lt", (half, 0)), -1))
            for made in (hopped.args[2], hopped, jumps[hop].args[1], jumps[hop]):
                ctx.mark(made, like=along_rows[0])
    for n in along_rows:
        _replace(g, ctx, n, jumps[n.args[2]], ids)
        ctx.count("path_jump")


def _replace(g: fx.Graph, ctx: PassContext, n: fx.Node, src: fx.Node, own: fx.Node) -> None:
    """``n`` (a ``row_earlier`` or ``row_has_earlier``) as a gather of rows ``src`` (-1 where there
    is none: the row itself, ``own``) or the test that ``src`` exists."""
    x, dim, _ = n.args
    with g.inserting_before(n):
        missing = ctx.mark(g.call_method("lt", (src, 0)), like=n)
        if is_op(n, torch.ops.treecompile.row_earlier):
            rows = ctx.mark(g.call_function(torch.where, (missing, own, src)), like=n)
            new = ctx.mark(g.call_function(torch.index_select, (x, dim, rows)), like=n)
        else:
            new = ctx.mark(g.call_method("logical_not", (missing,)), like=n)
    new.meta["example_value"] = value(n)
    n.replace_all_uses_with(new)
    g.erase_node(n)
