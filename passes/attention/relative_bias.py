"""A learned bias over (query, key) pairs that is a function of their distance, as a score_mod.

T5's relative position buckets (``bidirectional=False``), a hand-written learned ALiBi, any
``[.., S, S]`` bias ``g(h, i - j)`` computed from the two sequence indices and parameters
and added to the scores: per path ``i`` and ``j`` are the tokens' offsets on the path, so
on the tree the bias is ``g(h, positions[q] - positions[kv])``. The attention pass hands the
tree kernel a table ``T[h, d] = g(h, d)`` for ``d`` in ``[0, S)`` (the distances a causal
query sees) and a score_mod adding ``T[h, positions[q] - positions[kv]]``
(`treecompile.kernels.attention.flex_mods`): O(S) memory, the table computed in the graph from the
model's own parameters, so a learned table gets its gradient.

The table is the model's own subgraph with the key index replaced by 0 (``g(h, i - 0)``): the
two index grids must meet in one subtraction (and may be compared, ``i >= j``, a function of the
difference too), nothing else of the bias may read an index,
and the bias evaluated at the example length must equal the table at every distance;
otherwise the bias is refused.

A pair tensor built by moving the entries of a vector that reads no token (MEGA's and RWKV's
Toeplitz trick: a learned vector padded, tiled and cut into ``[T, T]``) has no index difference
to find. Its table is the key column of the model's own construction, copied (the pass's nodes,
so that no row rule judges its moves): ``[S, S]`` on the packed row, as the model builds it per
path, said in a warning. It is taken only where the pair, evaluated at the example length and at
half of it (and with its parameters moved, so that a learned table of zeros is not taken for
one), is below the diagonal the column at the distance, and the column does not change with
the length.
"""

from __future__ import annotations

import contextlib
import operator
import warnings

import torch
from torch import fx

from treecompile.core.advice import TreeWarning
from treecompile.kernels.attention.flex_mods import register_mods
from treecompile.passes._graph import (ARANGE, PassContext, ancestors, describe, is_call, location_of,
                                      mutated_args, same_size, value)
from treecompile.passes._mask_eval import (copy_node, copy_values, depends_on_inputs, evaluate, moved_parameters,
                                          reads_tokens, two_lengths, value_ancestors)
from treecompile.passes.rows.random import draws

__all__ = ["relative_bias_mods", "relative_table"]

_SUBTRACTIONS = (operator.sub, torch.sub, torch.subtract)
_COMPARISONS = (operator.ge, operator.gt, operator.le, operator.lt, torch.ge, torch.gt, torch.le, torch.lt)
_COMPARISON_METHODS = ("ge", "gt", "le", "lt")


def relative_bias_mods(gm: fx.GraphModule, ctx: PassContext, bias: fx.Node, at: fx.Node, scale: float,
                       heads: int | None) -> tuple[str, fx.Node] | str:
    """``(mods key, table node)`` for ``bias``, the table built in the graph before ``at`` and
    multiplied by ``scale`` (the factor on the scores after the bias is added); or why not."""
    found = relative_table(gm, ctx, bias, at)
    if isinstance(found, str):
        return found
    table, lead = found
    if scale != 1.0:
        with gm.graph.inserting_before(at):
            table = ctx.mark(gm.graph.call_function(operator.mul, (table, scale)), like=bias, rows=False)
    if heads is not None and lead not in (1, heads):
        return f"a bias over (query, key) pairs with {lead} leading entries for {heads} heads"
    why = _check(ctx, bias, table, scale) or _same_table_shorter(ctx, table)
    if why is not None:
        return why
    per_head = lead > 1

    def relative_bias(score, b, h, q_idx, kv_idx, tab):
        d = (q_idx - kv_idx).clamp(min=0)
        return score + tab[h if per_head else 0, d].to(score.dtype)

    return register_mods(relative_bias, None, 1, 0), table


