"""The chunked recurrence in float32 is about as accurate as the token loop (kernels/scans/recurrence.py).

Strong decays (``g`` down to -8 per token, a chunk's running sum down to about -250) are what
Mamba2 layers produce (``dt * A`` with ``A = -exp(A_log)`` up to -16). Each decay
``exp(b_i - b_j)`` must then be summed from its own terms: as a difference of two running
sums it cancels, and float32 gradients came out 30-50x less accurate than the loop's (seen
first as Bamba's ``A_log`` gradient in the GPU exactness procedure run on the CPU).
"""

from __future__ import annotations

import pytest
import torch

from gpu_exactness import FP32_RATIO

from treecompile.kernels.scans.naive import recurrence_reference
from treecompile.kernels.scans.recurrence import chunked_recurrence


def _errors(fn, inputs, weights, delta) -> list[float]:
    """Relative max error of the output-weighted loss's input gradients, float32 vs float64."""

    def grads(dtype):
        leaves = [x.to(dtype).requires_grad_() for x in inputs]
        out, final = fn(*leaves, delta=delta)
        loss = (out * weights[0].to(dtype)).sum() + (final * weights[1].to(dtype)).sum()
        return torch.autograd.grad(loss, leaves)

    ref = grads(torch.float64)
    return [float((a.double() - r).abs().max() / r.abs().max()) for a, r in zip(grads(torch.float32), ref)]


@pytest.mark.parametrize("delta", [False, True], ids=["ssd", "delta-rule"])
def test_chunked_float32_gradients_as_accurate_as_the_loop(delta):
    g = torch.Generator().manual_seed(0)
    b, s, h, d = 1, 200, 2, 8

    def rand(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    k = torch.nn.functional.normalize(rand(b, s, h, d), dim=-1)
    decay = -torch.rand(b, s, h, generator=g, dtype=torch.float64) * 8
    inputs = [rand(b, s, h, d) * d**-0.5, k, rand(b, s, h, d), decay, torch.rand(b, s, h, generator=g,
                                                                                  dtype=torch.float64)]
    weights = [rand(b, s, h, d), rand(b, h, d, d)]
    chunked = _errors(chunked_recurrence, inputs, weights, delta)
    loop = _errors(recurrence_reference, inputs, weights, delta)
    for name, c, lp in zip(["q", "k", "v", "g", "beta"], chunked, loop):
        assert c <= (1 + FP32_RATIO) * lp, f"grad {name}: chunked {c:.2e} vs token loop {lp:.2e}"
