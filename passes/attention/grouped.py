"""Softmax maps combined across a group of heads before the product with the values.

The Differential Transformer (as its reference, ``multihead_diffattn.py``, writes it) splits
the softmax's heads into groups, ``p.view(B, H, 2, S, S)``, and multiplies a linear combination
of each group's maps with the group's value, ``(p[:, :, 0] - lam * p[:, :, 1]) @ v``. The product
is linear in the maps, so it equals the same combination of each map's own product with the
value: one tree attention over every head with the group's value repeated for each of its
heads, its result viewed as ``[B, H, n, S, Dv]`` and combined with the model's coefficients
(`grouped_output`, `combine`). A coefficient may not have a dim of the sequence (a scalar or
one per group).
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import fx

from treecompile.passes._graph import MATMUL, Emitter, PassContext, is_call, row_dims, value
from treecompile.passes.attention.operands import single_user

__all__ = ["Grouped", "grouped_output", "repeat_values", "combine"]

_CASTS = ("float", "double", "to", "type", "type_as")


@dataclass
class Grouped:
    """A softmax's maps combined across head groups before ``@ v``.

    Attributes:
        out: the ``combination @ v`` node.
        v: the values, ``[*lead, groups, S, Dv]``.
        size: heads per group (``n``).
        terms: ``(index in the group, coefficient or None, sign)``: the combination.
        nodes: the nodes between the softmax and ``out`` the rewrite replaces.
    """

    out: fx.Node
    v: fx.Node
    size: int
    terms: list[tuple[int, object, float]]
    nodes: list[fx.Node]


def grouped_output(ctx: PassContext, softmax: fx.Node) -> Grouped | None:
    """The grouped combination after ``softmax`` (casts, a view splitting the heads into
    ``[groups, n]``, a selection per group member, a linear combination, a matmul with the
    values), or None."""
    cur, nodes = single_user(softmax), []
    while cur is not None and is_call(cur, (), _CASTS):
        nodes.append(cur)
        cur = single_user(cur)
    sv = value(softmax)
    if cur is None or not is_call(cur, (torch.reshape,), ("view", "reshape")):
        return None
    vv = value(cur)
    if not isinstance(vv, torch.Tensor) or vv.dim() != sv.dim() + 1 or tuple(vv.shape[-2:]) != tuple(sv.shape[-2:]) \
            or tuple(vv.shape[:-4]) != tuple(sv.shape[:-3]):
        return None
    groups, size = vv.shape[-4], vv.shape[-3]
    if not (isinstance(groups, int) and isinstance(size, int) and groups * size == sv.shape[-3] and size > 1):
        return None
    view = cur
    nodes.append(view)
    width = vv.dim() - 2  # an index selecting one member: every dim up to the member's
    picks = {}
    for u in view.users:
        index = u.args[1] if u.op == "call_function" and u.target is operator.getitem and len(u.args) == 2 else None
        if not (isinstance(index, tuple) and len(index) == width and all(i == slice(None) for i in index[:-1])
                and isinstance(index[-1], int)):
            return None
        picks[u] = index[-1] % size
    out = next(iter(picks), None)
    while out is not None and not is_call(out, MATMUL, ("matmul",)):
        out = single_user(out)
    if out is None or len(out.args) != 2:
        return None
    terms, inner = _terms(ctx, out.args[0], picks)
    if terms is None:
        return None
    nodes += list(picks) + inner
    members = set(nodes) | {out}
    if any(u not in members for n in nodes for u in n.users):
        return None  # a node of the combination is read elsewhere (the maps returned as weights)
    v = out.args[1]
    if not isinstance(value(v), torch.Tensor) or tuple(value(v).shape[:-2]) != tuple(vv.shape[:-3]):
        return None
    return Grouped(out, v, size, terms, nodes)


def _terms(ctx: PassContext, x, picks: dict) -> tuple[list | None, list]:
    """``(terms, the combination's own nodes)`` of ``x`` (see `Grouped.terms`), or ``(None, [])``."""
    if x in picks:
        return [(picks[x], None, 1.0)], []
    if not isinstance(x, fx.Node) or x.kwargs or len(x.args) != 2:
        return None, []
    a, b = x.args
    if is_call(x, (operator.add, torch.add, operator.sub, torch.sub), ("add", "sub")):
        ta, na = _terms(ctx, a, picks)
        tb, nb = _terms(ctx, b, picks)
        if ta is None or tb is None:
            return None, []
        sign = -1.0 if is_call(x, (operator.sub, torch.sub), ("sub",)) else 1.0
        return ta + [(i, c, sign * s) for i, c, s in tb], na + nb + [x]
    if is_call(x, (operator.mul, torch.mul), ("mul",)):
        for term, coef in ((a, b), (b, a)):
            t, inner = _terms(ctx, term, picks)
            if t is not None and len(t) == 1 and t[0][1] is None and _coefficient(ctx, coef):
                return [(t[0][0], coef, t[0][2])], inner + [x]
    return None, []


def _coefficient(ctx: PassContext, c) -> bool:
    """A number, or a tensor without a dim of the sequence whose last two dims are 1 (a scalar,
    one per group): the same factor on the maps and on their products with the values."""
    if isinstance(c, (int, float)) and not isinstance(c, bool):
        return True
    cv = value(c) if isinstance(c, fx.Node) else None
    return (isinstance(cv, torch.Tensor) and not row_dims(c, ctx.seq_len, "seq")
            and (cv.dim() == 0 or cv.dim() <= 3 and tuple(cv.shape[-2:]) == (1, 1)))


def repeat_values(e: Emitter, grouped: Grouped) -> fx.Node:
    """The values repeated for each head of their group: ``[*lead, groups * n, S, Dv]``."""
    vv = value(grouped.v)
    lead, groups, dv = tuple(vv.shape[:-3]), vv.shape[-3], vv.shape[-1]
    x = e.method("expand", e.method("unsqueeze", grouped.v, -3), *lead, groups, grouped.size, -1, -1)
    return e.method("reshape", x, *lead, groups * grouped.size, -1, dv)


def combine(g: fx.Graph, y: fx.Node, grouped: Grouped, mark: Callable[[fx.Node], fx.Node]) -> fx.Node:
    """The model's combination of the kernel's per-head results ``y`` ``[*lead, groups * n, S,
    Dv]``: ``sum sign * coefficient * y[group member]``, ``[*lead, groups, S, Dv]`` (each new
    node passed through ``mark``)."""
    vv = value(grouped.v)
    lead, groups, dv = tuple(vv.shape[:-3]), vv.shape[-3], vv.shape[-1]
    y = mark(g.call_method("view", (y, *lead, groups, grouped.size, -1, dv)))
    total = None
    for i, coef, sign in grouped.terms:
        part = mark(g.call_function(operator.getitem, (y, (*[slice(None)] * (len(lead) + 1), i))))
        if coef is not None:
            part = mark(g.call_function(operator.mul, (part, coef)))
        if total is None:
            total = part if sign > 0 else mark(g.call_function(operator.neg, (part,)))
        else:
            total = mark(g.call_function(operator.add if sign > 0 else operator.sub, (total, part)))
    return total
