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

Shifts along the sequence by ``k`` (``pad(x, (.., k, -k))`` as RWKV's time shift writes it,
``cat([zeros, x[:, :-k]])``, ``diff(x, prepend=zeros)``, ``roll(x, k)`` with its first ``k`` rows
zeroed, and the other spellings of `treecompile.passes.shifts`) are the same thing with one tap:
each becomes a gather of the row ``k`` steps back on its path (`SHIFT_SPELLINGS`, one entry each).

Windows over the last k rows (a causal pool, an ``unfold`` of the left-padded rows) are the
stack of k such gathers (`WINDOW_SPELLINGS`).

Scans along the sequence (``cumsum``, ``cumprod``, ``logcumsumexp``, ``cummax``, ``cummin``)
become scans along each row's root path (`treecompile.passes.scans`).

Counters (``ctx.counters["rewrite_conv_context_pass"]``): ``causal_conv1d`` (rewritten conv
calls), of which ``depthwise_conv1d`` were plain convs; ``shift``; ``window``; ``offset_window``
(`treecompile.passes.offset_slices`); ``path_jump`` (`treecompile.passes.path_jumps`); ``tap_conv``;
``path_scan``.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx

from treecompile.core.errors import UnsupportedModelError
from treecompile.kernels import conv as _conv  # noqa: F401  (registers the treecompile:: conv ops)
from treecompile.passes._graph import (Emitter, PassContext, bind, describe, emit, is_call, is_op,
                                      same_size, source_of, value)
from treecompile.passes.first_row import rewrite_first_row_kept
from treecompile.passes.offset_slices import rewrite_offset_windows
from treecompile.passes.path_jumps import rewrite_path_jumps
from treecompile.passes.position_gathers import rewrite_position_gathers
from treecompile.passes.rows.domain import op_key
from treecompile.passes.rows.elementwise import POINTWISE
from treecompile.passes.rooted import rewrite_rooted_scans
from treecompile.passes.scans import rewrite_scans
from treecompile.passes.shifts import REPLICATE, SHIFT_SPELLINGS, WINDOW_SPELLINGS, padded_rows, row_ids

__all__ = ["rewrite_conv_context_pass", "NeedsStructure"]


class NeedsStructure(UnsupportedModelError):
    """The graph has a causal conv or a shift along the sequence, and the call passed no path
    structure (``pred_index``): a whole-tree call captures again with it; any other call is
    refused with this message."""


