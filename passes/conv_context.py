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

A plain depthwise ``conv1d`` written as a causal conv is recognised too, in the two usual
spellings: ``conv1d(x, w, b, padding=K - 1, groups=C)[..., :S]`` (``nn.Conv1d`` with
``padding=K - 1``, as Mamba's and many short-conv layers are written) and
``conv1d(pad(x, (K - 1, 0)), w, b, groups=C)``; each becomes ``treecompile::causal_conv1d``
first (stride and dilation 1, weight ``[C, 1, K]``, input ``[B, C, S]``). Any other
convolution over the sequence is left alone, and the verify pass refuses it.

The ancestor table is built in the graph from ``pred_index`` with ``K - 2`` gathers, once
per kernel size.

Counters (``ctx.counters["rewrite_conv_context_pass"]``): ``causal_conv1d`` (rewritten conv
calls), of which ``depthwise_conv1d`` were plain convs.
"""

from __future__ import annotations

import operator

import torch
import torch.nn.functional as F
from torch import fx

from treecompile.core.errors import UnsupportedModelError
from treecompile.kernels import conv as _conv  # noqa: F401  (registers the treecompile:: conv ops)
from treecompile.passes._graph import PADS, PassContext, bind, describe, is_call, is_op, same_size, source_of, value

__all__ = ["rewrite_conv_context_pass"]


def rewrite_conv_context_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Replaces each ``treecompile::causal_conv1d`` with its tree form.

    Counters (``ctx.counters["rewrite_conv_context_pass"]``): ``causal_conv1d``.
    """
    _canonical_convs(gm, ctx)
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
        ctx.count("causal_conv1d")
    return gm


_CONV1D = (torch.conv1d, F.conv1d)
_CONV1D_ARGS = ["input", "weight", "bias", "stride", "padding", "dilation", "groups"]
_CONV1D_DEFAULTS = {"bias": None, "stride": 1, "padding": 0, "dilation": 1, "groups": 1}


def _canonical_convs(gm: fx.GraphModule, ctx: PassContext) -> None:
    """Replaces each plain depthwise causal ``conv1d`` over the sequence with ``treecompile::causal_conv1d``."""
    for node in list(gm.graph.nodes):
        if not is_call(node, _CONV1D):
            continue
        a = bind(node, _CONV1D_ARGS, _CONV1D_DEFAULTS)
        x, weight = a["input"], a["weight"]
        wv = value(weight)
        if not (isinstance(wv, torch.Tensor) and wv.dim() == 3 and wv.shape[1] == 1):
            continue
        kk = int(wv.shape[2])
        if not (_ints(a["stride"]) == [1] and _ints(a["dilation"]) == [1] and a["groups"] == wv.shape[0]):
            continue
        padding, padded = _ints(a["padding"]), None
        if padding == [kk - 1]:
            # conv1d(x, padding=K - 1)[..., :S] (or [..., :-(K - 1)]): the output's one user keeps
            # the first S rows.
            users = list(node.users)
            if len(users) != 1 or not _keeps_first(users[0], ctx.seq_len, kk):
                continue
            replaced = users[0]
        elif padding == [0] and _left_padded(x, kk):
            replaced, padded, x = node, x, x.args[0]
        else:
            continue
        xv = value(x)
        if not (isinstance(xv, torch.Tensor) and xv.dim() == 3 and xv.shape[1] == wv.shape[0]
                and same_size(xv.shape[2], ctx.seq_len)):
            continue
        with gm.graph.inserting_before(replaced):
            w2 = ctx.mark(gm.graph.call_method("squeeze", (weight, 1)), like=node)
            w2.meta["example_value"] = wv.squeeze(1)
            new = gm.graph.call_function(torch.ops.treecompile.causal_conv1d.default, (x, w2, a["bias"]))
        new.meta["example_value"] = value(replaced)
        ctx.mark(new, like=node)
        replaced.replace_all_uses_with(new)
        gm.graph.erase_node(replaced)
        for dead in (node, padded):
            if dead is not None and dead is not replaced and not dead.users:
                gm.graph.erase_node(dead)
        ctx.count("depthwise_conv1d")


def _ints(v) -> list | None:
    if isinstance(v, int):
        return [v]
    if isinstance(v, (tuple, list)) and all(isinstance(i, int) for i in v):
        return list(v)
    return None


def _keeps_first(node: fx.Node, seq_len, kk: int) -> bool:
    """``y[..., :S]``, ``y[:, :, :S]`` or ``y[..., :-(K - 1)]`` on a ``[B, C, S + K - 1]`` conv output."""
    if not (node.op == "call_function" and node.target is operator.getitem):
        return False
    index = node.args[1]
    if not isinstance(index, tuple):
        return False
    if index and index[0] is Ellipsis:
        index = (slice(None), slice(None)) + index[1:]
    if len(index) != 3 or any(i != slice(None) for i in index[:2]):
        return False
    last = index[2]
    return (isinstance(last, slice) and last.start in (None, 0) and last.step in (None, 1)
            and (same_size(last.stop, seq_len) or last.stop == 1 - kk))


def _left_padded(x, kk: int) -> bool:
    """``pad(x, (K - 1, 0))`` with zeros."""
    if not (isinstance(x, fx.Node) and is_call(x, PADS)):
        return False
    pad = x.args[1] if len(x.args) > 1 else x.kwargs.get("pad")
    mode = x.args[2] if len(x.args) > 2 else x.kwargs.get("mode", "constant")
    fill = x.args[3] if len(x.args) > 3 else x.kwargs.get("value", None)
    return _ints(pad) == [kk - 1, 0] and mode == "constant" and fill in (None, 0, 0.0)


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
