"""A long convolution written with FFTs, as a sum over each token's ancestors.

S4 / S4D, H3 and Hyena convolve each channel with a kernel as long as the sequence through
the FFT: ``irfft(rfft(u, n) * rfft(k, n), n)[..., :S]``. With ``n >= S + K - 1`` (``K`` the
kernel's length) nothing wraps around, so per path this is the causal convolution
``y[t] = sum_d k[d] * u[t - d]``: each token sums the tokens before it on its path, each
weighted by the kernel at their distance. On the packed tree row those are its
ancestors-or-self at path distances,

    y[q] = sum_{kv ancestor-or-self of q} k[c, positions[q] - positions[kv]] * u[c, kv]

which is `treecompile.kernels.long_conv.tree_long_conv`: each tree node's rows by one FFT
convolution over its root path (the work of one path as long as that root path per node, the
memory the channels times that length).

The rule: the three transforms run along the last dim with one ``n``; their norms and the
scalar factors on the two spectra multiply to 1 (``norm="forward"`` on the inverse with the
kernel's spectrum divided by ``n``, as safari writes it, included); one operand reads the
tokens and has the rows in its last dim and no other dim of that size, the other (the
kernel) reads no token and draws nothing at random; ``n >= S + K - 1`` holds for every
length; every use of the result takes ``[..., :S]``; and the kernel, evaluated at the
example length and at a shorter one, agrees on the shorter one's distances (a filter that
changes with the length, ``linspace(0, 1, L)``, does not: per path it is built at the
path's length). The kernel's subgraph is copied (marked as the pass's) and the copy feeds
the sum, so the positions pass leaves its index alone: it counts distances, not positions.
Otherwise the transform is left with a note and the verify pass refuses it.
"""

from __future__ import annotations

import operator

import sympy
import torch
from torch import fx

from treecompile.kernels import long_conv as _kernel  # noqa: F401  (registers treecompile::tree_long_conv)
from treecompile.passes._graph import (PassContext, ancestors, bind, describe, is_call, mutated_args, same_size,
                                      source_of, value)
from treecompile.passes._mask_eval import copy_values, evaluate, reads_tokens, two_lengths
from treecompile.passes.rows.random import draws

__all__ = ["is_fft_conv", "rewrite_fft_conv"]

_RFFT = (torch._C._fft.fft_rfft, torch.fft.rfft)
_IRFFT = (torch._C._fft.fft_irfft, torch.fft.irfft)
_FFT_ARGS = ["input", "n", "dim", "norm"]
_MUL = (operator.mul, torch.mul)
_DIV = (operator.truediv, torch.div, torch.true_divide)
# The factor each norm puts on a transform, relative to the one whose inverse undoes it
# exactly (``backward``: the forward transform unscaled, the inverse divided by ``n``).
_FORWARD_SCALE = {None: lambda n: 1, "backward": lambda n: 1, "forward": lambda n: 1 / n,
                  "ortho": lambda n: 1 / sympy.sqrt(n)}
_INVERSE_SCALE = {None: lambda n: 1, "backward": lambda n: 1, "forward": lambda n: n, "ortho": lambda n: sympy.sqrt(n)}


def is_fft_conv(node: fx.Node) -> bool:
    """An inverse real FFT (`rewrite_fft_conv` decides whether it closes a convolution)."""
    return is_call(node, _IRFFT)


def rewrite_fft_conv(gm: fx.GraphModule, ctx: PassContext, node: fx.Node) -> None:
    """Replaces ``irfft(rfft(u, n) * rfft(k, n), n)[..., :S]`` (module docstring) with the tree
    sum; leaves a note on the transform where one condition does not hold."""
    why = _rewrite(gm, ctx, node)
    if why is not None:
        ctx.notes[node] = f"a convolution by FFT {why}"


