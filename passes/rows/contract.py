"""Row rules: products (matmul, einsum, linear), attention, lookups, convolutions, pooling."""

from __future__ import annotations

import string
from typing import Any

from torch import fx
from treecompile.passes._graph import value
from treecompile.passes.rows.domain import (
    _LOOKUP,
    SQUARE,
    Args,
    NotRowLocal,
    RowEnv,
    Rows,
    _data_rows,
    _is_tensor,
    _name,
    _nd,
    _shape,
    _register,
    _right_aligned,
    combine,
    iter_nodes,
)

_LETTERS = "abcdefghij"


def einsum_rows(specs: list[str], out: str, operands: list, env: RowEnv) -> Rows | None:
    """The rows of an einsum: every operand's rows on one letter, kept in the result."""
    found = []
    for spec, x in zip(specs, operands):
        r = _data_rows(env, x) if _is_tensor(x) else None
        if r is not None:
            found.append((spec[r.dim], r))
    if not found:
        return None
    letters = {ch for ch, _ in found}
    if any(ch not in out for ch in letters):
        raise NotRowLocal("contracts over the sequence (a matmul whose inner dim is S)")
    if len(letters) > 1:
        raise NotRowLocal(SQUARE)
    ch = letters.pop()
    return combine([r.at(out.index(ch)) for _, r in found])


def _matmul_specs(na: int, nb: int) -> tuple[list[str], str]:
    if na == 1 and nb == 1:
        return ["k", "k"], ""
    if na == 1:
        b = _LETTERS[:nb - 2]
        return ["k", b + "km"], b + "m"
    if nb == 1:
        b = _LETTERS[:na - 2]
        return [b + "nk", "k"], b + "n"
    nbatch = max(na, nb) - 2
    b = _LETTERS[:nbatch]
    return [b[nbatch - (na - 2):] + "nk", b[nbatch - (nb - 2):] + "km"], b + "nm"


_FIXED = {"mm": (["nk", "km"], "nm"), "bmm": (["bnk", "bkm"], "bnm"), "mv": (["nk", "k"], "n"),
          "dot": (["k", "k"], ""), "vdot": (["k", "k"], ""), "outer": (["n", "m"], "nm"), "ger": (["n", "m"], "nm")}
_WITH_INPUT = {"baddbmm": (["bnk", "bkm"], "bnm"), "addmm": (["nk", "km"], "nm"), "addbmm": (["bnk", "bkm"], "nm"),
               "addmv": (["nk", "k"], "n"), "addr": (["n", "m"], "nm")}


@_register("contraction", "matmul mm bmm mv dot vdot outer ger inner baddbmm addmm addbmm addmv addr")
def matmul(node: fx.Node, a: Args, env: RowEnv) -> Any:
    """A product contracts a dim: the rows must be on a dim it keeps."""
    name = _name(node)
    nd = _nd(node)
    if name in _WITH_INPUT:
        specs, out = _WITH_INPUT[name]
        product = einsum_rows(specs, out, [a.get(1, "batch1", a.kwargs.get("mat1")), a.get(2, "batch2",
                                                                                         a.kwargs.get("mat2"))], env)
        return combine([product, _right_aligned(env, a.first, nd) if _is_tensor(a.first) else None])
    x, y = a.args[0], a.args[1] if len(a.args) > 1 else a.kwargs.get("other", a.kwargs.get("mat2"))
    if name == "inner":
        if _nd(x) != 1 or _nd(y) != 1:
            specs, out = [_LETTERS[:_nd(x) - 1] + "k", "mnopq"[:_nd(y) - 1] + "k"], \
                _LETTERS[:_nd(x) - 1] + "mnopq"[:_nd(y) - 1]
        else:
            specs, out = ["k", "k"], ""
    elif name in _FIXED:
        specs, out = _FIXED[name]
    else:
        specs, out = _matmul_specs(_nd(x), _nd(y))
    return einsum_rows(specs, out, [x, y], env)


