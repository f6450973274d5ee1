"""Attention without a softmax: ``(scale * (q @ k^T) * D) @ v`` with ``D`` a causal function of ``i - j``.

Linear attention in its parallel form (``(q @ k^T).masked_fill(triu(ones(T, T), 1), 0) @ v``,
``torch.tril(q @ k^T) @ v``; normalised, ``(A @ v) / (A.sum(-1, keepdim=True) + eps)`` or
``A / A.sum(-1, keepdim=True).clamp(min=eps) @ v``) and RetNet's parallel retention (``(q @ k^T * decay_mask) @ v``,
the mask ``gamma[h] ** (i - j)`` below the diagonal and 0 above) sum, for each query, the
keys before it on its path, each weighted by a factor of the distance. On the tree that is
`treecompile.kernels.attention.pair_sum.tree_pair_sum` over the query's ancestors-or-self at
path distances, with the factor as a table ``table[h, d]``.

The walk from the product with ``v`` back to ``q @ k^T`` takes constant scales, pair factors
(a tensor that reads no token: built from the indices, a buffer, a parameter), masks filled
with 0, ``tril`` and casts. The factors together must be, at the example length and at a
shorter one, zero above the diagonal (causal) and a function of ``i - j`` below it that does
not change with the length (``1 / T`` would: per path ``T`` is the path's length). A constant
factor below the diagonal (linear attention) is a one-entry table; one that varies with the
distance is the model's own subgraph with the key index replaced by 0
(`treecompile.passes.attention.relative_bias.relative_table`), so a learned decay gets its
gradient; it costs what the model's own mask code costs on the packed row (a mask built as a
``[T, T]`` tensor is ``[S, S]`` there). The interval rule only (the bitmask rule is noted and
left to the verify pass).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

from treecompile.kernels.attention import pair_sum as _kernel  # noqa: F401  (registers treecompile::tree_pair_sum)
from treecompile.passes._graph import MATMUL, PassContext, bind, is_call, same_size, value
from treecompile.passes._mask_eval import evaluate, reads_tokens
from treecompile.passes.attention.operands import output_operands, scores_operands, single_user
from treecompile.passes.attention.relative_bias import relative_table

__all__ = ["is_pair_product", "rewrite_pair_sum"]

_CASTS = ("float", "double", "to", "type", "type_as")
_MUL = (operator.mul, torch.mul)
_DIV = (operator.truediv, torch.div, torch.true_divide)


def is_pair_product(node: fx.Node) -> bool:
    """A ``matmul`` / ``bmm`` / ``einsum`` whose first operand is square in its last two dims."""
    if not (is_call(node, MATMUL, ("matmul", "bmm")) or is_call(node, (torch.einsum,))):
        return False
    first = node.args[1] if is_call(node, (torch.einsum,)) and len(node.args) > 1 else node.args[0]
    v = value(first)
    return isinstance(v, torch.Tensor) and v.dim() >= 2 and same_size(v.shape[-1], v.shape[-2])


@dataclass
class _Match:
    """``chain(q @ k^T) @ v`` read off the graph: the operands, what the chain does (scale,
    factors, zero-filled masks, ``tril``), a denominator (``normalize``, ``eps``: see
    `treecompile.kernels.attention.pair_sum.tree_pair_sum`) and the node whose users get the result."""

    q: fx.Node
    k: fx.Node
    v: fx.Node
    post: Any
    scale: float = 1.0
    factors: list = field(default_factory=list)
    masks: list = field(default_factory=list)
    tril: bool = False
    normalize: int = 0
    eps: float = 0.0
    output: fx.Node | None = None


def rewrite_pair_sum(gm: fx.GraphModule, ctx: PassContext, node: fx.Node) -> None:
    """Replaces ``(chain(q @ k^T)) @ v`` (module docstring) with the tree pair sum; leaves a note
    where the chain is such a product but its factor is not a causal function of the distance."""
    m = _match(ctx, node)
    if m is None:
        return
    out = m.output
    with gm.graph.inserting_before(node):  # keys made with the sequence last (a permute): transposed back
        m.q, m.k, m.v = (ctx.mark(x(gm.graph), like=node) if callable(x) else x for x in (m.q, m.k, m.v))
    vals = [value(x) if isinstance(x, fx.Node) else None for x in (m.q, m.k, m.v)]
    dims = {t.dim() if t is not None else None for t in vals} | {value(node).dim()}
    if dims not in ({4}, {3}):
        ctx.notes[node] = "attention without a softmax over tensors that are not [B, H, S, D] (or [B * H, S, D])"
        return
    three_d = dims == {3}  # [B * H, S, D] with B = 1: the leading dim is the heads
    if three_d:
        vals = [t.unsqueeze(0) for t in vals]
    if ctx.mask != "interval":
        ctx.notes[node] = "attention without a softmax runs on the interval mask rule (tree_compile(mask='interval'))"
        return
    heads = vals[0].shape[1]
    if not isinstance(heads, int) or heads % vals[1].shape[1] or vals[1].shape[1] != vals[2].shape[1]:
        ctx.notes[node] = "attention without a softmax whose key and value heads do not divide the query heads"
        return
    judged = _judge(ctx, m.factors, m.masks, m.tril, heads)
    if isinstance(judged, str):
        ctx.notes[node] = f"attention without a softmax whose pair factor is {judged}"
        return
    constant, relative, columns = judged
    g = gm.graph
    if relative is None:
        with g.inserting_before(node):
            table = ctx.mark(g.call_function(torch.tensor, (constant,), {"dtype": vals[0].dtype,
                                                                          "device": vals[0].device}), like=node)
        table.meta["example_value"] = torch.tensor(constant, dtype=vals[0].dtype, device=vals[0].device)
    else:
        found = relative_table(gm, ctx, relative, node)
        why = found if isinstance(found, str) else _check_table(ctx, found[0], columns)
        if why is not None:
            ctx.notes[node] = f"attention without a softmax whose pair factor is {why}"
            return
        table = found[0]
    dtype = vals[0].dtype
    for t in vals[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    with g.inserting_before(out):
        args = [x if t.dtype == dtype else ctx.mark(g.call_method("to", (x, dtype)), like=node)
                for x, t in zip((m.q, m.k, m.v), vals)]
        if three_d:
            args = [ctx.mark(g.call_method("unsqueeze", (x, 0)), like=node) for x in args]
        new = ctx.mark(g.call_function(torch.ops.treecompile.tree_pair_sum.default,
                                       (*args, table, ctx.positions, ctx.mask_buffers[0], float(m.scale),
                                        m.normalize, float(m.eps))), like=node)
        if three_d:
            new = ctx.mark(g.call_method("squeeze", (new, 0)), like=node)
        if dtype != value(out).dtype:
            new = ctx.mark(g.call_method("to", (new, value(out).dtype)), like=node)
        if m.post is not None:
            new = ctx.mark(m.post(g, new), like=node)
    new.meta["example_value"] = value(out)
    out.replace_all_uses_with(new)
    ctx.count("pair_sum")


def _match(ctx: PassContext, node: fx.Node) -> _Match | None:
    """The pair sum ending in ``node`` (``chain(q @ k^T) @ v``), or None."""
    if not is_pair_product(node) or not all(same_size(d, ctx.seq_len) for d in value(node).shape[-2:-1]):
        return None
    pv = output_operands(node, None) if not is_call(node, (torch.einsum,)) else None
    if pv is None:
        return None
    first, v, post = pv
    m = _Match(q=None, k=None, v=v, post=post, output=node)
    # Normalised: (A @ v) / A.sum(-1, keepdim=True), or (A / A.sum(-1, keepdim=True)) @ v.
    after = single_user(node)
    norm = _normalised(after, node, first) if after is not None and set(first.users) != {node} else None
    if norm is not None:
        m.normalize, m.eps = norm
        m.output = after
    elif set(first.users) != {node}:
        return None
    cur = first
    if is_call(cur, _DIV, ("div",)) and isinstance(cur.args[1], fx.Node):
        norm = _denominator(cur.args[1], cur.args[0])
        if norm is None or m.normalize or set(cur.args[0].users) != {cur, _sum_nodes(cur.args[1])[1]}:
            return None
        m.normalize, m.eps = norm
        cur = first = cur.args[0]  # read by the division and its row sum
    while True:
        if not isinstance(cur, fx.Node):
            return None
        if is_call(cur, MATMUL, ("matmul", "bmm")) and reads_tokens(ctx, cur):
            operands = scores_operands(cur)
            if operands is None or single_user(cur) is None:
                return None
            m.q, m.k, _ = operands
            if not (m.factors or m.masks or m.tril):
                return None  # no causal factor: bidirectional, left to the verify pass
            return m
        if cur is not first and single_user(cur) is None:
            return None
        nxt = _step(ctx, cur, m.factors, m.masks)
        if nxt is None:
            return None
        if isinstance(nxt, tuple):
            nxt, factor = nxt
            if factor == "tril":
                m.tril = True
            else:
                m.scale *= factor
        cur = nxt


def _normalised(div: fx.Node, product: fx.Node, weights: fx.Node) -> tuple[int, float] | None:
    """``(normalize, eps)`` if ``div`` is ``product / den`` with ``den`` a denominator of ``weights``
    (its only other reader being that row sum)."""
    if not is_call(div, _DIV, ("div",)) or div.args[0] is not product or not isinstance(div.args[1], fx.Node):
        return None
    norm = _denominator(div.args[1], weights)
    if norm is None or set(weights.users) != {product, _sum_nodes(div.args[1])[1]}:
        return None
    return norm


def _denominator(den: fx.Node, weights: fx.Node) -> tuple[int, float] | None:
    """``(1, eps)`` for ``rowsum(weights) [+ eps]``, ``(2, eps)`` for ``rowsum(weights).clamp(min=eps)``,
    where ``rowsum`` is ``.sum(-1, keepdim=True)`` (or ``.sum(-1).unsqueeze(-1)``); else None."""
    mode, eps, d = 1, 0.0, den
    if is_call(d, (operator.add, torch.add), ("add",)) and len(d.args) == 2 and not d.kwargs:
        a, b = d.args
        a, b = (a, b) if isinstance(a, fx.Node) else (b, a)
        if not isinstance(b, (int, float)) or isinstance(b, bool):
            return None
        eps, d = float(b), a
    elif is_call(d, (torch.clamp, torch.clamp_min), ("clamp", "clamp_min")):
        b = bind(d, ["input", "min", "max"], {"min": None, "max": None})
        if not isinstance(b["min"], (int, float)) or isinstance(b["min"], bool) or b["max"] is not None:
            return None
        mode, eps, d = 2, float(b["min"]), b["input"]
    return (mode, eps) if weights in _sum_nodes(d) and _sum_nodes(d) else None


def _sum_nodes(d: fx.Node) -> list:
    """``[x, the sum]`` if ``d`` is ``x.sum(-1, keepdim=True)`` or ``x.sum(-1).unsqueeze(-1)`` (through
    an ``add`` or ``clamp`` on top), else []."""
    chain = []
    while isinstance(d, fx.Node) and (is_call(d, (operator.add, torch.add, torch.clamp, torch.clamp_min),
                                              ("add", "clamp", "clamp_min"))):
        chain.append(d)
        d = d.args[0] if isinstance(d.args[0], fx.Node) else d.args[1]
    unsqueezed = False
    if isinstance(d, fx.Node) and is_call(d, (torch.unsqueeze,), ("unsqueeze",)) and d.args[1:2] == (-1,):
        chain.append(d)
        d, unsqueezed = d.args[0], True
    if not isinstance(d, fx.Node) or not is_call(d, (torch.sum,), ("sum",)):
        return []
    b = bind(d, ["input", "dim", "keepdim"], {"dim": None, "keepdim": False})
    x = b["input"]
    dim = b["dim"][0] if isinstance(b["dim"], (tuple, list)) and len(b["dim"]) == 1 else b["dim"]
    xv = value(x)
    if not isinstance(xv, torch.Tensor) or dim not in (-1, xv.dim() - 1) or bool(b["keepdim"]) == unsqueezed:
        return []
    return [x, d, *chain]


def _step(ctx: PassContext, cur: fx.Node, factors: list, masks: list):
    """The node before ``cur`` on the chain (with a scale or ``"tril"`` as ``(node, what)``),
    recording a factor or mask; None if ``cur`` is no step of this chain."""
    if is_call(cur, _MUL, ("mul",)):
        a, b = cur.args[:2]
        for x, other in ((a, b), (b, a)):
            if isinstance(x, (int, float)) and not isinstance(x, bool) and isinstance(other, fx.Node):
                return other, float(x)
        if all(isinstance(x, fx.Node) for x in (a, b)):
            chain = [x for x in (a, b) if reads_tokens(ctx, x)]
            if len(chain) == 1:
                factors.append(b if chain[0] is a else a)
                return chain[0]
        return None
    if is_call(cur, _DIV, ("div",)):
        a, b = cur.args[:2]
        if isinstance(b, (int, float)) and not isinstance(b, bool) and b != 0 and len(cur.args) == 2 and not cur.kwargs:
            return a, 1.0 / float(b)
        return None
    if is_call(cur, (torch.masked_fill,), ("masked_fill",)):
        b = bind(cur, ["input", "mask", "value"], {})
        if b["value"] == 0 and isinstance(b["mask"], fx.Node) and not reads_tokens(ctx, b["mask"]):
            masks.append(b["mask"])
            return b["input"]
        return None
    if is_call(cur, (torch.tril,), ("tril",)):
        b = bind(cur, ["input", "diagonal"], {"diagonal": 0})
        return (b["input"], "tril") if b["diagonal"] == 0 else None
    if is_call(cur, (), _CASTS) and isinstance(cur.args[0], fx.Node):
        return cur.args[0]
    return None


def _judge(ctx: PassContext, factors: list, masks: list, tril: bool, heads: int):
    """``(constant per lead, None)`` or ``(None, the factor node)``, or why the factors are not a
    causal function of the distance that does not change with the length."""
    s = value(ctx.input_ids).shape[-1]
    example = int(s.node.hint) if isinstance(s, torch.SymInt) else int(s)
    tables = []
    for rows in (example, max(2, example // 2)):
        try:
            full = _product(ctx, factors, masks, tril, rows)
        except Exception as e:  # a factor that cannot be evaluated alone (or at another length)
            return f"not evaluable alone ({type(e).__name__})"
        if full.shape[-1] != rows or full.shape[-2] != rows:
            return f"of shape {list(full.shape)}, not over the (query, key) pairs"
        full = full.reshape(-1, rows, rows)
        if full.shape[0] not in (1, heads):
            return f"{full.shape[0]} tables for {heads} heads"
        if torch.count_nonzero(full.triu(1)):
            return "not causal (a key after its query gets a nonzero factor)"
        i, j = torch.tril_indices(rows, rows)
        col = full[:, :, 0]
        tol = 1e-9 if full.dtype == torch.float64 else 1e-5
        if not torch.allclose(full[:, i, j], col[:, i - j], rtol=tol, atol=tol):
            return "not a function of the distance between query and key"
        tables.append(col)
        if rows == example:
            long_full = full
    long, short = tables
    if not torch.allclose(long[:, : short.shape[1]], short, rtol=1e-9, atol=1e-9):
        return "one that changes with the sequence length (per path the length is the path's)"
    columns = {rows: col for rows, col in zip((example, max(2, example // 2)), tables)}
    if torch.all(long == long[:, :1]):
        return long[:, :1].tolist(), None, columns
    varying = [f for f in factors if _varies(ctx, f, example)]
    if len(varying) != 1 or any(f is not varying[0] for f in factors):
        return "built from several tensors (one factor varying with the distance, and causal masks, are read)"
    alone = _product(ctx, varying, [], False, example)
    i, j = torch.tril_indices(example, example)
    if not torch.equal(alone.reshape(-1, example, example)[:, i, j], long_full[:, i, j]):
        return "a factor varying with the distance beside masks that drop pairs below the diagonal"
    return None, varying[0], columns


def _check_table(ctx: PassContext, table: fx.Node, columns: dict) -> str | None:
    """Why the table built in the graph is not, at each judged length, the factor's key column."""
    for rows, col in columns.items():
        try:
            got = evaluate(ctx, table, rows=rows).to(torch.float64).reshape(col.shape[0], -1)
        except Exception as e:
            return f"not evaluable from its distances alone ({type(e).__name__})"
        if got.shape != col.shape or not torch.allclose(got, col, rtol=1e-9, atol=1e-9):
            return "not its own key column when built from the distances (an op mixes the keys)"
    return None


def _varies(ctx: PassContext, f: fx.Node, rows: int) -> bool:
    v = evaluate(ctx, f, rows=rows)
    return not torch.all(v == v.reshape(-1)[0])


def _product(ctx: PassContext, factors: list, masks: list, tril: bool, rows: int) -> torch.Tensor:
    """The factors, masks and ``tril`` multiplied out at ``rows`` rows (float64)."""
    full = torch.ones(rows, rows, dtype=torch.float64)
    for f in factors:
        full = full * evaluate(ctx, f, rows=rows).to(torch.float64)
    for m in masks:
        full = full * (~evaluate(ctx, m, rows=rows).bool()).to(torch.float64)
    return full.tril() if tril else full
