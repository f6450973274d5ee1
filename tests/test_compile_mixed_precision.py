"""bf16: autocast on a float32 model and a model loaded in bf16, on CPU, against the same
model run per path in the same precision; both measured against a float64 reference.

The criterion is the one the GPU check uses: the tree's error against float64 is at most
1.5x the per-path run's error against the same reference (both measured here; no bare
tolerance), for the loss and for the gradients as a whole.
"""

from __future__ import annotations

import copy

import pytest
import torch
from test_compile_models import NanoGPT, make_batch, tiny
from testing import perturbed_hf_model

import treecompile as tc
from treecompile.core.reference import per_path_loss

transformers = pytest.importorskip("transformers")

#: How much larger the tree's bf16 error may be than the per-path run's (the GPU check's rule).
ERROR_RATIO = 1.5


def _qwen3():
    cfg = transformers.Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    return perturbed_hf_model(cfg, torch.float32)


def _run(model, run):
    """``(loss, logprobs [all path targets], grads)`` in float64, from ``run() -> (loss, logprobs)``."""
    model.zero_grad(set_to_none=True)
    loss, logprobs = run()
    loss.backward()
    grads = {n: p.grad.detach().double().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach().double(), logprobs.detach().double(), grads


def _per_path(model, trees):
    out = per_path_loss(model, trees)
    return out.loss, torch.cat(out.logprobs)


def _tree(compiled, batch):
    out = compiled(batch)
    return out.loss, torch.cat([out.logprobs[batch.path_rows(i)] for i in range(batch.num_paths)])


def _rel(x, ref) -> float:
    return ((x - ref).norm() / ref.norm()).item()


def _grad_error(grads, ref_grads) -> float:
    num = sum(((grads[n] - g) ** 2).sum() for n, g in ref_grads.items())
    den = sum((g**2).sum() for g in ref_grads.values())
    return (num / den).sqrt().item()


@pytest.mark.full
@pytest.mark.parametrize("arch, precision", [("qwen3", "autocast"), ("nanogpt", "bf16-weights")])
def test_bf16_tree_error_is_within_the_per_path_error(arch, precision):
    base = _qwen3() if arch == "qwen3" else tiny(NanoGPT).float()
    ref_model = copy.deepcopy(base).double()
    model = base if precision == "autocast" else base.to(torch.bfloat16)
    compiled = tc.tree_compile(model)
    for name in ("branchy", "forest"):
        batch, trees = make_batch(name)
        ref_loss, ref_lp, ref_g = _run(ref_model, lambda: _per_path(ref_model, trees))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "autocast"):
            path_loss, path_lp, path_g = _run(model, lambda: _per_path(model, trees))
            tree_loss, tree_lp, tree_g = _run(model, lambda: _tree(compiled, batch))
        # Per-token log-probabilities and all gradients, as vectors.
        assert _rel(tree_lp, ref_lp) <= ERROR_RATIO * _rel(path_lp, ref_lp), name
        assert _grad_error(tree_g, ref_g) <= ERROR_RATIO * _grad_error(path_g, ref_g), name
        # The loss is a weighted mean of the log-probabilities, whose errors partly cancel by
        # chance: bound it by the per-path run's mean absolute per-token error.
        bound = ERROR_RATIO * (path_lp - ref_lp).abs().mean().item()
        assert abs(tree_loss - ref_loss).item() <= bound, (name, tree_loss, ref_loss, bound)