@_register("contraction", "linear")
def linear(node: fx.Node, a: Args, env: RowEnv) -> Any:
    x, w = a.first, a.get(1, "weight")
    b = _LETTERS[:_nd(x) - 1]
    rows = einsum_rows([b + "k", "mk" if _nd(w) == 2 else "k"], b + ("m" if _nd(w) == 2 else ""), [x, w], env)
    bias = a.get(2, "bias")
    return combine([rows, _right_aligned(env, bias, _nd(node)) if _is_tensor(bias) else None])


@_register("contraction", "bilinear")
def bilinear(node: fx.Node, a: Args, env: RowEnv) -> Any:
    x1, x2, w = a.args[:3]
    b = _LETTERS[:_nd(x1) - 1]
    rows = einsum_rows([b + "i", b + "j", "oij"], b + "o", [x1, x2, w], env)
    bias = a.get(3, "bias")
    return combine([rows, _right_aligned(env, bias, _nd(node)) if _is_tensor(bias) else None])


@_register("recurrent cell", "gru_cell lstm_cell rnn_tanh_cell rnn_relu_cell")
def rnn_cell(node: fx.Node, a: Args, env: RowEnv) -> Any:
    """One step of a recurrent cell over a batch of rows (x-transformers' GRU gating applies
    ``nn.GRUCell`` to the flattened tokens): each row with its own state, its weights shared."""
    hx = a.get(1, "hx")
    states = [a.first, *(hx if isinstance(hx, (list, tuple)) else [hx])]
    rows = [_data_rows(env, t) for t in states if _is_tensor(t)]
    if any(_is_tensor(w) and _data_rows(env, w) is not None for w in a.args[2:]):
        raise NotRowLocal("runs a recurrent cell whose weights have rows")
    out = combine([r for r in rows if r is not None])
    if out is not None and out.dim != 0:
        raise NotRowLocal("runs a recurrent cell with the rows on other than its batch dim")
    return (out, out) if _name(node) == "lstm_cell" else out


@_register("contraction", "einsum")
def einsum(node: fx.Node, a: Args, env: RowEnv) -> Any:
    eq = a.args[0]
    operands = list(a.args[1]) if len(a.args) == 2 and isinstance(a.args[1], (list, tuple)) else list(a.args[1:])
    specs, out = _parse_einsum(eq, [_nd(x) for x in operands])
    return einsum_rows(specs, out, operands, env)


def _parse_einsum(eq: str, nds: list[int]) -> tuple[list[str], str]:
    eq = eq.replace(" ", "")
    lhs, _, rhs = eq.partition("->")
    parts = lhs.split(",")
    ell = max((nd - len(p.replace("...", "")) for p, nd in zip(parts, nds) if "..." in p), default=0)
    pool = [c for c in string.ascii_uppercase if c not in eq]
    ell_letters = "".join(pool[:ell])
    specs = []
    for p, nd in zip(parts, nds):
        if "..." in p:
            k = nd - len(p.replace("...", ""))
            p = p.replace("...", ell_letters[ell - k:])
        specs.append(p)
    if "->" in eq:
        out = rhs.replace("...", ell_letters)
    else:
        counts = {c: sum(s.count(c) for s in specs) for c in set("".join(specs))}
        out = ell_letters + "".join(sorted(c for c, n in counts.items() if n == 1 and c not in ell_letters))
    return specs, out


@_register("contraction", "cdist")
def cdist(node: fx.Node, a: Args, env: RowEnv) -> Any:
    x1, x2 = a.args[:2]
    b = _LETTERS[:_nd(x1) - 2]
    return einsum_rows([b + "pm", b + "rm"], b + "pr", [x1, x2], env)


@_register("attention", "scaled_dot_product_attention")
def sdpa(node: fx.Node, a: Args, env: RowEnv) -> Any:
    """Attention: rows may be a batch dim (every query and key of one row), or only the
    queries (keys and values without rows); attending over rows is mixing them."""
    q, k, v = a.args[:3]
    mask = a.get(3, "attn_mask")
    b = _LETTERS[:_nd(q) - 2]
    try:
        rows = einsum_rows([b + "le", b + "se", b + "sf"], b + "lf", [q, k, v], env)
        if _is_tensor(mask):
            rows = combine([rows, _right_aligned(env, mask, _nd(q)) if env.rows(mask) is None or
                            env.rows(mask).dim == _nd(mask) - 2 else _not_causal()])
    except NotRowLocal:
        raise NotRowLocal("is scaled_dot_product_attention that is not provably causal, so it was not rewritten")
    return rows


