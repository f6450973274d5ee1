"""Counters a model keeps, weighted by the paths through each row.

A counter is ``buffer.add_(inc)`` with the increment computed from the batch and nothing else
reading the buffer (`treecompile.passes.state` leaves the increment in the main graph as an
extra result and adds it to the buffer after the call). Per-path training adds every path's
increment: a sum over the paths' tokens, where each token of the tree counts once per path
through it (``path_count``). The one increment treecompile weights is a histogram of group keys,
torchtitan's ``tokens_per_expert.add_(histc(topk_indices.view(-1), bins=E, min=0, max=E))``: the
row rules (`treecompile.passes.rows.grouped`) have proven it counts the whole flattened top-k
indices of the rows, one bin per group; weighted, it is ``zeros(E).index_add(0, keys,
path_count.repeat_interleave(k))``. Any other counter is refused naming the tensor.
"""

from __future__ import annotations

import torch
from torch import fx

from treecompile.core.errors import UnsupportedModelError
from treecompile.passes._graph import PassContext, _add_upstream, describe, location_of, source_of, value
from treecompile.passes.rows import Rows, RowEnv
from treecompile.passes.rows.domain import expr, same_expr
from treecompile.passes.rows.grouped import COUNTS, histogram_behind

__all__ = ["weight_counters", "counter_refusal"]


def weight_counters(gm: fx.GraphModule, ctx: PassContext, env: RowEnv) -> None:
    """Replaces each counter's increment (the main graph's last results) by the sum of the
    per-path increments, or raises naming the counter.

    Counters (``ctx.counters["verify_graph_pass"]``): ``counters_weighted``.
    """
    state = ctx.state
    if state is None or not state.counters:
        return
    out = gm.graph.output_node()
    results = list(out.args[0])
    n = len(state.counters)
    for k, name in enumerate(state.counter_names):
        at = len(results) - n + k
        with gm.graph.inserting_before(out):
            results[at] = _weighted(gm, ctx, env, results[at], name)
        ctx.count("counters_weighted")
    out.args = (tuple(results),)


def counter_refusal(gm: fx.GraphModule, ctx: PassContext, node: fx.Node, why: str) -> UnsupportedModelError | None:
    """The refusal naming a counter, where ``node`` (an op the checks refused) computes only that
    counter's increment (nothing the call returns reads it); else None."""
    state = ctx.state
    if state is None or not state.counters:
        return None
    results = list(gm.graph.output_node().args[0])
    n = len(state.counters)
    others = _add_upstream([r for r in results[:-n] if isinstance(r, fx.Node)], set())
    if node in others:
        return None
    for inc, name in zip(results[-n:], state.counter_names):
        if isinstance(inc, fx.Node) and node in _add_upstream([inc], set()):
            return _refusal(name, node, f"its increment {why}")
    return None


def _weighted(gm: fx.GraphModule, ctx: PassContext, env: RowEnv, inc: fx.Node, name: str) -> fx.Node:
    h = histogram_behind(inc)
    st = env.states.get(h) if h is not None else None
    flat = h.args[0] if h is not None and h.args else None
    rf = env.rows(flat) if isinstance(flat, fx.Node) else None
    shape = value(flat).shape if isinstance(flat, fx.Node) and isinstance(value(flat), torch.Tensor) else None
    counted = (isinstance(st, Rows) and isinstance(st.key, tuple) and st.key[0] == COUNTS and rf is not None
               and rf.dim == 0 and rf.key is None and rf.ids is None and not rf.uniform and shape is not None
               and len(shape) == 1 and rf.count is not None and same_expr(rf.count, expr(ctx.seq_len))
               and same_expr(expr(shape[0]), rf.count * rf.inner) and rf.inner.is_Integer)
    where = inc if isinstance(inc, fx.Node) else None
    if not counted:
        raise _refusal(name, where, "its increment is not a count of the groups of top-k indices over the rows "
                                    "(treecompile weights only such a histogram by the paths through each row)")
    if ctx.path_count is None:  # every call's marker carries them (passes/markers.py)
        raise _refusal(name, where, "this call has no path counts")
    g = gm.graph
    k, groups = int(rf.inner), int(st.count)
    weights = ctx.path_count if k == 1 else ctx.mark(g.call_function(torch.repeat_interleave, (ctx.path_count, k)),
                                                     like=where)
    weights = ctx.mark(g.call_method("to", (weights, torch.float64)), like=where)
    keys = ctx.mark(g.call_method("long", (flat,)), like=where)
    zeros = ctx.mark(g.call_method("new_zeros", (weights, (groups,))), like=where)
    total = ctx.mark(g.call_method("index_add", (zeros, 0, keys, weights)), like=where)
    return ctx.mark(g.call_method("to", (total, value(inc).dtype)), like=where)


def _refusal(name: str, node: fx.Node | None, why: str) -> UnsupportedModelError:
    at = f" ({describe(node)} at {location_of(node)})" if node is not None else ""
    src = f"\n  at {source_of(node)}" if node is not None else ""
    return UnsupportedModelError(
        f"treecompile cannot make this model exact on a tree: the model adds to {name} in every call{at}, and "
        f"{why}: per-path training adds each path's count, which the packed tree does not hold.{src}\n"
        "Keep such statistics out of the forward in training, or count the paths' tokens from the batch outside it.")
