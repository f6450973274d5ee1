"""Scans over a row in front: a sequence of T + 1 rows whose first reads no token.

minLSTM and minGRU with an initial state write their scan over ``cat([h_0, v], dim)`` (or
``pad(v, (.., 1, 0), value=c)``) and drop the first row of the result (``[:, 1:]``, or
``[:, -T:]``). On a path, that front row is the state before the path's first token; on the
tree, it is a row above every root, shared by every path. Each such "rooted" tensor is split
in two: its front row (``root``, one row that broadcasts) and its token rows (``rows``, the
packed sequence):

- ``cat([h, x], d)``: root ``h``, rows ``x``; ``pad(x, (.., 1, 0), value=c)``: root ``c``, rows ``x``;
- an element-wise op (`rows.elementwise` names, and casts): the op on the roots, and the op on
  the rows, operands without the row dim taken as they are;
- a scan along the rows (``cumsum``, ``cumprod``, ``logcumsumexp``): the root as it is, and the
  root combined with the scan of the rows (``root + cumsum(rows)``, ``root * cumprod(rows)``,
  ``logaddexp(root, logcumsumexp(rows))``); the scan of the rows then runs along each path
  (`scans.py`);
- ``r[:, 1:]`` (or ``r[:, -T:]``): the rows.

The rewrite is all or nothing per group of connected rooted tensors: if any of them is read
any other way (its front row alone, its last row cut, a matmul), the group is left as it is
and the verify pass refuses its ``cat`` / ``pad`` by name, as before. The front row's inputs
are judged by the row rules after the rewrite: a root read from the tokens (``x.mean(1)``,
``x[:, :1]``) is refused there.

Counter (``ctx.counters["rewrite_conv_context_pass"]``): ``rooted_scan``.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import fx

from treecompile.passes._graph import CATS, PADS, PassContext, emit, is_call, op_name, same_size, value
from treecompile.passes.rows.elementwise import ROW_LOCAL
from treecompile.passes.shifts import _cut_along, padded_rows

__all__ = ["rewrite_rooted_scans", "ROOTED_SCANS"]

#: The scans over a rooted tensor, by name: how the front row combines with the scan of the rows.
ROOTED_SCANS = {"cumsum": torch.add, "cumprod": torch.mul, "logcumsumexp": torch.logaddexp}



class _Decline(Exception):
    """The group is not a rooted scan this rewrite knows: left as it is."""


def _rooted_dim(node: Any, ctx: PassContext) -> int | None:
    """The dim of ``node`` with S + 1 entries (one, else None)."""
    v = value(node)
    if not isinstance(v, torch.Tensor):
        return None
    dims = [d for d in range(v.dim()) if same_size(v.shape[d], ctx.seq_len + 1)]
    return dims[0] if len(dims) == 1 else None


def _source(node: fx.Node, ctx: PassContext) -> tuple[Any, fx.Node, int] | None:
    """``(root, rows, dim)`` if ``node`` puts one row in front of the rows: ``cat([h, x], d)``
    with ``h`` one row along ``d``, or ``pad(x, (.., 1, 0), value=c)``."""
    if not (is_call(node, CATS) or is_call(node, PADS)):
        return None
    d = _rooted_dim(node, ctx)
    if d is None:
        return None
    nd = value(node).dim()
    if is_call(node, CATS):
        parts = node.args[0] if node.args else node.kwargs.get("tensors")
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
        if isinstance(parts, (list, tuple)) and len(parts) == 2 and isinstance(dim, int) and dim % nd == d:
            h, x = parts
            hv, xv = value(h), value(x)
            if isinstance(hv, torch.Tensor) and isinstance(xv, torch.Tensor) and hv.shape[d] == 1 \
                    and same_size(xv.shape[d], ctx.seq_len):
                return h, x, d
        return None
    found = padded_rows(node, d, 1)  # a constant fill (not `REPLICATE`, the first token's row)
    return None if found is None or isinstance(found[1], str) else (float(found[1]), found[0], d)


def _cut(node: fx.Node, rooted: fx.Node, d: int, ctx: PassContext) -> str | None:
    """``"front"`` if ``node`` is ``rooted[.., 1:, ..]`` (or ``-T:``) along ``d`` (the token rows),
    ``"back"`` if it is ``rooted[.., :-1, ..]`` (or ``:T``: the front row and every token row
    but the last, an exclusive scan), else None."""
    if not (node.op == "call_function" and node.target is operator.getitem and node.args[0] is rooted):
        return None
    found = _cut_along(node.args[1], d, value(rooted).dim())
    cut = None if found is None else found[0]
    if not (isinstance(cut, slice) and cut.step in (None, 1) and same_size(value(node).shape[d], ctx.seq_len)):
        return None
    if cut.stop is None:
        return "front" if cut.start == 1 or not isinstance(cut.start, int) else None
    if cut.start in (None, 0):
        return "back" if cut.stop == -1 or not isinstance(cut.stop, int) else None
    return None


def _scan(node: fx.Node, d: int) -> str | None:
    name = op_name(node)
    if name not in ROOTED_SCANS or node.kwargs.get("out") is not None:
        return None
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    return name if isinstance(dim, int) and dim % value(node).dim() == d else None


def _group(start: fx.Node, ctx: PassContext) -> tuple[dict[fx.Node, int], list[tuple[fx.Node, str]]]:
    """The rooted tensors connected to ``start`` (each with its row dim) and the cuts that take
    their rows, with their kind (`_cut`); raises `_Decline` where one is read any other way."""
    rooted: dict[fx.Node, int] = {}
    cuts: list[tuple[fx.Node, str]] = []
    todo = [start]
    while todo:
        n = todo.pop()
        if n in rooted:
            continue
        d = _rooted_dim(n, ctx)
        if d is None or (n.op == "call_function" and n.target is operator.getitem):
            raise _Decline
        source = _source(n, ctx) is not None
        if not source and _scan(n, d) is None and op_name(n) not in ROW_LOCAL:
            raise _Decline
        if not source:  # an op reading a rooted tensor: every S + 1 input must be rooted
            todo.extend(a for a in n.all_input_nodes if _rooted_dim(a, ctx) is not None)
        rooted[n] = d
        nd = value(n).dim()
        for user in n.users:
            kind = _cut(user, n, d, ctx)
            if kind is not None:
                cuts.append((user, kind))
            elif _rooted_dim(user, ctx) is not None and value(user).dim() == nd and _rooted_dim(user, ctx) == d:
                todo.append(user)
            else:
                raise _Decline
    for n, d in rooted.items():
        if _source(n, ctx) is not None:
            continue
        for a in n.all_input_nodes:
            av = value(a)
            if isinstance(av, torch.Tensor) and a not in rooted:
                # An operand without the rooted dim: it must broadcast over it (absent or size 1).
                at = d - (value(n).dim() - av.dim())
                if at >= 0 and av.shape[at] != 1:
                    raise _Decline
    return rooted, cuts


def _split(gm: fx.GraphModule, ctx: PassContext, rooted: dict[fx.Node, int]) -> dict[fx.Node, tuple[Any, Any]]:
    """Each rooted node's ``(root, rows)``, emitted in graph order."""
    parts: dict[fx.Node, tuple[Any, Any]] = {}
    for n in gm.graph.nodes:
        if n not in rooted:
            continue
        d = rooted[n]
        found = _source(n, ctx)
        if found is not None:
            root, rows, _ = found
            if isinstance(root, float):
                rv = value(rows)
                root = emit(gm, ctx, n, "call_function", torch.full, ((1,) * rv.dim(), root),
                             {"dtype": rv.dtype, "device": rv.device}, fake=getattr(rv, "fake_mode", None))
            parts[n] = (root, rows)
            continue
        scan = _scan(n, d)
        if scan is not None:
            root, rows = parts[n.args[0]]
            rest, kw = tuple(n.args[1:]), dict(n.kwargs)
            scanned = emit(gm, ctx, n, n.op, n.target, (rows, *rest), kw, mark=False)
            parts[n] = (root, emit(gm, ctx, n, "call_function", ROOTED_SCANS[scan], (root, scanned), {}))
            continue

        def side(i: int, n=n):
            return fx.node.map_arg((n.args, n.kwargs), lambda a: parts[a][i] if a in parts else a)

        # The model's own op on each part, unmarked: the row rules judge it as any op of the model.
        (ra, rk), (wa, wk) = side(0), side(1)
        parts[n] = (emit(gm, ctx, n, n.op, n.target, ra, rk, mark=False),
                    emit(gm, ctx, n, n.op, n.target, wa, wk, mark=False))
    return parts


