"""Windows of the rows at several offsets, padded back to the length: ancestor gathers.

recurrentgemma's ``Conv1D`` computes each temporal shift ``k`` on a window of ``T - k`` rows:
``x[:, :T - k]`` times a document mask ANDed from slices of ``segment_pos != 0`` at offsets
``1 .. k`` (``[:, s : T - k + s]``), then pads the window back with ``k`` rows in front. Row ``t``
of the result reads ``x`` at ``t - k`` and the mask at ``t - k + s``: the path's rows ``k`` and
``k - s`` steps back.

**The rule.** A ``pad`` adding ``k`` rows in front of a window of ``S - k`` rows (a constant
fill) whose window is computed, element-wise, from slices ``y[.., a : S - k + a, ..]`` of
full-length tensors (``0 <= a <= k``), from tensors without a row dim, and from ``ones_like``-style
tensors shaped like the window: each slice becomes ``y``'s ``(k - a)``-th ancestor on the path
(the farthest it has where the path is shorter), the element-wise ops run on all ``S`` rows, and the
rows whose path has fewer than ``k`` earlier tokens take the pad's fill. Per path, row ``t >= k``
of the padded window is the ops on rows ``t - k + a`` of each input, the rows ``k - a`` steps back,
and rows ``t < k`` the fill: the same. A window read by anything else, an op the rule does not
name (a reduction, a view that is not an added dim, a write), a slice at another offset, or a
slice of a tensor the graph writes anywhere (the gather reads it where it is cut) is left alone:
the verify pass refuses the pad.
Counter ``offset_window`` of ``rewrite_conv_context_pass``.
"""

from __future__ import annotations

import operator
from typing import Any, Callable

import torch
from torch import fx

from treecompile.passes._graph import PassContext, emit, is_call, mutated_args, same_size, storage_of, value
from treecompile.passes.rows.domain import op_key, split_inplace
from treecompile.passes.rows.elementwise import POINTWISE
from treecompile.passes.shifts import _const_int, _cut_along, _pad_pairs

__all__ = ["rewrite_offset_windows"]

_ELEMENTWISE = POINTWISE | {"add", "sub", "mul", "neg", "pow", "where", "masked_fill", "bitwise_and", "bitwise_or",
                            "bitwise_xor", "logical_and", "logical_or", "logical_not", "bitwise_not"}
_LIKE = {"ones_like", "zeros_like", "full_like"}


def rewrite_offset_windows(gm: fx.GraphModule, ctx: PassContext, table_for: Callable[[int], fx.Node],
                           read_back: Callable[..., fx.Node], needs_structure: Callable[[fx.Node], None]) -> None:
    """Rewrites each padded window of offset slices (see the module doc). ``table_for(kk)``: the
    ancestor table of ``kk - 1`` columns; ``read_back(x, dim, k, like)``: ``x`` with each row
    replaced by its ``k``-th ancestor's (the farthest it has where the path is shorter), inserted
    where the graph inserts; ``needs_structure(node)`` raises where the call has no path structure."""
    written = {storage_of(t) for n in gm.graph.nodes for t in mutated_args(n)}  # memory the graph writes
    for pad in list(gm.graph.nodes):
        if pad.graph is not gm.graph or pad in ctx.created:
            continue
        found = _match(pad, ctx, written)
        if found is None:
            continue
        if ctx.pred_index is None:
            needs_structure(pad)
        _rewrite(gm, ctx, pad, *found, table_for, read_back)
        ctx.count("offset_window")


# ----------------------------------------------------------------------------- the match


def _match(pad: fx.Node, ctx: PassContext, written: set):
    """``(dim, k, fill, region, leaves)`` for a padded window of offset slices, else None.
    ``region``: the window's nodes (graph order); ``leaves``: ``(slice node, y, dim, a)``;
    ``written``: the memory the graph writes."""
    pairs_fill = _pad_pairs(pad)
    if pairs_fill is None:
        return None
    pairs, fill = pairs_fill
    moved = [(d, p) for d, p in enumerate(pairs) if p != (0, 0)]
    if len(moved) != 1 or not isinstance(fill, (int, float)):
        return None
    dim, (k, right) = moved[0]
    window = pad.args[0]
    wv = value(window)
    if k < 1 or right != 0 or not isinstance(wv, torch.Tensor) or _const_int(ctx.seq_len - wv.shape[dim]) != k:
        return None
    short = wv.shape[dim]
    region: dict[fx.Node, int] = {}
    leaves: list[tuple] = []
    stack = [(window, dim)]
    while stack:
        n, rd = stack.pop()
        if n in region:
            if region[n] != rd:
                return None
            continue
        if not isinstance(n, fx.Node) or n in ctx.created or n.op not in ("call_function", "call_method"):
            return None
        nv = value(n)
        if not isinstance(nv, torch.Tensor) or rd >= nv.dim() or not same_size(nv.shape[rd], short):
            return None
        offset = _offset_slice(n, rd, k, ctx)
        if offset is not None:
            leaves.append((n, n.args[0], rd, offset))
            region[n] = rd
            continue
        inputs = _inputs(n, rd, short, ctx)
        if inputs is None:
            return None
        region[n] = rd
        stack.extend(inputs)
    slices = {leaf[0] for leaf in leaves}
    if any(n not in slices and any(u is not pad and u not in region for u in n.users) for n in region):
        return None  # the window read elsewhere: its rows would change length under that reader
    if not leaves or any(storage_of(y) is None or storage_of(y) in written for _, y, _, _ in leaves):
        return None  # a slice reads the tensor when the window's ops run, the gather where it is cut
    order = {n: i for i, n in enumerate(pad.graph.nodes)}
    inner = sorted((n for n in region if n not in slices), key=order.get)
    return dim, k, fill, inner, leaves


