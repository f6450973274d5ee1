"""Fused target log-probabilities with Triton kernels for the row-wise ``[C, V]`` work.

    lp = triton_target_logprobs(hidden, lm_head.weight, None, slot, target)   # [M], CUDA

The same function as :func:`treecompile.kernels.logprobs.fused.fused_target_logprobs` (its
torch op is the reference the tests compare with), split the same way: rows are processed
``chunk`` at a time, so at most ``[chunk, V]`` logits exist at once, never ``[R, V]``.
Per chunk, the projection ``y = h W^T + b`` is one matrix product (cuBLAS), and everything
row-wise after it is one Triton program per row that streams the row in ``BLOCK_V`` tiles:

* forward (`_row_logprobs_kernel`): soft-cap, an online log-sum-exp over the tiles, then the
  row's target logits read back from ``y`` (one load each), ``lp = z[t] - lse``, written
  straight to the targets' output slots. No ``[C, V]`` float32 copy, no softmax tensor.
* backward (`_row_grad_kernel`): recomputes ``y`` (one product per chunk) and overwrites it,
  in place, with ``dL/dy = (onehot(t) g - softmax(z) sum g) * cap'(y)``; two more products
  give ``dL/dh`` and the chunk's share of ``dL/dW``.

The logit arithmetic follows the torch op exactly: projection and soft-cap rounded to the
weight's dtype, then upcast to at least float32 for the log-softmax. Targets are grouped by
row with a stable sort and ``searchsorted`` on the device, so no step synchronises with the
host.

The two numbers, for ``R`` rows, vocabulary ``V``, hidden size ``H`` in bfloat16: the forward
does ``2 R V H`` FLOP in its product and moves ``2 R V`` bytes in the row pass (read ``y``
once), the backward ``6 R V H`` FLOP and ``4 R V`` bytes (read ``y``, write ``dL/dy``). At
Qwen3-0.6B's head (``V = 151936``, ``H = 1024``) the products dominate (``H`` FLOP per byte
against an H100's ~260), so the row passes should cost about a fifth of the step's LM-head
time; the torch op adds a float32 copy of every chunk (``8 R V`` more bytes each way).
`tests/gpu/test_gpu_fused_head.py` times both on a GPU.

The kernels are compiled for CUDA. On CPU they run only under Triton's interpreter
(``TRITON_INTERPRET=1`` set before this module is first imported), which is how the test
suite checks them without a GPU; :func:`check_device` says which applies.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from treecompile.kernels.dtypes import compute_dtype

__all__ = ["MAX_BLOCK_V", "INTERPRETED", "check_device", "default_block_v", "triton_target_logprobs"]

Tensor = torch.Tensor

#: Widest vocabulary tile one program streams at a time (elements). Rows are read once per
#: pass, so the kernels are bound by memory; 4096-wide tiles keep 8 warps busy with 16-byte
#: loads of bf16. Not yet timed on a GPU: `treecompile bench --device cuda` reports the
#: fused head's step time.
MAX_BLOCK_V = 4096


@triton.jit
def _capped(y, softcap, HAS_CAP: tl.constexpr, ACC: tl.constexpr):
    """``(cap(y), tanh(y / cap))`` as the torch op computes them: the capped value rounded to
    ``y``'s dtype, then upcast to ``ACC``; without a cap, ``(y, y)`` upcast."""
    x = y.to(ACC)
    t = x
    if HAS_CAP:
        x = x / softcap
        # tanh(x) = sign(x) (1 - e) / (1 + e), e = exp(-2|x|): no overflow for any x.
        e = tl.exp(-2.0 * tl.abs(x))
        t = (1.0 - e) / (1.0 + e)
        t = tl.where(x < 0, -t, t)
        x = (t * softcap).to(y.dtype).to(ACC)
    return x, t


@triton.jit
def _row_logprobs_kernel(
    y_ptr, lse_ptr, lp_ptr, tstart_ptr, tgt_ptr, order_ptr, V, stride_y, softcap,
    HAS_CAP: tl.constexpr, ACC: tl.constexpr, BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0)
    base = y_ptr + row.to(tl.int64) * stride_y
    m = tl.full([], float("-inf"), ACC)
    s = tl.zeros([], ACC)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        y = tl.load(base + cols, mask=cols < V, other=0.0)
        z, _ = _capped(y, softcap, HAS_CAP, ACC)
        z = tl.where(cols < V, z, float("-inf"))
        m_new = tl.maximum(m, tl.max(z, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), axis=0)
        m = m_new
    lse = m + tl.log(s)
    tl.store(lse_ptr + row, lse)
    # This row's targets: sorted positions tstart[row] .. tstart[row + 1].
    t0 = tl.load(tstart_ptr + row)
    t1 = tl.load(tstart_ptr + row + 1)
    for j in range(t0, t1):
        t = tl.load(tgt_ptr + j)
        zt, _ = _capped(tl.load(base + t), softcap, HAS_CAP, ACC)
        tl.store(lp_ptr + tl.load(order_ptr + j), zt - lse)


