"""The spellings of a shift along the sequence by ``k`` that `treecompile.passes.conv_context`
turns into a gather of each row's ``k``-th ancestor on its path.

Each matcher takes a node and returns a `Shift` or None. What a shift reads above the root (where
the path has fewer than ``k`` earlier tokens) is its `Shift.fill`: zeros, another constant
(``pad(.., value=c)``), the path's first row (``mode="replicate"``, ``cat([x[:, :1], x[:, :-1]])``)
or a row that does not depend on the tokens (a learned initial state, ``cat([h0.expand(..), x[:, :-1]])``).
Reflecting and circular padding read rows after the shifted one: no matcher takes them.
"""

from __future__ import annotations

import operator
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import fx

from treecompile.passes._graph import ARANGE, CATS, PADS, PassContext, bind, is_call, mutated_args, same_size, value

__all__ = ["SHIFT_SPELLINGS", "WINDOW_SPELLINGS", "Shift", "Window", "REPLICATE", "pad_fill", "padded_rows", "row_ids"]

#: `Shift.fill` of a shift whose rows above the root read the path's first row.
REPLICATE = "replicate"


class Shift(NamedTuple):
    """A shift found in the graph: the node's value is ``x + sign * shift(x, dim, k)``.

    Attributes:
        x: the shifted tensor. dim: its rows' dim. k: the shift.
        sign: ``-1`` for ``x - shift(x)`` (``diff``), else 0 (the shift alone).
        dead: nodes only the match used (removed once nothing reads them).
        target: the node whose value is the shift (None: the matched node).
        at: where the gather goes (None: before the matched node).
        fill: what rows above the root read: a number, `REPLICATE`, or a node of one row
            along ``dim`` that broadcasts against ``x`` (``k`` is 1 then).
    """

    x: fx.Node
    dim: int
    k: int
    sign: int = 0
    dead: tuple = ()
    target: fx.Node | None = None
    at: fx.Node | None = None
    fill: Any = 0


def _row_dim(x: Any, ctx: PassContext) -> list[int]:
    xv = value(x)
    return [d for d in range(xv.dim()) if same_size(xv.shape[d], ctx.seq_len)] if isinstance(xv, torch.Tensor) else []


def row_ids(g: fx.Graph, ctx: PassContext, like: fx.Node) -> fx.Node:
    """The packed row ids ``0 .. S - 1`` (``ones_like(pred_index).cumsum(0) - 1``), inserted where
    ``g`` inserts, marked like ``like``."""
    ones = ctx.mark(g.call_function(torch.ones_like, (ctx.pred_index,)), like=like)
    return ctx.mark(g.call_function(operator.sub, (ctx.mark(g.call_method("cumsum", (ones, 0)), like=like), 1)),
                    like=like)


def pad_fill(node: fx.Node) -> Any:
    """What a ``pad`` node writes into the rows it adds: a number (``mode="constant"``),
    `REPLICATE`, or None (reflecting or circular padding, which read rows from the far side)."""
    mode = node.args[2] if len(node.args) > 2 else node.kwargs.get("mode", "constant")
    fill = node.args[3] if len(node.args) > 3 else node.kwargs.get("value", None)
    if mode == "constant":
        fill = 0 if fill is None else fill
        return fill if isinstance(fill, (int, float)) and not isinstance(fill, bool) else None
    return REPLICATE if mode == "replicate" else None


