"""The first row kept, every later row computed from itself and the row before it.

modded-nanogpt's and nanochat's "smear" mixes each token's embedding with the previous
token's: ``cat([x[:, :1], x[:, 1:] + gate(x[:, 1:]) * x[:, :-1]], dim=1)``. Per path, row 0 is
the path's first row, kept; every later row ``t`` reads rows ``t`` and ``t - 1``. On the tree
that is: a root row kept, every other row computed from itself and its parent. So

- the cut ``y[:, 1:]`` (the rows from the second on) becomes ``y``: every row;
- the cut ``y[:, :-1]`` (the rows before each) becomes ``y`` shifted by one along the path, the
  root reading itself (``cat([y[:, :1], y[:, :-1]])``, a shift the shifts pass runs along the
  path);
- the ops between those cuts and the ``cat`` run on every row, as written;
- the ``cat`` becomes ``where(positions == 0, x, computed)``: roots keep their row.

The ops in between must be row-local by name (element-wise ops, casts, ``linear``, indexing:
`rows.elementwise.ROW_LOCAL`; a scan, roll or reduction over the cut rows would read the root's row once run
on every row) and are judged again by the row rules after the rewrite; each must give the
shape it gave with one row less (an op reading the length, ``view(b, t - 1, ..)``, is left as
written), and nothing else may read them. Otherwise the ``cat`` is left as written and
refused by name.

Counter (``ctx.counters["rewrite_conv_context_pass"]``): ``first_row``.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import fx

from treecompile.passes._graph import CATS, PassContext, emit, is_call, op_name, same_size, value
from treecompile.passes.rows.elementwise import ROW_LOCAL

__all__ = ["rewrite_first_row_kept"]



class _Decline(Exception):
    """Not this spelling: left as written."""


def _rows_at(node: Any, size: Any) -> list[int]:
    v = value(node)
    return [d for d in range(v.dim()) if same_size(v.shape[d], size)] if isinstance(v, torch.Tensor) else []


def _index(node: fx.Node) -> tuple | None:
    """A getitem's index over every dim of its input (``...`` expanded), ints and slices only."""
    index = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
    nd = value(node.args[0]).dim()
    if Ellipsis in index:
        at = index.index(Ellipsis)
        index = index[:at] + (slice(None),) * (nd - len(index) + 1) + index[at + 1:]
    index = index + (slice(None),) * (nd - len(index))
    return index if len(index) == nd and all(isinstance(i, (slice, int)) for i in index) else None


def _cut(node: fx.Node, ctx: PassContext) -> tuple[fx.Node, int, str, tuple] | None:
    """``(y, d, kind, index)`` if ``node`` is ``y[.., 1:, ..]`` (kind ``"later"``) or
    ``y[.., :-1, ..]`` (``"earlier"``) along y's row dim ``d``; ``index`` is the cut with the
    row dim taken whole (other dims may be cut too: ``x[:, 1:, :24]``)."""
    if not (node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[0], fx.Node)):
        return None
    y = node.args[0]
    dims = _rows_at(y, ctx.seq_len)
    index = _index(node) if len(dims) == 1 else None
    if index is None or any(isinstance(i, int) for i in index):
        return None
    d = dims[0]
    cut = index[d]
    if cut.step not in (None, 1) or not same_size(value(node).shape[d], ctx.seq_len - 1):
        return None
    whole = index[:d] + (slice(None),) + index[d + 1:]
    if cut.start == 1:
        return y, d, "later", whole
    if cut.start in (None, 0):
        return y, d, "earlier", whole
    return None


def _first(node: Any, ctx: PassContext) -> tuple[fx.Node, int] | None:
    """``(x, d)`` if ``node`` is ``x[:, :1]`` (every other dim whole) along x's row dim."""
    if not (isinstance(node, fx.Node) and node.op == "call_function" and node.target is operator.getitem):
        return None
    x = node.args[0]
    dims = _rows_at(x, ctx.seq_len)
    index = _index(node) if len(dims) == 1 else None
    if index is None:
        return None
    d = dims[0]
    if any(i != slice(None) for k, i in enumerate(index) if k != d):
        return None
    cut = index[d]
    ok = isinstance(cut, slice) and cut.start in (None, 0) and cut.stop == 1 and cut.step in (None, 1)
    return (x, d) if ok else None