def _token_rows(gm: fx.GraphModule, ctx: PassContext, cut: fx.Node, kind: str, root: fx.Node, rows: fx.Node,
                d: int) -> Any:
    """What ``cut`` takes of a rooted tensor: its token rows (``[:, 1:]``), or its front row
    then its token rows shifted by one (``[:, :-1]``), a shift the shifts pass runs along the
    path with the front row above each root (None where the shapes are not known numbers)."""
    if kind == "front":
        return rows
    shape = list(value(cut).shape)
    shape[d] = 1
    if not all(isinstance(x, int) for x in shape):
        return None
    front = emit(gm, ctx, cut, "call_method", "expand", (root, *shape), {})
    index = (slice(None),) * d + (slice(None, -1),)
    rest = emit(gm, ctx, cut, "call_function", operator.getitem, (rows, index), {}, mark=False)
    return emit(gm, ctx, cut, "call_function", torch.cat, ([front, rest], d), {}, mark=False)


def rewrite_rooted_scans(gm: fx.GraphModule, ctx: PassContext) -> None:
    """Splits each group of rooted tensors (see the module docstring) into front rows and token
    rows; a group read any other way is left as it is."""
    done: set[fx.Node] = set()
    for node in list(gm.graph.nodes):
        if node in done or node.op not in ("call_function", "call_method") or _source(node, ctx) is None:
            continue
        try:
            rooted, cuts = _group(node, ctx)
        except _Decline:
            continue
        done |= set(rooted)
        # Without a scan the front row reaches nothing the cuts keep: left as it is (removing
        # it would leave its parameters without a gradient where the model gives them zeros).
        if not cuts or not any(_scan(n, d) for n, d in rooted.items()):
            continue
        parts = _split(gm, ctx, rooted)
        new = [_token_rows(gm, ctx, cut, kind, *parts[cut.args[0]], rooted[cut.args[0]]) for cut, kind in cuts]
        if any(r is None or tuple(value(r).shape) != tuple(value(c).shape) for r, (c, _) in zip(new, cuts)):
            continue  # left as it is (what was emitted is dead code)
        for (cut, _), r in zip(cuts, new):
            cut.replace_all_uses_with(r)
            gm.graph.erase_node(cut)
        for n in reversed(list(gm.graph.nodes)):
            if n in rooted and not n.users:
                gm.graph.erase_node(n)
        ctx.count("rooted_scan")
