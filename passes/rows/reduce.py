"""Row rules: reductions, scans, sorts and softmaxes along dims, and norms."""

from __future__ import annotations

from typing import Any

import torch
from torch import fx
from treecompile.passes._graph import value
from treecompile.passes.rows.domain import (
    RULES,
    Args,
    NotRowLocal,
    RowEnv,
    Rule,
    _data_rows,
    _dim,
    _is_tensor,
    _name,
    _nd,
    _register,
    _right_aligned,
    combine,
    iter_nodes,
    op_is,
)
from treecompile.passes.rows.elementwise import (
    pointwise,
)

_REDUCE, _SCAN, _KEEP = "reduce", "scan", "keep"
_ONE_WITHOUT_DIM = ("max", "min", "median", "nanmedian")


def _along(kind: str, dim_at: tuple = (1, "dim"), default: Any = None, results: int = 1, message: str | None = None,
           keepdim_at: tuple = (None, "keepdim")):
    """A rule for ops that reduce, scan, sort or normalise along dims (``default`` when the dims are
    not given: None for all dims, else a dim)."""

    def rule(node: fx.Node, a: Args, env: RowEnv) -> Any:
        x = a.first
        r = env.rows(x)
        nd = _nd(x)
        dims = a.get(*dim_at)
        if dims is None or isinstance(dims, bool):
            dims = default
        if dims is None or dims == ():
            dims = list(range(nd))
        elif isinstance(dims, int):
            dims = [dims]
        dims = [_dim(d, nd) for d in dims]
        # max, min, median without a dim reduce everything to one value; with one, values and indices.
        n = 1 if results == 2 and a.get(*dim_at) is None and _name(node) in _ONE_WITHOUT_DIM else results
        if r is None:
            return None if n == 1 else (None,) * n
        r = _data_rows(env, x)
        if r.dim in dims:
            name = _name(node)
            raise NotRowLocal(message or (f"is a scan ({name}) along the sequence" if kind == _SCAN
                                          else f"reduces or reorders ({name}) along the sequence"))
        keep = kind != _REDUCE or bool(a.get(*keepdim_at, False))
        out = r if keep else r.at(r.dim - sum(d < r.dim for d in dims))
        # Tensors among the other arguments (diff's prepend / append) line up with the rows.
        out = combine([out, *(_right_aligned(env, t, _nd(node) if n == 1 else _nd(x))
                              for t in iter_nodes((a.args[1:], a.kwargs)) if _is_tensor(t))])
        return out if n == 1 else (out,) * n

    return rule


def _reg_along(names: str, *args, **kwargs) -> None:
    rule = _along(*args, **kwargs)
    for name in names.split():
        RULES[name] = Rule(rule, "along a dim")


_reg_along("sum nansum mean nanmean amax amin logsumexp count_nonzero any all argmax argmin std var prod", _REDUCE)
_reg_along("norm vector_norm linalg_vector_norm", _REDUCE, dim_at=(2, "dim"))  # (input, p / ord, dim)
_reg_along("var_mean std_mean aminmax", _REDUCE, results=2)
_reg_along("median nanmedian", _REDUCE, results=2)
_reg_along("mode", _REDUCE, default=-1, results=2)
_reg_along("kthvalue", _REDUCE, dim_at=(2, "dim"), default=-1, results=2)
_reg_along("cumsum cumprod logcumsumexp", _SCAN)
_reg_along("cummax cummin", _SCAN, results=2)
_reg_along("softmax log_softmax softmin _softmax _log_softmax", _KEEP, default=None)
_reg_along("sort", _KEEP, default=-1, results=2)
_reg_along("argsort msort", _KEEP, default=-1)
_reg_along("topk", _KEEP, dim_at=(2, "dim"), default=-1, results=2)
_reg_along("flip", _KEEP, dim_at=(1, "dims"))
_reg_along("roll", _KEEP, dim_at=(2, "dims"))
_reg_along("glu", _KEEP, default=-1)
_reg_along("fft ifft rfft irfft hfft ihfft", _KEEP, dim_at=(2, "dim"), default=-1)
_reg_along("fft2 ifft2 rfft2 irfft2", _KEEP, dim_at=(2, "dim"), default=(-2, -1))
_reg_along("fftn ifftn rfftn irfftn fftshift ifftshift", _KEEP, dim_at=(2, "dim"), default=None)
_reg_along("diff", _KEEP, dim_at=(2, "dim"), default=-1,
           message="takes differences along the sequence (torch.diff): the row before a token in the packed row is "
                   "not its predecessor on the path")
_reg_along("normalize", _KEEP, dim_at=(2, "dim"), default=1,
           message="normalises over the sequence (statistics shared by the tokens of the row)")
@_register("along a dim", "max min")
def max_min(node: fx.Node, a: Args, env: RowEnv) -> Any:
    """``max(a, b)`` element-wise with a tensor ``b``; with a dim (or none), a reduction."""
    if _is_tensor(a.get(1, "other")):
        return pointwise(node, a, env)
    return reduction(node, a, env)


RULES["fliplr"] = Rule(lambda n, a, e: _along(_KEEP, default=1)(n, Args(a.args[:1], {}), e), "along a dim")
RULES["flipud"] = Rule(lambda n, a, e: _along(_KEEP, default=0)(n, Args(a.args[:1], {}), e), "along a dim")


def reduction(node: fx.Node, a: Args, env: RowEnv) -> Any:
    """``max`` / ``min`` with a dim (values and indices) or without (over everything)."""
    two = a.get(1, "dim") is not None
    return _along(_REDUCE, results=2 if two else 1)(node, a, env)


_NORM = "normalises over the sequence (statistics shared by the tokens of the row)"


@_register("norm", "layer_norm rms_norm native_layer_norm", sizes=(1, "normalized_shape"))
def layer_norm(node: fx.Node, a: Args, env: RowEnv) -> Any:
    x = a.first
    r = _data_rows(env, x)
    shape = a.get(1, "normalized_shape")
    shape = value(shape) if isinstance(shape, fx.Node) else shape
    n = len(shape) if isinstance(shape, (list, tuple, torch.Size)) else 1
    if r is not None and r.dim >= _nd(x) - n:
        raise NotRowLocal(_NORM)
    for w in iter_nodes(a.args[2:]):
        if env.rows(w) is not None:
            raise NotRowLocal("normalises with weights that have rows")
    return r if not isinstance(value(node), (tuple, list)) else (r, None, None)


@_register("norm", "group_norm instance_norm local_response_norm")
def channel_norm(node: fx.Node, a: Args, env: RowEnv) -> Any:
    """Statistics per sample (and channel): rows must be the samples (dim 0)."""
    r = _data_rows(env, a.first)
    if r is not None and (r.dim != 0 or op_is(node, "instance_norm") and r.dim > 1):
        raise NotRowLocal(_NORM)
    return r


@_register("norm", "batch_norm")
def batch_norm(node: fx.Node, a: Args, env: RowEnv) -> Any:
    """Evaluation with running statistics is a per-channel affine map; training computes
    statistics over the batch and spatial dims, which hold the rows."""
    r = _data_rows(env, a.first)
    training = a.get(5, "training", False)
    running = a.get(1, "running_mean")
    if r is not None and (training or running is None or r.dim == 1):
        raise NotRowLocal(_NORM)
    return r


# --------------------------------------------------------------------------- contractions

