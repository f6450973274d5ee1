"""Row rules: views, permutations, expansions, joins and splits, padding."""

from __future__ import annotations

import dataclasses
from typing import Any

import sympy
import torch
from torch import fx
from treecompile.passes._graph import same_size, value
from treecompile.passes.rows.grouped import grouped_cat, grouped_split
from treecompile.passes.rows.domain import (
    IDS,
    LENGTH,
    ONE_ROW,
    SPLIT_ROWS,
    Args,
    NotRowLocal,
    RowEnv,
    Rows,
    _created_rows,
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
    divides,
    expr,
    numel,
    op_is,
)


@_register("attribute", "getattr")
def attribute(node: fx.Node, a: Args, env: RowEnv) -> Any:
    x, name = a.args[0], a.args[1]
    if not _is_tensor(x) or not isinstance(value(node), torch.Tensor):
        return None
    if name in ("T", "mT", "H", "mH"):
        return permute(node, Args((x,), {}), env, attr=name)
    if name in ("real", "imag", "data"):
        return env.rows(x)
    raise NotRowLocal(f"reads the tensor attribute {name!r} of the rows, which no row rule covers")


# --------------------------------------------------------------------------- views


@_register("view", "view reshape _unsafe_view flatten unflatten view_as reshape_as ravel _reshape_alias", sizes="*")
def reshape(node: fx.Node, a: Args, env: RowEnv) -> Any:
    """A reshape keeps the flat order of the elements: the rows stay rows if the new shape
    has a dim that holds the whole row index (alone, or merged with neighbouring dims)."""
    x = a.first
    if op_is(node, "view") and len(a.args) == 2 and isinstance(a.args[1], torch.dtype):
        r = env.rows(a.first)  # a view in another dtype: the same elements, unless the last dim changes
        if r is not None and r.dim == _nd(x) - 1 and _shape(node)[-1] != _shape(x)[-1]:
            raise NotRowLocal("views the rows as another dtype of another size")
        return r
    r = env.rows(x)
    if r is None:
        return None
    return reshaped(r, _shape(x), _shape(node))


def reshaped(r: Rows, src: tuple, dst: tuple) -> Rows:
    """``r`` after a reshape from ``src`` to ``dst``; raises if a row is cut across dims."""
    if isinstance(r.ids, tuple):
        d, _ = r.ids
        if src[d] != 1:
            raise NotRowLocal("reshapes a tensor of row ids whose columns hold other values")
        r = dataclasses.replace(r, ids=IDS)
    count = r.count
    sigma = r.inner * numel(src[r.dim + 1:])
    for q in range(len(dst)):
        below = numel(dst[q + 1:])
        if divides(below, sigma) and divides(sigma * count, below * expr(dst[q])):
            return dataclasses.replace(r, dim=q, inner=sympy.cancel(sigma / below))
    raise NotRowLocal("reshapes the rows so that one row's entries land in several rows, or several rows in one "
                      "(a view that splits or transposes the sequence)")


def _moved(r: Rows | None, perm: list[int]) -> Rows | None:
    """``r`` after ``permute(perm)`` (result dim ``i`` is input dim ``perm[i]``)."""
    if r is None:
        return None
    ids = r.ids
    if isinstance(ids, tuple):
        ids = (perm.index(ids[0]), ids[1])
    return dataclasses.replace(r, dim=perm.index(r.dim), ids=ids)


@_register("permute", "permute transpose swapaxes swapdims t movedim moveaxis adjoint numpy_T mT matrix_H mH")
def permute(node: fx.Node, a: Args, env: RowEnv, attr: str | None = None) -> Any:
    """A permutation of dims moves the rows' dim."""
    x = a.first
    r = env.rows(x)
    nd = _nd(x)
    if r is None:
        return None
    perm = list(range(nd))
    name = attr or _name(node)
    if name == "permute":
        dims = a.args[1:] if len(a.args) > 2 or not isinstance(a.get(1, "dims"), (list, tuple)) else a.get(1, "dims")
        perm = [_dim(d, nd) for d in dims]
    elif name in ("transpose", "swapaxes", "swapdims"):
        d0, d1 = _dim(a.get(1, "dim0"), nd), _dim(a.get(2, "dim1"), nd)
        perm[d0], perm[d1] = perm[d1], perm[d0]
    elif name in ("t", "T", "numpy_T"):  # x.T (torch >= 2.14 records aten.numpy_T)
        perm = perm[::-1]
    elif name in ("mT", "mH", "adjoint", "H", "matrix_H"):  # x.H, aten.matrix_H: of a matrix, so the last two
        perm[-2], perm[-1] = perm[-1], perm[-2]
    elif name in ("movedim", "moveaxis"):
        src, dst = a.get(1, "source"), a.get(2, "destination")
        src = [src] if isinstance(src, int) else list(src)
        dst = [dst] if isinstance(dst, int) else list(dst)
        src, dst = [_dim(d, nd) for d in src], [_dim(d, nd) for d in dst]
        rest = [d for d in range(nd) if d not in src]
        perm = [None] * nd
        for s, d in zip(src, dst):
            perm[d] = s
        it = iter(rest)
        perm = [p if p is not None else next(it) for p in perm]
    return _moved(r, perm)


