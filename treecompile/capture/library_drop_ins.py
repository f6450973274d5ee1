"""Drop-ins for other libraries' public scan kernels, by their names and parameters: mamba-ssm's,
flash-linear-attention's Gated Linear Attention, recurrentgemma's ``rnn_scan``.

Custom Mamba models (written on ``mamba_ssm.modules``, or copying its reference listings)
call ``selective_scan_fn`` / ``selective_scan_ref`` (Mamba-1) and
``mamba_chunk_scan_combined`` (Mamba-2; the reference listings pad the length to a multiple of
the chunk and run ``ssd_minimal_discrete`` on the chunks). Neither the CUDA / Triton kernels nor
a Python loop over the tokens can be captured as one graph of a tree, so
`treecompile.capture.kernel_table.SEQUENCE_KERNELS` swaps each, for one call, for a drop-in here
that computes the same function with one treecompile scan op (one node per layer, which the
SSM state pass runs along each path). The unmodified model (the per-path baseline, the probe's
reference) keeps its own kernel.

What each computes, from mamba-ssm (``ops/selective_scan_interface.py``,
``ops/triton/ssd_combined.py``):

- ``selective_scan_fn(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
  return_last_state=False)``: ``u, delta, z`` ``[b, d, l]``, ``A`` ``[d, n]``, ``B, C``
  ``[b, n, l]``; ``delta += delta_bias``, ``softplus`` if asked; the scan
  ``x_t = exp(delta_t A) x_{t-1} + delta_t B_t u_t``, ``y_t = C_t x_t``; ``+ u * D``,
  ``* silu(z)``; the result in ``u``'s dtype. The reference computes in float32; the drop-in in
  at least float32 (float64 stays float64).
- ``mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=None, z=None, ...)``: ``x, z``
  ``[b, l, h, p]``, ``dt`` ``[b, l, h]``, ``A`` ``[h]``, ``B, C`` ``[b, l, g, n]`` (``g`` groups
  shared by ``h / g`` heads), ``D`` ``[h]`` or ``[h, p]``; keywords ``dt_bias``,
  ``dt_softplus``, ``dt_limit`` (a clamp only where it is not ``(0, inf)``),
  ``initial_states`` ``[b, h, p, n]``, ``return_final_states``. The chunk size only changes
  how the kernel sums. Arguments after ``z`` differ between mamba-ssm's versions and the
  listings that copy it, so they are taken by keyword only.
"""

from __future__ import annotations

import inspect
import math
from typing import Any

import torch
import torch.nn.functional as F

from treecompile.capture.drop_ins import mamba2_ssd
from treecompile.kernels.dtypes import compute_dtype
from treecompile.kernels.scans import associative as _assoc  # registers treecompile::row_earlier
from treecompile.kernels.scans import gla as _gla  # noqa: F401  (registers treecompile::gla_scan)
from treecompile.kernels.scans import mamba as _mamba  # noqa: F401  (registers treecompile::selective_scan)
from treecompile.kernels.scans import mamba2 as _mamba2  # noqa: F401  (registers treecompile::ssd_scan)

__all__ = ["SELECTIVE_SCAN_PARAMS", "CHUNK_SCAN_PARAMS", "selective_scan_fn", "mamba_chunk_scan_combined",
           "fla_chunk_gla", "fla_fused_recurrent_gla", "fla_naive_recurrent_gla", "recurrentgemma_rnn_scan",
           "associative_scan", "associative_scan_for", "hf_rwkv_linear_attention"]

Tensor = torch.Tensor

#: mamba-ssm's ``selective_scan_fn`` / ``selective_scan_ref`` parameters, all of them: a function
#: of that name is swapped only where it takes exactly these first.
SELECTIVE_SCAN_PARAMS = ("u", "delta", "A", "B", "C", "D", "z", "delta_bias", "delta_softplus", "return_last_state")
#: ``mamba_chunk_scan_combined``'s parameters up to ``z`` (the same in every mamba-ssm version).
CHUNK_SCAN_PARAMS = ("x", "dt", "A", "B", "C", "chunk_size", "D", "z")

_CHUNK_KEYWORDS = {"dt_bias", "initial_states", "seq_idx", "cu_seqlens", "dt_softplus", "dt_limit",
                   "return_final_states", "return_varlen_states"}