def _pad_pairs(node: fx.Node) -> tuple[list[tuple[int, int]], Any] | None:
    """``([(left, right)] per dim (dim 0 first), fill)`` of a ``pad`` (`pad_fill`), or None."""
    if not is_call(node, PADS):
        return None
    pad = node.args[1] if len(node.args) > 1 else node.kwargs.get("pad")
    pad = [_amount(p, ctx_seq_len(node)) for p in pad] if isinstance(pad, (list, tuple)) else None
    pad = None if pad is None or None in pad else pad
    fill = pad_fill(node)
    xv = value(node.args[0])
    if pad is None or len(pad) % 2 or fill is None or not isinstance(xv, torch.Tensor):
        return None
    pairs = [(0, 0)] * xv.dim()
    for i in range(len(pad) // 2):
        pairs[xv.dim() - 1 - i] = (pad[2 * i], pad[2 * i + 1])
    return pairs, fill


def ctx_seq_len(node: fx.Node) -> Any:
    """S as the node's tensor input sees it (its largest symbolic dim), for `_amount`."""
    xv = value(node.args[0]) if node.args else None
    syms = [d for d in getattr(xv, "shape", ()) if isinstance(d, torch.SymInt)]
    return syms[0] if len(syms) == 1 else None


def _amount(p: Any, s: Any) -> int | None:
    """A pad amount as an int: a constant, sizes whose arithmetic is one, or ``min(k, S)`` /
    ``-min(k, S)`` (x-transformers
    clamps its shift to the length: a shift by ``min(k, S)`` is a shift by ``k``, every row
    zero when the sequence is shorter)."""
    if isinstance(p, int):
        return p
    if not isinstance(p, fx.Node) or p.op != "call_function":
        return None
    known = _const_int(value(p))
    if known is not None:
        return known  # ``T - x[:, :T - k].shape[1]``: arithmetic on sizes that is a number
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


_CONSTANTS = {"zeros": 0, "zeros_like": 0, "new_zeros": 0, "ones": 1, "ones_like": 1, "new_ones": 1}


def _constant(node: Any) -> float | int | None:
    """The value of a tensor filled with one constant made here (``zeros``, ``x.new_zeros``,
    ``ones``, ``full``, ``full_like``, ``x.new_full``), else None."""
    if not isinstance(node, fx.Node) or node.op not in ("call_function", "call_method"):
        return None
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    if name in _CONSTANTS:
        return _CONSTANTS[name]
    if name in ("full", "full_like", "new_full"):
        fill = node.args[-1] if len(node.args) > 1 else node.kwargs.get("fill_value")
        return fill if isinstance(fill, (int, float)) and not isinstance(fill, bool) else None
    return None


def _is_zeros(node: Any) -> bool:
    """A tensor of zeros made here (``zeros``, ``zeros_like``, ``x.new_zeros``, ``full(.., 0)``)."""
    return _constant(node) in (0, 0.0)


def _match_pad(node: fx.Node, ctx: PassContext):
    """``pad(x, (.., k, -k))``: k zeros in front, the last k rows cut (RWKV's ``nn.ZeroPad2d((0, 0,
    1, -1))`` time shift, x-transformers' ``shift_tokens``); or ``pad(x[:, :-k], (.., k, 0))``."""
    found = _pad_pairs(node)
    if found is None:
        return None
    pairs, fill = found
    moved = [(d, p) for d, p in enumerate(pairs) if p != (0, 0)]
    if len(moved) != 1:
        return None
    dim, (left, right) = moved[0]
    x = node.args[0]
    if left > 0 and right == -left and dim in _row_dim(x, ctx) and fill != REPLICATE:
        return Shift(x, dim, left, fill=fill)
    # Replicated padding of ``x[:, :-k]`` repeats its first row, which is x's.
    cropped = _drops_last(x, dim, ctx) if left > 0 and right == 0 else None
    if cropped is not None and cropped[1] == left:
        return Shift(cropped[0], dim, left, dead=(x,), fill=fill)
    return None


def _match_crop(node: fx.Node, ctx: PassContext):
    """``pad(x, (.., k, 0))[:, :-k]``: k zeros in front, then the last k rows cut (a running
    window's ``c - F.pad(c, (0, 0, K, 0))[:, :-K]``)."""
    if not (node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[0], fx.Node)):
        return None
    padded = node.args[0]
    pairs, fill = _pad_pairs(padded) or ([], None)
    moved = [(d, p) for d, p in enumerate(pairs) if p != (0, 0)]
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
    return Shift(x, dim, left, dead=(padded,), fill=fill)


