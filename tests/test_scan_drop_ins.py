"""Scan kernels known by name and treecompile's drop-ins for them compute the same function.

The references are the repositories' own listings: mamba-ssm's (tests/zoo_repos/mamba_ssm.py:
``selective_scan_ref``'s token loop, ``ssd_minimal_discrete`` over padded chunks) and
recurrentgemma's ``rnn_scan`` (tests/zoo_repos/hawk.py); the drop-ins run one scan op. Compared in
float64, forward and every input's gradient, with each optional argument.
"""

from __future__ import annotations

import pytest
import torch
from zoo_repos import mamba_ssm as ref

from treecompile.capture import dynamo
from treecompile.capture.library_drop_ins import mamba_chunk_scan_combined, selective_scan_fn

F64 = torch.float64


def _close(ours, theirs, inputs, what):
    ours = ours if isinstance(ours, tuple) else (ours,)
    theirs = theirs if isinstance(theirs, tuple) else (theirs,)
    for a, b in zip(ours, theirs, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape, what
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=what)
    cot = [torch.randn_like(t) for t in theirs]
    leaves = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    ga = torch.autograd.grad(ours, leaves, cot, allow_unused=True)
    gb = torch.autograd.grad(theirs, leaves, cot, allow_unused=True)
    for i, (a, b) in enumerate(zip(ga, gb)):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10, msg=f"{what}: gradient of input {i}")


def _selective_inputs(b=2, d=6, n=4, length=11):
    g = torch.Generator().manual_seed(1)
    r = lambda *s: torch.randn(*s, generator=g, dtype=F64)  # noqa: E731
    u, delta, z = r(b, d, length), r(b, d, length) * 0.5, r(b, d, length)
    A = -torch.rand(d, n, generator=g, dtype=F64) - 0.2
    B, C, D, bias = r(b, n, length), r(b, n, length), r(d), r(d) * 0.1
    return [t.requires_grad_() for t in (u, delta, A, B, C, D, z, bias)]


@pytest.mark.parametrize("kwargs", [dict(), dict(D=True), dict(z=True), dict(bias=True, softplus=True),
                                    dict(D=True, z=True, bias=True, softplus=True, last=True)])
def test_selective_scan_matches_reference(kwargs):
    u, delta, A, B, C, D, z, bias = _selective_inputs()
    if not kwargs.get("softplus"):
        delta = delta.detach().abs().requires_grad_()  # a positive step without the softplus
    kw = dict(D=D if kwargs.get("D") else None, z=z if kwargs.get("z") else None,
              delta_bias=bias if kwargs.get("bias") else None, delta_softplus=bool(kwargs.get("softplus")),
              return_last_state=bool(kwargs.get("last")))
    _close(selective_scan_fn(u, delta, A, B, C, **kw), ref.selective_scan_ref(u, delta, A, B, C, **kw),
           [u, delta, A, B, C, D, z, bias], f"selective scan {kwargs}")


def _chunk_inputs(b=2, length=13, h=4, p=3, g=2, n=5):
    gen = torch.Generator().manual_seed(2)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=F64)  # noqa: E731
    x, dt, z = r(b, length, h, p), r(b, length, h), r(b, length, h, p)
    A = -torch.rand(h, generator=gen, dtype=F64) - 0.5
    B, C = r(b, length, g, n), r(b, length, g, n)
    return [t.requires_grad_() for t in (x, dt, A, B, C, z, r(h) * 0.1, r(h), r(h, p), r(b, h, p, n))]


@pytest.mark.parametrize("case", ["plain", "gated", "hdim", "limit", "initial", "final"])
def test_chunk_scan_matches_reference(case):
    x, dt, A, B, C, z, dt_bias, D, Dp, init = _chunk_inputs()
    kw = dict(D=D, dt_bias=dt_bias, dt_softplus=True)
    if case == "plain":
        kw = dict()
        dt = dt.detach().abs().requires_grad_()
    elif case == "gated":
        kw["z"] = z
    elif case == "hdim":
        kw["D"] = Dp
    elif case == "limit":
        kw["dt_limit"] = (0.3, 0.9)
    elif case == "initial":
        kw["initial_states"] = init
    else:
        kw.update(initial_states=init, return_final_states=True)
    for chunk in (4, 13, 16):  # chunks that split the length, one that fits it, one longer than it
        _close(mamba_chunk_scan_combined(x, dt, A, B, C, chunk, **kw),
               ref.mamba_chunk_scan_combined(x, dt, A, B, C, chunk, **kw),
               [x, dt, A, B, C, z, dt_bias, D, Dp, init], f"chunk scan {case}, chunk {chunk}")


