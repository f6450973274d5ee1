"""Shared test utilities: tolerances with their reasons, and a prefix-hash 'model'."""

from __future__ import annotations

import contextlib
import hashlib

import os
import sys
import types

import numpy as np
import torch

# (dtype, what is compared) -> (rtol, atol), each with the reason for its size.
TOLERANCES = {
    # Pure float64 arithmetic, summed in a different order: rounding only.
    ("float64", "pure"): (1e-12, 1e-12),
    # Hugging Face norms compute in float32 even in a float64 model: a ~1e-7 floor.
    ("float64", "hf"): (1e-6, 1e-7),
}

# Elementwise (rtol, atol) for the tree_compile comparisons (loss, logprobs, each gradient).
COMPILE_TOL = {
    # Pure float64 on both sides, summed in a different order: rounding only (measured
    # <= 2e-15 on these models).
    "pure": (1e-12, 1e-12),
    # Hugging Face norms compute in float32 inside a float64 model, so each norm output
    # rounds to float32 (~6e-8 relative) and a 1e-16 difference upstream can flip one
    # rounding. Measured max |diff|: grads 6e-8 (Llama, Qwen2/3, Mistral), 2e-7 (Gemma2:
    # four norms per layer); logprobs 4e-8. Structural errors show as 1e-4 and more.
    "hf": (1e-6, 1e-6),
}

# Gradient comparisons use the error relative to the reference tensor's largest entry,
# so that a loss mode that scales the loss ("sum") does not scale the tolerance away.
# A structural error (a wrong mask, position or weight) shows as 1e-4 or worse.
SCALED_GRAD_TOLERANCE = {
    ("float64", "pure"): 1e-10,
    ("float64", "hf"): 2e-6,
    # The architecture zoo's bar (tests/zoo.py): relative 1e-6 across families whose norms,
    # softmaxes or RoPE compute in float32 inside a float64 model (measured <= 3e-7).
    ("float64", "zoo"): 1e-6,
}

#: Relative tolerance of the zoo's loss and log-prob comparisons (the same bar).
ZOO_TOLERANCE = SCALED_GRAD_TOLERANCE[("float64", "zoo")]
#: The zoo's bar for Hugging Face models, run with their float32 casts computed in float64 on both
#: sides (`hf_float64_casts`): float64 rounding only (measured <= 2.5e-15 over its HF cases).
ZOO_F64_TOLERANCE = COMPILE_TOL["pure"][0]


def examples(n: int) -> int:
    """``n`` generated examples for ``hypothesis.settings(max_examples=...)``; at most 5 in the
    quick tier (``scripts/test.sh --quick``)."""
    return min(n, 5) if os.environ.get("TREECOMPILE_QUICK") == "1" else n


def assert_grads_close(got: dict, ref: dict, kind: tuple[str, str]) -> float:
    """Compares every parameter's gradient; returns the worst scaled error.

    Fails naming the parameter, its max and mean absolute error and the scale used.
    """
    assert got.keys() == ref.keys(), f"gradients differ in which parameters they cover: {got.keys() ^ ref.keys()}"
    tol = SCALED_GRAD_TOLERANCE[kind]
    worst = 0.0
    for name, r in ref.items():
        g = got[name]
        scale = max(r.abs().max().item(), 1e-30)
        err = (g - r).abs()
        scaled = err.max().item() / scale
        worst = max(worst, scaled)
        where = tuple(int(i) for i in np.unravel_index(int(err.argmax()), tuple(r.shape)))
        assert scaled <= tol, (
            f"{name}: max |diff| {err.max().item():.3e} at {where}, mean {err.mean().item():.3e}, "
            f"scale {scale:.3e} -> scaled error {scaled:.3e} > {tol:.0e}"
        )
    return worst


def param_grads(model) -> dict:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def backward_grads(model, run):
    """``(out, grads)``: ``out = run()`` with ``out.loss`` backpropagated from fresh gradients;
    the model's gradients are cleared again afterwards."""
    model.zero_grad(set_to_none=True)
    out = run()
    out.loss.backward()
    grads = param_grads(model)
    model.zero_grad(set_to_none=True)
    return out, grads


def hash_logits(prefix: tuple[int, ...], vocab: int) -> np.ndarray:
    """Logits that are a fixed pseudo-random function of the whole prefix."""
    digest = hashlib.blake2b(repr(prefix).encode(), digest_size=8).digest()
    rng = np.random.default_rng(int.from_bytes(digest, "little"))
    return rng.normal(size=vocab) * 2.0


