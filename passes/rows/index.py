"""Row rules: indexing, gathers and scatters, and rows chosen by the data (``nonzero``).

Picking rows needs row ids: ``arange(S)`` (the identity) or the ids ``nonzero`` /
``torch.where`` return for a row-wise mask (a *selection*, keyed by the mask). Values of
the selected rows line up with each other and scatter back to the rows they came from
(a token-wise mixture of experts); any other index along the rows moves tokens.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import fx
from treecompile.passes._graph import ARANGE, ancestors, is_call, mutated_args, same_size, storage_of, value
from treecompile.passes.rows.domain import (
    _LOOKUP,
    _TABLE_SLICE,
    IDS,
    LENGTH,
    ONE_ROW,
    ROW_INDEX_MATH,
    RULES,
    SQUARE,
    TABLE,
    Args,
    NotRowLocal,
    RowEnv,
    Rows,
    _data_rows,
    _dim,
    _is_row_sym,
    _is_tensor,
    _name,
    _nd,
    _register,
    _right_aligned,
    _shape,
    combine,
    expr,
    iter_nodes,
    op_is,
    op_key,
    same_expr,
)
from treecompile.passes.rows.elementwise import (
    pointwise,
)
from treecompile.passes.rows.grouped import counts_entry, indexes_by_flat_ids, same_count


def _full(env: RowEnv, sl: slice, size: Any) -> bool:
    """Whether ``sl`` takes every element of a dim of ``size`` in order."""
    start, stop, step = (value(x) if isinstance(x, fx.Node) else x for x in (sl.start, sl.stop, sl.step))
    if step not in (None, 1):
        return False
    if start not in (None, 0) and not (_sym_or_int(start) and same_size(-start, size)):
        return False
    return stop is None or _sym_or_int(stop) and (same_size(stop, size) or isinstance(stop, int) and stop >= 2**62
                                                  or same_count(env, stop, size))


def _sym_or_int(x: Any) -> bool:
    return isinstance(x, (int, torch.SymInt)) and not isinstance(x, bool)


def indexed(x: Any, index: Any, env: RowEnv, out_shape: tuple | None = None) -> tuple[Rows | None, int]:
    """The rows of ``x[index]`` and its number of dims (numpy indexing: slices, ints, None,
    Ellipsis, and tensor indices, which are broadcast together and placed where the first
    one is if they are adjacent, else first)."""
    r = env.rows(x)
    shape = _shape(x)
    nd_in = len(shape)
    items = list(index) if isinstance(index, tuple) else [index]

    def consumes(it):
        if it is None or it is Ellipsis:
            return 0
        if _is_tensor(it) and value(it).dtype == torch.bool:
            return _nd(it)
        return 1

    used = sum(consumes(i) for i in items)
    if Ellipsis in items:
        k = items.index(Ellipsis)
        items = items[:k] + [slice(None)] * (nd_in - used) + items[k + 1:]
    else:
        items = items + [slice(None)] * (nd_in - used)
    tensor_index = any(_is_tensor(i) for i in items)
    layout: list[tuple] = []  # per result dim before the advanced block: ("in", d), ("new",), ("adv",)
    advanced: list[tuple[int, list[int], Any]] = []  # (item position, input dims, index)
    d = 0
    for pos, it in enumerate(items):
        if it is None:
            layout.append(("new",))
            continue
        if isinstance(it, slice):
            if r is not None and d == r.dim:
                if not _full(env, it, shape[d]):
                    raise NotRowLocal(LENGTH)
            elif _is_row_sym(env, it) and not _keeps_whole(it, shape[d], out_shape, len(layout), tensor_index):
                raise NotRowLocal(_TABLE_SLICE)
            layout.append(("in", d))
            d += 1
            continue
        if _is_tensor(it) or tensor_index:
            k = consumes(it)
            advanced.append((pos, list(range(d, d + k)), it))
            layout.append(("adv",))
            d += k
            continue
        # an integer index
        if r is not None and d == r.dim:
            raise NotRowLocal(ONE_ROW)
        if _is_row_sym(env, it):
            raise NotRowLocal(_TABLE_SLICE)
        d += 1
    if not advanced:
        out_dims = [e for e in layout]
        return _basic_rows(r, out_dims), len(out_dims)
    # The advanced block: its dims, and where it goes.
    block_nd = max((1 if value(i).dtype == torch.bool else _nd(i)) if _is_tensor(i) else 0 for _, _, i in advanced)
    adv_positions = [k for k, e in enumerate(layout) if e[0] == "adv"]
    adjacent = adv_positions == list(range(adv_positions[0], adv_positions[0] + len(adv_positions)))
    rest = [e for e in layout if e[0] != "adv"]
    first = adv_positions[0] if adjacent else 0
    # Where the block starts in the result: after the non-advanced entries before it.
    start = sum(1 for e in layout[:first] if e[0] != "adv") if adjacent else 0
    out_nd = len(rest) + block_nd
    states: list[Rows | None] = []
    rows_indexed = False
    for _, dims, it in advanced:
        if not _is_tensor(it):
            if r is not None and r.dim in dims:
                raise NotRowLocal(ONE_ROW)
            continue
        ri = env.rows(it)
        if value(it).dtype == torch.bool:
            count = expr(out_shape[start]) if out_shape is not None and len(out_shape) > start else None
            states.append(_masked(env, r, ri, dims, it, start, count))
            rows_indexed = rows_indexed or (r is not None and r.dim in dims)
            continue
        if r is not None and r.dim in dims:
            rows_indexed = True
            by_ids = ri is not None and ri.ids == IDS and same_expr(r.inner, 1) and _whole_dim(r, shape)
            if not (by_ids or indexes_by_flat_ids(r, ri, shape)):
                raise NotRowLocal(_gather_reason(it, env))
            states.append(ri.data().at(ri.dim + start + block_nd - _nd(it)))
            continue
        if ri is not None:
            if ri.ids is not None:
                raise NotRowLocal(_LOOKUP)
            states.append(ri.at(ri.dim + start + block_nd - _nd(it)))
    if r is not None and not rows_indexed:
        k = rest.index(("in", r.dim))
        states.append(r.at(k if k < start else k + block_nd))
    return combine(states), out_nd


def _whole_dim(r: Rows, shape: tuple) -> bool:
    """Whether the rows' dim holds just the rows (an index into it picks rows)."""
    return r.count is not None and same_expr(expr(shape[r.dim]), r.count)