@triton.jit
def _row_grad_kernel(
    y_ptr, lse_ptr, rowg_ptr, tstart_ptr, tgt_ptr, g_ptr, V, stride_y, softcap,
    HAS_CAP: tl.constexpr, ACC: tl.constexpr, BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0)
    base = y_ptr + row.to(tl.int64) * stride_y
    lse = tl.load(lse_ptr + row)
    rg = tl.load(rowg_ptr + row)
    t0 = tl.load(tstart_ptr + row)
    t1 = tl.load(tstart_ptr + row + 1)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        y = tl.load(base + cols, mask=cols < V, other=0.0)
        z, t = _capped(y, softcap, HAS_CAP, ACC)
        gz = -tl.exp(z - lse) * rg
        for j in range(t0, t1):
            gz += tl.where(cols == tl.load(tgt_ptr + j), tl.load(g_ptr + j).to(ACC), 0.0)
        if HAS_CAP:
            gz = gz * (1.0 - t * t)
        tl.store(base + cols, gz.to(y.dtype), mask=cols < V)


#: Whether this module's kernels were built for Triton's CPU interpreter.
INTERPRETED = isinstance(_row_logprobs_kernel, InterpretedFunction)


def check_device(device: torch.device) -> None:
    """Raises ``RuntimeError`` unless the kernels can run on ``device``."""
    if device.type == "cuda" or (device.type == "cpu" and INTERPRETED):
        return
    raise RuntimeError(
        f"the Triton fused log-prob kernel runs on CUDA tensors (on CPU only under Triton's interpreter, "
        f"TRITON_INTERPRET=1 set before treecompile.kernels.logprobs.fused_triton is imported); got {device}"
    )


def default_block_v(vocab: int) -> int:
    """Vocabulary tile: the next power of two at or above ``vocab``, at most :data:`MAX_BLOCK_V`."""
    return min(MAX_BLOCK_V, triton.next_power_of_2(max(vocab, 16)))


def _acc(dtype: torch.dtype):
    return tl.float64 if dtype == torch.float64 else tl.float32


def _warps(block_v: int) -> int:
    return 8 if block_v >= 2048 else 4


def _targets_by_row(slot: Tensor, target: Tensor, rows: int) -> tuple[Tensor, Tensor, Tensor]:
    """``(tstart [rows + 1], sorted targets, order)``: row ``r``'s targets are
    ``target[order[tstart[r]:tstart[r + 1]]]``. On the device, no host sync."""
    sorted_slot, order = torch.sort(slot, stable=True)
    tstart = torch.searchsorted(sorted_slot, torch.arange(rows + 1, device=slot.device, dtype=slot.dtype))
    return tstart, target[order].contiguous(), order


@torch.library.custom_op("treecompile::triton_target_logprobs", mutates_args=())
def _forward(
    hidden: Tensor, weight: Tensor, bias: Tensor | None, slot: Tensor, target: Tensor, softcap: float | None,
    chunk: int, block_v: int,
) -> tuple[Tensor, Tensor]:
    """``([M] log-probs, [R] log-sum-exp)``; see :func:`triton_target_logprobs`."""
    rows, vocab = hidden.shape[0], weight.shape[0]
    up = compute_dtype(hidden.dtype)
    lp = hidden.new_empty(slot.shape[0], dtype=up)
    lse = hidden.new_empty(rows, dtype=up)
    tstart, tgt, order = _targets_by_row(slot, target, rows)
    for r0 in range(0, rows, chunk):
        r1 = min(r0 + chunk, rows)
        y = F.linear(hidden[r0:r1], weight, bias).contiguous()
        _row_logprobs_kernel[(r1 - r0,)](
            y, lse[r0:], lp, tstart[r0:], tgt, order, vocab, y.stride(0), float(softcap or 1.0),
            HAS_CAP=softcap is not None, ACC=_acc(up), BLOCK_V=block_v, num_warps=_warps(block_v),
        )
    return lp, lse


@_forward.register_fake
def _forward_fake(hidden, weight, bias, slot, target, softcap, chunk, block_v):
    up = compute_dtype(hidden.dtype)
    return hidden.new_empty(slot.shape[0], dtype=up), hidden.new_empty(hidden.shape[0], dtype=up)