def hash_forward(vocab: int):
    """``forward(model, ids[1, T]) -> logits[1, T, V]`` for :func:`treecompile.core.reference.per_path_loss`."""

    def forward(model, ids):
        toks = ids[0].tolist()
        rows = [hash_logits(tuple(toks[: t + 1]), vocab) for t in range(len(toks))]
        return torch.tensor(np.stack(rows), dtype=torch.float64)[None]

    return forward


def tree_hash_logits(batch, vocab: int) -> torch.Tensor:
    """``[S, V]`` logits of every row from the prefix along its own path (pred_index chain)."""
    pred = batch.pred_index.tolist()
    ids = batch.input_ids.tolist()
    rows = []
    for j in range(len(ids)):
        chain = []
        k = j
        while k >= 0:
            chain.append(ids[k])
            k = pred[k]
        rows.append(hash_logits(tuple(reversed(chain)), vocab))
    return torch.tensor(np.stack(rows), dtype=torch.float64)


class NoModel(torch.nn.Module):
    """Stands in for a model where ``forward=`` does the work."""

    def __init__(self) -> None:
        super().__init__()
        self.p = torch.nn.Parameter(torch.zeros(1, dtype=torch.float64))


def tree_visibility(batch, window: int | None = None) -> torch.Tensor:
    """``[S, S]`` dense tree mask (reference, O(S^2)), optionally cut to a window along the path."""
    visible = batch.reference_attention_mask()
    if window:
        pos = batch.position_ids
        visible = visible & (pos[:, None] - pos[None, :] < window)
    return visible


