"""The Triton fused log-prob kernels on CUDA at LM-head sizes, against the torch op."""

from __future__ import annotations

import pytest
import torch

from gpu_exactness import BF16_RATIO
from test_fused_logprobs import TOLERANCES

from treecompile.kernels.logprobs.fused import fused_target_logprobs
from treecompile.kernels.logprobs.naive import reference_target_logprobs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _inputs(r, h, v, m, dtype, bias, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    hidden = (torch.randn(r, h, generator=g, device="cuda") * h**-0.5).to(dtype).requires_grad_()
    weight = torch.randn(v, h, generator=g, device="cuda").to(dtype).requires_grad_()
    b = torch.randn(v, generator=g, device="cuda").to(dtype).requires_grad_() if bias else None
    slot = torch.randint(0, r, (m,), generator=g, device="cuda")
    target = torch.randint(0, v, (m,), generator=g, device="cuda")
    grad = torch.randn(m, generator=g, device="cuda")
    grad[1::3] = 0.0
    return hidden, weight, b, slot, target, grad


def _run(kernel, hidden, weight, bias, slot, target, grad, softcap, chunk=None):
    params = [hidden, weight] + ([bias] if bias is not None else [])
    if kernel == "reference":
        lp = reference_target_logprobs(hidden, weight, bias, slot, target, softcap=softcap)
    else:
        lp = fused_target_logprobs(hidden, weight, bias, slot, target, softcap=softcap, chunk=chunk, kernel=kernel)
    return [lp, *torch.autograd.grad((lp * grad.to(lp.dtype)).sum(), params)]


@pytest.mark.parametrize("softcap", [None, 30.0], ids=["nocap", "cap30"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_triton_matches_torch_op_float32(bias, softcap):
    args = _inputs(1000, 256, 50_001, 1500, torch.float32, bias)
    got = _run("triton", *args, softcap, chunk=96)
    want = _run("torch", *args, softcap, chunk=96)
    for name, a, b in zip(["logprobs", "hidden", "weight", "bias"], got, want):
        err = (a - b).abs().max().item() / max(b.abs().max().item(), 1.0)
        assert err <= TOLERANCES[torch.float32], f"{name}: {err:.3e}"


def test_triton_bf16_error_within_the_torch_op_error():
    args = _inputs(2048, 512, 32_003, 3000, torch.bfloat16, True)
    # float64 on the same (bf16) numbers: the error of each kernel's arithmetic alone.
    ref = _run("reference", *[a.detach().double().requires_grad_() if a is not None and a.dtype == torch.bfloat16
                              else a for a in args], 20.0)

    def rel(xs):
        return [float((x.double() - r).norm() / r.norm()) for x, r in zip(xs, ref)]

    tri, op = rel(_run("triton", *args, 20.0)), rel(_run("torch", *args, 20.0))
    for name, t, o in zip(["logprobs", "hidden", "weight", "bias"], tri, op):
        assert t <= BF16_RATIO * o, f"{name}: triton {t:.3e} vs torch op {o:.3e}"


def _timed(kernel, args) -> tuple[float, int]:
    """``(ms, peak bytes above the inputs)`` of one forward + backward."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    _run(kernel, *args, None)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end), torch.cuda.max_memory_allocated() - base


def test_triton_never_forms_rows_by_vocab(record_property):
    """Qwen3-0.6B's head at 32k rows. Floors (H100: 790 TFLOP/s bf16, 3.0 TB/s): the forward's
    projection is 2 R V H = 1.0e13 FLOP (12.7 ms) and its row pass reads R V bf16 = 10 GB
    (3.3 ms); the backward's three products 38 ms and its row pass 20 GB (6.6 ms): about 60 ms
    for both. The torch op also writes and reads a float32 copy of every chunk's logits."""
    r, h, v = 32768, 1024, 151_936
    _run("triton", *_inputs(64, h, v, 64, torch.bfloat16, False, seed=1), None)  # compiles the kernels
    args = _inputs(r, h, v, r, torch.bfloat16, False)
    ms, extra = _timed("triton", args)
    op_ms, op_extra = _timed("torch", args)
    record_property("triton_fwd_bwd_ms", round(ms, 1))
    record_property("torch_op_fwd_bwd_ms", round(op_ms, 1))
    record_property("triton_peak_extra_mib", round(extra / 2**20))
    record_property("torch_op_peak_extra_mib", round(op_extra / 2**20))
    # [R, V] bf16 logits alone would be 9.3 GiB; the chunked kernel holds [chunk, V] plus the
    # [V, H] weight gradient (float32 accumulator and bf16 result, 0.9 GiB).
    assert extra < r * v * 2 / 4, f"peak extra memory {extra / 2**30:.2f} GiB"
