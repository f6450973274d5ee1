"""Fused target log-probabilities (kernels/logprobs/fused.py) against the plain path."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from treecompile.kernels.logprobs.fused import default_chunk, fused_target_logprobs
from treecompile.kernels.logprobs.naive import reference_target_logprobs

# (dtype, atol) for values and grads against the plain path on the same inputs. float64: the
# only difference is where log-sum-exp is subtracted (z - lse vs log_softmax), a few ulps.
# float32: the same, at float32 rounding of logits of size ~10.
TOLERANCES = {torch.float64: 1e-12, torch.float32: 2e-5}

CASES = [
    # (R, H, V, M, chunk)
    (1, 4, 5, 1, 1),
    (37, 8, 97, 50, 8),  # R not a multiple of chunk, V odd
    (64, 16, 65, 64, 64),  # exactly one chunk
    (65, 7, 127, 200, 16),  # many targets per row (branch points), odd H
    (20, 8, 33, 5, 128),  # chunk larger than R; most rows predict nothing
]


def _inputs(r, h, v, m, dtype, bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(r, h, generator=g, dtype=dtype).requires_grad_()
    weight = torch.randn(v, h, generator=g, dtype=dtype).requires_grad_()
    b = torch.randn(v, generator=g, dtype=dtype).requires_grad_() if bias else None
    slot = torch.randint(0, r, (m,), generator=g)
    target = torch.randint(0, v, (m,), generator=g)
    grad = torch.randn(m, generator=g, dtype=torch.promote_types(dtype, torch.float32))
    return hidden, weight, b, slot, target, grad


def _run(fn, hidden, weight, bias, slot, target, grad, **kw):
    params = [hidden, weight] + ([bias] if bias is not None else [])
    lp = fn(hidden, weight, bias, slot, target, **kw)
    grads = torch.autograd.grad((lp * grad).sum(), params)
    return lp, grads


def _assert_close(name, got, want, atol):
    err = (got - want).abs()
    assert err.max().item() <= atol, (
        f"{name}: max error {err.max().item():.3g} at {divmod(err.argmax().item(), got.shape[-1])} "
        f"(mean {err.mean().item():.3g}, atol {atol:g})"
    )


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("softcap", [None, 5.0], ids=["nocap", "softcap5"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("case", CASES, ids=[f"R{c[0]}-H{c[1]}-V{c[2]}-M{c[3]}-C{c[4]}" for c in CASES])
def test_matches_plain_path(case, bias, softcap, dtype):
    r, h, v, m, chunk = case
    hidden, weight, b, slot, target, grad = _inputs(r, h, v, m, dtype, bias)
    lp, grads = _run(fused_target_logprobs, hidden, weight, b, slot, target, grad, softcap=softcap, chunk=chunk)
    ref, ref_grads = _run(reference_target_logprobs, hidden, weight, b, slot, target, grad, softcap=softcap)
    assert lp.dtype == ref.dtype == torch.promote_types(dtype, torch.float32)
    atol = TOLERANCES[dtype]
    _assert_close("logprobs", lp, ref, atol)
    for name, g, rg in zip(["hidden", "weight", "bias"], grads, ref_grads):
        assert g.dtype == rg.dtype and g.shape == rg.shape, name
        _assert_close(f"grad {name}", g, rg, atol)


def test_bfloat16_upcasts_like_the_plain_path():
    hidden, weight, b, slot, target, grad = _inputs(33, 8, 65, 40, torch.bfloat16, bias=False)
    lp = fused_target_logprobs(hidden, weight, b, slot, target, softcap=4.0, chunk=8)
    ref = reference_target_logprobs(hidden, weight, b, slot, target, softcap=4.0)
    assert lp.dtype == torch.float32
    # Same bf16 projection and cap, the same float32 log-softmax: agreement to float32 rounding.
    _assert_close("logprobs", lp, ref, 1e-5)


def test_gradcheck():
    hidden, weight, b, slot, target, _ = _inputs(9, 3, 11, 12, torch.float64, bias=True)
    fn = lambda h, w, bb: fused_target_logprobs(h, w, bb, slot, target, softcap=2.0, chunk=4)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (hidden, weight, b))


def test_no_targets():
    hidden, weight, b, slot, target, grad = _inputs(10, 4, 7, 0, torch.float64, bias=False)
    lp, grads = _run(fused_target_logprobs, hidden, weight, b, slot, target, grad, chunk=3)
    assert lp.shape == (0,)
    assert all(g.abs().max().item() == 0 for g in grads)


def test_opcheck():
    hidden, weight, b, slot, target, _ = _inputs(13, 4, 9, 20, torch.float64, bias=True)
    torch.library.opcheck(torch.ops.treecompile.fused_target_logprobs, (hidden, weight, b, slot, target, 3.0, 4))


def test_compiles_with_dynamic_rows():
    fn = torch.compile(
        lambda h, w, s, t: fused_target_logprobs(h, w, None, s, t, chunk=8), backend="aot_eager", fullgraph=True
    )
    for r, m in [(20, 30), (41, 17)]:
        hidden, weight, _, slot, target, grad = _inputs(r, 8, 33, m, torch.float64, bias=False)
        lp, grads = _run(lambda h, w, b, s, t: fn(h, w, s, t), hidden, weight, None, slot, target, grad)
        ref, ref_grads = _run(reference_target_logprobs, hidden, weight, None, slot, target, grad)
        _assert_close("logprobs", lp, ref, 1e-12)
        for g, rg in zip(grads, ref_grads):
            _assert_close("grad", g, rg, 1e-12)


class _LargestTensor(TorchDispatchMode):
    """Records the shape of the largest tensor any op produces."""

    def __init__(self):
        super().__init__()
        self.largest = 0
        self.shape = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.numel() > self.largest:
                self.largest, self.shape = t.numel(), tuple(t.shape)
        return out


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "plain"])
def test_memory_is_chunk_by_vocab(fused):
    # R x V is far above every other size, so any [R, V] intermediate would be the largest.
    r, h, v, chunk = 300, 16, 97, 32
    hidden, weight, b, slot, target, grad = _inputs(r, h, v, 400, torch.float32, bias=True)
    fn = fused_target_logprobs if fused else reference_target_logprobs
    kw = {"chunk": chunk, "softcap": 3.0} if fused else {"softcap": 3.0}
    with _LargestTensor() as mode:
        _run(fn, hidden, weight, b, slot, target, grad, **kw)
    bound = max(chunk * v, v * h, r * h)
    if fused:
        assert mode.largest <= bound, f"largest intermediate {mode.shape} exceeds chunk x vocab {chunk}x{v}"
    else:  # the checker sees the plain path's [R, V] logits
        assert mode.largest >= r * v, mode.shape


def test_default_chunk_bounds_memory():
    assert default_chunk(151_936) * 151_936 <= 1 << 24
    assert default_chunk(10) >= 1


@pytest.mark.parametrize("bad", ["hidden", "slot", "chunk"])
def test_bad_arguments(bad):
    hidden, weight, b, slot, target, _ = _inputs(5, 4, 7, 3, torch.float64, bias=False)
    kw = {"chunk": 0} if bad == "chunk" else {}
    if bad == "hidden":
        hidden = hidden[None]
    if bad == "slot":
        slot = slot[:2]
    with pytest.raises(ValueError):
        fused_target_logprobs(hidden, weight, b, slot, target, **kw)