def relative_table(gm: fx.GraphModule, ctx: PassContext, pair: fx.Node, at: fx.Node) -> tuple[fx.Node, int] | str:
    """``(table, lead)``: ``table[l, d] = pair[l, d, 0]``, the pair tensor's key column 0 (a
    ``[lead, S]`` node built before ``at`` from the model's own subgraph with the key index
    replaced by 0), for a ``pair`` over (query, key) computed from the two sequence indices
    through their difference; or why it is not one. Whether ``pair`` is that column at every
    distance is the caller's check (at the example length)."""
    bias = pair
    anc = value_ancestors(bias) | {bias}
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    aranges = [n for n in anc if is_call(n, ARANGE)]
    if not aranges:
        return _own_column(gm, ctx, pair, at, "a bias over (query, key) pairs that is not built from the sequence "
                                              "index (a learned [S, S] table)")
    meet = next((n for n in sorted(anc, key=order.get) if _meets(n, ctx) and is_call(n, _SUBTRACTIONS, ("sub",))),
                None)
    if meet is None:
        return _own_column(gm, ctx, pair, at, "a bias over (query, key) pairs whose indices do not meet in one "
                                              "difference (i - j)")
    key_side = next(a for a in meet.args[:2] if _is_key_grid(a, ctx))
    # The same two grids compared (a causal ``(i >= j)``) is a function of their difference too.
    compared = [n for n in anc if n is not meet and is_call(n, _COMPARISONS, _COMPARISON_METHODS)
                and set(n.args[:2]) == set(meet.args[:2])]
    allowed = ancestors(meet) | {meet} | (_downstream(meet) & anc)
    for c in compared:
        allowed |= {c} | (_downstream(c) & anc)
    indexed = _downstream_of(aranges) & anc
    if not indexed <= allowed:
        return "a bias over (query, key) pairs that reads a sequence index other than through their difference"
    if any(m not in indexed for n in indexed for m in mutated_args(n)):  # its copy would write that again
        return "a bias over (query, key) pairs built by writing in place into a tensor it does not create"
    g = gm.graph
    env: dict[fx.Node, fx.Node] = {}
    kv = value(key_side)
    with g.inserting_before(at):
        zero = ctx.mark(g.call_function(torch.zeros, (tuple([1] * kv.dim()),), {"dtype": kv.dtype,
                                                                                  "device": kv.device}), like=bias,
                        rows=False)
        zero.meta["example_value"] = torch.zeros([1] * kv.dim(), dtype=kv.dtype, device=kv.device)
        # A pair tensor the bias reads that is not built from the indices (a causal mask from
        # ones(T, T), a buffer sliced [:T, :T]) is built at key 0 too: its creation with one key.
        pairs = {n for n in anc - indexed if _is_pair(n, ctx)}
        for n in sorted(indexed | pairs, key=order.get):
            if n is key_side:
                env[n] = zero
                continue
            if n in pairs:
                env[n] = _key_column(g, ctx, n, env, pairs)
                ctx.mark(env[n], like=bias, rows=False)
                continue
            env[n] = ctx.mark(copy_node(g, n, env), like=bias, rows=False)
            env[n].meta = dict(n.meta)
            env[n].meta.pop("example_value", None)
        column = env[bias]
        lead = int(torch.Size(value(bias).shape[:-2]).numel()) if value(bias).dim() > 2 else 1
        picked = ctx.mark(g.call_method("select", (column, -1, 0)), like=bias, rows=False)
        table = ctx.mark(g.call_method("reshape", (picked, lead, -1)), like=bias, rows=False)
    return table, lead


def _own_column(gm: fx.GraphModule, ctx: PassContext, pair: fx.Node, at: fx.Node,
                why: str) -> tuple[fx.Node, int] | str:
    """``(table, lead)``: the key column of a copy of ``pair``'s construction (module docstring),
    or ``why`` where the pair reads a token, is built by writing in place or drawing at random,
    or is not, at both judged lengths, a function of the distance that does not change with the
    length."""
    sub = value_ancestors(pair) | {pair}
    if reads_tokens(ctx, pair) or any(mutated_args(n) or draws(n) for n in sub):
        return why
    lengths = two_lengths(ctx)
    if lengths is None:
        return why
    columns = []
    # A learned table that is a function of the distance only for its present values (zeros at
    # the start) is judged again with its parameters moved.
    judged = [(r, False) for r in lengths] + ([(lengths[0], True)] if depends_on_inputs(ctx, pair) else [])
    for rows, moved in judged:
        try:
            with moved_parameters(ctx) if moved else contextlib.nullcontext():
                full = evaluate(ctx, pair, rows=rows).to(torch.float64)
        except Exception:  # not evaluable alone or at another length
            return why
        if full.dim() < 2 or full.shape[-1] != rows or full.shape[-2] != rows:
            return why
        full = full.reshape(-1, rows, rows)
        i, j = torch.tril_indices(rows, rows)
        tol = 1e-9 if value(pair).dtype == torch.float64 else 1e-5
        if not torch.allclose(full[:, i, j], full[:, i - j, 0], rtol=tol, atol=tol, equal_nan=True):
            return why
        if not moved:
            columns.append(full[:, :, 0])
    long, short = columns
    if not torch.allclose(long[:, : short.shape[1]], short, rtol=1e-9, atol=1e-9, equal_nan=True):
        return why
    g = gm.graph
    with g.inserting_before(at):
        copy = copy_values(ctx, g, pair)
        lead = int(torch.Size(value(pair).shape[:-2]).numel()) if value(pair).dim() > 2 else 1
        picked = ctx.mark(g.call_method("select", (copy, -1, 0)), like=pair, rows=False)
        table = ctx.mark(g.call_method("reshape", (picked, lead, -1)), like=pair, rows=False)
    warnings.warn(f"treecompile: the relative table of {describe(pair)} at {location_of(pair)} is the key column of "
                  "the model's own construction of that [S, S] tensor, built for the whole packed row: S^2 memory",
                  TreeWarning, stacklevel=2)
    return table, lead