@_register("unsqueeze", "unsqueeze")
def unsqueeze(node: fx.Node, a: Args, env: RowEnv) -> Any:
    r = env.rows(a.first)
    if r is None:
        return None
    d = _dim(a.get(1, "dim"), _nd(node))
    ids = r.ids
    if isinstance(ids, tuple):
        ids = (ids[0] + (ids[0] >= d), ids[1])
    return dataclasses.replace(r, dim=r.dim + (r.dim >= d), ids=ids)


@_register("squeeze", "squeeze")
def squeeze(node: fx.Node, a: Args, env: RowEnv) -> Any:
    r = env.rows(a.first)
    if r is None:
        return None
    shape, nd = _shape(a.first), _nd(a.first)
    dims = a.get(1, "dim")
    cand = range(nd) if dims is None else ([dims] if isinstance(dims, int) else list(dims))
    gone = {_dim(d, nd) for d in cand if isinstance(shape[_dim(d, nd)], int) and shape[_dim(d, nd)] == 1}
    ids = r.ids
    if isinstance(ids, tuple):
        ids = IDS if ids[0] in gone else (ids[0] - sum(g < ids[0] for g in gone), ids[1])
    return dataclasses.replace(r, dim=r.dim - sum(g < r.dim for g in gone), ids=ids)


@_register("expand", "expand expand_as broadcast_to repeat tile", sizes="*")
def expand(node: fx.Node, a: Args, env: RowEnv) -> Any:
    """New leading dims shift the rows' dim; a repeat tiles whole dims (a row stays a row). A
    tensor without rows expanded to S rows holds the same values in every row."""
    r = env.rows(a.first)
    if r is None:
        return _created_rows(node, env)
    if isinstance(r.ids, tuple):
        raise NotRowLocal("expands a tensor of row ids with other columns")
    return r.at(r.dim + _nd(node) - _nd(a.first))


@_register("repeat_interleave", "repeat_interleave", sizes="*")
def repeat_interleave(node: fx.Node, a: Args, env: RowEnv) -> Any:
    r = _data_rows(env, a.first)
    if r is None:
        return None
    reps, dim = a.get(1, "repeats"), a.get(2, "dim")
    if dim is None:
        raise NotRowLocal("repeats the flattened rows")
    if _dim(dim, _nd(a.first)) == r.dim:
        if not isinstance(reps, int):
            raise NotRowLocal("repeats rows a data-dependent number of times")
        return r.at(r.dim, r.inner * reps)
    return r


@_register("broadcast_tensors", "broadcast_tensors")
def broadcast_tensors(node: fx.Node, a: Args, env: RowEnv) -> Any:
    nd = max(_nd(x) for x in a.args)
    rows = combine([_right_aligned(env, x, nd) for x in a.args if _is_tensor(x)])
    if rows is None:
        return tuple(None for _ in a.args)
    return tuple(rows if env.rows(x) is not None else dataclasses.replace(rows, uniform=True) for x in a.args)


# --------------------------------------------------------------------------- indexing


@_register("cat", "cat concat concatenate")
def cat(node: fx.Node, a: Args, env: RowEnv) -> Any:
    parts = a.get(0, "tensors")
    nd = _nd(node)
    d = _dim(a.get(1, "dim", 0), nd)
    grouped = grouped_cat(node, [p for p in parts if _is_tensor(p)], d, env)
    if grouped is not None:
        return grouped
    rows = [_data_rows(env, p) for p in parts if _is_tensor(p) and _nd(p) == nd]
    if len(parts) == 1 and len(rows) == 1:
        return rows[0]  # one part: a copy (mistral-inference's positions, cat of one sequence's arange)
    if any(r is not None and r.dim == d for r in rows):
        raise NotRowLocal(LENGTH)
    return combine(rows)