def rewrite_conv_context_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Replaces each ``treecompile::causal_conv1d`` with its tree form.

    Counters (``ctx.counters["rewrite_conv_context_pass"]``): ``causal_conv1d``.
    """
    _cut_at_conv(gm, ctx)
    _canonical_convs(gm, ctx)
    tables: dict[int, fx.Node] = {}
    rewrite_rooted_scans(gm, ctx)
    rewrite_first_row_kept(gm, ctx)
    _rewrite_shifts(gm, ctx, tables)
    _rewrite_windows(gm, ctx, tables)
    rewrite_offset_windows(gm, ctx, lambda kk: _table(gm, ctx, tables, kk),
                           lambda x, dim, k, like: _ancestor_gather(gm, ctx, x, dim, _table(gm, ctx, tables, k + 1), k,
                                                                    like, fill=REPLICATE),
                           lambda node: _no_path_structure(node, "pads a window of earlier rows back to the length"))
    rewrite_path_jumps(gm, ctx, lambda node: _no_path_structure(node, "is a step of an associative scan"))
    _rewrite_tap_convs(gm, ctx, tables)
    rewrite_scans(gm, ctx, _needs_structure)
    rewrite_position_gathers(gm, ctx, lambda node: _no_path_structure(node, "gathers rows at positions"))
    convs = [n for n in gm.graph.nodes if is_op(n, torch.ops.treecompile.causal_conv1d)]
    if not convs:
        return gm
    if ctx.pred_index is None:
        raise NeedsStructure(
            f"treecompile cannot make this model exact on a tree: {describe(convs[0])} is a causal conv, and this "
            f"call has no path structure to run it along (a streamed or context-parallel call of a model without "
            f"conv or recurrent modules).\n  at {source_of(convs[0])}")
    for node in convs:
        x, weight, bias = node.args
        xv, wv = value(x), value(weight)
        if not (isinstance(xv, torch.Tensor) and xv.dim() == 3 and same_size(xv.shape[2], ctx.seq_len)):
            raise UnsupportedModelError(
                f"treecompile: {describe(node)} is a causal conv whose input is not [B, C, S] over the packed "
                f"sequence.\n  at {source_of(node)}"
            )
        table = _table(gm, ctx, tables, int(wv.shape[1]))
        with gm.graph.inserting_before(node):
            new = gm.graph.call_function(torch.ops.treecompile.tree_causal_conv1d.default, (x, weight, bias, table))
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
        elif padding == [0] and _left_pad(x, kk - 1) in (0, 0.0):
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


def _cut_at_conv(gm: fx.GraphModule, ctx: PassContext) -> None:
    """A cut of the rows made after a transpose and element-wise ops on a ``conv1d``'s output
    (``conv1d(..).transpose(1, 2)[:, :S]``, mamba2-minimal's spelling; Mamba-2's
    ``act(conv1d(..).transpose(1, 2))[:, :S]``) is made on the conv's output instead, the ops
    after it: the form the conv rewrites read. Each op of the chain has one user and computes
    each element from that element alone (or swaps the last two dims, once), so the kept rows
    hold the same values whichever comes first."""
    for node in list(gm.graph.nodes):
        if not (node.op == "call_function" and node.target is operator.getitem):
            continue
        chain, swapped, t = [], False, node.args[0]
        while isinstance(t, fx.Node) and not is_call(t, _CONV1D) and len(t.users) == 1:
            if _swaps_last_two(t) and not swapped:
                swapped = True
            elif not (op_key(t) in POINTWISE and [a for a in t.all_input_nodes if isinstance(value(a), torch.Tensor)]
                      == [t.args[0]]):
                break
            chain.append(t)
            t = t.args[0]
        conv, cv = t, value(t)
        if not (chain and isinstance(conv, fx.Node) and is_call(conv, _CONV1D) and len(conv.users) == 1
                and isinstance(cv, torch.Tensor) and cv.dim() == 3):
            continue
        index = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
        index = index + (slice(None),) * (3 - len(index)) if Ellipsis not in index else index
        if Ellipsis in index and len(index) == 2 and index[0] is Ellipsis:
            index = (slice(None), slice(None), index[1])
        rows, other = (index[1], index[2]) if swapped else (index[2], index[1])
        if len(index) != 3 or index[0] != slice(None) or other != slice(None) or not isinstance(rows, slice):
            continue
        # The model's own ops again, unmarked: the row rules judge them as they judged the chain.
        out = emit(gm, ctx, node, "call_function", operator.getitem, (conv, (slice(None), slice(None), rows)),
                   mark=False)
        for op in reversed(chain):
            out = emit(gm, ctx, node, op.op, op.target, (out, *op.args[1:]), dict(op.kwargs), mark=False)
            out.meta.update({k: op.meta[k] for k in ("stack_trace", "nn_module_stack", "source_fn_stack")
                             if k in op.meta})
        node.replace_all_uses_with(out)
        gm.graph.erase_node(node)
        for op in chain:
            gm.graph.erase_node(op)


def _swaps_last_two(node: fx.Node) -> bool:
    """``x.transpose(1, 2)`` (or ``(-1, -2)``, ``permute(0, 2, 1)``) of a 3-dim ``x``."""
    if node.op not in ("call_method", "call_function"):
        return False
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    args = [a % 3 if isinstance(a, int) else a for a in node.args[1:]]
    if name == "transpose":
        return sorted(args) == [1, 2]
    if name == "permute":
        dims = args[0] if len(args) == 1 and isinstance(args[0], (list, tuple)) else args
        return [d % 3 for d in dims] == [0, 2, 1]
    return False


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


def _left_pad(x, reach: int, both: bool = False) -> Any:
    """What ``pad(x, (reach, 0))`` over the last dim writes into the rows it adds (`pad_fill`: a
    number or `REPLICATE`), else None; with ``both`` also ``pad(x, (reach, reach))``, as
    ``nn.Conv1d`` pads for a ``padding_mode`` (the caller checks that the rows after S are cut)."""
    xv = value(x.args[0]) if isinstance(x, fx.Node) and x.args else None
    if not isinstance(xv, torch.Tensor):
        return None
    last = xv.dim() - 1
    found = padded_rows(x, last, reach) or (padded_rows(x, last, reach, reach) if both else None)
    return None if found is None else found[1]


# --------------------------------------------------------------------------- shifts
#
# A shift along the sequence by k (row t reads row t - k, zeros for the first k rows) is a
# causal conv whose kernel picks one tap. Per path, row t reads the token k steps back on its
# path; in the tree that is pred_index followed k times (`_ancestor_table`), zero where the path
# has fewer than k earlier tokens, exactly where the per-path shift reads its zero padding.
# Each spelling below is one entry: ``match(node, ctx) -> (x, dim, k, sign, dead) or None``, where
# the node's value is ``x + sign * shift(x, dim, k)`` (sign 0: the shift alone; -1: ``diff``)
# and ``dead`` are nodes only the match used.


def _needs_structure(node: fx.Node) -> None:
    raise NeedsStructure(
        f"treecompile cannot make this model exact on a tree: {describe(node)} scans the sequence, and this call has "
        f"no path structure to scan it along (a streamed or context-parallel call).\n  at {source_of(node)}")


def _first_node(gm: fx.GraphModule) -> fx.Node:
    """The first node after the placeholders (where per-graph tables are built)."""
    return next(n for n in gm.graph.nodes if n.op != "placeholder")


def _matched(gm: fx.GraphModule, ctx: PassContext, spellings: tuple, does: str):
    """``(node, match)`` for each node of ``gm`` (not one a pass made) that one of ``spellings``
    matches; raises `NeedsStructure`, saying what the node ``does``, when the call has no path
    structure."""
    for node in list(gm.graph.nodes):
        if node.graph is not gm.graph or node in ctx.created:
            continue
        found = next((f for _, match in spellings if (f := match(node, ctx)) is not None), None)
        if found is None:
            continue
        if ctx.pred_index is None:
            _no_path_structure(node, does)
        yield node, found


def _no_path_structure(node: fx.Node, does: str) -> None:
    raise NeedsStructure(
        f"treecompile cannot make this model exact on a tree: {describe(node)} {does}, and this call has no "
        f"path structure to follow (a streamed or context-parallel call).\n  at {source_of(node)}")


def _table(gm: fx.GraphModule, ctx: PassContext, tables: dict[int, fx.Node], kk: int) -> fx.Node:
    """The ancestor table of ``kk - 1`` columns (`_ancestor_table`), built once per graph."""
    if kk not in tables:
        with gm.graph.inserting_before(_first_node(gm)):
            tables[kk] = _ancestor_table(gm, ctx, kk)
    return tables[kk]


def _rewrite_shifts(gm: fx.GraphModule, ctx: PassContext, tables: dict[int, fx.Node]) -> None:
    """Replaces every shift along the sequence (`SHIFT_SPELLINGS`) by a gather of each row's
    k-th ancestor on its path. Counter: ``shift``."""
    for node, found in _matched(gm, ctx, SHIFT_SPELLINGS, "shifts the sequence"):
        # A matcher may name the node whose value is the shift (default: the matched node) and
        # where the gather goes (default: before the matched node; after x in any case).
        x, dim, k, sign, dead = found.x, found.dim, found.k, found.sign, found.dead
        target, at = found.target or node, found.at or node
        table = _table(gm, ctx, tables, k + 1)
        with gm.graph.inserting_before(at):
            new = _ancestor_gather(gm, ctx, x, dim, table, k, like=target, fill=found.fill)
            if sign:
                new = ctx.mark(gm.graph.call_function(operator.sub, (x, new)), like=target)
                new.meta["example_value"] = value(target)
        # A write the shift already does (a roll's wrapped rows zeroed, a buffer's shifted rows)
        # stays on the old node, which nothing reads any more: the mutation-safe dead-code
        # elimination removes both.
        zeroing = {d for d in dead if isinstance(d, fx.Node) and d.target is operator.setitem and d.args[0] is target}
        target.replace_all_uses_with(new, delete_user_cb=lambda user: user not in zeroing)
        if not target.users:
            gm.graph.erase_node(target)
        for d in dead:
            if isinstance(d, fx.Node) and not d.users and d not in zeroing:
                gm.graph.erase_node(d)
        ctx.count("shift")


def _rewrite_windows(gm: fx.GraphModule, ctx: PassContext, tables: dict[int, fx.Node]) -> None:
    """Replaces every window over the last k rows (`WINDOW_SPELLINGS`: a causal pool, an
    ``unfold`` of the left-padded rows) by the stack of its rows' ancestor gathers, reduced as
    the window was. Counter: ``window``."""
    for node, found in _matched(gm, ctx, WINDOW_SPELLINGS, "reads a window of earlier rows"):
        x, dim, k = found.x, found.dim, found.k
        table = _table(gm, ctx, tables, k)
        emit = Emitter(gm, ctx, node)
        with gm.graph.inserting_before(node):
            taps = [_ancestor_gather(gm, ctx, x, dim, table, d, like=node, fill=found.fill) if d else x
                    for d in range(k - 1, -1, -1)]
        new = emit.fn(torch.stack, taps, -1)
        if found.reduce is not None:
            new = emit.method(found.reduce, new, -1)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        for n in found.dead:
            if n.graph is gm.graph and not n.users:
                gm.graph.erase_node(n)
        ctx.count("window")


# --------------------------------------------------------------------------- any causal conv, tap by tap
#
# A causal conv1d that is not depthwise (channels mixed, ``groups`` < C), dilated, or causal
# only through a mask on its weight (MADE / PixelCNN-style: a centred kernel whose taps after
# the centre are zero) reads, for output row t, the inputs d = 0, dil, 2 dil, ... steps back,
# each through one slice of the weight: ``sum_d conv1d(x[t - d], w[..., tap(d)])``. On the tree
# ``x[t - d]`` is the row d steps back on t's path (an ancestor gather, zero above the root),
# and each 1-tap conv mixes channels within a row.


def _conv_taps(node: fx.Node, ctx: PassContext):
    """``(x, w, bias, groups, [(tap, d)], replaced, dead, fill)`` for a causal conv1d over the
    rows (``fill``: what its padding reads, `_left_pad`), or None."""
    if not is_call(node, _CONV1D):
        return None
    a = bind(node, _CONV1D_ARGS, _CONV1D_DEFAULTS)
    x, w = a["input"], a["weight"]
    wv = value(w)
    if not (isinstance(wv, torch.Tensor) and wv.dim() == 3) or _ints(a["stride"]) != [1]:
        return None
    kk, dil = int(wv.shape[2]), (_ints(a["dilation"]) or [None])[0]
    padding = _ints(a["padding"])
    if dil is None or padding is None or len(padding) != 1:
        return None
    reach, fill = (kk - 1) * dil, 0
    users = list(node.users)
    keeps_first = len(users) == 1 and _keeps_first(users[0], ctx.seq_len, reach + 1)
    if padding == [reach] and reach > 0:  # conv1d(x, padding=(K-1) dil)[..., :S]
        if not keeps_first:
            return None
        taps = [(j, reach - j * dil) for j in range(kk)]
        replaced, dead = users[0], (node,)
    elif padding == [0] and reach > 0 and _left_pad(x, reach) is not None:  # conv1d(pad(x, ((K-1) dil, 0)))
        taps, fill = [(j, reach - j * dil) for j in range(kk)], _left_pad(x, reach)
        replaced, dead, x = node, (x,), x.args[0]
    elif padding == [0] and reach > 0 and keeps_first and _left_pad(x, reach, both=True) is not None:
        # nn.Conv1d(padding=(K-1) dil, padding_mode=..)(x)[..., :S]: padded on both sides, the end cut.
        taps, fill = [(j, reach - j * dil) for j in range(kk)], _left_pad(x, reach, both=True)
        replaced, dead, x = users[0], (node, x), x.args[0]
    elif dil == 1 and kk % 2 == 1 and padding == [kk // 2] and _future_taps_zero(ctx, w, kk // 2):
        taps = [(j, kk // 2 - j) for j in range(kk // 2 + 1)]  # MADE: the centred kernel's past half
        replaced, dead = node, ()
    else:
        return None
    xv = value(x)
    if not (isinstance(xv, torch.Tensor) and xv.dim() == 3 and same_size(xv.shape[2], ctx.seq_len)):
        return None
    return x, w, a["bias"], a["groups"], taps, replaced, dead, fill


def _future_taps_zero(ctx: PassContext, w: Any, centre: int) -> bool:
    """``w = weight * mask`` (either order) with a structural ``mask`` zero at every tap after
    ``centre``, for every channel: a MADE-style causal mask."""
    from treecompile.passes._mask_eval import depends_on_inputs, evaluate

    if not (isinstance(w, fx.Node) and is_call(w, (operator.mul, torch.mul), ("mul",))):
        return False
    for m in w.args[:2]:
        if isinstance(m, fx.Node) and depends_on_inputs(ctx, m) is False:
            try:
                mv = evaluate(ctx, m)
            except Exception:  # a mask that cannot be evaluated alone
                return False
            if mv.dim() >= 1 and mv.shape[-1] == 2 * centre + 1 and not torch.any(mv[..., centre + 1:] != 0):
                return True
    return False


def _rewrite_tap_convs(gm: fx.GraphModule, ctx: PassContext, tables: dict[int, fx.Node]) -> None:
    """Rewrites each causal conv1d `_conv_taps` finds into a sum of 1-tap convs over ancestor
    gathers. Counter: ``tap_conv``."""
    for node, found in _matched(gm, ctx, (("conv", _conv_taps),), "is a causal conv"):
        x, w, bias, groups, taps, replaced, dead, fill = found
        reach = max(d for _, d in taps)
        table = _table(gm, ctx, tables, reach + 1)
        emit = Emitter(gm, ctx, replaced)
        total = None
        for j, d in taps:
            if d == 0:
                src = x
            else:
                with gm.graph.inserting_before(replaced):
                    src = _ancestor_gather(gm, ctx, x, 2, table, d, like=node, fill=fill)
            term = emit.fn(F.conv1d, src, emit.method("narrow", w, 2, j, 1), None, 1, 0, 1, groups)
            total = term if total is None else emit.fn(operator.add, total, term)
        if bias is not None:
            total = emit.fn(operator.add, total, emit.method("view", bias, 1, -1, 1))
        replaced.replace_all_uses_with(total)
        gm.graph.erase_node(replaced)
        for n in dead:
            if isinstance(n, fx.Node) and n.graph is gm.graph and not n.users:
                gm.graph.erase_node(n)
        ctx.count("tap_conv")


def _ancestor_gather(gm: fx.GraphModule, ctx: PassContext, x: fx.Node, dim: int, table: fx.Node, k: int,
                     like: fx.Node, fill: Any = 0) -> fx.Node:
    """``x`` with row ``r`` (on ``dim``) replaced by its ``k``-th ancestor's row; where the path
    has fewer than ``k`` earlier tokens, ``fill`` (`treecompile.passes.shifts.Shift.fill`):
    a number, the path's first row (`REPLICATE`: the farthest ancestor there is), or a node
    of one row."""
    g = gm.graph
    xv = value(x)
    shape = [1] * xv.dim()
    shape[dim] = -1

    def node(op, target, *args, example=None):
        n = ctx.mark(getattr(g, op)(target, args), like=like)
        if example is not None:
            n.meta["example_value"] = example
        return n

    if fill == REPLICATE:
        # Row r's j-th ancestor where it has one, else the farthest it has (r itself at a root).
        rows = row_ids(g, ctx, like)
        for j in range(1, k + 1):
            anc = node("call_function", torch.select, table, 1, j - 1)
            rows = node("call_function", torch.where, node("call_method", "lt", anc, 0), rows, anc)
        return node("call_function", torch.index_select, x, dim, rows, example=xv)
    anc = node("call_function", torch.select, table, 1, k - 1)
    missing = node("call_method", "lt", anc, 0)
    rows = node("call_method", "clamp", anc, 0)
    picked = node("call_function", torch.index_select, x, dim, rows, example=xv)
    missing = node("call_method", "view", missing, shape)
    if isinstance(fill, fx.Node):
        return node("call_function", torch.where, missing, fill, picked, example=xv)
    return node("call_method", "masked_fill", picked, missing, fill, example=xv)


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