def _offset_slice(n: fx.Node, rd: int, k: int, ctx: PassContext) -> int | None:
    """``a`` if ``n`` is ``y[.., a : S - k + a, ..]`` on ``rd`` of a full-length ``y`` (``0 <= a <= k``)."""
    if not (n.op == "call_function" and n.target is operator.getitem and isinstance(n.args[0], fx.Node)):
        return None
    yv = value(n.args[0])
    if not isinstance(yv, torch.Tensor) or yv.dim() != value(n).dim() or not same_size(yv.shape[rd], ctx.seq_len):
        return None
    found = _cut_along(n.args[1], rd, yv.dim())
    cut = None if found is None else found[0]
    if not isinstance(cut, slice) or cut.step not in (None, 1):
        return None
    a = 0 if cut.start is None else cut.start
    return a if isinstance(a, int) and 0 <= a <= k else None


def _inputs(n: fx.Node, rd: int, short: Any, ctx: PassContext) -> list[tuple] | None:
    """The window inputs of an op of the window (``(node, its row dim)``), or None where the op
    is not one the rule takes."""
    name, inplace = split_inplace(op_key(n))
    nv = value(n)
    if name in _LIKE:
        src = n.args[0]
        return [(src, rd)] if isinstance(src, fx.Node) else None
    if name == "unsqueeze" or (name == "getitem" and _adds_dims(n.args[1])):
        src = n.args[0]
        sv = value(src)
        if not isinstance(sv, torch.Tensor):
            return None
        back = _source_dim(n, rd, sv.dim())
        return None if back is None else [(src, back)]
    if name not in _ELEMENTWISE:
        return None
    if inplace or name in ("iadd", "isub", "imul", "itruediv"):
        return None  # a write (into a slice, it would write the full tensor)
    out = []
    for a in n.all_input_nodes:
        av = value(a)
        if not isinstance(av, torch.Tensor):
            continue
        at = rd - (nv.dim() - av.dim())  # broadcast from the right
        if any(same_size(d, ctx.seq_len) or same_size(d, short) for i, d in enumerate(av.shape) if i != at):
            return None  # rows on another dim
        if at < 0 or (isinstance(av.shape[at], int) and av.shape[at] == 1):
            continue  # no row dim: the same value on every row
        if not same_size(av.shape[at], short):
            return None
        out.append((a, at))
    return out


def _adds_dims(index: Any) -> bool:
    index = index if isinstance(index, tuple) else (index,)
    return any(i is None for i in index) and all(i is None or i == slice(None) or i is Ellipsis for i in index) \
        and sum(i is Ellipsis for i in index) <= 1


def _source_dim(n: fx.Node, rd: int, src_dims: int) -> int | None:
    """The input dim of ``unsqueeze`` / ``x[:, None]`` that output dim ``rd`` comes from."""
    if n.op == "call_method" and n.target == "unsqueeze" or is_call(n, (torch.unsqueeze,)):
        at = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim")
        if not isinstance(at, int):
            return None
        at %= src_dims + 1
        return None if rd == at else rd - (rd > at)
    index = n.args[1] if isinstance(n.args[1], tuple) else (n.args[1],)
    if Ellipsis in index:
        e = index.index(Ellipsis)
        fill = src_dims - sum(i is not None and i is not Ellipsis for i in index)
        index = index[:e] + (slice(None),) * fill + index[e + 1:]
    out_dim, in_dim = 0, 0
    for i in index:
        if i is None:
            if out_dim == rd:
                return None
            out_dim += 1
        else:
            if out_dim == rd:
                return in_dim
            out_dim, in_dim = out_dim + 1, in_dim + 1
    return in_dim + (rd - out_dim) if rd >= out_dim else None


# ----------------------------------------------------------------------------- the rewrite


def _rewrite(gm: fx.GraphModule, ctx: PassContext, pad: fx.Node, dim: int, k: int, fill: Any, inner: list,
             leaves: list, table_for: Callable[[int], fx.Node], read_back: Callable[..., fx.Node]) -> None:
    g = gm.graph
    full_rows: dict[fx.Node, fx.Node] = {}
    for leaf, y, rd, a in leaves:
        # The row ``k - a`` steps back on the path; where the path is shorter, a real row (nothing
        # that rows above the root would make NaN), and those rows take the pad's fill below.
        with g.inserting_before(leaf):
            full_rows[leaf] = y if a == k else read_back(y, rd, k - a, pad)
    # The window's ops again on the full rows (their example values computed anew), judged by the
    # verify pass as the model's own; the window itself is left to the dead-code elimination.
    for n in inner:
        args, kwargs = fx.node.map_arg((n.args, n.kwargs), lambda a: full_rows.get(a, a))
        full_rows[n] = emit(gm, ctx, n, n.op, n.target, args, kwargs, mark=False)
    window = full_rows.get(pad.args[0], pad.args[0])
    with g.inserting_before(pad):
        ancestor = ctx.mark(g.call_function(torch.select, (table_for(k + 1), 1, k - 1)), like=pad)
        shape = [1] * value(pad).dim()
        shape[dim] = -1
        missing = ctx.mark(g.call_method("view", (ctx.mark(g.call_method("lt", (ancestor, 0)), like=pad), shape)),
                           like=pad)
        new = ctx.mark(g.call_method("masked_fill", (window, missing, fill)), like=pad)
    new.meta["example_value"] = value(pad)
    pad.replace_all_uses_with(new)
    g.erase_node(pad)