def _keeps_whole(it: slice, size: Any, out_shape: tuple | None, at: int, tensor_index: bool) -> bool:
    """Whether ``[:stop]`` bounded by the length keeps a dim of constant ``size`` whole: the
    result's dim ``at`` is as long (old GPT-NeoX's ``cos_cached[:T]`` on its leading dim of
    size 1: the length never cuts it)."""
    return (not tensor_index and out_shape is not None and isinstance(size, int) and it.start in (None, 0)
            and it.step in (None, 1) and at < len(out_shape) and isinstance(out_shape[at], int)
            and out_shape[at] == size)


def _basic_rows(r: Rows | None, layout: list[tuple]) -> Rows | None:
    if r is None:
        return None
    ids = r.ids
    if isinstance(ids, tuple):
        ids = ("in", ids[0]) in layout and (layout.index(("in", ids[0])), ids[1])
        if ids is False:
            raise NotRowLocal("indexes a tensor of row ids by an integer along its columns")  # handled by _ids_column
    return dataclasses.replace(r, dim=layout.index(("in", r.dim)), ids=ids)


def _masked(env: RowEnv, r: Rows | None, rm: Rows | None, dims: list[int], mask: fx.Node, start: int,
            count: Any) -> Rows | None:
    """``x[mask]`` with a boolean mask over ``dims``: a selection of rows if it covers them."""
    if r is not None and r.dim in dims:
        if rm is None or rm.key is not None or rm.ids is not None or dims[0] + rm.dim != r.dim:
            raise NotRowLocal("selects rows of the sequence with a mask that does not come from those rows")
        return _selection(env, mask, start, count)
    if rm is not None:
        raise NotRowLocal("selects with a mask over the rows entries of a tensor without rows")
    if r is not None and max(dims) < r.dim and count is not None:
        _count_of_other_entries(env, mask, count)
    return None


def _count_of_other_entries(env: RowEnv, mask: fx.Node, count: Any) -> None:
    """``x[mask]`` with a mask over dims before the rows (X-MOD's language adapters choose batch
    entries, whole rows each): the count of its entries is not a count of rows, provided the
    mask's values read no size of the sequence (else a path alone would choose other entries)."""
    if _reads_sequence_size(env, mask):
        raise NotRowLocal("selects along the batch with a mask computed from the sequence length")
    env.other_counts |= {x for x in getattr(count, "free_symbols", set()) if str(x).startswith("u")}


