"""Fused target log-probabilities: vocabulary projection and log-softmax in row chunks.

    lp = fused_target_logprobs(hidden, lm_head.weight, None, slot, target)   # [M]

For ``R`` predicting rows and a vocabulary of ``V`` tokens, the plain loss path forms the
``[R, V]`` logits (and as many again for the softmax and its gradient). Here the rows are
processed ``chunk`` at a time: each chunk's logits ``[chunk, V]`` are formed, reduced to
one log-sum-exp per row and the target logits picked, then freed. Backward recomputes each
chunk's logits from ``hidden`` and ``weight`` (one extra matmul per chunk) instead of
storing them. Peak extra memory is O(chunk x V) plus the ``[V, H]`` weight gradient.

Exact: every row's log-softmax depends on that row only, so chunking the rows changes no
arithmetic on any row. The formula per target ``m`` (row ``r = slot[m]``, token
``t = target[m]``) is the plain one,

    z_r = cap(h_r W^T + b)   (cap(y) = softcap * tanh(y / softcap), Gemma 2; identity without)
    lp_m = z_r[t] - logsumexp(z_r),

computed with the projection and soft-cap in the weight's dtype, then upcast to at least
float32, as `treecompile.passes.markers.tree_logprobs` does. Its gradient with respect to
``z_r`` is ``onehot(t) * g_m - softmax(z_r) * sum_{m' on r} g_m'``.

:func:`treecompile.kernels.logprobs.naive.reference_target_logprobs` is the same computation
written plainly (it forms ``[R, V]``); tests compare the two.
"""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F

from treecompile.kernels.dtypes import compute_dtype

__all__ = [
    "DEFAULT_CHUNK_ELEMENTS",
    "KERNELS",
    "default_chunk",
    "default_kernel",
    "fused_target_logprobs",
]

Tensor = torch.Tensor

#: Default bound on the elements of one chunk's ``[chunk, V]`` logits (64 MiB in float32).
#: A memory bound, not a tuned speed optimum: at V = 152k it gives chunks of 110 rows.
DEFAULT_CHUNK_ELEMENTS = 1 << 24


#: Implementations ``fused_target_logprobs(kernel=...)`` accepts.
KERNELS = ("torch", "triton")


def default_kernel(device: torch.device) -> str:
    """``"triton"`` for CUDA tensors when Triton is installed, else ``"torch"``."""
    if device.type == "cuda" and importlib.util.find_spec("triton") is not None:
        return "triton"
    return "torch"


