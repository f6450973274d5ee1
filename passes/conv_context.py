"""rewrite_conv_context_pass: each causal conv window reads its own path, never a sibling.

A causal depthwise conv with kernel ``K`` mixes row ``s`` with the ``K - 1`` tokens before it.
Per path those are the path's previous tokens; in the packed row, the rows just before a
node's first token belong to its preceding sibling's subtree (DFS order). The wrapper swaps
Hugging Face's ``causal_conv1d_fn`` for ``treecompile::causal_conv1d`` (see
:mod:`treecompile.kernels.conv`); this pass replaces each such node with
``treecompile::tree_causal_conv1d(x, weight, bias, ancestors)``, where ``ancestors[s, d - 1]``
is ``pred_index`` followed ``d`` times from row ``s`` (-1, a zero input, past the root).

Why exact: ``pred_index[s]`` is the row holding the token before ``s`` on every path
through ``s`` (the previous row inside a node, the parent's last row at a node start), so
following it ``d`` times gives the token ``d`` steps back on the path, however short the
nodes in between; -1 exactly where the path has fewer than ``d`` earlier tokens, where the
per-path conv reads its zero padding. The rows fed to the conv equal the per-path rows (by
induction over layers), so each output row does too.

The ancestor table is built in the graph from ``pred_index`` with ``K - 2`` gathers, once
per kernel size.

Counters (``ctx.counters["conv_context"]``): ``causal_conv1d`` (rewritten conv calls).
"""

from __future__ import annotations

import torch
from torch import fx

from treecompile.errors import UnsupportedModelError
from treecompile.kernels import conv as _conv  # noqa: F401  (registers the treecompile:: conv ops)
from treecompile.passes._graph import PassContext, describe, is_op, same_size, source_of, value

__all__ = ["rewrite_conv_context_pass"]

NAME = "conv_context"


def rewrite_conv_context_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Replaces each ``treecompile::causal_conv1d`` with its tree form.

    Counters (``ctx.counters["conv_context"]``): ``causal_conv1d``.
    """
    convs = [n for n in gm.graph.nodes if is_op(n, torch.ops.treecompile.causal_conv1d)]
    if not convs:
        return gm
    if ctx.pred_index is None:
        raise RuntimeError("treecompile: a causal conv op is in the graph but the wrapper passed no pred_index")
    tables: dict[int, fx.Node] = {}
    for node in convs:
        x, weight, bias = node.args
        xv, wv = value(x), value(weight)
        if not (isinstance(xv, torch.Tensor) and xv.dim() == 3 and same_size(xv.shape[2], ctx.seq_len)):
            raise UnsupportedModelError(
                f"treecompile: {describe(node)} is a causal conv whose input is not [B, C, S] over the packed "
                f"sequence.\n  at {source_of(node)}"
            )
        kk = int(wv.shape[1])
        if kk not in tables:
            with gm.graph.inserting_before(convs[0]):
                tables[kk] = _ancestor_table(gm, ctx, kk)
        with gm.graph.inserting_before(node):
            new = gm.graph.call_function(torch.ops.treecompile.tree_causal_conv1d.default, (x, weight, bias, tables[kk]))
        new.meta["example_value"] = value(node)
        ctx.mark(new, like=node)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        ctx.count(NAME, "causal_conv1d")
    return gm


def _ancestor_table(gm: fx.GraphModule, ctx: PassContext, kk: int) -> fx.Node:
    """``[S, K - 1]`` int64: column ``d - 1`` is ``pred_index`` followed ``d`` times (-1 past the root)."""
    graph = gm.graph
    prev = ctx.pred_index
    cols = [prev]
    for _ in range(kk - 2):
        last = cols[-1]
        # pred_index[max(last, 0)] where last >= 0, else -1 (stays -1 past the root).
        safe = ctx.mark(graph.call_method("clamp", (last,), {"min": 0}))
        hop = ctx.mark(graph.call_function(torch.index_select, (prev, 0, safe)))
        cols.append(ctx.mark(graph.call_method("masked_fill", (hop, ctx.mark(graph.call_method("lt", (last, 0))), -1))))
    table = ctx.mark(graph.call_function(torch.stack, (cols,), {"dim": 1}))
    if kk == 1:
        table = ctx.mark(graph.call_function(torch.narrow, (table, 1, 0, 0)))
    return table
