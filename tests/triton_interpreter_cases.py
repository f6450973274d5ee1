"""Runs the Triton fused log-prob kernels under Triton's CPU interpreter; prints JSON errors.

Run as its own process with ``TRITON_INTERPRET=1`` (Triton reads the variable when a kernel is
decorated, so it must be set before the kernels are imported, and setting it inside the test
process would leak into every later test): ``tests/test_fused_logprobs_triton.py`` does so and
asserts on the numbers. Each case compares the Triton path with the torch op's plain
reference on the same inputs: the ``[M]`` log-probs and the gradients with respect to the
hidden states, the head weight and the bias.
"""

from __future__ import annotations

import json
import os
import sys

import torch

# Cases: (R rows, H, V, M targets, chunk rows, BLOCK_V). Awkward on purpose: one row; V below,
# at and not a multiple of the tile; R not a multiple of the chunk; more targets than rows
# (branch points); rows that predict nothing.
CASES = {
    "R1-V5": (1, 4, 5, 1, 1, 16),
    "R9-V97-B32": (9, 8, 97, 14, 4, 32),
    "R12-V64-B16": (12, 8, 64, 20, 5, 16),
    "R10-V33-sparse": (10, 4, 33, 3, 4, 16),
}


def inputs(case, dtype, bias, seed):
    r, h, v, m, _, _ = case
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(r, h, generator=g, dtype=dtype).requires_grad_()
    weight = torch.randn(v, h, generator=g, dtype=dtype).requires_grad_()
    b = torch.randn(v, generator=g, dtype=dtype).requires_grad_() if bias else None
    slot = torch.randint(0, r, (m,), generator=g)
    target = torch.randint(0, v, (m,), generator=g)
    grad = torch.randn(m, generator=g, dtype=dtype)
    grad[1::2] = 0.0  # targets of weight zero (masked tokens): no gradient through them
    return hidden, weight, b, slot, target, grad


def run(fn, hidden, weight, bias, slot, target, grad, **kw):
    params = [hidden, weight] + ([bias] if bias is not None else [])
    lp = fn(hidden, weight, bias, slot, target, **kw)
    return lp, torch.autograd.grad((lp * grad).sum(), params)


def main() -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("run with TRITON_INTERPRET=1")
    from treecompile.kernels.logprobs import fused_triton as tri
    from treecompile.kernels.logprobs.fused import fused_target_logprobs
    from treecompile.kernels.logprobs.naive import reference_target_logprobs

    assert tri.INTERPRETED
    out: dict[str, dict] = {}
    # Each case plain and with bias + soft-cap (the interpreter is slow: one Python call per op
    # per program), and one float64 case, where the two must agree to rounding.
    variants = [(name, torch.float32, bias, cap) for name in CASES for bias, cap in ((False, None), (True, 3.0))]
    variants.append(("R9-V97-B32", torch.float64, True, None))
    for seed, (name, dtype, bias, cap) in enumerate(variants):
        case = CASES[name]
        chunk, block_v = case[4], case[5]
        args = inputs(case, dtype, bias, seed)
        lp, grads = run(tri.triton_target_logprobs, *args, softcap=cap, chunk=chunk, block_v=block_v)
        ref, ref_grads = run(reference_target_logprobs, *args, softcap=cap)
        errs = {"logprobs": (lp - ref).abs().max().item()}
        for what, g, rg in zip(("hidden", "weight", "bias"), grads, ref_grads):
            assert g.dtype == rg.dtype and g.shape == rg.shape, what
            errs[f"grad {what}"] = (g - rg).abs().max().item()
        key = f"{name}-{str(dtype).removeprefix('torch.')}-{'bias' if bias else 'nobias'}-{'cap3' if cap else 'nocap'}"
        out[key] = {"dtype": str(dtype), "errors": errs, "lp_dtype": str(lp.dtype)}
    # The kernel chosen by name through the public function, and the op's fake/autograd registration.
    args = inputs(CASES["R9-V97-B32"], torch.float32, True, 99)
    lp = fused_target_logprobs(*args[:5], chunk=4, kernel="triton")
    out["public-kernel-triton"] = {
        "dtype": "torch.float32",
        "errors": {"logprobs": (lp - reference_target_logprobs(*args[:5])).abs().max().item()},
        "lp_dtype": str(lp.dtype),
    }
    # Inside a compiled graph (the fake and autograd registrations), two row counts, one graph.
    fn = torch.compile(lambda h, w, s, t: fused_target_logprobs(h, w, None, s, t, chunk=8, kernel="triton"),
                       backend="aot_eager", fullgraph=True, dynamic=True)
    worst = 0.0
    for r, m in [(20, 30), (41, 17)]:
        args = inputs((r, 8, 33, m, 8, 16), torch.float32, False, 50 + r)
        lp, grads = run(lambda h, w, b, s, t: fn(h, w, s, t), *args)
        ref, ref_grads = run(reference_target_logprobs, *args)
        worst = max(worst, (lp - ref).abs().max().item(), *[(g - rg).abs().max().item()
                                                            for g, rg in zip(grads, ref_grads)])
    out["compiled-dynamic-rows"] = {"dtype": "torch.float32", "errors": {"all": worst}, "lp_dtype": str(lp.dtype)}
    hidden, weight, b, slot, target, _ = inputs(CASES["R1-V5"], torch.float32, True, 7)
    torch.library.opcheck(torch.ops.treecompile.triton_target_logprobs, (hidden, weight, b, slot, target, 2.0, 1, 16))
    out["opcheck"] = {"ok": True}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