def _meets(n: fx.Node, ctx: PassContext) -> bool:
    """A node combining a query-index grid ``[.., S, 1]`` with a key-index grid ``[.., 1, S]``."""
    ins = [a for a in n.args[:2] if isinstance(a, fx.Node)]
    return len(ins) == 2 and any(_is_key_grid(a, ctx) for a in ins) and any(_is_query_grid(a, ctx) for a in ins)


_CREATIONS = (torch.ones, torch.zeros, torch.full, torch.empty)


def _key_column(g: fx.Graph, ctx: PassContext, n: fx.Node, env: dict, pairs: set) -> fx.Node:
    """A copy of pair tensor ``n`` with one key (``[.., S, 1]``): its creation with the last size
    1, its ``[:T, :T]`` slice as ``[:T, :1]``, an op on such copies copied; otherwise the key
    column of ``n`` itself."""
    s = ctx.seq_len
    if is_call(n, _CREATIONS) and n.args and isinstance(n.args[0], (tuple, list)) and same_size(n.args[0][-1], s):
        return g.call_function(n.target, (tuple(n.args[0][:-1]) + (1,), *n.args[1:]), dict(n.kwargs))
    if is_call(n, _CREATIONS) and len(n.args) >= 2 and all(not isinstance(a, (tuple, list)) for a in n.args[:2]) \
            and n.target is not torch.full and same_size(n.args[-1], s):
        return g.call_function(n.target, (*n.args[:-1], 1), dict(n.kwargs))
    if n.op == "call_function" and n.target is operator.getitem and isinstance(n.args[1], tuple) and n.args[1] \
            and isinstance(n.args[1][-1], slice) and n.args[1][-1].start in (None, 0) and n.args[1][-1].step is None \
            and same_size(n.args[1][-1].stop, s) and n.args[0] not in pairs:
        return g.call_function(operator.getitem, (n.args[0], (*n.args[1][:-1], slice(0, 1))))
    ins = [x for x in n.all_input_nodes if x in pairs]
    if ins and all(x in env for x in ins):
        return g.node_copy(n, lambda x: env.get(x, x))
    return g.call_function(operator.getitem, (n, (Ellipsis, slice(0, 1))))


def _is_pair(x, ctx: PassContext) -> bool:
    s = _grid(x, ctx)
    return s is not None and all(same_size(d, ctx.seq_len) for d in s)


def _grid(x, ctx: PassContext) -> tuple | None:
    v = value(x) if isinstance(x, fx.Node) else None
    return tuple(v.shape[-2:]) if isinstance(v, torch.Tensor) and v.dim() >= 2 else None


def _is_key_grid(x, ctx: PassContext) -> bool:
    s = _grid(x, ctx)
    return s is not None and s[0] == 1 and same_size(s[1], ctx.seq_len)


def _is_query_grid(x, ctx: PassContext) -> bool:
    s = _grid(x, ctx)
    return s is not None and s[1] == 1 and same_size(s[0], ctx.seq_len)


def _downstream(node: fx.Node) -> set[fx.Node]:
    return _downstream_of([node]) - {node}


def _downstream_of(nodes) -> set[fx.Node]:
    seen, stack = set(), list(nodes)
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(n.users)
    return seen


def _same_table_shorter(ctx: PassContext, table: fx.Node) -> str | None:
    """Why the table built at half the example length is not the first entries of the example's
    (a bias scaled by ``1 / T``: per path it is the path's length), or None (also for a table
    that cannot be built at another length, judged as it was)."""
    lengths = two_lengths(ctx)
    if lengths is None:
        return None
    try:
        long, short = (evaluate(ctx, table, rows=r).double() for r in lengths)
    except Exception:
        return None
    n = short.shape[-1]
    if long.shape[:-1] != short.shape[:-1] or long.shape[-1] < n or \
            not torch.allclose(long[..., :n], short, rtol=1e-9, atol=1e-12, equal_nan=True):
        return "a bias over (query, key) pairs that changes with the sequence length (per path it is the path's length)"
    return None


def _check(ctx: PassContext, bias: fx.Node, table: fx.Node, scale: float) -> str | None:
    """Why the bias evaluated at the example length is not the table at each distance (on and
    below the diagonal, the pairs a causal query sees), or None."""
    try:
        full, col = evaluate(ctx, bias), evaluate(ctx, table)
    except Exception as e:  # an operand that cannot be evaluated alone
        return f"a bias over (query, key) pairs that cannot be evaluated ({type(e).__name__})"
    tol = 1e-9 if full.dtype == torch.float64 else 1e-5
    full, col = full.double(), col.double() / scale
    s = full.shape[-1]
    full = full.reshape(-1, s, s)
    i, j = torch.tril_indices(s, s)
    want = full[:, i, j]
    got = col[:, i - j].expand_as(want)
    if not torch.allclose(got, want, rtol=tol, atol=tol, equal_nan=True):
        return "a bias over (query, key) pairs that is not a function of their distance"
    return None