def test_chunk_scan_refuses_what_it_cannot_read():
    x, dt, A, B, C, z, dt_bias, D, *_ = _chunk_inputs()
    with pytest.raises(ValueError, match="by keyword only"):
        mamba_chunk_scan_combined(x, dt, A, B, C, 4, D, z, dt_bias)
    with pytest.raises(ValueError, match="does not know the argument"):
        mamba_chunk_scan_combined(x, dt, A, B, C, 4, delta_bias=dt_bias)
    with pytest.raises(ValueError, match="keeps packed sequences apart"):
        mamba_chunk_scan_combined(x, dt, A, B, C, 4, seq_idx=torch.zeros(2, 13, dtype=torch.int32))
    with pytest.raises(ValueError, match="grouped or time-invariant"):
        u, delta, A1, B1, C1, *_ = _selective_inputs()
        selective_scan_fn(u, delta, A1, B1[:, None], C1[:, None])


def test_only_mamba_ssm_signatures_are_swapped():
    """A function of one of these names with other parameters (mamba-minimal's ``selective_scan`` layout
    under mamba-ssm's name) is left alone: its own code is captured and judged."""
    import types

    def selective_scan_fn(u, delta, A, B, C, D):  # noqa: N803  (b, l, d) layout, no z / bias
        return u

    def selective_scan_ref(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                           return_last_state=False):
        return u

    module = types.ModuleType("custom_mamba")
    module.selective_scan_fn, module.selective_scan_ref = selective_scan_fn, selective_scan_ref

    class Layer(torch.nn.Module):
        pass

    Layer.__module__ = module.__name__
    import sys

    sys.modules[module.__name__] = module
    try:
        found = {name for _, name, _ in dynamo.sequence_kernels(Layer())}
    finally:
        del sys.modules[module.__name__]
    assert found == {"selective_scan_ref"}


@pytest.mark.parametrize("with_h0", [False, True], ids=["zero-state", "initial-state"])
@pytest.mark.parametrize("reset_dims", [2, 3], ids=["reset-bt", "reset-bt1"])
def test_rnn_scan_matches_recurrentgemma_loop(with_h0, reset_dims):
    """recurrentgemma's ``rnn_scan`` (a loop over the tokens) and its drop-in, with resets inside
    the sequence (a gradient through neither ``log 0`` nor ``-inf``)."""
    from zoo_repos.hawk import rnn_scan

    from treecompile.capture.library_drop_ins import recurrentgemma_rnn_scan

    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 9, 5, generator=g, dtype=F64).requires_grad_()
    a = torch.rand(2, 9, 5, generator=g, dtype=F64).clamp(min=0.05).requires_grad_()
    reset = torch.zeros(2, 9, dtype=torch.bool)
    reset[:, 0] = reset[0, 4] = reset[1, 7] = True
    h0 = torch.randn(2, 5, generator=g, dtype=F64).requires_grad_() if with_h0 else None
    r = reset if reset_dims == 2 else reset[..., None]
    ours = recurrentgemma_rnn_scan(x, a, r, h0, acc_dtype=torch.float64)
    theirs = rnn_scan(x, a, reset, h0, acc_dtype=torch.float64)
    _close(ours, theirs, [x, a, h0], "rnn_scan")


def test_rwkv_wkv_matches_the_transformers_loop(monkeypatch):
    """RWKV-4's WKV by one scan op equals transformers' own CPU loop (its running maximum kept),
    float64 forward and gradients (the loop's float32 casts made float64, as the zoo does); a
    state carried between calls is refused."""
    from testing import FLOAT64_TORCH, float_keeping_float64

    modeling = pytest.importorskip("transformers.models.rwkv.modeling_rwkv")
    monkeypatch.setattr(modeling, "torch", FLOAT64_TORCH)
    monkeypatch.setattr(torch.Tensor, "float", float_keeping_float64)
    from treecompile.capture.library_drop_ins import hf_rwkv_linear_attention
    from treecompile.core.errors import UnsupportedModelError

    g = torch.Generator().manual_seed(3)
    decay, first = torch.randn(8, generator=g, dtype=F64), torch.randn(8, generator=g, dtype=F64)
    key, value = torch.randn(2, 9, 8, generator=g, dtype=F64) * 3, torch.randn(2, 9, 8, generator=g, dtype=F64)
    inputs = [t.requires_grad_() for t in (decay, first, key, value)]
    _close(hf_rwkv_linear_attention(*inputs)[0], modeling.rwkv_linear_attention_cpu(*inputs)[0], inputs, "wkv")
    with pytest.raises(UnsupportedModelError, match="state carried between calls"):
        hf_rwkv_linear_attention(*inputs, return_state=True)
