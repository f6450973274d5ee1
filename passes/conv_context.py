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
zeroed in place before any read) are the same thing with one tap: each becomes a gather of the
row ``k`` steps back on its path (`SHIFT_SPELLINGS`, one entry each).

Scans along the sequence (``cumsum``, ``cumprod``, ``logcumsumexp``, ``cummax``, ``cummin``)
become scans along each row's root path (`treecompile.passes.scans`).

Counters (``ctx.counters["rewrite_conv_context_pass"]``): ``causal_conv1d`` (rewritten conv
calls), of which ``depthwise_conv1d`` were plain convs; ``shift``; ``path_scan``.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx

from treecompile.core.errors import UnsupportedModelError
from treecompile.kernels import conv as _conv  # noqa: F401  (registers the treecompile:: conv ops)
from treecompile.passes._graph import (ARANGE, PADS, Emitter, PassContext, bind, describe, is_call, is_op,
                                      mutated_args, same_size, source_of, value)
from treecompile.passes.scans import rewrite_scans

__all__ = ["rewrite_conv_context_pass", "NeedsStructure"]


class NeedsStructure(UnsupportedModelError):
    """The graph has a causal conv or a shift along the sequence, and the call passed no path
    structure (``pred_index``): a whole-tree call captures again with it; any other call is
    refused with this message."""


def rewrite_conv_context_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Replaces each ``treecompile::causal_conv1d`` with its tree form.

    Counters (``ctx.counters["rewrite_conv_context_pass"]``): ``causal_conv1d``.
    """
    _canonical_convs(gm, ctx)
    tables: dict[int, fx.Node] = {}
    _rewrite_shifts(gm, ctx, tables)
    _rewrite_tap_convs(gm, ctx, tables)
    rewrite_scans(gm, ctx, _needs_structure)
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
        kk = int(wv.shape[1])
        if kk not in tables:
            with gm.graph.inserting_before(_first_node(gm)):
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


def _row_dim(x: Any, ctx: PassContext) -> list[int]:
    xv = value(x)
    return [d for d in range(xv.dim()) if same_size(xv.shape[d], ctx.seq_len)] if isinstance(xv, torch.Tensor) else []


def _pad_pairs(node: fx.Node) -> list[tuple[int, int]] | None:
    """``[(left, right)]`` per dim (dim 0 first) of a constant zero ``pad``, or None."""
    if not is_call(node, PADS):
        return None
    pad = node.args[1] if len(node.args) > 1 else node.kwargs.get("pad")
    pad = [_amount(p, ctx_seq_len(node)) for p in pad] if isinstance(pad, (list, tuple)) else None
    pad = None if pad is None or None in pad else pad
    mode = node.args[2] if len(node.args) > 2 else node.kwargs.get("mode", "constant")
    fill = node.args[3] if len(node.args) > 3 else node.kwargs.get("value", None)
    xv = value(node.args[0])
    if pad is None or len(pad) % 2 or mode != "constant" or fill not in (None, 0, 0.0) or not isinstance(
            xv, torch.Tensor):
        return None
    pairs = [(0, 0)] * xv.dim()
    for i in range(len(pad) // 2):
        pairs[xv.dim() - 1 - i] = (pad[2 * i], pad[2 * i + 1])
    return pairs


def ctx_seq_len(node: fx.Node) -> Any:
    """S as the node's tensor input sees it (its largest symbolic dim), for `_amount`."""
    xv = value(node.args[0]) if node.args else None
    syms = [d for d in getattr(xv, "shape", ()) if isinstance(d, torch.SymInt)]
    return syms[0] if len(syms) == 1 else None


def _amount(p: Any, s: Any) -> int | None:
    """A pad amount as an int: a constant, or ``min(k, S)`` / ``-min(k, S)`` (x-transformers
    clamps its shift to the length: a shift by ``min(k, S)`` is a shift by ``k``, every row
    zero when the sequence is shorter)."""
    if isinstance(p, int):
        return p
    if not isinstance(p, fx.Node) or p.op != "call_function":
        return None
    name = getattr(p.target, "__name__", "")
    if name == "neg" and len(p.args) == 1:
        inner = _amount(p.args[0], s)
        return None if inner is None else -inner
    if name in ("sym_min", "min") and len(p.args) == 2:
        consts = [a for a in p.args if isinstance(a, int)]
        others = [a for a in p.args if not isinstance(a, int)]
        if len(consts) == 1 and len(others) == 1 and s is not None and same_size(value(others[0]), s):
            return consts[0]
    return None


