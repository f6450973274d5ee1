"""Row rules: tokens grouped by a key, as sort-based mixture-of-experts dispatch writes it.

torchtitan's MoE (and code written like it) sorts the ``T * k`` (token, expert) pairs by
expert, ``argsort(keys)``, counts them per expert, ``histc(keys, bins=E, min=0, max=E)`` (or
``bincount(keys, minlength=E)``), runs each expert on its ``split`` piece of the sorted rows and
``cat``\\ s the pieces back before a ``scatter_add`` to the token rows. Each step moves rows,
and the counts are computed from every row; yet the result is token-wise. The rules here
prove it from four facts:

* ``argsort`` of a flattened key tensor is a *grouped selection*: every (token, slot) entry
  once, in an order the keys decide (`Rows.key` is the argsort node); its values are flat ids
  (`FlatIds`), and ``ids // k`` over ``[T * k]`` is the token's row id.
* The keys' values lie in ``[0, E)`` (``topk`` or ``argmax`` indices over a dim of ``E``), so a
  histogram with one bin per integer of ``[0, E)`` counts every entry: the counts (`COUNTS`
  rows, which no rule lets reach a value) sum to the selection's length, and their
  ``.item()``\\ s are the group sizes.
* ``split(sorted, [count_0, ..., count_{E-1}])`` along the selection cuts it at the group
  boundaries: piece ``g`` holds exactly the entries whose key is ``g``, chosen by the entry's
  own row, so an op run on piece ``g`` with expert ``g``'s weights is a token-wise op; ``cat``
  of the pieces in order is the selection again.
* A slice to the counts' sum, or zeros of ``length - sum`` rows, keep it whole / add nothing.

Anything else done with the counts (a value in the loss, a reduction, a branch) is refused.
"""

from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass
from typing import Any

import sympy
import torch
from torch import fx

from treecompile.passes._graph import value
from treecompile.passes.rows.domain import IDS, RULES, Args, NotRowLocal, RowEnv, Rows, _dim, _nd, _shape, expr, op_key, same_expr

__all__ = ["COUNTS", "EMPTY", "FlatIds", "GroupCount", "grouped_cat", "grouped_split", "group_count_item",
           "counts_entry", "floor_divide", "indexes_by_flat_ids", "zero_rows", "same_count", "empty_rows",
           "vstack", "register", "sort", "histogram_behind"]

#: `Rows.key` of a histogram of group keys: its dim is the groups, not rows, but it counts rows.
COUNTS = "counts"
#: `Rows.key` of zero rows (a tensor of ``length - sum(counts)`` rows, which is none).
EMPTY = "empty"


@dataclass(frozen=True)
class FlatIds:
    """`Rows.ids` of a grouped selection's values: the flat index of an entry of a ``[T * inner]``
    tensor of rows (row ``i // inner``, slot ``i % inner``)."""

    inner: Any


@dataclass(frozen=True)
class GroupCount:
    """The state of ``counts[g]``: one group's count, a 0-d tensor read only by ``.item()``."""

    base: fx.Node
    group: int


@dataclass
class _Groups:
    """What is known of one key tensor's groups."""

    size: int  # E: the keys lie in [0, E)
    entries: Any = None  # the number of keyed entries (sympy), once flattened
    symbols: dict[int, sympy.Symbol] = dataclasses.field(default_factory=dict)  # group -> its count's symbol


# --------------------------------------------------------------------------- the keys

_FLATTEN = {"view", "reshape", "flatten", "ravel", "_unsafe_view"}
_CASTS = {"float", "double", "long", "int", "to", "type", "contiguous", "clone", "detach"}


def _key_base(node: Any) -> tuple[fx.Node, int] | None:
    """``(base, E)`` if ``node`` is a whole flattening (and casts) of ``topk`` / ``argmax``
    indices over a dim of ``E``: the keys' values lie in ``[0, E)``. None otherwise."""
    if not isinstance(node, fx.Node) or not isinstance(value(node), torch.Tensor) or value(node).dim() != 1:
        return None
    n = node
    while True:
        name = op_key(n)
        if name in _FLATTEN or name in _CASTS:
            src = n.args[0] if n.args else None
            if not isinstance(src, fx.Node) or not isinstance(value(src), torch.Tensor):
                return None
            if name in _CASTS and name in ("to", "type") and not _dtype_only(n):
                return None
            n = src
            continue
        break
    size = _index_range(n)
    if size is None or value(n).numel() != value(node).numel():
        return None
    return n, size


