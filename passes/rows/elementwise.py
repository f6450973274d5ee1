"""Row rules: element-wise ops, casts, shape reads, host reads, ``torch.vmap``'s batch dims."""

from __future__ import annotations

from typing import Any

import torch
from torch import fx
from treecompile.passes._graph import value
from treecompile.passes.rows.domain import (
    Args,
    NotRowLocal,
    RowEnv,
    _data_rows,
    _dim,
    _is_tensor,
    _nd,
    _register,
    _right_aligned,
    combine,
    iter_nodes,
    op_is,
)

_POINTWISE = """
abs absolute acos arccos acosh arccosh add addcdiv addcmul angle asin arcsin asinh arcsinh atan arctan atan2 arctan2
atanh arctanh bitwise_and bitwise_not bitwise_or bitwise_xor bitwise_left_shift bitwise_right_shift ceil clamp clip
clamp_min clamp_max conj conj_physical copysign cos cosh deg2rad digamma div divide eq erf erfc erfinv exp exp2
expm1 fix float_power floor floor_divide fmax fmin fmod frac ge greater_equal gt greater heaviside hypot i0 igamma
igammac isclose isfinite isinf isnan isneginf isposinf isreal ldexp le less_equal lerp lgamma log log10 log1p log2
logaddexp logaddexp2 logical_and logical_not logical_or logical_xor logit lt less maximum minimum mul multiply mvlgamma
nan_to_num ne not_equal neg negative nextafter polygamma positive pow rad2deg real imag reciprocal remainder round
rsqrt rsub sgn sigmoid sign signbit sin sinc sinh sqrt square sub subtract tan tanh true_divide trunc xlogy
masked_fill relu relu6 gelu silu mish elu selu celu leaky_relu hardtanh hardswish hardsigmoid softplus softsign log_sigmoid
tanhshrink hardshrink softshrink threshold logsigmoid prelu rrelu polar complex resolve_conj
resolve_neg copy fill zero entr erfcx expit exp2 ndtr ndtri
log_ndtr xlog1py sinc special_expit
""".split()


#: Op names that compute each element of their result from that element of their inputs
#: alone (the element-wise ops and casts): such an op commutes with any cut of the rows.
POINTWISE = frozenset(_POINTWISE) | {"truediv", "floordiv", "to", "type_as", "float", "double", "half", "bfloat16",
                                     "clone", "contiguous"}

#: Op names that compute each row of their result from that row of their inputs alone (the
#: element-wise ops, Python's operators, casts, ``linear`` over the features, indexing): the
#: rewrites that run such ops on more rows than the model did (`passes/rooted.py`,
#: `passes/first_row.py`) take only these, and the rules below judge them again after.
ROW_LOCAL = POINTWISE | {"add", "sub", "mul", "neg", "pow", "where", "linear", "getitem"}


@_register("pointwise", _POINTWISE)
def pointwise(node: fx.Node, a: Args, env: RowEnv) -> Any:
    """Element-wise with broadcasting: each result element reads the same element of each
    input, so the inputs' rows must be the same rows at the same (right-aligned) dim."""
    nd = _nd(node)
    return combine([_right_aligned(env, x, nd) for x in iter_nodes((a.args, a.kwargs)) if _is_tensor(x)])


@_register("cast", "to type type_as float double half bfloat16 int long bool short byte char cfloat cdouble cpu cuda "
           "contiguous clone detach requires_grad pin_memory _to_copy alias lift_fresh _wrap_for_grad _unwrap_for_grad")
def cast(node: fx.Node, a: Args, env: RowEnv) -> Any:
    """Same values in another dtype, device or memory: the first tensor's rows (row ids included)."""
    if not isinstance(value(node), torch.Tensor):
        return None
    return env.rows(a.first)


@_register("meta", "size dim ndimension numel nelement stride element_size is_floating_point is_complex "
           "is_contiguous data_ptr storage_offset get_device __len__ sym_size sym_numel sym_stride "
           "_assert _assert_async _assert_scalar _check _check_is_size sym_constrain_range "
           "sym_constrain_range_for_size _functional_assert_async", sizes=("all",))
def meta(node: fx.Node, a: Args, env: RowEnv) -> Any:
    """Reads shapes or checks a condition: no tensor result, nothing moves."""
    return None


@_register("vmap", "_add_batch_dim", sizes=("all",))
def add_batch_dim(node: fx.Node, a: Args, env: RowEnv) -> Any:
    """``torch.vmap`` over a dim: the function sees one slice of it at a time. Mapped over the
    rows, every op inside sees one row (the rows come back at `remove_batch_dim`); mapped
    over another dim, the rows move down past it."""
    x, bdim, level = a.args[:3]
    r = env.rows(x)
    if r is None:
        return None
    if isinstance(r.ids, tuple):
        raise NotRowLocal("maps over a tensor of row ids with other columns")
    bdim = _dim(bdim, _nd(x))
    if r.dim == bdim:
        env.hidden[_level(level)] = r
        return None
    return r.at(r.dim - (r.dim > bdim))


@_register("vmap", "_remove_batch_dim", sizes=("all",))
def remove_batch_dim(node: fx.Node, a: Args, env: RowEnv) -> Any:
    x, level, _, out_dim = a.args[:4]
    r = env.rows(x)
    out_dim = _dim(out_dim, _nd(node))
    moved = None if r is None else r.at(r.dim + (r.dim >= out_dim))
    hidden = env.hidden.get(_level(level))
    return combine([moved, None if hidden is None else hidden.at(out_dim)])


def _level(level: Any) -> Any:
    return value(level) if isinstance(level, fx.Node) and isinstance(value(level), int) else level


@_register("host read", "item tolist __bool__ __int__ __float__ __index__")
def host_read(node: fx.Node, a: Args, env: RowEnv) -> Any:
    if env.rows(a.first) is not None:
        raise NotRowLocal("reads a value of the rows on the host (item / tolist / a branch on a tensor): it may "
                          "depend on every token of the packed row")
    return None


@_register("complex view", "view_as_complex view_as_real")
def complex_view(node: fx.Node, a: Args, env: RowEnv) -> Any:
    r = _data_rows(env, a.first)
    if r is not None and op_is(node, "view_as_complex") and r.dim == _nd(a.first) - 1:
        raise NotRowLocal("views the rows as complex numbers")
    return r


# --------------------------------------------------------------------------- creation