def _drops_last(node: Any, dim: int, ctx: PassContext) -> tuple[fx.Node, int] | None:
    """``(x, k)`` if ``node`` is ``x[..., :-k, ...]`` (or ``:S - k``) on ``dim``, the rows of ``x``."""
    if not (isinstance(node, fx.Node) and node.op == "call_function" and node.target is operator.getitem):
        return None
    x, index = node.args
    xv, nv = value(x), value(node)
    if not isinstance(xv, torch.Tensor):
        return None
    index = index if isinstance(index, tuple) else (index,)
    if index and index[0] is Ellipsis:
        index = (slice(None),) * (xv.dim() - len(index) + 1) + index[1:]
    index = index + (slice(None),) * (xv.dim() - len(index))
    if not isinstance(xv, torch.Tensor) or len(index) != xv.dim() or dim not in _row_dim(x, ctx):
        return None
    if any(i != slice(None) for d, i in enumerate(index) if d != dim):
        return None
    cut = index[dim]
    if not (isinstance(cut, slice) and cut.start in (None, 0) and cut.step in (None, 1)):
        return None
    k = -cut.stop if isinstance(cut.stop, int) and cut.stop < 0 else None
    if k is None and isinstance(nv, torch.Tensor):
        k = _const_int(ctx.seq_len - nv.shape[dim])
    return (x, k) if isinstance(k, int) and k > 0 else None


def _const_int(v: Any) -> int | None:
    try:
        return int(v) if isinstance(v, int) or (isinstance(v, torch.SymInt) and v.node.expr.is_number) else None
    except (TypeError, ValueError):
        return None


_ZEROS = {"zeros", "zeros_like", "new_zeros"}


def _is_zeros(node: Any) -> bool:
    """A tensor of zeros made here (``zeros``, ``zeros_like``, ``x.new_zeros``)."""
    if not isinstance(node, fx.Node) or node.op not in ("call_function", "call_method"):
        return False
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    return name in _ZEROS or name in ("full", "new_full") and len(node.args) > 1 and node.args[-1] in (0, 0.0)


def _match_pad(node: fx.Node, ctx: PassContext):
    """``pad(x, (.., k, -k))``: k zeros in front, the last k rows cut (RWKV's ``nn.ZeroPad2d((0, 0,
    1, -1))`` time shift, x-transformers' ``shift_tokens``); or ``pad(x[:, :-k], (.., k, 0))``."""
    pairs = _pad_pairs(node)
    if pairs is None:
        return None
    moved = [(d, p) for d, p in enumerate(pairs) if p != (0, 0)]
    if len(moved) != 1:
        return None
    dim, (left, right) = moved[0]
    x = node.args[0]
    if left > 0 and right == -left and dim in _row_dim(x, ctx):
        return x, dim, left, 0, ()
    cropped = _drops_last(x, dim, ctx) if left > 0 and right == 0 else None
    if cropped is not None and cropped[1] == left:
        return cropped[0], dim, left, 0, (x,)
    return None


def _match_crop(node: fx.Node, ctx: PassContext):
    """``pad(x, (.., k, 0))[:, :-k]``: k zeros in front, then the last k rows cut (a running
    window's ``c - F.pad(c, (0, 0, K, 0))[:, :-K]``)."""
    if not (node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[0], fx.Node)):
        return None
    padded = node.args[0]
    pairs = _pad_pairs(padded)
    moved = [(d, p) for d, p in enumerate(pairs or []) if p != (0, 0)]
    if len(moved) != 1:
        return None
    dim, (left, right) = moved[0]
    x, index = padded.args[0], node.args[1]
    pv = value(padded)
    if left <= 0 or right != 0 or dim not in _row_dim(x, ctx) or dim not in _row_dim(node, ctx):
        return None
    index = index if isinstance(index, tuple) else (index,)
    if Ellipsis in index:
        at = index.index(Ellipsis)
        index = index[:at] + (slice(None),) * (pv.dim() - len(index) + 1) + index[at + 1:]
    index = index + (slice(None),) * (pv.dim() - len(index))
    if len(index) != pv.dim() or any(i != slice(None) for d, i in enumerate(index) if d != dim):
        return None
    cut = index[dim]
    if not (isinstance(cut, slice) and cut.start in (None, 0) and cut.step in (None, 1)):
        return None
    # ``:-k``, or ``:S`` (the first S of the S + k rows): the result has the rows of x.
    if not (cut.stop == -left or same_size(value(node).shape[dim], ctx.seq_len) and not isinstance(cut.stop, int)):
        return None
    return x, dim, left, 0, (padded,)