def _rewrite(gm: fx.GraphModule, ctx: PassContext, node: fx.Node) -> str | None:
    inv = bind(node, _FFT_ARGS, {"n": None, "dim": -1, "norm": None})
    n = _size(inv["n"])
    if n is None or not _last(inv["input"], inv["dim"]) or inv["norm"] not in _INVERSE_SCALE:
        return "whose inverse transform is not along the last dim with a given length"
    found = _scalars(inv["input"])
    if isinstance(found, str):
        return found
    prod, factor, lead = found
    if lead or not (is_call(prod, _MUL, ("mul",)) and len(prod.args) == 2
                    and all(isinstance(a, fx.Node) for a in prod.args)):
        return "whose inverse transform is not of a product of two spectra"
    sides = [_spectrum(a) for a in prod.args]
    if any(isinstance(s, str) for s in sides):
        return next(s for s in sides if isinstance(s, str))
    factor *= _INVERSE_SCALE[inv["norm"]](n)
    for x, size, norm, scale, lead in sides:
        if size is None or sympy.simplify(size - n) != 0:
            return "whose transforms do not share one length n"
        factor *= _FORWARD_SCALE[norm](n) * scale
    if sympy.simplify(factor - 1) != 0:
        return f"whose norms and factors multiply to {factor}, not 1"
    token = [reads_tokens(ctx, s[0]) for s in sides]
    if token.count(True) != 1:
        return "of two token operands" if all(token) else "reading no token"
    (u, _, _, _, u_lead), (k, _, _, _, k_lead) = sides if token[0] else sides[::-1]
    uv, kv, out = value(u), value(k), value(node)
    s = ctx.seq_len
    if not (isinstance(uv, torch.Tensor) and same_size(uv.shape[-1], s)
            and not any(same_size(d, s) for d in uv.shape[:-1])):
        return "whose token operand does not have the rows in its last dim alone"
    if not all(isinstance(d, int) for d in out.shape[:-1]):
        return "over leading dims of a symbolic size"
    if not _long_enough(n, _expr(kv.shape[-1]), s):
        return (f"of length n = {n}, not provably at least S + K - 1 = {_expr(s + kv.shape[-1] - 1)} "
                "(it would wrap around)")
    users = list(node.users)
    if not users or not all(_takes_rows(user, s) for user in users):
        return "whose result is used other than as [..., :S]"
    why = _kernel_why(ctx, k)
    if why is not None:
        return why
    if ctx.node_table is None:
        from treecompile.passes.conv_context import NeedsStructure

        raise NeedsStructure(f"treecompile cannot make this model exact on a tree: {describe(node)} is a convolution "
                             "by FFT, and this call has no path structure to run it along (a streamed or "
                             f"context-parallel call).\n  at {source_of(node)}")
    _emit(gm, ctx, node, u, k, u_lead, k_lead, users, tuple(out.shape[:-1]), out.dtype)
    return None


def _scalars(x: fx.Node) -> tuple[fx.Node, sympy.Expr, list[int]] | str:
    """``(x', c, unsqueezes)`` with ``x = c * x'`` through scalar products and quotients (a number
    or a size), and ``unsqueeze`` of leading dims on the way; or why not."""
    scale, lead = sympy.Integer(1), []
    while True:
        if is_call(x, _MUL + _DIV, ("mul", "div", "truediv")) and len(x.args) == 2:
            a, b = x.args
            num = _number(b) if isinstance(a, fx.Node) else None
            if num is None and is_call(x, _MUL, ("mul",)) and isinstance(b, fx.Node):
                num, a = _number(a), b
            if num is None:
                return x, scale, lead  # a product of two tensors
            if num == 0:
                return "whose spectra are multiplied by zero"
            scale = scale / num if is_call(x, _DIV, ("div", "truediv")) else scale * num
            x = a
        elif is_call(x, (torch.unsqueeze,), ("unsqueeze",)) and len(x.args) == 2 and isinstance(x.args[1], int):
            v = value(x)
            d = x.args[1] % v.dim()
            if d == v.dim() - 1:
                return "whose spectrum gains a dim after the frequencies"
            lead.insert(0, d)
            x = x.args[0]
        else:
            return x, scale, lead


def _spectrum(x: fx.Node) -> tuple | str:
    """``(operand, n, norm, scale, unsqueezes)`` of a spectrum ``c * rfft(operand, n)``; or why
    it is not one."""
    found = _scalars(x)
    if isinstance(found, str):
        return found
    x, scale, lead = found
    if not is_call(x, _RFFT):
        return "whose product is not of two real FFTs"
    fwd = bind(x, _FFT_ARGS, {"n": None, "dim": -1, "norm": None})
    if not _last(fwd["input"], fwd["dim"]) or fwd["norm"] not in _FORWARD_SCALE:
        return "whose forward transforms are not along the last dim"
    return fwd["input"], _size(fwd["n"]), fwd["norm"], scale, lead


def _kernel_why(ctx: PassContext, k: fx.Node) -> str | None:
    """Why the kernel may not be evaluated apart and copied, or changes with the length; None
    if it is a function of the distance alone."""
    sub = ancestors(k) | {k}
    if any(mutated_args(n) for n in sub):
        return "whose kernel is built by writing in place"
    drawn = next((d for d in map(draws, sub) if d is not None), None)
    if drawn is not None:
        return f"whose kernel makes {drawn}"
    lengths = two_lengths(ctx)
    if lengths is None:
        return "at a constant sequence length"
    try:
        long, short = (evaluate(ctx, k, rows=r).to(torch.float64) for r in lengths)
    except Exception as e:  # a kernel that cannot be built alone (or at another length)
        return f"whose kernel cannot be evaluated alone ({type(e).__name__})"
    m = short.shape[-1]
    tol = 1e-9 if value(k).dtype == torch.float64 else 1e-5
    if long.shape[:-1] != short.shape[:-1] or long.shape[-1] < m or \
            not torch.allclose(long[..., :m], short, rtol=tol, atol=tol):
        return "whose kernel changes with the sequence length (per path it is built at the path's length)"
    return None