def _not_causal():
    raise NotRowLocal("is scaled_dot_product_attention that is not provably causal, so it was not rewritten")


# --------------------------------------------------------------------------- lookups, convolutions


@_register("lookup", "embedding one_hot")
def embedding(node: fx.Node, a: Args, env: RowEnv) -> Any:
    """A table read at each row's own ids: the result has the index's rows (plus a last dim)."""
    tensors = [x for x in a.args[:2] if _is_tensor(x)]
    index = next((x for x in tensors if not value(x).dtype.is_floating_point), a.first)
    table = next((x for x in tensors if x is not index), None)
    if table is not None and env.rows(table) is not None:
        raise NotRowLocal("looks up a table that has rows")
    r = env.rows(index)
    if r is not None and r.ids is not None:
        raise NotRowLocal(_LOOKUP)
    return r


_CONV = "is a convolution over the sequence"


@_register("convolution", "conv1d conv2d conv3d conv_transpose1d conv_transpose2d conv_transpose3d convolution "
           "_convolution conv_tbc")
def conv(node: fx.Node, a: Args, env: RowEnv) -> Any:
    """A convolution mixes its channels and its spatial dims: rows may only be the batch."""
    x, w = a.args[:2]
    r = _data_rows(env, x)
    if any(env.rows(t) is not None for t in iter_nodes(a.args[1:])):
        raise NotRowLocal("convolves with weights that have rows")
    if r is None:
        return None
    if _nd(x) == _nd(w) and r.dim >= 2 and _pointwise_along(node, a, w, r.dim - 2):
        return r  # a kernel of size 1 along the rows (Conformer's pointwise Conv1d): one row in, one out
    if _nd(x) != _nd(w) or r.dim != 0:
        raise NotRowLocal(_CONV if r.dim >= 2 or _nd(x) != _nd(w) else "mixes the rows as convolution channels")
    return r


def _pointwise_along(node: fx.Node, a: Args, w: Any, spatial: int) -> bool:
    """Whether a ``conv1d`` / ``conv2d`` / ``conv3d`` has a kernel of size 1, stride 1 and no
    padding along spatial dim ``spatial``."""
    if _name(node) not in ("conv1d", "conv2d", "conv3d"):
        return False
    kernel = _shape(w)[2:]
    if spatial >= len(kernel) or kernel[spatial] != 1:
        return False

    def along(arg: Any, default: int) -> Any:
        if isinstance(arg, (tuple, list)):
            return arg[spatial] if len(arg) == len(kernel) else (arg[0] if len(arg) == 1 else None)
        return arg if isinstance(arg, (int, str)) else (default if arg is None else None)

    stride = along(a.get(3, "stride", 1), 1)
    padding = along(a.get(4, "padding", 0), 0)
    return stride == 1 and (padding == 0 or padding in ("same", "valid"))


@_register("pooling", "avg_pool1d avg_pool2d avg_pool3d max_pool1d max_pool2d max_pool3d adaptive_avg_pool1d "
           "adaptive_avg_pool2d adaptive_avg_pool3d adaptive_max_pool1d adaptive_max_pool2d adaptive_max_pool3d "
           "lp_pool1d lp_pool2d max_pool1d_with_indices max_pool2d_with_indices")
def pool(node: fx.Node, a: Args, env: RowEnv) -> Any:
    r = _data_rows(env, a.first)
    spatial = int(next(ch for ch in _name(node) if ch.isdigit()))
    out = value(node)
    if r is not None and r.dim >= _nd(a.first) - spatial:
        raise NotRowLocal("pools over the sequence")
    return (r, r) if isinstance(out, (tuple, list)) else r