def _match_cat(node: fx.Node, ctx: PassContext):
    """``cat([zeros with k rows, x[:, :-k]], dim)``."""
    if not is_call(node, (torch.cat, torch.concat, torch.concatenate)):
        return None
    parts = node.args[0] if node.args else node.kwargs.get("tensors")
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    if not (isinstance(parts, (list, tuple)) and len(parts) == 2 and isinstance(dim, int)):
        return None
    zeros, rest = parts
    nd = value(node).dim()
    dim %= nd
    cropped = _drops_last(rest, dim, ctx)
    if cropped is None or not _is_zeros(zeros) or _const_int(value(zeros).shape[dim]) != cropped[1]:
        return None
    return cropped[0], dim, cropped[1], 0, (rest, zeros)


def _match_diff(node: fx.Node, ctx: PassContext):
    """``diff(x, dim=d, prepend=zeros with one row)``: ``x - shift(x, 1)``."""
    if not is_call(node, (torch.diff,), ("diff",)):
        return None
    a = bind(node, ["input", "n", "dim", "prepend", "append"], {"n": 1, "dim": -1, "prepend": None, "append": None})
    x, dim = a["input"], a["dim"]
    if a["n"] != 1 or a["append"] is not None or not _is_zeros(a["prepend"]) or not isinstance(dim, int):
        return None
    dim %= value(x).dim()
    if dim not in _row_dim(x, ctx) or _const_int(value(a["prepend"]).shape[dim]) != 1:
        return None
    return x, dim, 1, -1, (a["prepend"],)


def _match_roll(node: fx.Node, ctx: PassContext):
    """``roll(x, k, dims=d)`` whose first ``k`` rows are zeroed in place before anything reads
    it (``y[:, 0] = 0`` for ``k = 1``, ``y[:, :k] = 0``): the rows that wrapped around are the
    shift's zero padding. A roll read before the zeroing, or zeroed on other rows, is no shift."""
    if not is_call(node, (torch.roll,), ("roll",)):
        return None
    a = bind(node, ["input", "shifts", "dims"], {"dims": None})
    x, k, dim = a["input"], a["shifts"], a["dims"]
    k = k[0] if isinstance(k, (list, tuple)) and len(k) == 1 else k
    dim = dim[0] if isinstance(dim, (list, tuple)) and len(dim) == 1 else dim
    xv = value(x)
    if not (isinstance(k, int) and k > 0 and isinstance(dim, int) and isinstance(xv, torch.Tensor)):
        return None
    dim %= xv.dim()
    if dim not in _row_dim(x, ctx):
        return None
    first = node.next  # the first user in graph order (users follow the node)
    while first.op != "root" and first not in node.users:
        first = first.next
    if first.op != "root" and is_call(first, (torch.masked_fill,), ("masked_fill",)) and len(node.users) == 1 \
            and first.args[0] is node and first.args[2] in (0, 0.0) and _first_rows_mask(first.args[1], dim, xv.dim()) == k:
        # ``roll(x, k, d).masked_fill(arange(T) < k, 0)`` (or ``== 0`` for k = 1), out of place:
        # the masked fill is the shift.
        return x, dim, k, 0, (node,), first
    if first.op == "root" or not (first.op == "call_function" and first.target is operator.setitem
                             and first.args[0] is node and first.args[2] in (0, 0.0)
                             and _first_rows(first.args[1], dim, xv.dim()) == k):
        return None
    return x, dim, k, 0, (first,)


def _first_rows_mask(mask: Any, dim: int, nd: int) -> int | None:
    """``k`` if ``mask`` is ``arange(S) < k`` (or ``== 0``, k = 1) along ``dim`` of an ``nd``-dim
    tensor, through indexing or unsqueezes that only add dims of size 1."""
    if not isinstance(mask, fx.Node):
        return None
    mv = value(mask)
    if not isinstance(mv, torch.Tensor) or mv.dim() > nd or mv.dtype != torch.bool:
        return None
    at = dim - (nd - mv.dim())  # the mask broadcasts from the right
    if at < 0 or any(not (isinstance(d, int) and d == 1) for i, d in enumerate(mv.shape) if i != at):
        return None
    cur = mask
    while cur.op == "call_method" and cur.target in ("unsqueeze", "view", "reshape") or (
            cur.op == "call_function" and cur.target is operator.getitem
            and all(i is None or i == slice(None) or i is Ellipsis for i in
                    (cur.args[1] if isinstance(cur.args[1], tuple) else (cur.args[1],)))):
        cur = cur.args[0]
        if not isinstance(cur, fx.Node):
            return None
    if not is_call(cur, (operator.eq, operator.lt, torch.eq, torch.lt), ("eq", "lt")):
        return None
    grid, bound = cur.args[:2]
    if not (isinstance(grid, fx.Node) and is_call(grid, ARANGE) and isinstance(bound, int)):
        return None
    a = bind(grid, ["start", "end", "step"], {"end": None, "step": 1})
    end = a["start"] if a["end"] is None else a["end"]
    if (a["end"] is not None and a["start"] != 0) or a["step"] != 1 or not same_size(end, ctx_seq_len_of(grid)):
        return None
    if is_call(cur, (operator.eq, torch.eq), ("eq",)):
        return 1 if bound == 0 else None
    return bound if bound > 0 else None