def default_chunk(vocab: int) -> int:
    """Rows per chunk for a vocabulary of ``vocab`` tokens (see :data:`DEFAULT_CHUNK_ELEMENTS`)."""
    return max(1, DEFAULT_CHUNK_ELEMENTS // max(1, vocab))


def _chunk_logits(h: Tensor, weight: Tensor, bias: Tensor | None, softcap: float | None) -> tuple[Tensor, Tensor]:
    """``(pre_cap, z)``: the chunk's projection ``[C, V]`` and its capped, upcast logits."""
    y = F.linear(h, weight, bias)
    z = torch.tanh(y / softcap) * softcap if softcap is not None else y
    return y, z.to(compute_dtype(z.dtype))


def _by_row(slot: Tensor, rows: int, chunk: int) -> tuple[Tensor, Tensor, list[int]]:
    """Targets sorted by their row: ``(order, sorted slot, bounds)``; chunk ``i`` owns
    targets ``order[bounds[i]:bounds[i+1]]``."""
    sorted_slot, order = torch.sort(slot, stable=True)
    starts = torch.arange(0, rows + chunk, chunk, device=slot.device).clamp_(max=rows)
    bounds = torch.searchsorted(sorted_slot, starts).tolist()
    return order, sorted_slot, bounds


@torch.library.custom_op("treecompile::fused_target_logprobs", mutates_args=())
def _fused_forward(
    hidden: Tensor, weight: Tensor, bias: Tensor | None, slot: Tensor, target: Tensor, softcap: float | None, chunk: int
) -> tuple[Tensor, Tensor]:
    """``([M] log-probs, [R] log-sum-exp)``; see :func:`fused_target_logprobs`."""
    rows = hidden.shape[0]
    dtype = compute_dtype(hidden.dtype)
    lp = hidden.new_empty(slot.shape[0], dtype=dtype)
    lse = hidden.new_empty(rows, dtype=dtype)
    order, sorted_slot, bounds = _by_row(slot, rows, chunk)
    sorted_target = target[order]
    for i, r0 in enumerate(range(0, rows, chunk)):
        r1 = min(r0 + chunk, rows)
        _, z = _chunk_logits(hidden[r0:r1], weight, bias, softcap)
        lse_c = torch.logsumexp(z, dim=-1)
        lse[r0:r1] = lse_c
        a, b = bounds[i], bounds[i + 1]
        if a < b:
            local = sorted_slot[a:b] - r0
            lp[order[a:b]] = z[local, sorted_target[a:b]] - lse_c[local]
    return lp, lse


@_fused_forward.register_fake
def _fused_forward_fake(hidden, weight, bias, slot, target, softcap, chunk):
    dtype = compute_dtype(hidden.dtype)
    return hidden.new_empty(slot.shape[0], dtype=dtype), hidden.new_empty(hidden.shape[0], dtype=dtype)


@torch.library.custom_op("treecompile::fused_target_logprobs_backward", mutates_args=())
def _fused_backward(
    grad_lp: Tensor,
    grad_lse: Tensor | None,
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    slot: Tensor,
    target: Tensor,
    lse: Tensor,
    softcap: float | None,
    chunk: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(grad_hidden [R, H], grad_weight [V, H], grad_bias [V] or [0])``, chunk by chunk."""
    rows = hidden.shape[0]
    up = lse.dtype
    grad_lp = grad_lp.to(up)
    # Each row's softmax is weighted by the sum of its targets' gradients (minus the lse's).
    row_g = torch.zeros(rows, dtype=up, device=hidden.device).index_add_(0, slot, grad_lp)
    if grad_lse is not None:
        row_g = row_g - grad_lse.to(up)
    order, sorted_slot, bounds = _by_row(slot, rows, chunk)
    sorted_target, sorted_g = target[order], grad_lp[order]
    grad_hidden = torch.empty_like(hidden)
    # Accumulated over chunks in at least float32, cast once at the end.
    grad_weight = torch.zeros(weight.shape, dtype=compute_dtype(weight.dtype), device=weight.device)
    grad_bias = torch.zeros(bias.shape if bias is not None else (0,), dtype=up, device=hidden.device)
    for i, r0 in enumerate(range(0, rows, chunk)):
        r1 = min(r0 + chunk, rows)
        h = hidden[r0:r1]
        y, z = _chunk_logits(h, weight, bias, softcap)
        gz = torch.exp(z - lse[r0:r1, None]).mul_(-row_g[r0:r1, None])
        a, b = bounds[i], bounds[i + 1]
        if a < b:
            gz.index_put_((sorted_slot[a:b] - r0, sorted_target[a:b]), sorted_g[a:b], accumulate=True)
        if softcap is not None:
            t = torch.tanh(y.to(up) / softcap)
            gz.mul_(1 - t * t)
        if bias is not None:
            grad_bias += gz.sum(dim=0)
        gy = gz.to(weight.dtype)
        grad_hidden[r0:r1] = gy @ weight
        grad_weight += (gy.T @ h).to(grad_weight.dtype)
    return grad_hidden, grad_weight.to(weight.dtype), grad_bias.to(weight.dtype)


@_fused_backward.register_fake
def _fused_backward_fake(grad_lp, grad_lse, hidden, weight, bias, slot, target, lse, softcap, chunk):
    nb = bias.shape if bias is not None else (0,)
    return torch.empty_like(hidden), torch.empty_like(weight), weight.new_empty(nb)


def _setup(ctx, inputs, output):
    hidden, weight, bias, slot, target, softcap, chunk = inputs
    ctx.save_for_backward(hidden, weight, bias, slot, target, output[1])
    ctx.softcap, ctx.chunk = softcap, chunk


def _backward(ctx, grad_lp, grad_lse):
    hidden, weight, bias, slot, target, lse = ctx.saved_tensors
    if grad_lp is None:
        grad_lp = torch.zeros_like(slot, dtype=lse.dtype)
    gh, gw, gb = torch.ops.treecompile.fused_target_logprobs_backward(
        grad_lp, grad_lse, hidden, weight, bias, slot, target, lse, ctx.softcap, ctx.chunk
    )
    return gh, gw, (gb if bias is not None else None), None, None, None, None


_fused_forward.register_autograd(_backward, setup_context=_setup)


def fused_target_logprobs(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    slot: Tensor,
    target: Tensor,
    *,
    softcap: float | None = None,
    chunk: int | None = None,
    kernel: str | None = None,
) -> Tensor:
    """Per-target log-probabilities without forming the ``[R, V]`` logits.

    Args:
        hidden: ``[R, H]`` inputs of the vocabulary projection, one row per predicting row.
        weight: ``[V, H]`` projection weight (the LM head).
        bias: ``[V]`` or None.
        slot: ``[M]`` int64, the row of ``hidden`` that predicts each target.
        target: ``[M]`` int64 token ids.
        softcap: final logit soft-cap (``softcap * tanh(logits / softcap)``), or None.
        chunk: rows per chunk; None picks :func:`default_chunk` ``(V)``.
        kernel: a name from :data:`KERNELS`; None picks :func:`default_kernel` for
            ``hidden``'s device.

    Returns:
        ``[M]`` ``log softmax(cap(hidden[slot] @ weight.T + bias))[target]`` in at least
        float32, differentiable with respect to ``hidden``, ``weight`` and ``bias``.

    Raises:
        ValueError: mismatched shapes, a chunk below 1, or an unknown ``kernel``.
        RuntimeError: ``kernel="triton"`` without Triton or on a device it cannot run on.
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"expected hidden [R, H] and weight [V, H], got {tuple(hidden.shape)} and {tuple(weight.shape)}")
    if slot.shape != target.shape or slot.dim() != 1:
        raise ValueError(f"expected slot and target [M], got {tuple(slot.shape)} and {tuple(target.shape)}")
    chunk = default_chunk(weight.shape[0]) if chunk is None else int(chunk)
    if chunk < 1:
        raise ValueError(f"chunk must be a positive number of rows, got {chunk}")
    kernel = default_kernel(hidden.device) if kernel is None else kernel
    if kernel not in KERNELS:
        raise ValueError(f"unknown kernel {kernel!r}; valid kernels: {', '.join(KERNELS)}")
    if kernel == "triton":
        if importlib.util.find_spec("triton") is None:
            raise RuntimeError("kernel='triton' needs the triton package (pip install triton)")
        from treecompile.kernels.logprobs.fused_triton import triton_target_logprobs

        return triton_target_logprobs(hidden, weight, bias, slot, target, softcap=softcap, chunk=chunk)
    lp, _ = torch.ops.treecompile.fused_target_logprobs(
        hidden, weight, bias, slot, target, None if softcap is None else float(softcap), chunk
    )
    return lp