def dense_tree_attention(q, k, v, visible, scale: float, softcap: float | None) -> torch.Tensor:
    """Plain softmax attention over a dense visibility mask, GQA by repetition (reference)."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    scores = (q @ k.transpose(-1, -2)) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    return torch.softmax(scores.masked_fill(~visible, float("-inf")), -1) @ v

# Hugging Face Trainer on trees against the stock Trainer (tests/test_integrations_hf.py):
# dtype -> (loss rtol, update tolerance relative to each parameter's largest update entry).
# The stock causal-LM loss casts the logits to float32 (transformers' ForCausalLMLoss), so even
# a float64 model's stock loss and gradients carry float32 rounding. Measured over 3 SGD steps
# on tiny Qwen3: float64 loss 1e-7 relative, updates 1.1e-6; float32 loss 1.1e-7, updates
# 3.7e-5 (norm weights, whose updates are small). A wrong mask or normalisation shows as 1e-3.
TRAINER_TOLERANCE = {
    "float64": (1e-6, 1e-5),
    "float32": (1e-6, 2e-4),
}
#: bf16 autocast: how much farther from the float32 stock run the tree run may be than the
#: stock bf16 run (the GPU check's and tests/test_compile_mixed_precision.py's rule).
TRAINER_ERROR_RATIO = 1.5

#: How much farther from the stock trainer's float64 run a tree-packed TRL run in float32 (or
#: bf16 autocast) may be than the stock trainer's own run in that precision, per step, for the
#: loss, the gradients and the parameters (tests/test_integration_trl.py). Both runs round
#: the same sums in a different order, so the tree run's error is of the stock run's size;
#: measured ratios (1.0x to 2.9x) are given in that test's module docstring.
TRL_NOISE_FACTOR = 4.0

#: Relative tolerance of the KL a float64 GRPO run with a reference model logs (``beta > 0``;
#: tests/test_integration_trl.py). The KL (about 5e-4 after one step) is a small function of
#: the difference of two log-probabilities of size ~8 (the entropy), each computed by a float64
#: model whose norms compute in float32: their ~1e-7 relative floor is ~1e-5 of the KL
#: (measured 9.8e-6 between the tree and the stock run). A wrong reference shows as a KL of 0
#: or one off by its own size.
TRL_KL_RTOL = 1e-4

#: Floor of that comparison for the logged loss: the Trainer accumulates the logged loss in a
#: float32 tensor, so a float64 run's loss is rounded to float32 and the stock float32 run often
#: shows no error at all; two float32 ulps (relative 2 * 2**-23) is the resolution of the log.
TRL_LOSS_RESOLUTION = 2 * 2.0**-23


def perturbed_hf_model(config, dtype=torch.float64, *, eval: bool = True, **from_config):
    """A Hugging Face causal LM from ``config`` (``from_config`` keyword arguments passed on)
    with every weight moved off its init (no zero bias, no identity norm, which would hide
    bugs), in ``dtype``, in eval mode unless ``eval=False``."""
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, **from_config).to(dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model.eval() if eval else model


@contextlib.contextmanager
def eager_default_lowering():
    """Inside, a wrapper built with the default lowering (``backend=None``: AOTAutograd on CPU)
    runs its rewritten graph as it is (``backend="eager"``); an explicit backend is kept. For
    tests of what does not depend on the lowering (docs examples, the benchmark's rows) whose
    model families the equivalence tests already check through the default lowering: the
    lowering is two thirds of a small model's compile time."""
    from treecompile.compile.wrapper import TreeCompiledModel

    backend = TreeCompiledModel._backend

    def eager_by_default(self, device, **kw):
        if self._backend_name is not None or device.type != "cpu":
            return backend(self, device, **kw)
        self._backend_name = "eager"  # for this graph's backend only
        try:
            return backend(self, device, **kw)
        finally:
            self._backend_name = None

    TreeCompiledModel._backend = eager_by_default
    try:
        yield
    finally:
        TreeCompiledModel._backend = backend


#: What every spawned rank imports: loaded once by the fork server (`spawn_ranks`).
RANK_PRELOAD = ["torch", "torch.distributed", "transformers", "treecompile.compile.wrapper",
                "treecompile.distributed.context_parallel", "treecompile.distributed.data_parallel"]


def spawn_ranks(fn, args: tuple, nprocs: int) -> None:
    """``torch.multiprocessing.spawn(fn, args, nprocs, join=True)``, with each rank forked from
    a fork server that imported torch, transformers and treecompile once (`RANK_PRELOAD`),
    instead of a fresh interpreter importing them per rank (about 5 s of CPU each). The server
    is a single-threaded process of its own: nothing of the test process (threads, compiled
    graphs) is forked."""
    import multiprocessing

    import torch.multiprocessing as mp

    multiprocessing.set_forkserver_preload(RANK_PRELOAD)
    mp.start_processes(fn, args=args, nprocs=nprocs, join=True, start_method="forkserver")


# ``torch`` with ``float32`` and ``float`` meaning float64. One object for every call: Dynamo
# guards on the modules' ``torch`` global by identity, so a new one per call would recompile the
# shared compiled models in every test.
FLOAT64_TORCH = types.ModuleType("torch")
FLOAT64_TORCH.__dict__.update(torch.__dict__)
FLOAT64_TORCH.float32 = FLOAT64_TORCH.float = torch.float64


def float_keeping_float64(self, *args, **kwargs):
    """``Tensor.float()`` as the modules mean it in a float64 model: a float64 tensor stays float64,
    integers (position ids) become float64 too (what they meet is float64 now), half precision
    becomes float32."""
    wide = torch.float64 if self.dtype == torch.float64 or not self.is_floating_point() else torch.float32
    return self.to(wide, *args, **kwargs)


@contextlib.contextmanager
def hf_float64_casts(model, methods: bool = False):
    """Inside, the model's Hugging Face modules cast to float64 where they cast to float32
    (norms, routers, softmaxes, rotary tables, the GDN and Mamba2 fallbacks): in a float64 model
    those casts put float32 rounding on both sides of a comparison, ~1e-7 apart, a floor that
    would hide a real error of that size (and that ill-conditioned gradients, Qwen3-Next's
    ``dt_bias``, amplify past any float64 budget). Both sides run under it: the model is the same
    function on the tree and per path. ``methods``: ``tensor.float()`` too, for the run (Dynamo
    traces the method as it is set, so the captured graph does as well; it does not guard on
    it, so a compiled model is called with ``methods`` always or never)."""
    modules = {sys.modules[type(m).__module__] for m in model.modules()
               if type(m).__module__.startswith("transformers.models.")}
    saved = [(mod, mod.torch) for mod in modules if getattr(mod, "torch", None) is torch]
    saved_float = torch.Tensor.float
    try:
        for mod, _ in saved:
            mod.torch = FLOAT64_TORCH
        if methods:
            torch.Tensor.float = float_keeping_float64
        yield
    finally:
        torch.Tensor.float = saved_float
        for mod, real in saved:
            mod.torch = real