def ctx_seq_len_of(grid: fx.Node) -> Any:
    """The length an arange covers (its example value's size)."""
    v = value(grid)
    return v.shape[0] if isinstance(v, torch.Tensor) and v.dim() == 1 else None


def _match_filled(node: fx.Node, ctx: PassContext):
    """``y = zeros_like(x); y[:, k:] = x[:, :-k]``: a tensor of zeros whose rows from k on are
    written, before anything reads it, with the rows of x k earlier (a token shift into a buffer)."""
    if not _is_zeros(node):
        return None
    first = node.next  # the first user in graph order
    while first.op != "root" and first not in node.users:
        first = first.next
    if first.op == "root" or not (first.op == "call_function" and first.target is operator.setitem
                                  and first.args[0] is node and isinstance(first.args[2], fx.Node)):
        return None
    nv = value(node)
    if any(u is not first and node in mutated_args(u) for u in node.users):
        return None  # written again: not one shift
    for dim in _row_dim(node, ctx):
        k = _rows_from(first.args[1], dim, nv.dim())
        cropped = _drops_last(first.args[2], dim, ctx)
        if k is not None and cropped is not None and cropped[1] == k and \
                tuple(value(cropped[0]).shape) == tuple(nv.shape):
            return cropped[0], dim, k, 0, (first, first.args[2]), node, first
    return None


def _rows_from(index: Any, dim: int, nd: int) -> int | None:
    """``k`` if ``index`` picks the rows from ``k`` on along ``dim`` (``k:``) and whole other dims."""
    index = index if isinstance(index, tuple) else (index,)
    if Ellipsis in index:
        at = index.index(Ellipsis)
        index = index[:at] + (slice(None),) * (nd - len(index) + 1) + index[at + 1:]
    index = index + (slice(None),) * (nd - len(index))
    if len(index) != nd or any(i != slice(None) for d, i in enumerate(index) if d != dim):
        return None
    cut = index[dim]
    ok = isinstance(cut, slice) and isinstance(cut.start, int) and cut.start > 0 and cut.stop is None
    return cut.start if ok and cut.step in (None, 1) else None


def _first_rows(index: Any, dim: int, nd: int) -> int | None:
    """``k`` if ``index`` picks the first ``k`` rows on ``dim`` (``0`` or ``:k``) and whole
    other dims, else None."""
    index = index if isinstance(index, tuple) else (index,)
    if Ellipsis in index:
        at = index.index(Ellipsis)
        index = index[:at] + (slice(None),) * (nd - len(index) + 1) + index[at + 1:]
    index = index + (slice(None),) * (nd - len(index))
    if len(index) != nd or any(i != slice(None) for d, i in enumerate(index) if d != dim):
        return None
    cut = index[dim]
    if isinstance(cut, int) and not isinstance(cut, bool) and cut == 0:
        return 1
    if isinstance(cut, slice) and cut.start in (None, 0) and cut.step in (None, 1) and isinstance(cut.stop, int):
        return cut.stop if cut.stop > 0 else None
    return None


#: The spellings of a shift along the sequence, each a matcher (see above).
SHIFT_SPELLINGS = (("pad", _match_pad), ("crop", _match_crop), ("cat", _match_cat), ("diff", _match_diff),
                   ("roll", _match_roll), ("filled", _match_filled))


def _rewrite_shifts(gm: fx.GraphModule, ctx: PassContext, tables: dict[int, fx.Node]) -> None:
    """Replaces every shift along the sequence (`SHIFT_SPELLINGS`) by a gather of each row's
    k-th ancestor on its path. Counter: ``shift``."""
    for node in list(gm.graph.nodes):
        if node.graph is not gm.graph or node in ctx.created:
            continue
        for _, match in SHIFT_SPELLINGS:
            found = match(node, ctx)
            if found is not None:
                break
        else:
            continue
        if ctx.pred_index is None:
            raise NeedsStructure(
                f"treecompile cannot make this model exact on a tree: {describe(node)} shifts the sequence, and this "
                f"call has no path structure to shift it along (a streamed or context-parallel call).\n"
                f"  at {source_of(node)}")
        # A matcher may name the node whose value is the shift (default: the matched node) and
        # where the gather goes (default: before the matched node; after x in any case).
        x, dim, k, sign, dead, *where = found
        target, at = (where + [node, node])[:2] if len(where) < 2 else where
        if k + 1 not in tables:
            with gm.graph.inserting_before(_first_node(gm)):
                tables[k + 1] = _ancestor_table(gm, ctx, k + 1)
        with gm.graph.inserting_before(at):
            new = _ancestor_gather(gm, ctx, x, dim, tables[k + 1], k, like=target)
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