def _reads_sequence_size(env: RowEnv, node: fx.Node) -> bool:
    """Whether a value upstream of ``node`` takes a size mentioning the sequence length."""
    for n in ancestors(node) | {node}:
        flat: list = []
        fx.node.map_aggregate((n.args, n.kwargs), flat.append)
        if any(isinstance(v, (torch.SymInt, torch.SymFloat)) and env.is_row_size(v)
               for v in (value(a) if isinstance(a, fx.Node) else a for a in flat)):
            return True
    return False


def _selection(env: RowEnv, key: fx.Node, dim: int, count: Any = None) -> Rows:
    """Rows chosen by ``key``'s non-zero entries, in order, at ``dim``. A mask computed again
    the same way from the same tensors (``y[idx == i] = expert(x[idx == i])``) chooses the
    same rows: it is the same selection."""
    key = next((k for k in env.selections if _recomputed(k, key)), key)
    if key not in env.selections:
        env.selections[key] = count
    return Rows(dim, count=env.selections[key], key=key)


_CONSTANTS = (int, float, bool, str, type(None))


def _same_arg(a: Any, b: Any) -> bool:
    if isinstance(a, fx.Node) or isinstance(b, fx.Node):
        return a is b
    return isinstance(a, _CONSTANTS) and type(a) is type(b) and a == b


def _recomputed(first: fx.Node, again: fx.Node) -> bool:
    """Whether ``again`` computes what ``first`` did: the same element-wise op (a comparison,
    a cast; never a random draw) on the same nodes and constants, with no write in place into
    the memory of those nodes between the two."""
    if first is again:
        return True
    if (first.op, first.target) != (again.op, again.target) or first.op not in ("call_function", "call_method"):
        return False
    rule = RULES.get(op_key(first))
    if rule is None or rule.family not in ("pointwise", "cast") or len(first.args) != len(again.args) or \
            first.kwargs.keys() != again.kwargs.keys():
        return False
    if not all(_same_arg(a, b) for a, b in zip(first.args, again.args)) or \
            not all(_same_arg(first.kwargs[k], v) for k, v in again.kwargs.items()):
        return False
    read = {storage_of(n) for n in first.all_input_nodes}
    node = first.next
    while node is not again and node.op != "root":
        if any(storage_of(m) in read or storage_of(m) is None for m in mutated_args(node)):
            return False
        node = node.next
    return node is again


def _gather_reason(index: Any, env: RowEnv) -> str:
    source = _positional_source(index, env)
    if source:
        return (f"gathers or scatters rows of the sequence at indices computed from {source} (e.g. a token shift "
                "x[:, arange(T) - 1]): the row before a token in the packed row is not its predecessor on the path")
    return ("gathers or scatters rows of the sequence at indices that are not the rows' own (rows chosen by nonzero / "
            "torch.where of a row-wise mask are): it reorders or shifts the packed row")


def _positional_source(index: Any, env: RowEnv) -> str | None:
    stack, seen = [n for n in iter_nodes(index)], set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if is_call(n, ARANGE):
            return "arange"
        if n is env.ctx.positions or n.op == "placeholder" and "position" in str(n.target).lower():
            return "the positions"
        if env.row_symbols(value(n)):
            return "the sequence length"
        stack.extend(n.all_input_nodes)
    return None


@_register("getitem", "getitem", sizes="rule")
def getitem(node: fx.Node, a: Args, env: RowEnv) -> Any:
    x, index = a.args[0], a.args[1]
    if not _is_tensor(x):
        st = env.state(x)
        if isinstance(st, tuple) and isinstance(index, (int, slice)):
            return st[index]
        return None
    entry = counts_entry(env, node, x, index)
    if entry is not None:
        return entry
    column = _ids_column(env, x, index)
    if column is not ...:
        return column
    rows, _ = indexed(x, index, env, _shape(node))
    return rows


def _ids_column(env: RowEnv, x: fx.Node, index: Any) -> Any:
    """``nz[:, j]`` on ``nonzero``'s result: the row ids if ``j`` is the rows' column, else data."""
    r = env.rows(x)
    if r is None or not isinstance(r.ids, tuple):
        return ...
    d, col = r.ids
    items = list(index) if isinstance(index, tuple) else [index]
    if len(items) != d + 1 or any(i != slice(None) for i in items[:d]) or not isinstance(items[d], int):
        raise NotRowLocal("indexes a tensor of row ids other than by column")
    return dataclasses.replace(r, ids=IDS if items[d] % _shape(x)[d] == col else None)


