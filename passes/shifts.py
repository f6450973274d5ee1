"""The spellings of a shift along the sequence by ``k`` that `treecompile.passes.conv_context`
turns into a gather of each row's ``k``-th ancestor on its path (zero above the root).

Each matcher takes a node and returns ``(x, dim, k, sign, dead[, target, at])`` or None: the
shifted tensor ``x``, the rows' dim, the shift, ``-1`` for ``x - shift(x)`` (``diff``) else 0,
the nodes the rewrite leaves dead, and optionally the node whose value is the shift (default:
the matched node) and where the gather goes (default: before the matched node).
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import fx

from treecompile.passes._graph import ARANGE, PADS, PassContext, bind, is_call, mutated_args, same_size, value

__all__ = ["SHIFT_SPELLINGS"]


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
    if not isinstance(xv, torch.Tensor) or dim not in _row_dim(x, ctx):
        return None
    found = _cut_along(index, dim, xv.dim())
    cut = None if found is None else found[0]
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
    found = _cut_along(index, dim, pv.dim())
    cut = None if found is None else found[0]
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
            and first.args[0] is node and first.args[2] in (0, 0.0) \
            and _first_rows_mask(first.args[1], dim, xv.dim(), ctx.seq_len) == k:
        # ``roll(x, k, d).masked_fill(arange(T) < k, 0)`` (or ``== 0`` for k = 1), out of place:
        # the masked fill is the shift.
        return x, dim, k, 0, (node,), first
    if first.op == "root" or not (first.op == "call_function" and first.target is operator.setitem
                             and first.args[0] is node and first.args[2] in (0, 0.0)
                             and _first_rows(first.args[1], dim, xv.dim()) == k):
        return None
    return x, dim, k, 0, (first,)


def _first_rows_mask(mask: Any, dim: int, nd: int, seq_len: Any) -> int | None:
    """``k`` if ``mask`` is ``arange(S) < k`` (or ``== 0``, k = 1; ``S`` the rows, ``seq_len``)
    along ``dim`` of an ``nd``-dim tensor, through indexing or unsqueezes that only add dims of size 1."""
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
    if (a["end"] is not None and a["start"] != 0) or a["step"] != 1 or not same_size(end, seq_len):
        return None
    if is_call(cur, (operator.eq, torch.eq), ("eq",)):
        return 1 if bound == 0 else None
    return bound if bound > 0 else None


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


def _cut_along(index: Any, dim: int, nd: int) -> tuple[Any] | None:
    """``(entry,)``: a getitem's ``index`` entry on ``dim`` (over ``nd`` dims, an ``...`` expanded),
    if every other dim is taken whole; else None."""
    index = index if isinstance(index, tuple) else (index,)
    if Ellipsis in index:
        at = index.index(Ellipsis)
        index = index[:at] + (slice(None),) * (nd - len(index) + 1) + index[at + 1:]
    index = index + (slice(None),) * (nd - len(index))
    if len(index) != nd or any(i != slice(None) for d, i in enumerate(index) if d != dim):
        return None
    return (index[dim],)


def _rows_from(index: Any, dim: int, nd: int) -> int | None:
    """``k`` if ``index`` picks the rows from ``k`` on along ``dim`` (``k:``) and whole other dims."""
    found = _cut_along(index, dim, nd)
    cut = None if found is None else found[0]
    ok = isinstance(cut, slice) and isinstance(cut.start, int) and cut.start > 0 and cut.stop is None
    return cut.start if ok and cut.step in (None, 1) else None


def _first_rows(index: Any, dim: int, nd: int) -> int | None:
    """``k`` if ``index`` picks the first ``k`` rows on ``dim`` (``0`` or ``:k``) and whole
    other dims, else None."""
    found = _cut_along(index, dim, nd)
    if found is None:
        return None
    cut = found[0]
    if isinstance(cut, int) and not isinstance(cut, bool) and cut == 0:
        return 1
    if isinstance(cut, slice) and cut.start in (None, 0) and cut.step in (None, 1) and isinstance(cut.stop, int):
        return cut.stop if cut.stop > 0 else None
    return None


#: The spellings of a shift along the sequence, each a matcher (see above).
SHIFT_SPELLINGS = (("pad", _match_pad), ("crop", _match_crop), ("cat", _match_cat), ("diff", _match_diff),
                   ("roll", _match_roll), ("filled", _match_filled))