# --------------------------------------------------------------------------- any causal conv, tap by tap
#
# A causal conv1d that is not depthwise (channels mixed, ``groups`` < C), dilated, or causal
# only through a mask on its weight (MADE / PixelCNN-style: a centred kernel whose taps after
# the centre are zero) reads, for output row t, the inputs d = 0, dil, 2 dil, ... steps back,
# each through one slice of the weight: ``sum_d conv1d(x[t - d], w[..., tap(d)])``. On the tree
# ``x[t - d]`` is the row d steps back on t's path (an ancestor gather, zero above the root),
# and each 1-tap conv mixes channels within a row.


def _conv_taps(node: fx.Node, ctx: PassContext):
    """``(x, w, bias, groups, [(tap, d)], replaced, dead)`` for a causal conv1d over the rows, or None."""
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
    reach = (kk - 1) * dil
    if padding == [reach] and reach > 0:  # conv1d(x, padding=(K-1) dil)[..., :S]
        users = list(node.users)
        if len(users) != 1 or not _keeps_first(users[0], ctx.seq_len, reach + 1):
            return None
        taps = [(j, reach - j * dil) for j in range(kk)]
        replaced, dead = users[0], (node,)
    elif padding == [0] and reach > 0 and _left_padded(x, reach + 1):  # conv1d(pad(x, ((K-1) dil, 0)))
        taps = [(j, reach - j * dil) for j in range(kk)]
        replaced, dead, x = node, (x,), x.args[0]
    elif dil == 1 and kk % 2 == 1 and padding == [kk // 2] and _future_taps_zero(ctx, w, kk // 2):
        taps = [(j, kk // 2 - j) for j in range(kk // 2 + 1)]  # MADE: the centred kernel's past half
        replaced, dead = node, ()
    else:
        return None
    xv = value(x)
    if not (isinstance(xv, torch.Tensor) and xv.dim() == 3 and same_size(xv.shape[2], ctx.seq_len)):
        return None
    return x, w, a["bias"], a["groups"], taps, replaced, dead


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
    for node in list(gm.graph.nodes):
        if node.graph is not gm.graph or node in ctx.created:
            continue
        found = _conv_taps(node, ctx)
        if found is None:
            continue
        if ctx.pred_index is None:
            raise NeedsStructure(
                f"treecompile cannot make this model exact on a tree: {describe(node)} is a causal conv, and this call "
                f"has no path structure to run it along (a streamed or context-parallel call).\n  at {source_of(node)}")
        x, w, bias, groups, taps, replaced, dead = found
        reach = max(d for _, d in taps)
        if reach + 1 not in tables:
            with gm.graph.inserting_before(_first_node(gm)):
                tables[reach + 1] = _ancestor_table(gm, ctx, reach + 1)
        emit = Emitter(gm, ctx, replaced)
        total = None
        for j, d in taps:
            if d == 0:
                src = x
            else:
                with gm.graph.inserting_before(replaced):
                    src = _ancestor_gather(gm, ctx, x, 2, tables[reach + 1], d, like=node)
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
                     like: fx.Node) -> fx.Node:
    """``x`` with row ``r`` (on ``dim``) replaced by its ``k``-th ancestor's row, zero where the
    path has fewer than ``k`` earlier tokens."""
    g = gm.graph
    xv = value(x)
    shape = [1] * xv.dim()
    shape[dim] = -1

    def node(op, target, *args, example=None):
        n = ctx.mark(getattr(g, op)(target, args), like=like)
        if example is not None:
            n.meta["example_value"] = example
        return n

    anc = node("call_function", torch.select, table, 1, k - 1)
    missing = node("call_method", "lt", anc, 0)
    rows = node("call_method", "clamp", anc, 0)
    picked = node("call_function", torch.index_select, x, dim, rows, example=xv)
    out = node("call_method", "masked_fill", picked, node("call_method", "view", missing, shape), 0, example=xv)
    return out


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
