"""Scalar-gated linear recurrences (Gated DeltaNet, Mamba2) on a sequence and on a tree.

Both layer kinds carry a matrix state ``S`` ``[Dk, Dv]`` per batch row and head and run,
token by token,

    S   <- exp(g_t) * S                                     # decay
    u_t  = beta_t * (v_t - S^T k_t)   (delta rule, GDN)     # what is written
         = beta_t * v_t               (plain, Mamba2's SSD)
    S   <- S + k_t u_t^T                                    # write
    o_t  = S^T q_t                                          # read

Gated DeltaNet (Yang et al., 2025) is the delta form. Mamba2's state space dual is the
plain form with ``q = C``, ``k = B``, ``v = x``, ``g = dt * A``, ``beta = dt`` (its state
``h = S^T``); see :mod:`treecompile.kernels.scans.mamba2`.

* `recurrence_reference` (in :mod:`treecompile.kernels.scans.naive`): that loop, the definition
  a reader can check by eye.
* `chunked_recurrence`: the same map computed 64 tokens at a time with matrix products, a
  differentiable torch function (the delta form solves a unit lower-triangular system per
  chunk, the WY form of the delta rule). Zero rows (``q = k = v = g = beta = 0``) leave
  the state bit-for-bit unchanged (``exp(0) = 1``, the write is ``0 * ...``), so padding a
  sequence at its end with them is exact.
* `tree_recurrence`: the recurrence on a packed tree. Each tree node's rows run from its
  *parent node's final state* (roots from the call's initial state, or zeros), so every
  row sees exactly the state of its own path, never a sibling's. Nodes at the same depth
  run together as one zero-padded batch (split where lengths differ widely, so padding at
  most doubles the rows), so the sequential steps follow how deep the tree is in nodes,
  not how many nodes it has. Siblings read the same parent state tensor,
  so autograd sums their gradients into it, as it does per path. Given a variable-length
  kernel (flash-linear-attention's Triton kernels on CUDA: one sequence per node, the
  parents' final states as initial states), a level runs through it unpadded instead.
  Which one runs is the caller's choice by name (`SCAN_KERNELS`, ``tree_compile(scan_kernel=...)``,
  carried by the tree op's ``scan_kernel`` argument); `varlen_kernel` resolves the name, and a
  kernel is used only once it has matched the torch scan on a small problem.

Each kind is registered as three ops (:func:`treecompile.kernels.scans.recurrence_ops.register`), e.g. for ``gated_delta_rule``:
``treecompile::gated_delta_rule(q, k, v, g, beta, initial_state) -> (out, final_state)``
(the linear-sequence form the wrapper swaps in for a model's kernel before capture),
``treecompile::tree_gated_delta_rule(q, k, v, g, beta, initial_state, node_table, scan_kernel) -> out``
(what the SSM state pass puts in its place, ``scan_kernel`` a name of `SCAN_KERNELS`) and their
backward, which recomputes the forward under autograd and differentiates it.

All compute in at least float32 (as Hugging Face's kernels do) and return the inputs'
dtype. Shapes: ``q, k`` ``[B, S, H, Dk]``, ``v`` ``[B, S, H, Dv]``, ``g, beta`` ``[B, S, H]``,
states ``[B, H, Dk, Dv]``; ``node_table`` ``[N, 3]`` int64 (start row, end row, parent node
in preorder, -1 for a root), on the CPU: the ops read it on the host, never syncing with a
device. The tree form takes one packed row (``B = 1``).
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable

import numpy as np
import torch

from treecompile.kernels.dtypes import compute_dtype

__all__ = ["chunked_recurrence", "tree_recurrence", "node_levels", "CHUNK",
           "padding_groups", "SCAN_KERNELS", "varlen_kernel", "varlen_disagreement", "known_bad_fla", "autograd_inside"]

Tensor = torch.Tensor

#: Tokens per chunk of `chunked_recurrence`.
CHUNK = 64


def chunked_recurrence(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    initial_state: Tensor | None = None,
    *,
    delta: bool,
    chunk: int = CHUNK,
) -> tuple[Tensor, Tensor]:
    """The recurrence, ``chunk`` tokens per step, differentiable, in the inputs' dtype.

    Inside a chunk with ``b_i = g_1 + ... + g_i`` and start state ``S0``, the state after
    token ``i`` is ``exp(b_i) S0 + sum_{j <= i} exp(b_i - b_j) k_j u_j^T``. The delta
    form's writes then satisfy ``(I + A) U = beta * (V - exp(b) * (K S0))`` with
    ``A_ij = beta_i exp(b_i - b_j) (k_i . k_j)`` for ``j < i``, a unit lower-triangular
    system; the plain form has ``U = beta * V``.
    """
    if g.dim() == k.dim():
        return _chunked_channel(q, k, v, g, beta, initial_state, chunk, delta=delta)
    b, s, h, dk = k.shape
    dv = v.shape[-1]
    state = q.new_zeros(b, h, dk, dv) if initial_state is None else initial_state.to(q.dtype)
    pad = (-s) % chunk
    # [B, H, n, C, D] and [B, H, n, C]; the zero padding rows at the end are exact no-ops.
    q, k, v = (torch.nn.functional.pad(x, (0, 0, 0, 0, 0, pad)).transpose(1, 2).unflatten(2, (-1, chunk))
               for x in (q, k, v))
    g, beta = (torch.nn.functional.pad(x, (0, 0, 0, pad)).transpose(1, 2).unflatten(2, (-1, chunk)) for x in (g, beta))
    idx = torch.arange(chunk, device=q.device)
    causal = idx[:, None] >= idx[None, :]
    strict = idx[:, None] > idx[None, :]
    outs = []
    for c in range(q.shape[2]):
        qc, kc, vc, gc, bc = q[:, :, c], k[:, :, c], v[:, :, c], g[:, :, c], beta[:, :, c]
        cum = gc.cumsum(-1)  # [B, H, C]
        # b_i - b_j = g_{j+1} + ... + g_i summed directly, not as a difference of two running
        # sums (which cancels: float32 lost ~50x in Mamba2's A_log gradient that way).
        seg = gc[..., None, :].expand(*gc.shape, chunk).transpose(-1, -2).masked_fill(~strict, 0.0).cumsum(-2)
        # exp(b_i - b_j) for j <= i, 0 above the diagonal (masked before exp: no overflow).
        decay = seg.masked_fill(~causal, float("-inf")).exp()
        start = cum.exp()[..., None]  # exp(b_i) [B, H, C, 1]
        if delta:
            a = (bc[..., :, None] * decay * (kc @ kc.transpose(-1, -2))).tril(-1)
            rhs = bc[..., None] * (vc - start * (kc @ state))
            eye = torch.eye(chunk, dtype=q.dtype, device=q.device)
            u = torch.linalg.solve_triangular(eye + a, rhs, upper=False, unitriangular=True)
        else:
            u = bc[..., None] * vc
        outs.append(start * (qc @ state) + ((qc @ kc.transpose(-1, -2)) * decay) @ u)
        tail = seg[..., -1, :].exp()[..., None]  # exp(b_C - b_j) [B, H, C, 1]
        state = cum[..., -1].exp()[..., None, None] * state + (kc * tail).transpose(-1, -2) @ u
    out = torch.stack(outs, dim=2).flatten(2, 3)[:, :, :s].transpose(1, 2)
    return out, state


def _chunked_channel(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor | None,
                     chunk: int, *, delta: bool) -> tuple[Tensor, Tensor]:
    """A decay per key channel (``g`` ``[B, S, H, Dk]``, ``S <- diag(exp(g_t)) S``): the delta form
    (Kimi Delta Attention) or the plain one (Gated Linear Attention), ``chunk`` tokens per step.
    As `chunked_recurrence` with ``b_i`` a vector: ``A_ij = beta_i sum_d k_i[d] exp(b_i - b_j)[d] k_j[d]``
    and the read ``sum_d q_i[d] exp(b_i - b_j)[d] k_j[d]``, one ``[C, C, Dk]`` decay per chunk and head."""
    b, s, h, dk = k.shape
    dv = v.shape[-1]
    state = q.new_zeros(b, h, dk, dv) if initial_state is None else initial_state.to(q.dtype)
    pad = (-s) % chunk
    # [B, H, n, C, D]; the zero padding rows at the end are exact no-ops.
    q, k, v, g = (torch.nn.functional.pad(x, (0, 0, 0, 0, 0, pad)).transpose(1, 2).unflatten(2, (-1, chunk))
                  for x in (q, k, v, g))
    beta = torch.nn.functional.pad(beta, (0, 0, 0, pad)).transpose(1, 2).unflatten(2, (-1, chunk))
    idx = torch.arange(chunk, device=q.device)
    causal = (idx[:, None] >= idx[None, :])[..., None]
    strict = (idx[:, None] > idx[None, :])[..., None]
    eye = torch.eye(chunk, dtype=q.dtype, device=q.device)
    outs = []
    for c in range(q.shape[2]):
        qc, kc, vc, gc, bc = q[:, :, c], k[:, :, c], v[:, :, c], g[:, :, c], beta[:, :, c]
        cum = gc.cumsum(-2)  # b_i [B, H, C, Dk]
        # b_i - b_j = g_{j+1} + ... + g_i per channel, summed directly (see `chunked_recurrence`).
        seg = gc[..., :, None, :].expand(*gc.shape[:-1], chunk, dk).masked_fill(~strict, 0.0).cumsum(-3)
        decay = seg.masked_fill(~causal, float("-inf")).exp()  # [B, H, C, C, Dk]
        start = cum.exp()  # exp(b_i)
        if delta:
            a = (bc[..., :, None] * (kc[..., :, None, :] * kc[..., None, :, :] * decay).sum(-1)).tril(-1)
            rhs = bc[..., None] * (vc - (kc * start) @ state)
            u = torch.linalg.solve_triangular(eye + a, rhs, upper=False, unitriangular=True)
        else:
            u = bc[..., None] * vc
        outs.append((qc * start) @ state + (qc[..., :, None, :] * kc[..., None, :, :] * decay).sum(-1) @ u)
        tail = seg[..., -1, :, :].exp()  # exp(b_C - b_j) [B, H, C, Dk]
        state = cum[..., -1, :].exp()[..., :, None] * state + (kc * tail).transpose(-1, -2) @ u
    out = torch.stack(outs, dim=2).flatten(2, 3)[:, :, :s].transpose(1, 2)
    return out, state


# ----------------------------------------------------------------------------- trees


def node_levels(node_table: Tensor) -> list[np.ndarray]:
    """Node ids grouped by depth (roots first), each group in preorder."""
    parent = node_table[:, 2].cpu().numpy()
    depth = np.zeros(len(parent), dtype=np.int64)
    for n, p in enumerate(parent.tolist()):  # preorder: a parent's depth is known first
        if p >= 0:
            depth[n] = depth[p] + 1
    order = np.argsort(depth, kind="stable")
    bounds = np.searchsorted(depth[order], np.arange(int(depth.max(initial=-1)) + 2))
    return [order[bounds[d]:bounds[d + 1]] for d in range(len(bounds) - 1)]


def tree_recurrence(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    initial_state: Tensor | None,
    node_table: Tensor,
    *,
    delta: bool,
    chunk: int = CHUNK,
    varlen: Callable | None = None,
) -> Tensor:
    """The recurrence on a packed tree (one row, ``B = 1``), differentiable: ``out [1, S, H, Dv]``.

    Each depth level is one batch of its nodes' rows, right-padded with zero rows to the
    longest node of the level, started from the parents' final states (a level whose
    lengths differ widely is split so that padding at most doubles its rows). With
    ``varlen``, a variable-length kernel (see `varlen_kernel`), each level runs through it
    instead, unpadded.
    """
    if q.shape[0] != 1:
        raise ValueError(f"the tree recurrence runs one packed row, got a batch of {q.shape[0]}")
    s, h, dk = k.shape[1:]
    dv = v.shape[-1]
    root = q.new_zeros(h, dk, dv) if initial_state is None else initial_state[0].to(q.dtype)
    table = node_table.cpu().numpy()
    start, end, parent = table[:, 0], table[:, 1], table[:, 2]
    # A zero row at index S for the padding.
    padded = [torch.cat([x[0], x.new_zeros(1, *x.shape[2:])]) for x in (q, k, v, g, beta)]
    finals: list[Tensor | None] = [None] * len(table)
    rows_out, vals_out = [], []
    for level in node_levels(node_table):
        lengths = end[level] - start[level]
        init = torch.stack([root if parent[n] < 0 else finals[parent[n]] for n in level.tolist()])
        if varlen is not None:
            # The level's rows back to back, one sequence per node.
            rows = np.concatenate([np.arange(a, b) for a, b in zip(start[level], end[level])])
            index = torch.from_numpy(rows).to(q.device, non_blocking=True)
            cu = torch.from_numpy(np.concatenate([[0], np.cumsum(lengths)])).to(q.device, non_blocking=True)
            out, final = varlen(*(x[index][None] for x in padded), init, cu)
            rows_out.append(rows)
            vals_out.append(out[0])
            for i, n in enumerate(level.tolist()):
                finals[n] = final[i]
            continue
        for group in padding_groups(lengths, chunk):
            width = int(lengths[group].max())
            offs = np.arange(width)[None, :]
            valid = offs < lengths[group][:, None]
            rows = np.where(valid, start[level][group][:, None] + offs, s)
            index = torch.from_numpy(rows).to(q.device, non_blocking=True)
            group_init = init[torch.from_numpy(group).to(init.device)]
            out, final = chunked_recurrence(*(x[index] for x in padded), group_init, delta=delta, chunk=chunk)
            rows_out.append(rows[valid])
            vals_out.append(out[torch.from_numpy(valid).to(q.device, non_blocking=True)])
            for i, n in enumerate(level[group].tolist()):
                finals[n] = final[i]
    order = np.argsort(np.concatenate(rows_out), kind="stable")
    return torch.cat(vals_out)[torch.from_numpy(order).to(q.device)][None]


def padding_groups(lengths: np.ndarray, chunk: int) -> list[np.ndarray]:
    """Splits a level's nodes (by index) into batches padded to their longest node, longest first,
    each with at most ``2 * tokens + chunk`` rows padded: O(S) memory whatever the lengths (one
    long node beside many short ones would otherwise pad every short one to its length)."""
    groups, current, tokens = [], [], 0
    for i in np.argsort(-lengths, kind="stable").tolist():
        n = int(lengths[i])
        if current and int(lengths[current[0]]) * (len(current) + 1) > 2 * (tokens + n) + chunk:
            groups.append(np.array(current))
            current, tokens = [], 0
        current.append(i)
        tokens += n
    groups.append(np.array(current))
    return groups


# The dispatch keys excluded outside any op (autocast's, by default): see `autograd_inside`.
_DEFAULT_EXCLUDE = torch._C._dispatch_tls_local_exclude_set()


@contextlib.contextmanager
def autograd_inside():
    """Autograd inside a custom op's implementation.

    A custom op runs below the autograd dispatch keys (they are excluded for the ops it
    calls); the backward ops here differentiate a recomputed forward, so they restore the
    default exclusions and turn grad mode on for that.
    """
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), _DEFAULT_EXCLUDE):
        with torch.enable_grad():
            yield


# ----------------------------------------------------------------------------- variable-length kernels

#: Scan kernels for a tree level, by the name ``tree_compile(scan_kernel=...)`` takes:
#: ``"auto"``: flash-linear-attention's on CUDA when it is installed and matches the torch scan
#: on a check problem (with a warning when it does not), else the torch scan; ``"torch"``:
#: the padded torch scan on every device; ``"fla"``: flash-linear-attention's, or an error
#: saying why it cannot be used.
SCAN_KERNELS = ("auto", "torch", "fla")


def _fla_kernel(delta: bool) -> Callable | None:
    """flash-linear-attention's chunked kernel for the form, or None when it is not installed.

    A variable-length kernel is ``fn(q, k, v, g, beta, initial_state, cu_seqlens) -> (out,
    final)`` with ``q, k`` ``[1, T, H, Dk]``, ``v`` ``[1, T, H, Dv]``, ``g, beta`` ``[1, T, H]``
    (``q`` already scaled), one initial state per sequence ``[N, H, Dk, Dv]`` and
    ``cu_seqlens`` ``[N + 1]``; it returns ``out`` ``[1, T, H, Dv]`` and the final states
    ``[N, H, Dk, Dv]``.
    """
    try:
        if delta:
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_fn
        else:
            from fla.ops.simple_gla import chunk_simple_gla as fla_fn
    except ImportError:
        return None

    def run(q, k, v, g, beta, initial_state, cu_seqlens):
        if delta:
            return fla_fn(q, k, v, g, beta, scale=1.0, initial_state=initial_state, output_final_state=True,
                          cu_seqlens=cu_seqlens)
        # The plain form is fla's simple GLA (scalar decay per head) with the write scaled by beta.
        return fla_fn(q, k, v * beta[..., None], g, scale=1.0, initial_state=initial_state, output_final_state=True,
                      cu_seqlens=cu_seqlens)

    return run


@functools.cache
def varlen_kernel(name: str, device: torch.device, delta: bool, dtype: torch.dtype) -> Callable | None:
    """The variable-length kernel named ``name`` (a key of `SCAN_KERNELS`) for a tree level on
    ``device``, or None for the padded torch scan.

    A kernel is used only after it agrees with the torch scan on a small random tree level
    (`varlen_disagreement`), checked once per (name, device, form, dtype).

    Raises:
        ValueError: an unknown name.
        RuntimeError: ``"fla"`` where it cannot be used: flash-linear-attention is not
            installed, the device is not CUDA, or the kernel fails or differs on the check.
    """
    if name not in SCAN_KERNELS:
        raise ValueError(f"unknown scan kernel {name!r}; valid scan kernels: {', '.join(SCAN_KERNELS)}")
    if name == "torch" or (name == "auto" and device.type != "cuda"):
        return None
    fn = _fla_kernel(delta)
    what = f"flash-linear-attention's {'delta-rule' if delta else 'SSD'} scan kernel on {device.type} ({dtype})"
    if name == "fla":
        if fn is None:
            raise RuntimeError("treecompile: scan_kernel='fla' asks for flash-linear-attention's scan kernels, which "
                               "are not installed (pip install '.[fla]'); scan_kernel='auto' or 'torch' runs the torch "
                               "scan")
        if device.type != "cuda":
            raise RuntimeError(f"treecompile: scan_kernel='fla' runs on CUDA only; this scan runs on {device.type} "
                               "(scan_kernel='auto' or 'torch' runs the torch scan)")
    if fn is None:
        return None
    why = known_bad_fla(device) or varlen_disagreement(fn, device, delta, dtype)
    if why is None:
        return fn
    if name == "fla":
        raise RuntimeError(f"treecompile: scan_kernel='fla' cannot be used: {what} {why}")
    warnings.warn(f"treecompile: {what} {why}; using the torch scan instead", RuntimeWarning, stacklevel=2)
    return None


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in (text.split("+")[0].split(".") + ["0", "0"])[:3] if p.isdigit())


def _fla_dispatches_to_tilelang() -> bool:
    """fla >= 0.6 runs the gated backward through tilelang where tilelang is installed."""
    import importlib.metadata as md
    import importlib.util

    try:
        fla_version = md.version("fla-core")
    except md.PackageNotFoundError:
        try:
            fla_version = md.version("flash-linear-attention")
        except md.PackageNotFoundError:
            return False
    return _version(fla_version) >= (0, 6, 0) and importlib.util.find_spec("tilelang") is not None


def known_bad_fla(device: torch.device) -> str | None:
    """Why fla's chunked kernels must not run on ``device``, or None.

    Triton >= 3.4.0 and < 3.7.1 compiles fla's gated ``chunk_bwd_dqkwg`` (the backward of both
    scans treecompile runs through fla) wrongly on Hopper GPUs (fla issue #640). fla 0.6
    raises there; older versions return wrong gradients, which a check on one small problem
    need not catch. So the combination is refused outright.
    """
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    import triton

    if torch.cuda.get_device_capability(device)[0] != 9 or not (3, 4, 0) <= _version(triton.__version__) < (3, 7, 1):
        return None
    if _fla_dispatches_to_tilelang():
        return None
    return (f"is known to give wrong gradients on Hopper GPUs with Triton {triton.__version__} (>= 3.4.0 and "
            "< 3.7.1, fla issue #640): upgrade Triton to 3.7.1 or later, or install tilelang with fla >= 0.6")


def varlen_disagreement(fn: Callable, device: torch.device, delta: bool, dtype: torch.dtype) -> str | None:
    """None if the variable-length kernel ``fn`` matches the torch scan on a small check
    problem, else what went wrong (``"differs from the torch scan in dq by ..."``).

    The problem is a tree level of sequences of 70, 1 and 5 tokens with initial states;
    outputs, final states and every input's gradient are compared with the torch scan in
    float64, within what ``dtype`` allows.
    """
    gen = torch.Generator().manual_seed(0)
    lengths, h, d = [70, 1, 5], 2, 16
    t = sum(lengths)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q, v = rand(1, t, h, d) * d**-0.5, rand(1, t, h, d)
    k = torch.nn.functional.normalize(rand(1, t, h, d), dim=-1)
    g, beta = -torch.rand(1, t, h, generator=gen, dtype=torch.float64), torch.rand(1, t, h, generator=gen,
                                                                                       dtype=torch.float64)
    init = rand(len(lengths), h, d, d) * 0.1
    cu = torch.tensor([0, *np.cumsum(lengths).tolist()])
    weights = [rand(1, t, h, d), rand(len(lengths), h, d, d)]

    def grads(run, ct):
        leaves = [x.to(device, ct).requires_grad_() for x in (q, k, v, g, beta, init)]
        out, final = run(*leaves)
        loss = (out * weights[0].to(device, out.dtype)).sum() + (final * weights[1].to(device, final.dtype)).sum()
        grads = torch.autograd.grad(loss, leaves, allow_unused=True)
        return [out, final, *(torch.zeros_like(x) if gr is None else gr for gr, x in zip(grads, leaves))]

    def reference(q, k, v, g, beta, init):
        outs, finals = [], []
        for i, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
            o, f = chunked_recurrence(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b], init[i:i + 1],
                                      delta=delta)
            outs.append(o)
            finals.append(f)
        return torch.cat(outs, 1), torch.cat(finals)

    with autograd_inside():
        want = grads(reference, torch.float64)
        try:
            got = grads(lambda *x: fn(*x[:5], x[5], cu.to(device)), dtype)
        except Exception as e:  # a kernel that cannot run this problem is not used either
            return f"failed on a check problem ({type(e).__name__}: {e})"
    tol = {torch.float64: 1e-9, torch.float32: 2e-3}.get(dtype, 5e-2)
    names = ["out", "final state", "dq", "dk", "dv", "dg", "dbeta", "d initial state"]
    for name, a, b in zip(names, got, want):
        err = ((a.double().cpu() - b.cpu()).abs().max() / b.abs().max().clamp_min(1e-30)).item()
        if not err <= tol:
            return f"differs from the torch scan in {name} by {err:.3g} (relative, over {tol:g})"
    return None
