"""Attention without a softmax: ``(scale * (q @ k^T) * D) @ v`` with ``D`` a causal function of ``i - j``.

Linear attention in its parallel form (``(q @ k^T).masked_fill(triu(ones(T, T), 1), 0) @ v``,
``torch.tril(q @ k^T) @ v``; normalised, ``(A @ v) / (A.sum(-1, keepdim=True) + eps)`` or
``A / A.sum(-1, keepdim=True).clamp(min=eps) @ v``) and RetNet's parallel retention (``(q @ k^T * decay_mask) @ v``,
the mask ``gamma[h] ** (i - j)`` below the diagonal and 0 above) sum, for each query, the
keys before it on its path, each weighted by a factor of the distance. On the tree that is
`treecompile.kernels.attention.pair_sum.tree_pair_sum` over the query's ancestors-or-self at
path distances, with the factor as a table ``table[h, d]``.

RetNet as torchscale writes it also scales each row of its decay mask by ``1 / sqrt(mask.sum(-1))``
(a function of the query's position: the row sum of a causal relative mask is the running sum
of its table, so a per-query table ``qtable[h, p]`` built from ``cumsum(table)`` by the model's
own ops) and divides the scores by ``qk.detach().abs().sum(-1).clamp(min=1, max=5e4)`` (a
denominator the kernel computes over the query's keys).

The walk from the product with ``v`` back to ``q @ k^T`` takes constant scales, pair factors
(a tensor that reads no token: built from the indices, a buffer, a parameter), masks filled
with 0, ``tril`` and casts. The factors together must be, at the example length and at a
shorter one, zero above the diagonal (causal; with the parameters moved too, so that a learned
value that is 0 now is not taken for a mask) and a function of ``i - j`` below it that does
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
from treecompile.passes._mask_eval import depends_on_inputs, evaluate, moved_parameters, reads_tokens
from treecompile.passes.attention.operands import output_operands, scores_operands, single_user
from treecompile.passes.attention.relative_bias import relative_table
from treecompile.passes.attention.score_chain import is_scalar

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
    high: float = 0.0
    output: fx.Node | None = None


def rewrite_pair_sum(gm: fx.GraphModule, ctx: PassContext, node: fx.Node) -> bool | None:
    """Replaces ``(chain(q @ k^T)) @ v`` (module docstring) with the tree pair sum; leaves a note
    where the chain is such a product but its factor is not a causal function of the distance, and
    declines the node (False) for the spellings after it (`dense_pairs`) wherever it does not rewrite it."""
    m = _match(ctx, node)
    if m is None:
        return False
    out = m.output
    with gm.graph.inserting_before(node):  # keys made with the sequence last (a permute): transposed back
        m.q, m.k, m.v = (ctx.mark(x(gm.graph), like=node) if callable(x) else x for x in (m.q, m.k, m.v))
    vals = [value(x) if isinstance(x, fx.Node) else None for x in (m.q, m.k, m.v)]
    dims = {t.dim() if t is not None else None for t in vals} | {value(node).dim()}
    if dims not in ({4}, {3}):
        ctx.notes[node] = "attention without a softmax over tensors that are not [B, H, S, D] (or [B * H, S, D])"
        return False
    three_d = dims == {3}  # [B * H, S, D] with B = 1: the leading dim is the heads
    if three_d:
        vals = [t.unsqueeze(0) for t in vals]
    if ctx.mask != "interval":
        ctx.notes[node] = "attention without a softmax runs on the interval mask rule (tree_compile(mask='interval'))"
        return False
    heads = vals[0].shape[1]
    if not isinstance(heads, int) or heads % vals[1].shape[1] or vals[1].shape[1] != vals[2].shape[1]:
        ctx.notes[node] = "attention without a softmax whose key and value heads do not divide the query heads"
        return False
    judged = _judge(ctx, m.factors, m.masks, m.tril, heads)
    if isinstance(judged, str):
        ctx.notes[node] = f"attention without a softmax whose pair factor is {judged}"
        return False
    tables = _tables(gm, ctx, judged, node, vals[0])
    if isinstance(tables, str):
        ctx.notes[node] = f"attention without a softmax whose pair factor is {tables}"
        return False
    table, qtable = tables
    g = gm.graph
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
                                        m.normalize, float(m.eps), float(m.high), qtable)), like=node)
        if three_d:
            new = ctx.mark(g.call_method("squeeze", (new, 0)), like=node)
        if dtype != value(out).dtype:
            new = ctx.mark(g.call_method("to", (new, value(out).dtype)), like=node)
        if m.post is not None:
            new = ctx.mark(m.post(g, new), like=node)
    new.meta["example_value"] = value(out)
    out.replace_all_uses_with(new)
    ctx.count("pair_sum")


def _tables(gm: fx.GraphModule, ctx: PassContext, judged: tuple, node: fx.Node, like):
    """``(table, query table or None)`` built in the graph before ``node`` for the judged factor
    (`_judge`), each checked against the factor evaluated at the judged lengths; or why not."""
    constant, relative, columns = judged
    g = gm.graph
    if relative is None:  # a constant below the diagonal: a one-entry table
        with g.inserting_before(node):
            table = ctx.mark(g.call_function(torch.tensor, (constant,), {"dtype": like.dtype, "device": like.device}),
                             like=node)
        table.meta["example_value"] = torch.tensor(constant, dtype=like.dtype, device=like.device)
        return table, None
    scaled = isinstance(relative, tuple)  # a relative factor scaled per query by its row sum
    found = relative_table(gm, ctx, relative[0] if scaled else relative, node)
    if isinstance(found, str):
        return found
    table = found[0]
    if not scaled:
        why = _check_table(ctx, table, columns)
        return why if why is not None else (table, None)
    qtable = _row_scale_table(gm, ctx, table, relative, node)
    why = _check_scaled(ctx, table, qtable, columns)
    return why if why is not None else (table, qtable)


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
        m.normalize, m.eps, m.high = norm
        m.output = after
    elif set(first.users) != {node}:
        return None
    cur = first
    if is_call(cur, _DIV, ("div",)) and isinstance(cur.args[1], fx.Node) and isinstance(cur.args[0], fx.Node):
        found = _denominator(cur.args[1], cur.args[0])
        if found is None or m.normalize or set(cur.args[0].users) != {cur, found[3]}:
            return None
        m.normalize, m.eps, m.high = found[:3]
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


def _normalised(div: fx.Node, product: fx.Node, weights: fx.Node) -> tuple[int, float, float] | None:
    """``(normalize, eps, high)`` if ``div`` is ``product / den`` with ``den`` a denominator of
    ``weights`` (its only other reader being that denominator)."""
    if not is_call(div, _DIV, ("div",)) or div.args[0] is not product or not isinstance(div.args[1], fx.Node):
        return None
    found = _denominator(div.args[1], weights)
    if found is None or set(weights.users) != {product, found[3]}:
        return None
    return found[:3]


def _denominator(den: fx.Node, weights: fx.Node) -> tuple[int, float, float, fx.Node] | None:
    """``(normalize, eps, high, the node reading weights)`` of a denominator over ``weights``' keys
    (see `treecompile.kernels.attention.pair_sum.tree_pair_sum`): ``rowsum(weights) [+ eps]`` (1),
    ``rowsum(weights).clamp(min=eps)`` (2), ``rowsum(weights.detach().abs()).clamp(min=eps[,
    max=high])`` (3), where ``rowsum`` is ``.sum(-1, keepdim=True)`` (or ``.sum(-1).unsqueeze(-1)``);
    else None."""
    mode, eps, high, d = 1, 0.0, 0.0, den
    if is_call(d, (operator.add, torch.add), ("add",)) and len(d.args) == 2 and not d.kwargs:
        a, b = d.args
        a, b = (a, b) if isinstance(a, fx.Node) else (b, a)
        if not is_scalar(b):
            return None
        eps, d = float(b), a
    elif is_call(d, (torch.clamp, torch.clamp_min), ("clamp", "clamp_min")):
        b = bind(d, ["input", "min", "max"], {"min": None, "max": None})
        if not is_scalar(b["min"]) or not (b["max"] is None or is_scalar(b["max"]) and b["max"] > 0):
            return None
        mode, eps, high, d = 2, float(b["min"]), float(b["max"] or 0.0), b["input"]
    unsqueezed = False
    if isinstance(d, fx.Node) and is_call(d, (torch.unsqueeze,), ("unsqueeze",)) and d.args[1:2] == (-1,):
        d, unsqueezed = d.args[0], True
    x = _row_sum(d, keepdim=not unsqueezed)
    if x is None:
        return None
    reader = d
    if isinstance(x, fx.Node) and is_call(x, (torch.abs,), ("abs",)):  # rowsum(|weights|), as a constant
        inner = x.args[0]
        if mode != 2 or not (isinstance(inner, fx.Node) and is_call(inner, (torch.Tensor.detach,), ("detach",))):
            return None
        mode, reader, x = 3, inner, inner.args[0]
    elif high:
        return None
    return (mode, eps, high, reader) if x is weights else None


def _row_sum(n, keepdim: bool = True) -> fx.Node | None:
    """``x`` if ``n`` is ``x.sum(-1, keepdim=keepdim)``, else None."""
    if not isinstance(n, fx.Node) or not is_call(n, (torch.sum,), ("sum",)):
        return None
    b = bind(n, ["input", "dim", "keepdim"], {"dim": None, "keepdim": False})
    x = b["input"]
    dim = b["dim"][0] if isinstance(b["dim"], (tuple, list)) and len(b["dim"]) == 1 else b["dim"]
    xv = value(x)
    if not isinstance(xv, torch.Tensor) or dim not in (-1, xv.dim() - 1) or bool(b["keepdim"]) != keepdim:
        return None
    return x


def _step(ctx: PassContext, cur: fx.Node, factors: list, masks: list):
    """The node before ``cur`` on the chain (with a scale or ``"tril"`` as ``(node, what)``),
    recording a factor or mask; None if ``cur`` is no step of this chain."""
    if is_call(cur, _MUL, ("mul",)):
        a, b = cur.args[:2]
        for x, other in ((a, b), (b, a)):
            if is_scalar(x) and isinstance(other, fx.Node):
                return other, float(x)
        if all(isinstance(x, fx.Node) for x in (a, b)):
            chain = [x for x in (a, b) if reads_tokens(ctx, x)]
            # The factor broadcasts into the scores, never the scores into a larger shape.
            if len(chain) == 1 and tuple(value(cur).shape) == tuple(value(chain[0]).shape):
                factors.append(b if chain[0] is a else a)
                return chain[0]
        return None
    if is_call(cur, _DIV, ("div",)):
        a, b = cur.args[:2]
        if is_scalar(b) and b != 0 and len(cur.args) == 2 and not cur.kwargs:
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
    learned = any(depends_on_inputs(ctx, f) for f in factors)
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
        if rows == example and learned:
            try:  # zero above the diagonal whatever the parameters (not a learned value that is 0 now)
                with moved_parameters(ctx):
                    moved = _product(ctx, factors, masks, tril, rows)
            except Exception as e:
                return f"not evaluable alone ({type(e).__name__})"
            if torch.count_nonzero(moved.reshape(-1, rows, rows).triu(1)):
                return "not causal for other values of its parameters (a key after its query gets a learned factor)"
        i, j = torch.tril_indices(rows, rows)
        col = full[:, :, 0]
        tol = 1e-9 if full.dtype == torch.float64 else 1e-5
        if not torch.allclose(full[:, i, j], col[:, i - j], rtol=tol, atol=tol):
            scaled = _row_scaled(ctx, factors, masks, tril)
            if scaled is None:
                return "not a function of the distance between query and key"
            fulls = {r: _product(ctx, factors, masks, tril, r).reshape(-1, r, r)
                     for r in (example, max(2, example // 2))}
            if any(torch.count_nonzero(f.triu(1)) for f in fulls.values()):
                return "not causal (a key after its query gets a nonzero factor)"
            return None, scaled, fulls
        tables.append(col)
        if rows == example:
            long_full = full
    long, short = tables
    if not torch.allclose(long[:, : short.shape[1]], short, rtol=1e-9, atol=1e-9):
        return "one that changes with the sequence length (per path the length is the path's)"
    columns = {rows: col for rows, col in zip((example, max(2, example // 2)), tables)}
    if torch.all(long == long[:, :1]) and not learned:
        return long[:, :1].tolist(), None, columns  # constants (a learned factor is not baked: it moves)
    varying = [f for f in factors if _varies(ctx, f, example)]
    if len(varying) != 1 or any(f is not varying[0] for f in factors):
        return "built from several tensors (one factor varying with the distance, and causal masks, are read)"
    alone = _product(ctx, varying, [], False, example)
    i, j = torch.tril_indices(example, example)
    if not torch.equal(alone.reshape(-1, example, example)[:, i, j], long_full[:, i, j]):
        return "a factor varying with the distance beside masks that drop pairs below the diagonal"
    return None, varying[0], columns


def _row_scaled(ctx: PassContext, factors: list, masks: list, tril: bool):
    """``(x, sum, y, op)`` if the one factor is ``x / y`` (or ``x * y``) with ``y`` computed from
    ``x.sum(-1, keepdim=True)`` alone, element by element (RetNet's ``mask / mask.sum(-1,
    keepdim=True).sqrt()``): a relative ``x`` scaled per query by a function of its row sum,
    which on a causal ``x`` is the running sum of its table up to the query's position."""
    if len(factors) != 1 or masks:
        return None
    f = factors[0]
    if not (is_call(f, _DIV, ("div",)) or is_call(f, _MUL, ("mul",))) or len(f.args) != 2 or f.kwargs:
        return None
    x, y = f.args
    if not all(isinstance(n, fx.Node) for n in (x, y)):
        return None
    cur = y
    while True:
        if is_call(cur, (torch.sum,), ("sum",)):
            return (x, cur, y, "div" if is_call(f, _DIV, ("div",)) else "mul") if _row_sum(cur) is x else None
        ins = cur.all_input_nodes
        if cur.op not in ("call_function", "call_method") or len(ins) != 1:
            return None
        cur = ins[0]


