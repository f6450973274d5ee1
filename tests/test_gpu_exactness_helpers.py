"""The CPU-checkable parts of the CUDA exactness tests (tests/gpu_exactness.py).

Every model the GPU tests build is built here; the trees are checked for the properties the
GPU tests rely on; the float32 procedure (per-path float32 error against float64 as the
budget for tree vs per path) runs end to end on the CPU, and the budgets are shown to catch
an error of the size a structural mistake makes.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import treecompile as tc
from gpu_exactness import (BF16_RATIO, MODELS, Measured, bf16_failures, build_model, copy_as, exactness_trees,
                           fp32_check, run_paths, run_tree)

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("name", MODELS)
def test_model_builds_with_perturbed_bf16_weights(name):
    model = build_model(name)
    for n, p in model.named_parameters():
        assert torch.equal(p, p.to(torch.bfloat16).float()), f"{n} is not a bfloat16 number"
        assert not torch.all(p == p.flatten()[0]), f"{n} is constant (unperturbed norm or bias)"


def test_trees_have_the_awkward_cases():
    trees = exactness_trees()
    batch = tc.pack(trees)
    assert batch.num_tokens % 128 != 0 and batch.num_tokens > 3 * 128
    assert int(((batch.node_end - batch.node_start) == 1).sum()) >= 3  # 1-token nodes
    assert len(trees) == 2 and batch.num_paths == 8
    assert max(len(s) for s in trees[0].sequences()) > 48  # longer than the sliding window


@pytest.fixture(scope="module")
def qwen3_fp32():
    base = build_model("qwen3")
    trees = exactness_trees()
    ref64 = run_paths(copy_as(base, torch.float64, "cpu"), trees)
    path32 = run_paths(copy_as(base, torch.float32, "cpu"), trees)
    model = copy_as(base, torch.float32, "cpu")
    tree32 = run_tree(tc.tree_compile(model, lm_head="fused", backend="eager"), tc.pack(trees))
    return tree32, path32, ref64


def test_fp32_procedure_passes_on_cpu(qwen3_fp32):
    tree32, path32, ref64 = qwen3_fp32
    chk = fp32_check(tree32, path32, ref64)
    assert 0 < chk.path_error < 1e-4, chk.path_error  # float32 rounding, measured
    assert not chk.failures(), (chk.budget, chk.failures())


def test_fp32_budget_catches_a_structural_error(qwen3_fp32):
    tree32, path32, ref64 = qwen3_fp32
    name = "model.layers.1.self_attn.k_proj.weight"
    bad = dict(tree32.grads)
    bad[name] = bad[name] * (1 + 1e-3)  # far smaller than a wrong mask or position would cause
    chk = fp32_check(dataclasses.replace(tree32, grads=bad), path32, ref64)
    assert f"grad {name}" in chk.failures()


def test_bf16_budget_compares_relative_errors():
    ref = Measured(torch.tensor(1.0), torch.ones(10), {"w": torch.ones(4)})
    path = Measured(torch.tensor(1.0), torch.ones(10) * 1.01, {"w": torch.ones(4) * 1.01})
    ok = Measured(torch.tensor(1.0), torch.ones(10) * (1 + 0.01 * BF16_RATIO * 0.99), {"w": torch.ones(4) * 1.012})
    bad = Measured(torch.tensor(1.0), torch.ones(10) * 1.02, {"w": torch.ones(4) * 1.01})
    assert bf16_failures(ok, path, ref) == {}
    assert set(bf16_failures(bad, path, ref)) == {"logprobs"}


# The float32 procedure on the CPU (the rewritten graph run eagerly, torch scans) for the GPU
# models whose CPU path differs from plain attention: window + soft-caps, MoE, the hybrids. Qwen3
# runs above; Llama, Gemma3 and GPT-2 passed it on an H100 (docs/gpu.md) and their attention is
# covered by tests/test_compile_hf.py and the zoo.
# Measured on the CPU: Qwen3-Next's Gated DeltaNet gradients of A_log and dt_bias are ill-conditioned
# in float32 on both sides (per-path 1.3e-4 against float64, the tree's chunked scan 3.3e-4), so the
# tree misses the 3x budget by about 17%. On a GPU where fla runs, both sides run fla's kernels;
# where it is refused (Hopper with Triton < 3.7.1) both run torch scans, as here.
_CPU_FP32_OVER_BUDGET = {"qwen3_next"}
_CPU_FP32_MODELS = ("gemma2", "qwen3_moe", "qwen3_next", "bamba")


@pytest.mark.slow
@pytest.mark.parametrize("name", [pytest.param(m, marks=pytest.mark.xfail(
    strict=True, reason="Gated DeltaNet A_log/dt_bias float32 gradients: tree 3.3e-4 vs per path 1.3e-4 "
    "against float64 (measured)")) if m in _CPU_FP32_OVER_BUDGET else m for m in _CPU_FP32_MODELS])
def test_fp32_procedure_on_cpu_for_the_gpu_models_with_their_own_paths(name):
    base = build_model(name)
    trees = exactness_trees()
    ref64 = run_paths(copy_as(base, torch.float64, "cpu"), trees)
    path32 = run_paths(copy_as(base, torch.float32, "cpu"), trees)
    tree32 = run_tree(tc.tree_compile(copy_as(base, torch.float32, "cpu"), backend="eager"), tc.pack(trees))
    chk = fp32_check(tree32, path32, ref64)
    assert not chk.failures(), (chk.budget, chk.failures())