def _dtype_only(n: fx.Node) -> bool:
    return all(isinstance(a, (torch.dtype, torch.device, str)) for a in n.args[1:]) and \
        set(n.kwargs) <= {"dtype", "device", "non_blocking", "copy"}


def _index_range(n: fx.Node) -> int | None:
    """E if ``n`` holds indices into a dim of ``E`` entries: ``topk(..)[1]`` / ``.indices``, ``argmax``."""
    if n.op == "call_function" and n.target is operator.getitem and n.args[1] == 1:
        src = n.args[0]
        if isinstance(src, fx.Node) and op_key(src) == "topk":
            return _dim_size(src, 2, -1)
    if op_key(n) in ("argmax", "argmin") and (len(n.args) > 1 or "dim" in n.kwargs):
        return _dim_size(n, 1, None)
    return None


def _dim_size(n: fx.Node, pos: int, default: Any) -> int | None:
    x = n.args[0]
    dim = n.args[pos] if len(n.args) > pos else n.kwargs.get("dim", default)
    xv = value(x)
    if not isinstance(xv, torch.Tensor) or not isinstance(dim, int):
        return None
    size = xv.shape[_dim(dim, xv.dim())]
    return size if isinstance(size, int) else None


def _whole_keys(x: Any, env: RowEnv) -> tuple[fx.Node, _Groups] | None:
    """The key tensor behind a 1-D tensor of all the keyed entries, with its group facts."""
    found = _key_base(x)
    r = env.rows(x)
    if found is None or r is None or r.dim != 0 or r.key is not None or r.ids is not None or r.uniform:
        return None
    base, size = found
    groups = env.groups.setdefault(base, _Groups(size))
    groups.entries = expr(_shape(x)[0])
    return base, groups


# --------------------------------------------------------------------------- the rules

def argsort(node: fx.Node, a: Args, env: RowEnv, fallback) -> Any:
    """``argsort(keys)`` of every keyed entry: a grouped selection (flat ids), ascending only."""
    x = a.first
    keys = _whole_keys(x, env)
    descending = a.get(2, "descending", False)
    if keys is None or _dim(a.get(1, "dim", -1), 1) != 0 or descending is not False:
        return fallback(node, a, env)
    base, groups = keys
    env.sorted[node] = base
    return Rows(0, count=groups.entries, key=node, ids=FlatIds(env.rows(x).inner))


def sort(node: fx.Node, a: Args, env: RowEnv, fallback) -> Any:
    """``keys.sort()`` of every keyed entry: ``(the keys in group order, their flat ids)``, the
    selection's data and ids (ScatterMoE's ``flat_expert_idxs.sort()``), ascending only."""
    ids = argsort(node, a, env, lambda *_: None)
    if ids is None:
        return fallback(node, a, env)
    return dataclasses.replace(ids, ids=None), ids


def histogram(node: fx.Node, a: Args, env: RowEnv) -> Any:
    """``histc(keys, bins=E, min=0, max=E)`` / ``bincount(keys, minlength=E)`` of every keyed entry:
    the count of each group (rows the counts are; `COUNTS`)."""
    x = a.first
    keys = _whole_keys(x, env)
    if keys is None:
        if env.rows(x) is None:
            return None
        raise NotRowLocal(f"counts values over the sequence ({op_key(node)}) of a tensor that is not the indices of "
                          "a top-k or an argmax over a fixed number of groups, flattened whole")
    base, groups = keys
    if op_key(node) == "histc":
        bins, lo, hi = a.get(1, "bins", 100), a.get(2, "min", 0), a.get(3, "max", 0)
        ok = bins == groups.size and lo == 0 and hi == groups.size
    else:
        ok = a.get(1, "weights") is None and a.get(2, "minlength", 0) == groups.size
    if not ok:
        raise NotRowLocal(f"counts the groups of a top-k's indices ({op_key(node)}) in bins other than one per group "
                          f"0 .. {groups.size - 1}")
    return Rows(0, count=sympy.Integer(groups.size), key=(COUNTS, base))