def _row_scale_table(gm: fx.GraphModule, ctx: PassContext, table: fx.Node, scaled, at: fx.Node) -> fx.Node:
    """The query table ``qtable[l, p]``: the factor's row scale at query position ``p``, built from the
    running sum of the distance table (the row sum of a causal relative ``x`` at row ``p``) through
    the model's own ops from its row sum to the scale."""
    x, total, y, op = scaled
    g = gm.graph
    lead = tuple(value(total).shape[:-2])
    env: dict[fx.Node, fx.Node] = {}
    with g.inserting_before(at):
        running = ctx.mark(g.call_method("cumsum", (table, -1)), like=at)
        env[total] = ctx.mark(g.call_method("reshape", (running, (*lead, -1, 1))), like=at)
        cur, chain = y, []
        while cur is not total:
            chain.append(cur)
            cur = cur.all_input_nodes[0]
        for n in reversed(chain):
            env[n] = ctx.mark(g.node_copy(n, lambda a: env.get(a, a)), like=at)
        scale = env[y]
        if op == "div":
            scale = ctx.mark(g.call_function(torch.reciprocal, (scale,)), like=at)
        lead_n = int(torch.Size(lead).numel()) if lead else 1
        return ctx.mark(g.call_method("reshape", (scale, lead_n, -1)), like=at)


def _check_scaled(ctx: PassContext, table: fx.Node, qtable: fx.Node, fulls: dict) -> str | None:
    """Why ``table[l, i - j] * qtable[l, i]`` is not the factor at each judged length, or why the
    tables change with the length; None if neither."""
    built = []
    for rows, full in fulls.items():
        try:
            t = evaluate(ctx, table, rows=rows).to(torch.float64)
            qt = evaluate(ctx, qtable, rows=rows).to(torch.float64)
        except Exception as e:
            return f"not evaluable from its distances alone ({type(e).__name__})"
        i, j = torch.tril_indices(rows, rows)
        got = t[:, i - j] * qt[:, i]
        if got.shape[-1] != i.numel() or not torch.allclose(got, full[:, i, j], rtol=1e-9, atol=1e-12):
            return "not a function of the distance scaled per query by its row sum"
        built.append((t, qt))
    (t_long, q_long), (t_short, q_short) = built
    n = t_short.shape[-1]
    if not (torch.allclose(t_long[:, :n], t_short, rtol=1e-9, atol=1e-12)
            and torch.allclose(q_long[:, :n], q_short, rtol=1e-9, atol=1e-12)):
        return "one that changes with the sequence length (per path the length is the path's)"
    return None


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