def selective_scan_fn(u: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None = None,
                      z: Tensor | None = None, delta_bias: Tensor | None = None, delta_softplus: bool = False,
                      return_last_state: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """Drop-in for mamba-ssm's ``selective_scan_fn`` and ``selective_scan_ref`` (the module docstring
    says what it computes). Complex ``A`` and time-invariant or grouped ``B`` / ``C`` are refused."""
    if A.is_complex():
        raise ValueError("treecompile's selective scan takes a real A; got a complex one")
    if B.dim() != 3 or C.dim() != 3 or A.dim() != 2:
        raise ValueError(f"treecompile's selective scan takes input-dependent B, C [batch, state, length] and A "
                         f"[channels, state]; got B {tuple(B.shape)}, C {tuple(C.shape)}, A {tuple(A.shape)} "
                         "(grouped or time-invariant B / C are not supported)")
    dtype_in = u.dtype
    ct = compute_dtype(torch.promote_types(dtype_in, A.dtype))
    step = delta.to(ct)
    if delta_bias is not None:
        step = step + delta_bias.to(ct)[..., None]
    if delta_softplus:
        step = F.softplus(step)
    x, step = u.to(ct).transpose(1, 2), step.transpose(1, 2)  # [b, l, d]
    y, last = torch.ops.treecompile.selective_scan(step * x, step, A.to(ct), B.transpose(1, 2).to(ct),
                                                   C.transpose(1, 2).to(ct), None)
    y = y.transpose(1, 2)
    if D is not None:
        y = y + u.to(ct) * D.to(ct)[:, None]
    if z is not None:
        y = y * F.silu(z.to(ct))
    y = y.to(dtype_in)
    return (y, last) if return_last_state else y


def mamba_chunk_scan_combined(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, chunk_size: int,
                              D: Tensor | None = None, z: Tensor | None = None, *args: Any,
                              **kwargs: Any) -> Tensor | tuple[Tensor, Tensor]:
    """Drop-in for mamba-ssm's ``mamba_chunk_scan_combined`` (the module docstring says what it
    computes): ``treecompile::ssd_scan`` with ``q = C``, ``k = B``, ``v = x``, ``g = dt * A``."""
    if args:
        raise ValueError("treecompile's drop-in for mamba_chunk_scan_combined takes the arguments after z by "
                         f"keyword only (their order differs between mamba-ssm versions); got {len(args)} more "
                         "positional")
    unknown = sorted(set(kwargs) - _CHUNK_KEYWORDS)
    if unknown:
        raise ValueError(f"treecompile's drop-in for mamba_chunk_scan_combined does not know the argument(s) "
                         f"{unknown}; it takes {sorted(_CHUNK_KEYWORDS)}")
    if kwargs.get("seq_idx") is not None or kwargs.get("cu_seqlens") is not None or kwargs.get("return_varlen_states"):
        raise ValueError("treecompile's Mamba2 scan keeps packed sequences apart itself: pass no seq_idx / "
                         "cu_seqlens / return_varlen_states")
    heads, groups = x.shape[2], B.shape[2]
    if B.dim() != 4 or C.shape != B.shape or heads % groups or A.dim() != 1:
        raise ValueError(f"treecompile's drop-in for mamba_chunk_scan_combined takes B, C [batch, length, groups, "
                         f"state] with groups dividing the heads and A [heads]; got B {tuple(B.shape)}, "
                         f"C {tuple(C.shape)}, A {tuple(A.shape)}")
    ct = compute_dtype(x.dtype)
    dt = dt.to(ct)
    if kwargs.get("dt_bias") is not None:
        dt = dt + kwargs["dt_bias"].to(ct)
    if kwargs.get("dt_softplus"):
        dt = F.softplus(dt)
    low, high = kwargs.get("dt_limit", (0.0, math.inf))
    if (low, high) != (0.0, math.inf):
        dt = dt.clamp(min=low, max=high)
    y, final = mamba2_ssd(x, dt, A, B, C, D, kwargs.get("initial_states"))
    if z is not None:
        y = y * F.silu(z.to(ct))
    y = y.to(x.dtype)
    return (y, final) if kwargs.get("return_final_states") else y


# --------------------------------------------------------------------------- Gated Linear Attention


def fla_chunk_gla(q: Tensor, k: Tensor, v: Tensor, g: Tensor, scale: float | None = None,
                  initial_state: Tensor | None = None, output_final_state: bool = False,
                  **kwargs: Any) -> tuple[Tensor, Tensor | None]:
    """Drop-in for flash-linear-attention's ``chunk_gla`` / ``fused_chunk_gla``: ``q, k, g``
    ``[B, T, H, K]`` (``g`` the log decay per key channel), ``v`` ``[B, T, H, V]``, ``scale``
    ``K^-0.5`` by default, the initial and final state ``[B, H, K, V]``. Returns ``o`` and the
    final state (None unless asked for)."""
    if kwargs.get("cu_seqlens") is not None or kwargs.get("offsets") is not None:
        raise ValueError("treecompile's GLA scan keeps packed sequences apart itself: pass no cu_seqlens")
    if kwargs.get("head_first") or kwargs.get("reverse"):
        raise ValueError("treecompile's GLA scan takes [B, T, H, D] inputs in order: head_first=True and "
                         "reverse=True are not supported")
    if g is None or g.shape != k.shape:
        raise ValueError("treecompile's GLA scan takes a log decay per key channel, g [B, T, H, K]")
    dtype = q.dtype
    ct = compute_dtype(dtype)
    q, k, v, g = (x.to(ct) for x in (q, k, v, g))
    q = q * (q.shape[-1] ** -0.5 if scale is None else scale)
    out, final = torch.ops.treecompile.gla_scan(q, k, v, g, torch.ones_like(g[..., 0]), initial_state)
    return out.to(dtype), (final if output_final_state else None)


def fla_fused_recurrent_gla(q: Tensor, k: Tensor, v: Tensor, gk: Tensor | None = None, gv: Tensor | None = None,
                            scale: float | None = None, initial_state: Tensor | None = None,
                            output_final_state: bool = False, **kwargs: Any) -> tuple[Tensor, Tensor | None]:
    """Drop-in for flash-linear-attention's ``fused_recurrent_gla`` (a decay on the keys only)."""
    if gv is not None:
        raise ValueError("treecompile's GLA scan decays per key channel: gv (a decay per value channel) is not "
                         "supported")
    return fla_chunk_gla(q, k, v, gk, scale, initial_state, output_final_state, **kwargs)


def fla_naive_recurrent_gla(q: Tensor, k: Tensor, v: Tensor, gk: Tensor, initial_state: Tensor | None = None,
                            output_final_state: bool = False) -> tuple[Tensor, Tensor | None]:
    """Drop-in for flash-linear-attention's reference ``naive_recurrent_gla`` (its loop over the
    tokens, ``scale = K^-0.5``)."""
    return fla_chunk_gla(q, k, v, gk, None, initial_state, output_final_state)


# --------------------------------------------------------------------------- a diagonal linear RNN


def recurrentgemma_rnn_scan(x: Tensor, a: Tensor, reset: Tensor, h0: Tensor | None = None,
                            acc_dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
    """Drop-in for google-deepmind/recurrentgemma's ``rnn_scan`` (its torch port's loop over the
    tokens): ``h_t = (a_t * ~reset_t) * h_{t-1} + x_t`` per channel in ``acc_dtype``, ``x, a``
    ``[B, T, D]``, ``reset`` ``[B, T]`` (or ``[B, T, 1]``), ``h0`` ``[B, D]``; returns ``(y, h_T)``,
    ``y`` in ``x``'s dtype. Each channel is a head of ``treecompile::ssd_scan`` with a state of
    one: ``g = log a`` (``-inf`` where the state resets), ``k = q = beta = 1``, ``v = x``."""
    if x.dim() != 3 or a.shape != x.shape:
        raise ValueError(f"treecompile's drop-in for rnn_scan takes x and a [batch, length, channels]; got "
                         f"x {tuple(x.shape)}, a {tuple(a.shape)}")
    ct = compute_dtype(torch.promote_types(acc_dtype, x.dtype))
    keep = ~reset[..., None] if reset.dim() == x.dim() - 1 else ~reset
    keep = keep.expand(x.shape)
    # log of a where kept (of 1 where reset, then -inf): no gradient through log(0) at a reset.
    g = torch.where(keep, torch.log(torch.where(keep, a.to(ct), 1.0)), float("-inf"))
    ones = torch.ones_like(g)
    init = None if h0 is None else h0.to(ct)[..., None, None]
    y, final = torch.ops.treecompile.ssd_scan(ones[..., None], ones[..., None], x.to(ct)[..., None], g, ones, init)
    return y[..., 0].to(x.dtype), final[..., 0, 0].to(acc_dtype)


def hf_rwkv_linear_attention(time_decay: Tensor, time_first: Tensor, key: Tensor, value: Tensor,
                             state: Any = None, return_state: bool = False) -> tuple[Tensor, None]:
    """Drop-in for Hugging Face RWKV-4's ``rwkv_linear_attention`` (its CUDA kernel or its CPU loop
    over the tokens): with ``w = -exp(time_decay)`` and ``u = time_first`` per channel,
    ``wkv_t = (a_{t-1} + e^{u + k_t} v_t) / (b_{t-1} + e^{u + k_t})`` where
    ``a_t = e^w a_{t-1} + e^{k_t} v_t`` and ``b_t = e^w b_{t-1} + e^{k_t}``. Both sums are one
    ``treecompile::ssd_scan`` (a head per channel, a state of one, two values); ``a_{t-1}`` is
    the scan shifted by one row, which the conv context pass reads at the parent. The loop keeps
    a running maximum so that ``e^k`` never overflows: the drop-in computes the same quotient
    without it, in at least float32 as the loop does (keys above about 88 overflow float32 to inf:
    an error, not a silent difference). A state carried in or returned (generation) is refused."""
    from treecompile.core.errors import UnsupportedModelError

    if state is not None or return_state:
        raise UnsupportedModelError("rwkv_linear_attention with a state carried between calls (generation) has no "
                                    "tree meaning")
    ct = compute_dtype(torch.promote_types(key.dtype, torch.float32))
    k, v = key.to(ct), value.to(ct)
    ek = torch.exp(k)
    g = (-torch.exp(time_decay.to(ct))).expand(k.shape)
    ones = torch.ones_like(k)
    sums, _ = torch.ops.treecompile.ssd_scan(ones[..., None], ones[..., None], torch.stack([ek * v, ek], -1), g,
                                             ones, None)
    before = torch.cat([torch.zeros_like(sums[:, :1]), sums[:, :-1]], dim=1)  # a_{t-1}, b_{t-1}
    now = torch.exp(time_first.to(ct) + k)
    out = (before[..., 0] + now * v) / (before[..., 1] + now)
    return out.to(key.dtype), None


def associative_scan_for(original) -> Any:
    """The drop-in for a hand-ported ``associative_scan(operator, elems, ...)`` (JAX's
    ``lax.associative_scan``: S5's, GateLoop's recursive odd/even scans), or None where
    ``original`` is not such a scan. Ports differ in their axis (a parameter, or fixed at 1), so
    ``original`` is run first, eagerly, on small tensors with a linear-recurrence operator (not
    commutative) at two lengths, odd and even: it is swapped only where it is the inclusive scan
    along the axis its ``axis`` parameter names (each axis of three dims, either sign, checked; a
    call with an axis that failed is refused), or along the one axis it scans; the drop-in scans
    that axis, its arguments bound by the original's own parameters."""
    try:
        params = inspect.signature(original).parameters
    except (TypeError, ValueError):  # not a Python function (a builtin, a class without a signature)
        return None
    names = list(params)
    if len(names) < 2 or any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params.values()):
        return None
    defaults = {n: p.default for n, p in params.items() if p.default is not p.empty}
    takes_axis = "axis" in params
    g = torch.Generator().manual_seed(0)

    def op(a, b):
        return a[0] * b[0], b[0] * a[1] + b[1]

    def matches(axis: int, n: int) -> bool:
        shape = [3, 2, 2]
        shape[axis] = n
        elems = (torch.rand(shape, generator=g, dtype=torch.float64) + 0.5,
                 torch.randn(shape, generator=g, dtype=torch.float64))
        try:
            with torch.no_grad():
                got = original(op, elems, axis=axis) if takes_axis else original(op, elems)
            want = _assoc.associative_scan_reference(lambda a, b: list(op(a, b)), list(elems), axis)
            return all(torch.allclose(x, y, rtol=1e-12, atol=1e-12) for x, y in zip(got, want))
        except Exception:
            return False

    # Where the original takes an axis, the axes it scans right (a call with another is refused);
    # where it does not, the one axis it scans.
    axes = [a for a in ((0, 1, 2, -1, -2, -3) if takes_axis else (0, 1, 2)) if matches(a, 5) and matches(a, 8)]
    if not axes or not takes_axis and len(axes) != 1:
        return None
    fixed = None if takes_axis else axes[0]

    def drop_in(*args, **kwargs):
        # The arguments by the original's own parameters (JAX's order is fn, elems, reverse, axis).
        bound = {**defaults, **dict(zip(names, args)), **kwargs}
        unknown = {n: v for n, v in bound.items() if n not in (*names[:2], "axis", "reverse") and v is not
                   defaults.get(n, object())}
        axis = bound.get("axis", 0) if fixed is None else fixed
        if unknown or axis not in axes:
            from treecompile.core.errors import UnsupportedModelError

            what = sorted(unknown) if unknown else f"axis={axis}, where the function was not checked to scan"
            raise UnsupportedModelError(f"associative_scan called with {what}, which treecompile's drop-in does not "
                                        "take")
        return associative_scan(bound[names[0]], bound[names[1]], axis, bound.get("reverse", False))

    return drop_in


def associative_scan(operator, elems, axis: int, reverse: bool = False):
    """The inclusive scan of ``operator(earlier, later)`` over ``elems`` (a tensor, or a tuple or
    list of them) along ``axis``, by pointer jumping in `treecompile.kernels.scans.associative.JUMPS`
    steps of ``treecompile::row_earlier`` / ``row_has_earlier``, which the path jumps pass runs
    over each row's ancestors (`associative_scan_for` picks ``axis``). ``reverse=True`` (a scan
    from the end) has no tree meaning and is refused."""
    from treecompile.core.errors import UnsupportedModelError

    if reverse:
        raise UnsupportedModelError("associative_scan(reverse=True) folds each token with the tokens after it")
    single = isinstance(elems, Tensor)
    xs = [elems] if single else list(elems)
    dim = axis % xs[0].dim() if xs and isinstance(xs[0], Tensor) else axis
    if not xs or not all(isinstance(x, Tensor) and 0 <= dim < x.dim() for x in xs):
        raise UnsupportedModelError("treecompile's drop-in for associative_scan takes a tensor or a tuple or list "
                                    f"of tensors with a dim {axis}")
    torch._check(xs[0].shape[dim] < 2 ** _assoc.JUMPS)
    shapes = [[-1 if d == dim else 1 for d in range(x.dim())] for x in xs]
    for hop in range(_assoc.JUMPS):
        earlier = [torch.ops.treecompile.row_earlier(x, dim, hop) for x in xs]
        has = torch.ops.treecompile.row_has_earlier(xs[0], dim, hop)
        combined = operator(earlier[0] if single else type(elems)(earlier), xs[0] if single else type(elems)(xs))
        combined = [combined] if single else list(combined)
        xs = [torch.where(has.view(shape), c, x) for c, x, shape in zip(combined, xs, shapes)]
    return xs[0] if single else type(elems)(xs)


#: Built for each function it replaces (`treecompile.capture.dynamo.sequence_kernels`).
associative_scan_for.per_original = True


def _linear(earlier, later):
    """The linear recurrence ``h_t = a_t * h_{t-1} + x_t`` as an associative operator on ``(a, x)``."""
    return earlier[0] * later[0], later[0] * earlier[1] + later[1]


def parallel_scan_for(original) -> Any:
    """The drop-in for a parallel scan of the linear recurrence ``H_t = A_t * H_{t-1} + X_t`` along
    dim 1 of ``A, X`` ``[B, L, ...]`` called as ``original(A, X)`` (alxndrTL/mamba.py's Blelloch
    ``pscan = PScan.apply``, an autograd Function whose sweeps write views in place), or None
    where ``original`` is not that scan. ``original`` is run first, eagerly, at an odd and a
    power-of-two length on signed ``A``; the drop-in is `associative_scan` of `_linear` along
    dim 1 (the gradient is autograd's, not the original's hand-written backward)."""
    g = torch.Generator().manual_seed(0)

    def matches(n: int) -> bool:
        a = torch.rand(2, n, 3, 2, generator=g, dtype=torch.float64) * 2 - 1
        x = torch.randn(2, n, 3, 2, generator=g, dtype=torch.float64)
        want, h = torch.empty_like(x), torch.zeros_like(x[:, 0])
        for t in range(n):
            h = a[:, t] * h + x[:, t]
            want[:, t] = h
        try:
            with torch.no_grad():
                got = original(a.clone(), x.clone())
            return isinstance(got, Tensor) and got.shape == want.shape and torch.allclose(got, want, rtol=1e-10,
                                                                                          atol=1e-12)
        except Exception:
            return False

    if not (matches(5) and matches(8)):
        return None

    def drop_in(A_in: Tensor, X_in: Tensor) -> Tensor:
        if A_in.shape != X_in.shape or A_in.dim() < 2:
            raise ValueError(f"treecompile's drop-in for a parallel scan takes A and X of one shape [B, L, ...]; got "
                             f"A {tuple(A_in.shape)}, X {tuple(X_in.shape)}")
        return associative_scan(_linear, (A_in, X_in), 1)[1]

    return drop_in


parallel_scan_for.per_original = True