def histogram_behind(x: Any) -> fx.Node | None:
    """The ``histc`` / ``bincount`` node ``x`` is, behind casts to another dtype; None if ``x`` is
    anything else (counts computed with)."""
    src = x
    while isinstance(src, fx.Node) and op_key(src) in _CASTS and src.args and isinstance(src.args[0], fx.Node) \
            and (op_key(src) not in ("to", "type") or _dtype_only(src)):
        src = src.args[0]
    return src if isinstance(src, fx.Node) and op_key(src) in ("histc", "bincount") else None


def counts_entry(env: RowEnv, node: fx.Node, x: Any, index: Any) -> GroupCount | None:
    """``counts[g]`` read only by ``.item()`` (a group's size), or None."""
    r = env.rows(x)
    if r is None or not isinstance(r.key, tuple) or r.key[0] != COUNTS:
        return None
    g = index[0] if isinstance(index, tuple) and len(index) == 1 else index
    if not isinstance(g, int) or isinstance(g, bool) or _nd(x) != 1:
        return None
    if histogram_behind(x) is None:
        return None  # counts computed with (scaled, shifted ...) are counts no longer
    if not node.users or any(op_key(u) != "item" for u in node.users):
        return None
    return GroupCount(r.key[1], g % int(r.count))


def group_count_item(node: fx.Node, env: RowEnv, st: GroupCount) -> None:
    """``.item()`` of a group's count: its symbol stands for the group's size."""
    v = value(node)
    sym = v.node.expr if isinstance(v, torch.SymInt) else None
    if not isinstance(sym, sympy.Symbol):
        raise NotRowLocal("reads a group's count on the host as something other than a size")
    env.groups[st.base].symbols[st.group] = sym
    env.group_syms[sym] = (st.base, st.group)


def floor_divide(node: fx.Node, a: Args, env: RowEnv, fallback) -> Any:
    """``flat_ids // k`` with ``k`` the flattening's inner size: each entry's token row id; any
    other division is element-wise (``fallback``)."""
    x, k = a.args[0], a.args[1] if len(a.args) > 1 else a.kwargs.get("other")
    r = env.rows(x) if isinstance(x, fx.Node) else None
    floor = op_key(node) == "floor_divide" or a.kwargs.get("rounding_mode") == "floor"
    if r is None or not isinstance(r.ids, FlatIds) or not floor:
        return fallback(node, a, env)
    kv = value(k) if isinstance(k, fx.Node) else k
    if not isinstance(kv, (int, torch.SymInt)) or isinstance(kv, bool) or not same_expr(expr(kv), r.ids.inner):
        raise NotRowLocal("computes with the flat ids of a sort other than dividing them by the slots per row")
    return dataclasses.replace(r, ids=IDS)


def indexes_by_flat_ids(r: Rows, ri: Rows | None, shape: tuple) -> bool:
    """Whether an index holds `FlatIds` into exactly ``r``'s merged rows (``x.view(-1)[sorted]``):
    the rows and their ``inner`` slots, nothing else, along the indexed dim."""
    return (ri is not None and isinstance(ri.ids, FlatIds) and r.key is None and r.ids is None and not r.uniform
            and same_expr(r.inner, ri.ids.inner) and r.count is not None
            and same_expr(expr(shape[r.dim]), r.count * r.inner))


def _sizes(env: RowEnv) -> list[tuple[Any, list[sympy.Symbol]]]:
    """For each key tensor whose every group count is known: (entries, the count symbols)."""
    out = []
    for g in env.groups.values():
        if g.entries is not None and len(g.symbols) == g.size:
            out.append((g.entries, [g.symbols[i] for i in range(g.size)]))
    return out


def same_count(env: RowEnv, a: Any, b: Any) -> bool:
    """Whether sizes ``a`` and ``b`` are equal given that each key tensor's group counts sum to
    its number of entries."""
    if not env.groups:
        return False
    try:
        diff = expr(a) - expr(b)
    except Exception:
        return False
    for entries, syms in _sizes(env):
        diff = diff.subs(syms[0], entries - sum(syms[1:]))
    return sympy.simplify(diff) == 0


def zero_rows(env: RowEnv, size: Any) -> bool:
    """Whether a size is provably 0 given the group counts (``length - sum(counts)``)."""
    return isinstance(size, torch.SymInt) and same_count(env, size, 0)