@_register("stack", "stack")
def stack(node: fx.Node, a: Args, env: RowEnv) -> Any:
    parts = a.get(0, "tensors")
    nd = _nd(node)
    d = _dim(a.get(1, "dim", 0), nd)
    rows = []
    for p in parts:
        r = _data_rows(env, p)
        rows.append(None if r is None else r.at(r.dim + (r.dim >= d)))
    return combine(rows)


@_register("split", "split split_with_sizes chunk tensor_split unbind unsafe_split unsafe_chunk", sizes="rule")
def split(node: fx.Node, a: Args, env: RowEnv) -> Any:
    pieces = grouped_split(node, a, env)
    if pieces is not None:
        return pieces
    from treecompile.passes.rows.walk import _check_values

    _check_values(node, a, None, env)  # the sizes of any other split are values like any other
    x = a.first
    r = env.rows(x)
    out = value(node)
    n = len(out) if isinstance(out, (tuple, list)) else 1
    if r is None:
        return tuple(None for _ in range(n))
    nd = _nd(x)
    unbind = op_is(node, "unbind")
    d = _dim(a.get(1, "dim", 0) if unbind else a.get(2, "dim", 0), nd)
    if isinstance(r.ids, tuple) and unbind and r.ids[0] == d:
        return tuple(dataclasses.replace(r, ids=IDS if k == r.ids[1] else None) for k in range(n))
    if r.dim == d:
        raise NotRowLocal(ONE_ROW if unbind else SPLIT_ROWS)
    if isinstance(r.ids, tuple):
        raise NotRowLocal("splits a tensor of row ids with other columns")
    moved = r.at(r.dim - (unbind and r.dim > d))
    return tuple(moved for _ in range(n))


# --------------------------------------------------------------------------- along a dim

@_register("unfold", "unfold")
def unfold(node: fx.Node, a: Args, env: RowEnv) -> Any:
    """``x.unfold(dim, size, step)``: windows along a dim (new last dim)."""
    r = _data_rows(env, a.first)
    if r is not None and _dim(a.get(1, "dimension"), _nd(a.first)) == r.dim:
        raise NotRowLocal(LENGTH)
    return r


@_register("pad", "pad constant_pad_nd", sizes="rule")
def pad(node: fx.Node, a: Args, env: RowEnv) -> Any:
    """Padding along a dim that is not the rows; ``(0, 0)`` literally on the rows' dim."""
    x, amounts = a.first, a.get(1, "pad")
    r = _data_rows(env, x)
    if _is_row_sym(env, a.args[2:]) or _is_row_sym(env, list(a.kwargs.values())):
        raise NotRowLocal("pads with a value computed from the sequence length")
    if r is None:
        if _is_row_sym(env, amounts):
            raise NotRowLocal(LENGTH)
        return None
    nd = _nd(x)
    for i in range(0, len(amounts) - 1, 2):
        d = nd - 1 - i // 2
        if d == r.dim and not (_is_zero(amounts[i]) and _is_zero(amounts[i + 1])):
            same = same_size(_shape(node)[d], _shape(x)[d])
            raise NotRowLocal("pads or shifts along the sequence" if same else LENGTH)
        if d != r.dim and (_is_row_sym(env, amounts[i]) or _is_row_sym(env, amounts[i + 1])):
            raise NotRowLocal("pads a dim by an amount computed from the sequence length")
    return r


def _is_zero(amount: Any) -> bool:
    """0, or sizes whose arithmetic is 0 (``T - x[:, :T].shape[1]``)."""
    v = value(amount) if isinstance(amount, fx.Node) else amount
    if isinstance(v, torch.SymInt):
        return bool(v.node.expr.is_number) and int(v.node.expr) == 0
    return isinstance(v, int) and v == 0


@_register("mask", "tril triu")
def triangle(node: fx.Node, a: Args, env: RowEnv) -> Any:
    r = _data_rows(env, a.first)
    if r is not None and r.dim >= _nd(a.first) - 2:
        raise NotRowLocal("builds a triangular mask over the sequence")
    return r