def _match_cat(node: fx.Node, ctx: PassContext):
    """``cat([front, x[:, :-k]], dim)`` with ``k`` rows in ``front``: a tensor of one constant
    (zeros, ``full``); for ``k = 1`` also x's first row ``x[:, :1]`` (the path's first row) or a
    row that does not depend on the tokens (a learned initial state, broadcast)."""
    if not is_call(node, CATS):
        return None
    parts = node.args[0] if node.args else node.kwargs.get("tensors")
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    if not (isinstance(parts, (list, tuple)) and len(parts) == 2 and isinstance(dim, int)):
        return None
    front, rest = parts
    nd = value(node).dim()
    dim %= nd
    cropped = _drops_last(rest, dim, ctx)
    fv = value(front)
    if cropped is None or not isinstance(fv, torch.Tensor) or _const_int(fv.shape[dim]) != cropped[1]:
        return None
    x, k = cropped
    fill = _constant(front)
    if fill is not None:
        return Shift(x, dim, k, dead=(rest, front), fill=fill)
    if k != 1:
        return None
    if isinstance(front, fx.Node) and front.op == "call_function" and front.target is operator.getitem \
            and front.args[0] is x and _first_rows(front.args[1], dim, nd) == 1 and fv.dim() == nd:
        return Shift(x, dim, 1, dead=(rest, front), fill=REPLICATE)
    from treecompile.passes._mask_eval import reads_tokens

    if isinstance(front, fx.Node) and not _row_dim(front, ctx) and reads_tokens(ctx, front) is False:
        return Shift(x, dim, 1, dead=(rest,), fill=front)
    return None


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
    return Shift(x, dim, 1, sign=-1, dead=(a["prepend"],))


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
            and _first_rows_mask(first.args[1], dim, xv.dim(), ctx.seq_len, ctx.positions) == k:
        # ``roll(x, k, d).masked_fill(arange(T) < k, 0)`` (or ``== 0`` for k = 1), out of place:
        # the masked fill is the shift.
        return Shift(x, dim, k, dead=(node,), target=first)
    if first.op == "root" or not (first.op == "call_function" and first.target is operator.setitem
                             and first.args[0] is node and first.args[2] in (0, 0.0)
                             and _first_rows(first.args[1], dim, xv.dim()) == k):
        return None
    return Shift(x, dim, k, dead=(first,))


def _first_rows_mask(mask: Any, dim: int, nd: int, seq_len: Any, positions: fx.Node | None = None) -> int | None:
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
    if isinstance(grid, fx.Node) and isinstance(bound, int) and _is_positions(grid, positions):
        # The positions pass read ``arange(S) < k`` as the rows' positions: the same first k
        # rows of each path.
        return _bound_rows(cur, bound)
    if not (isinstance(grid, fx.Node) and is_call(grid, ARANGE) and isinstance(bound, int)):
        return None
    a = bind(grid, ["start", "end", "step"], {"end": None, "step": 1})
    end = a["start"] if a["end"] is None else a["end"]
    if (a["end"] is not None and a["start"] != 0) or a["step"] != 1 or not same_size(end, seq_len):
        return None
    return _bound_rows(cur, bound)


def _bound_rows(cur: fx.Node, bound: int) -> int | None:
    """``k`` for ``grid < k`` (``k > 0``) or ``grid == 0`` (1)."""
    if is_call(cur, (operator.eq, torch.eq), ("eq",)):
        return 1 if bound == 0 else None
    return bound if bound > 0 else None


def _is_positions(node: fx.Node, positions: fx.Node | None) -> bool:
    """``positions`` or a cast of it (``positions.to(dtype)``, what the positions pass wrote
    for an ``arange(S)``)."""
    while node.op == "call_method" and node.target == "to" and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return positions is not None and node is positions


def _match_filled(node: fx.Node, ctx: PassContext):
    """``y = zeros_like(x); y[:, k:] = x[:, :-k]``: a tensor of one constant (zeros, ``full_like``)
    whose rows from k on are written, before anything reads it, with the rows of x k earlier (a
    token shift into a buffer)."""
    fill = _constant(node)
    if fill is None:
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
            return Shift(cropped[0], dim, k, dead=(first, first.args[2]), target=node, at=first, fill=fill)
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


# --------------------------------------------------------------------------- windows
#
# A window over the last k rows (``pool1d(pad(x, (k - 1, 0)), k, stride=1)``,
# ``pad(x, (.., k - 1, 0)).unfold(d, k, 1)``) reads the shifts of x by k - 1, ..., 1, 0: on the
# tree, the ancestors 0 to k - 1 steps back on each row's path, with the padding's fill above
# the root.