def _emit(gm: fx.GraphModule, ctx: PassContext, node: fx.Node, u: fx.Node, k: fx.Node, u_lead: list,
          k_lead: list, users: list, lead: tuple, dtype: torch.dtype) -> None:
    g = gm.graph
    channels = int(torch.Size(lead).numel())

    def op(target, *args, method: bool = True):
        made = g.call_method(target, args) if method else g.call_function(target, args)
        return ctx.mark(made, like=node)

    with g.inserting_before(node):
        kernel, signal = copy_values(ctx, g, k), u
        for d in k_lead:
            kernel = ctx.mark(g.call_method("unsqueeze", (kernel, d)), like=node, rows=False)
        for d in u_lead:
            signal = op("unsqueeze", signal, d)
        signal = op("reshape", op("expand", op("to", signal, dtype), *lead, -1), channels, -1)
        for step in (("to", dtype), ("expand", *lead, -1), ("reshape", channels, -1)):
            kernel = ctx.mark(g.call_method(step[0], (kernel, *step[1:])), like=node, rows=False)
        conv = ctx.mark(g.call_function(torch.ops.treecompile.tree_long_conv.default,
                                        (signal, kernel, ctx.node_table)), like=node)
        y = op("reshape", conv, *lead, -1)
    y.meta["example_value"] = value(users[0])
    for user in users:
        user.replace_all_uses_with(y)
    ctx.count("fft_conv")


def _takes_rows(user: fx.Node, s) -> bool:
    """``x[..., :S]`` (leading dims whole)."""
    if not (user.op == "call_function" and user.target is operator.getitem and isinstance(user.args[1], tuple)):
        return False
    *head, last = user.args[1]
    whole = all(h is Ellipsis or h == slice(None) for h in head) and sum(h is Ellipsis for h in head) <= 1
    return whole and isinstance(last, slice) and last.start in (None, 0) and last.step in (None, 1) \
        and last.stop is not None and same_size(_value_of(last.stop), s)


def _last(x, dim) -> bool:
    v = value(x) if isinstance(x, fx.Node) else None
    return isinstance(v, torch.Tensor) and isinstance(dim, int) and dim % max(v.dim(), 1) == v.dim() - 1


def _value_of(x):
    return value(x) if isinstance(x, fx.Node) else x


def _expr(x) -> sympy.Expr:
    x = _value_of(x)
    return x.node.expr if isinstance(x, torch.SymInt) else sympy.Integer(int(x))


def _size(x) -> sympy.Expr | None:
    x = _value_of(x)
    return _expr(x) if isinstance(x, (int, torch.SymInt)) and not isinstance(x, bool) else None


def _number(x) -> sympy.Expr | None:
    """A scalar factor (a number or a size) as an expression, or None."""
    x = _value_of(x)
    if isinstance(x, (int, torch.SymInt)) and not isinstance(x, bool):
        return _expr(x)
    if isinstance(x, float):
        return sympy.Rational(x) if x == int(x) else sympy.Float(x, 17)
    return None


def _long_enough(n: sympy.Expr, k: sympy.Expr, s: torch.SymInt) -> bool:
    """Whether ``n >= S + K - 1`` for every length the compiled graph runs at: a polynomial in
    ``S`` alone, once each size the graph's guards equate with ``S`` (``Min(64, S)`` where
    ``S <= 64`` is guarded) is written as ``S``."""
    length = s.node.expr
    same = {}
    for guard in getattr(s.node.shape_env, "guards", []):
        e = guard.expr
        if isinstance(e, sympy.Eq) and length in e.args:
            other = e.args[1] if e.args[0] == length else e.args[0]
            same[other] = length
    gap = sympy.expand((n - length - k + 1).xreplace(same))
    if not gap.free_symbols:
        return bool(gap >= 0)
    if gap.free_symbols != {length}:
        return False
    try:  # S >= 1 as S + 1 with S >= 0: every coefficient at least 0
        poly = sympy.Poly(sympy.expand(gap.subs(length, length + 1)), length)
    except sympy.PolynomialError:
        return False
    return all(c >= 0 for c in poly.all_coeffs())