@_register("select", "select", sizes="rule")
def select(node: fx.Node, a: Args, env: RowEnv) -> Any:
    x = a.first
    nd = _nd(x)
    d, i = _dim(a.get(1, "dim"), nd), a.get(2, "index")
    r = env.rows(x)
    if r is not None and isinstance(r.ids, tuple) and r.ids[0] == d and isinstance(i, int):
        return dataclasses.replace(r, dim=r.dim - (r.dim > d), ids=IDS if i % _shape(x)[d] == r.ids[1] else None)
    if r is not None and r.dim == d:
        raise NotRowLocal(ONE_ROW)
    if _is_row_sym(env, i):
        raise NotRowLocal(_TABLE_SLICE)
    return None if r is None else r.at(r.dim - (r.dim > d))


@_register("narrow", "narrow slice", sizes="rule")
def narrow(node: fx.Node, a: Args, env: RowEnv) -> Any:
    """``narrow(dim, start, length)`` / ``aten.slice(dim, start, end)``: the identity on the rows' dim."""
    x = a.first
    r = _data_rows(env, x) if env.rows(x) is None or env.rows(x).ids is None else env.rows(x)
    nd = _nd(x)
    d = _dim(a.get(1, "dim", 0), nd)
    if r is not None and r.dim == d:
        if not same_size(_shape(node)[d], _shape(x)[d]):
            raise NotRowLocal(LENGTH)
        return r
    if _is_row_sym(env, a.args[2:]):
        raise NotRowLocal(_TABLE_SLICE)
    return r


@_register("setitem", "setitem", sizes="rule")
def setitem(node: fx.Node, a: Args, env: RowEnv) -> Any:
    """``x[index] = v``: ``v``'s rows must be the rows of the region it is written to."""
    x, index, v = a.args[0], a.args[1], a.args[2]
    _write(env, x, index, v)
    return None


def _write(env: RowEnv, x: Any, index: Any, v: Any) -> None:
    region, nd = indexed(x, index, env)
    rv = _right_aligned(env, v, nd) if _is_tensor(v) else None
    if rv is None:
        return
    if region is None:
        raise NotRowLocal("writes rows into a part of a tensor that has no rows there")
    combine([region, rv])
    if region.dim != rv.dim:
        raise NotRowLocal(SQUARE)


@_register("mutation", "index_put", sizes="rule")
def index_put(node: fx.Node, a: Args, env: RowEnv) -> Any:
    x, indices, v = a.first, a.get(1, "indices"), a.get(2, "values")
    _write(env, x, tuple(slice(None) if i is None else i for i in indices), v)
    return env.rows(x)


@_register("index_select", "index_select")
def index_select(node: fx.Node, a: Args, env: RowEnv) -> Any:
    """``x.index_select(dim, index)``: picking rows needs row ids; row data as the index of a
    table without rows gives rows (an embedding lookup)."""
    x, d, index = a.first, a.get(1, "dim"), a.get(2, "index")
    rx, ri = env.rows(x), env.rows(index)
    d = _dim(d, _nd(x))
    if rx is not None and rx.dim == d and rx.key == TABLE and ri is not None and ri.ids is None \
            and ri.key != TABLE and same_expr(rx.inner, 1):
        return ri.at(d)  # a table read at each row's position
    if rx is not None and rx.dim == d:
        if ri is None or ri.ids != IDS or not _whole_dim(rx, _shape(x)) or not same_expr(rx.inner, 1):
            raise NotRowLocal(_gather_reason(index, env))
        return ri.data().at(d)
    if ri is not None:
        if ri.ids is not None:
            raise NotRowLocal(_LOOKUP)
        if rx is not None:
            raise NotRowLocal(SQUARE)
        return ri.at(d)
    return None if rx is None else _data_rows(env, x)


@_register("gather", "gather take_along_dim")
def gather(node: fx.Node, a: Args, env: RowEnv) -> Any:
    """``x.gather(dim, index)``: the result has the index's shape; along a dim that is not the
    rows, the index must have the same rows as ``x`` (each row reads itself)."""
    x = a.first
    if op_is(node, "take_along_dim"):
        index, d = a.get(1, "indices"), a.get(2, "dim")
    else:
        d, index = a.get(1, "dim"), a.get(2, "index")
    rx, ri = _data_rows(env, x), env.rows(index)
    nd = _nd(x)
    d = _dim(d, nd) if d is not None else None
    if rx is not None and d is not None and rx.dim == d and ri is not None and ri.ids == IDS and ri.dim == d \
            and same_expr(rx.inner, 1) and _whole_dim(rx, _shape(x)):
        # Each entry of the index holds the row id of its own row: out[i, ..] = x[id(i), ..], row id(i)'s data.
        return ri.data()
    if rx is not None and (d is None or rx.dim == d):
        raise NotRowLocal(_gather_reason(index, env))
    if ri is not None and ri.ids is not None:
        raise NotRowLocal(_LOOKUP)
    if rx is not None and ri is None:
        raise NotRowLocal("gathers with an index that has no rows from a tensor that has: it reads fixed rows")
    return combine([rx, ri])