def grouped_split(node: fx.Node, a: Args, env: RowEnv) -> tuple | None:
    """``split(sorted, [count_0 .. count_{E-1}])`` along a grouped selection: one piece per group."""
    x = a.first
    r = env.rows(x)
    sizes = a.get(1, "split_size_or_sections", a.kwargs.get("split_size", a.kwargs.get("split_sizes")))
    if r is None or r.key not in env.sorted or not isinstance(sizes, (list, tuple)):
        return None
    if r.dim != _dim(a.get(2, "dim", 0), _nd(x)) or r.ids is not None:
        return None
    base = env.sorted[r.key]
    groups = env.groups[base]
    want = [env.group_syms.get(value(s).node.expr) if isinstance(s, fx.Node) and isinstance(value(s), torch.SymInt)
            else None for s in sizes]
    if want != [(base, g) for g in range(groups.size)]:
        raise NotRowLocal(f"splits the rows of a sort at sizes other than the counts of its own {groups.size} groups "
                          "in order (a piece would hold tokens of another group)")
    out = value(node)
    return tuple(Rows(r.dim, count=expr(piece.shape[r.dim]), key=(r.key, g)) for g, piece in enumerate(out))


def grouped_cat(node: fx.Node, parts: list, d: int, env: RowEnv) -> Rows | None:
    """``cat`` along the rows of every group's piece in order (zero rows aside): the selection."""
    states = [env.rows(p) for p in parts]
    kept = [s for s in states if not (s is not None and s.key == EMPTY and s.dim == d)]
    if not kept or any(s is None or s.dim != d or s.ids is not None for s in kept):
        return None
    if len(kept) == 1 and len(kept) < len(states):
        return dataclasses.replace(kept[0], count=expr(_shape(node)[d]))  # the selection and no rows
    keys = [s.key for s in kept]
    if not all(isinstance(k, tuple) and len(k) == 2 and isinstance(k[1], int) for k in keys):
        return None
    sel = keys[0][0]
    if sel not in env.sorted:
        return None
    if keys != [(sel, g) for g in range(env.groups[env.sorted[sel]].size)]:
        raise NotRowLocal("joins the pieces of a sort by groups other than all of them in order")
    return Rows(d, count=expr(_shape(node)[d]), key=sel)


def empty_rows(node: fx.Node, env: RowEnv) -> Rows | None:
    """A new tensor whose one dim of row size is provably 0 long: zero rows (`EMPTY`)."""
    dims = [d for d, size in enumerate(_shape(node)) if env.is_row_size(size)]
    if len(dims) == 1 and zero_rows(env, _shape(node)[dims[0]]):
        return Rows(dims[0], count=sympy.Integer(0), key=EMPTY, uniform=True)
    return None


def vstack(node: fx.Node, a: Args, env: RowEnv) -> Any:
    """``vstack`` of tensors of two or more dims: ``cat`` along dim 0."""
    parts = a.get(0, "tensors")
    if any(isinstance(value(p), torch.Tensor) and value(p).dim() < 2 for p in parts):
        if any(env.rows(p) is not None for p in parts):
            raise NotRowLocal("stacks 1-D tensors of rows as rows of a matrix (vstack)")
        return None
    return RULES["cat"].infer(node, Args((list(parts), 0), {}), env)


def register() -> None:
    """Puts the rules in `RULES`: ``argsort`` / ``sort`` fall back to their rule along a dim, a division
    not of flat ids to the element-wise rule."""
    from treecompile.passes.rows.domain import Rule

    along, sorting, divide = RULES["argsort"], RULES["sort"], RULES["floor_divide"]
    for name in ("floor_divide", "div", "divide"):
        RULES[name] = Rule(lambda n, a, env: floor_divide(n, a, env, divide.infer), "pointwise", divide.sizes)
    RULES["argsort"] = Rule(lambda n, a, env: argsort(n, a, env, along.infer), "grouped", along.sizes)
    RULES["sort"] = Rule(lambda n, a, env: sort(n, a, env, sorting.infer), "grouped", sorting.sizes)
    for name in ("histc", "bincount"):
        RULES[name] = Rule(histogram, "grouped")
    for name in ("vstack", "row_stack"):
        RULES[name] = Rule(vstack, "grouped")