def _region(later: fx.Node, ctx: PassContext, cat: fx.Node) -> tuple[list[fx.Node], dict[fx.Node, tuple]]:
    """The ops from the cuts to ``later`` (graph order) and the cuts; raises `_Decline`."""
    ops: set[fx.Node] = set()
    cuts: dict[fx.Node, tuple] = {}
    todo = [later]
    while todo:
        n = todo.pop()
        if n in ops or n in cuts:
            continue
        found = _cut(n, ctx)
        if found is not None:
            cuts[n] = found
            continue
        if n.op not in ("call_function", "call_method") or not _rows_at(n, ctx.seq_len - 1) \
                or op_name(n) not in ROW_LOCAL:
            # Row-local ops only: run on every row (the root's included, then dropped) each gives a
            # later row what it gave with one row less; a scan, roll or reduction over the cut rows
            # would read the root's row.
            raise _Decline
        ops.add(n)
        for a in n.all_input_nodes:
            av = value(a)
            if not isinstance(av, torch.Tensor) or _rows_at(a, ctx.seq_len):
                raise _Decline  # a size read from the graph (t - 1), or the whole rows beside the cut ones
            if _rows_at(a, ctx.seq_len - 1):
                todo.append(a)
    for n in ops | set(cuts):
        if any(u not in ops and u is not cat for u in n.users):
            raise _Decline  # read elsewhere with one row less: left as written
    return [n for n in later.graph.nodes if n in ops], cuts


def _every_row(gm: fx.GraphModule, ctx: PassContext, at: fx.Node, cut: tuple) -> fx.Node:
    """What a cut becomes on every row: the rows themselves, or the rows shifted by one (the
    root reading itself, a row the ``where`` drops)."""
    y, d, kind, whole = cut
    if kind == "earlier":
        front = emit(gm, ctx, at, "call_function", operator.getitem, (y, (slice(None),) * d + (slice(None, 1),)), {},
                      mark=False)
        rest = emit(gm, ctx, at, "call_function", operator.getitem, (y, (slice(None),) * d + (slice(None, -1),)), {},
                     mark=False)
        y = emit(gm, ctx, at, "call_function", torch.cat, ([front, rest], d), {}, mark=False)
    if any(i != slice(None) for i in whole):
        y = emit(gm, ctx, at, "call_function", operator.getitem, (y, whole), {}, mark=False)
    return y


def _rewrite(gm: fx.GraphModule, ctx: PassContext, cat: fx.Node) -> bool:
    parts = cat.args[0] if cat.args else cat.kwargs.get("tensors")
    dim = cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)
    if not (isinstance(parts, (list, tuple)) and len(parts) == 2 and isinstance(dim, int)):
        return False
    first, later = parts
    found = _first(first, ctx)
    nd = value(cat).dim()
    if found is None or found[1] != dim % nd or not isinstance(later, fx.Node) or ctx.positions is None:
        return False
    x, d = found
    try:
        ops, cuts = _region(later, ctx, cat)
    except _Decline:
        return False
    if not any(c[2] == "earlier" for c in cuts.values()) or any(c[1] != d for c in cuts.values()):
        return False
    new: dict[fx.Node, fx.Node] = {c: _every_row(gm, ctx, cat, cut) for c, cut in cuts.items()}
    for n in ops:
        args, kwargs = fx.node.map_arg((n.args, n.kwargs), lambda a: new.get(a, a))
        try:  # unmarked: the row rules judge it as the model's own op
            new[n] = emit(gm, ctx, cat, n.op, n.target, args, kwargs, mark=False)
        except Exception:  # the op does not run on every row (it read the shorter length)
            return False
        want = list(value(n).shape)
        got = list(value(new[n]).shape)
        if len(got) != len(want) or not all(same_size(g, ctx.seq_len) if same_size(w, ctx.seq_len - 1) else
                                            same_size(g, w) for g, w in zip(got, want)):
            return False
    root = emit(gm, ctx, cat, "call_function", torch.eq, (ctx.positions, 0), {})
    for _ in range(nd - 1 - d):
        root = emit(gm, ctx, cat, "call_method", "unsqueeze", (root, -1), {})
    out = emit(gm, ctx, cat, "call_function", torch.where, (root, x, new[later]), {})
    if tuple(value(out).shape) != tuple(value(cat).shape) and not all(
            same_size(a, b) for a, b in zip(value(out).shape, value(cat).shape)):
        return False
    cat.replace_all_uses_with(out)
    gm.graph.erase_node(cat)
    for n in reversed(ops + list(cuts)):
        if not n.users:
            gm.graph.erase_node(n)
    if not first.users:
        gm.graph.erase_node(first)
    return True


def rewrite_first_row_kept(gm: fx.GraphModule, ctx: PassContext) -> None:
    """Rewrites each ``cat([x[:, :1], f(x[:, 1:], x[:, :-1])])`` (module docstring); any other
    ``cat`` is left as written."""
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and is_call(node, CATS) and _rewrite(gm, ctx, node):
            ctx.count("first_row")