@_register("scatter", "scatter scatter_add scatter_reduce index_add index_copy index_fill index_reduce")
def scatter(node: fx.Node, a: Args, env: RowEnv) -> Any:
    """Writes along a dim: into the rows' dim only at row ids, with the values of the same
    rows; along another dim, index and source must have the target's rows."""
    x = a.first
    d, index = a.get(1, "dim"), a.get(2, "index")
    src = a.get(3, "source", a.kwargs.get("src", a.kwargs.get("value")))
    rx, ri = env.rows(x), env.rows(index)
    rs = env.rows(src) if _is_tensor(src) else None
    nd = _nd(x)
    d = _dim(d, nd)
    if rx is not None and rx.ids is not None:
        raise NotRowLocal(ROW_INDEX_MATH)
    if rs is not None and rs.ids is not None:
        raise NotRowLocal(ROW_INDEX_MATH)
    index_along = _name(node).startswith("index_")
    if rx is not None and rx.dim == d:
        if ri is None or ri.ids != IDS or not _whole_dim(rx, _shape(x)) or not same_expr(rx.inner, 1):
            raise NotRowLocal(_gather_reason(index, env))
        if rs is not None and not (rs.uniform or rs.key == ri.key and rs.dim == (d if index_along else ri.dim)):
            raise NotRowLocal("scatters values of other rows than the row ids it writes to")
        return rx
    if ri is not None and ri.ids is not None:
        raise NotRowLocal(_LOOKUP)
    if index_along:
        if ri is not None:
            raise NotRowLocal("writes along a dim that is not the rows at indices that depend on the rows")
        return combine([rx, rs]) if rx is not None or rs is None else _target_without_rows()
    if rx is None and (ri is not None or rs is not None):
        return _target_without_rows()
    if rx is not None and ri is None:
        raise NotRowLocal("scatters with an index that has no rows into a tensor that has: it writes fixed rows")
    return combine([rx, ri, rs])


def _target_without_rows():
    raise NotRowLocal("writes values of rows into a tensor without rows")


@_register("masked_select", "masked_select")
def masked_select(node: fx.Node, a: Args, env: RowEnv) -> Any:
    x, mask = a.first, a.get(1, "mask")
    rx, rm = _data_rows(env, x), env.rows(mask)
    if rx is None and rm is None:
        return None
    if _nd(x) == 1 and _nd(mask) == 1 and rx is not None and rm is not None and rm.key is None and rm.ids is None:
        return _selection(env, mask, 0, expr(_shape(node)[0]))
    raise NotRowLocal("selects entries of the rows into one flat tensor")


@_register("nonzero", "nonzero argwhere")
def nonzero(node: fx.Node, a: Args, env: RowEnv) -> Any:
    """The indices of the non-zero entries: along the rows' dim they are row ids (a selection
    of rows, keyed by the tensor that chose them); the other columns are data of those rows."""
    x = a.first
    r = env.rows(x)
    if r is None:
        return None
    if r.key is not None or r.ids is not None or not same_expr(r.inner, 1) or not _whole_dim(r, _shape(x)):
        raise NotRowLocal("selects rows with nonzero from rows that are already a selection, row ids or merged rows")
    out = value(node)
    count = expr((out[0] if isinstance(out, (tuple, list)) else out).shape[0])
    sel = _selection(env, x, 0, count)
    if a.get(1, "as_tuple", False) or isinstance(out, (tuple, list)):
        return tuple(dataclasses.replace(sel, ids=IDS if k == r.dim else None) for k in range(_nd(x)))
    return dataclasses.replace(sel, ids=IDS if _nd(x) == 1 else (1, r.dim))


# --------------------------------------------------------------------------- joins and splits


@_register("index", "where")
def where(node: fx.Node, a: Args, env: RowEnv) -> Any:
    """``where(cond, x, y)`` is element-wise; ``where(cond)`` is ``nonzero(cond, as_tuple=True)``."""
    if len(a.args) == 1 and not a.kwargs:
        return nonzero(node, Args(a.args, {"as_tuple": True}), env)
    return pointwise(node, a, env)