class Window(NamedTuple):
    """A window over the last ``k`` rows: the node's value is ``reduce`` over the stack (on a
    new last dim, oldest first) of ``shift(x, dim, d, fill)`` for ``d = k - 1, ..., 0``.

    Attributes:
        reduce: ``"mean"``, ``"amax"`` (a pool) or None (the stack itself: ``unfold``).
        dead: nodes only the match used.
    """

    x: fx.Node
    dim: int
    k: int
    fill: Any
    reduce: str | None
    dead: tuple = ()


def padded_rows(x: Any, dim: int, left: int, right: int = 0) -> tuple[fx.Node, Any] | None:
    """``(inner, fill)`` if ``x`` is ``pad(inner, ..)`` adding ``left`` rows in front of ``dim``
    and ``right`` after it, and nothing on other dims (`pad_fill`), else None."""
    found = _pad_pairs(x) if isinstance(x, fx.Node) else None
    if found is None or left < 1:
        return None
    pairs, fill = found
    if [(d, p) for d, p in enumerate(pairs) if p != (0, 0)] != [(dim, (left, right))]:
        return None
    return x.args[0], fill


_POOLS = {torch.avg_pool1d: ("mean", ["input", "kernel_size", "stride", "padding", "ceil_mode", "count_include_pad"]),
          F.avg_pool1d: ("mean", ["input", "kernel_size", "stride", "padding", "ceil_mode", "count_include_pad"]),
          F.max_pool1d: ("amax", ["input", "kernel_size", "stride", "padding", "dilation", "ceil_mode",
                                  "return_indices"]),
          torch.max_pool1d: ("amax", ["input", "kernel_size", "stride", "padding", "dilation", "ceil_mode"])}


def _one(v: Any) -> Any:
    return v[0] if isinstance(v, (list, tuple)) and len(v) == 1 else v


def _match_pool(node: fx.Node, ctx: PassContext) -> Window | None:
    """``avg_pool1d`` / ``max_pool1d`` of ``pad(x, (k - 1, 0))`` with kernel ``k`` and stride 1
    over the rows (the last dim): a causal running mean or max."""
    if node.op != "call_function" or node.target not in _POOLS:
        return None
    reduce, names = _POOLS[node.target]
    a = bind(node, names, {"stride": None, "padding": 0, "dilation": 1, "ceil_mode": False,
                           "count_include_pad": True, "return_indices": False})
    k, padded = _one(a["kernel_size"]), a["input"]
    if not (isinstance(k, int) and _one(a["stride"]) == 1 and _one(a["padding"]) == 0 and _one(a["dilation"]) == 1
            and a["ceil_mode"] is False and a["return_indices"] is False):
        return None
    pv = value(padded)
    if not isinstance(pv, torch.Tensor) or pv.dim() not in (2, 3):
        return None
    found = padded_rows(padded, pv.dim() - 1, k - 1)
    if found is None or pv.dim() - 1 not in _row_dim(found[0], ctx):
        return None
    return Window(found[0], pv.dim() - 1, k, found[1], reduce, (padded,))


def _match_unfold(node: fx.Node, ctx: PassContext) -> Window | None:
    """``pad(x, (.., k - 1, 0)).unfold(d, k, 1)`` over the rows: each row's window of the last
    ``k`` rows on a new last dim (a lightweight conv's taps)."""
    if not (node.op == "call_method" and node.target == "unfold" and len(node.args) == 4):
        return None
    padded, dim, k, step = node.args
    pv = value(padded)
    if not (isinstance(pv, torch.Tensor) and isinstance(dim, int) and isinstance(k, int) and step == 1):
        return None
    dim %= pv.dim()
    found = padded_rows(padded, dim, k - 1)
    if found is None or dim not in _row_dim(found[0], ctx):
        return None
    return Window(found[0], dim, k, found[1], None, (padded,))


#: The spellings of a window over the last k rows, each a matcher (see above).
WINDOW_SPELLINGS = (("pool", _match_pool), ("unfold", _match_unfold))