@torch.library.custom_op("treecompile::triton_target_logprobs_backward", mutates_args=())
def _backward_op(
    grad_lp: Tensor, grad_lse: Tensor | None, hidden: Tensor, weight: Tensor, bias: Tensor | None, slot: Tensor,
    target: Tensor, lse: Tensor, softcap: float | None, chunk: int, block_v: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(grad_hidden [R, H], grad_weight [V, H], grad_bias [V] or [0])``, chunk by chunk."""
    rows, vocab = hidden.shape[0], weight.shape[0]
    up = lse.dtype
    grad_lp = grad_lp.to(up)
    # Each row's softmax is weighted by the sum of its targets' gradients (minus the lse's).
    row_g = torch.zeros(rows, dtype=up, device=hidden.device).index_add_(0, slot, grad_lp)
    if grad_lse is not None:
        row_g = row_g - grad_lse.to(up)
    tstart, tgt, order = _targets_by_row(slot, target, rows)
    g_sorted = grad_lp[order].contiguous()
    grad_hidden = torch.empty_like(hidden)
    # Accumulated over chunks in at least float32, cast once at the end (as the torch op).
    grad_weight = torch.zeros(weight.shape, dtype=compute_dtype(weight.dtype), device=weight.device)
    grad_bias = torch.zeros(bias.shape if bias is not None else (0,), dtype=up, device=hidden.device)
    for r0 in range(0, rows, chunk):
        r1 = min(r0 + chunk, rows)
        h = hidden[r0:r1]
        gy = F.linear(h, weight, bias).contiguous()
        _row_grad_kernel[(r1 - r0,)](
            gy, lse[r0:], row_g[r0:], tstart[r0:], tgt, g_sorted, vocab, gy.stride(0), float(softcap or 1.0),
            HAS_CAP=softcap is not None, ACC=_acc(up), BLOCK_V=block_v, num_warps=_warps(block_v),
        )
        if bias is not None:
            grad_bias += gy.sum(dim=0, dtype=up)
        grad_hidden[r0:r1] = gy @ weight
        grad_weight += (gy.T @ h).to(grad_weight.dtype)
    return grad_hidden, grad_weight.to(weight.dtype), grad_bias.to(weight.dtype)


@_backward_op.register_fake
def _backward_fake(grad_lp, grad_lse, hidden, weight, bias, slot, target, lse, softcap, chunk, block_v):
    nb = bias.shape if bias is not None else (0,)
    return torch.empty_like(hidden), torch.empty_like(weight), weight.new_empty(nb)


def _setup(ctx, inputs, output):
    hidden, weight, bias, slot, target, softcap, chunk, block_v = inputs
    ctx.save_for_backward(hidden, weight, bias, slot, target, output[1])
    ctx.softcap, ctx.chunk, ctx.block_v = softcap, chunk, block_v


def _backward(ctx, grad_lp, grad_lse):
    hidden, weight, bias, slot, target, lse = ctx.saved_tensors
    if grad_lp is None:
        grad_lp = torch.zeros_like(slot, dtype=lse.dtype)
    gh, gw, gb = torch.ops.treecompile.triton_target_logprobs_backward(
        grad_lp, grad_lse, hidden, weight, bias, slot, target, lse, ctx.softcap, ctx.chunk, ctx.block_v
    )
    return gh, gw, (gb if bias is not None else None), None, None, None, None, None


_forward.register_autograd(_backward, setup_context=_setup)


def triton_target_logprobs(
    hidden: Tensor, weight: Tensor, bias: Tensor | None, slot: Tensor, target: Tensor, *,
    softcap: float | None, chunk: int, block_v: int | None = None,
) -> Tensor:
    """``[M]`` target log-probabilities through the Triton kernels (arguments checked by the caller).

    Args:
        hidden, weight, bias, slot, target, softcap, chunk: as in
            :func:`treecompile.kernels.logprobs.fused.fused_target_logprobs`.
        block_v: vocabulary tile (a power of two); None picks :func:`default_block_v`.

    Raises:
        RuntimeError: the tensors are on a device the kernels cannot run on (`check_device`).
    """
    check_device(hidden.device)
    block_v = default_block_v(weight.shape[0]) if block_v is None else int(block_v)
    if block_v < 16 or block_v & (block_v - 1):
        raise ValueError(f"block_v must be a power of two >= 16, got {block_v}")
    lp, _ = torch.ops.treecompile.triton_target_logprobs(
        hidden, weight, bias, slot, target, None if softcap is None else float(softcap), chunk, block_v
    )
    return lp
