"""The zoo's hand-written spellings on CUDA (tests/zoo.py): what each rewrite hands the tree
kernel there (a bias or mask read from the tokens as extra query and key features, maps combined across
heads, a model's own FlexAttention mods on path positions, a learned relative bias table, `nn.MultiheadAttention`'s
extra key, the pair sum, path scans, a mask of the distance, the long convolution by FFT) in float32, against per-path training in float32, within
the budget of tests/gpu_exactness.py (1 + FP32_RATIO times the per-path run's own error against
float64 on the CPU). The CPU suite checks the same models in float64 (tests/test_zoo.py)."""

from __future__ import annotations

import pytest
import torch
import zoo
from gpu_exactness import Measured, copy_as, fp32_check, run_tree

import treecompile as tc
from treecompile.core.reference import per_path_loss

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

#: One case per kernel input the rewrites build (ids in tests/zoo.py).
CASES = ["forgetting-transformer", "key-gate-bias-mqa", "key-padding-sdpa", "key-padding-fill", "encoder-layer-padding",
         "diff-transformer", "t5-bias", "flex-softcap", "mha-bias-kv-zero-attn", "retnet-learned-decay",
         "cumsum-linear-attention", "talking-heads-both", "doge", "dbrx", "minimax",
         # FlexAttention given a transposed key, the distance-table mask_mod, the long conv by FFT
         # per tree node, MEGA's Toeplitz table beside it.
         "gqa-keys-transposed", "strided-mask", "s4d", "mega"]


def _paths(model: torch.nn.Module, trees) -> Measured:
    """The unmodified model on each path alone, in its dtype and on its device."""
    model.zero_grad(set_to_none=True)
    ref = per_path_loss(model, trees)
    ref.loss.backward()
    out = Measured(ref.loss.detach().double().cpu(), torch.cat([lp.detach().double().cpu() for lp in ref.logprobs]),
                   {n: p.grad.detach().double().cpu() for n, p in model.named_parameters() if p.grad is not None})
    model.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("case_id", CASES)
def test_zoo_spelling_matches_per_path_training_on_cuda(case_id, record_property):
    case = next(c for c in zoo.all_cases() if c.id == case_id).installed()
    assert case.expect == "exact", case
    trees = [t for _, _, forest in zoo.batches() for t in forest]
    base = case.build()  # float64 on the CPU: the ground truth
    ref64 = _paths(base, trees)
    model = copy_as(base, torch.float32, "cuda")
    path32 = _paths(model, trees)
    compiled = tc.tree_compile(model)
    tree32 = run_tree(compiled, tc.pack(trees, device="cuda"))
    chk = fp32_check(tree32, path32, ref64)
    record_property("per_path_fp32_error", f"{chk.path_error:.3e}")
    record_property("tree_vs_path_worst", f"{chk.worst[0]}: {chk.worst[1]:.3e} (budget {chk.budget:.3e})")
    record_property("rewrites", {k: dict(v) for k, v in compiled.counters.items()})
    assert not chk.failures(), f"tree vs per-path float32 beyond {chk.budget:.3e}: {chk.failures()}"
