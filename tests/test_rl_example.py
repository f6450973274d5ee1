"""The GRPO example: 10 optimizer steps on trees equal, in float64, those path by path."""

import importlib.util
from pathlib import Path

import pytest
from testing import eager_default_lowering

pytest.importorskip("transformers")

# Both runs use a GPT-2 computing in float64 throughout: only summation order differs, and Adam
# carries it through 10 steps; 1e-10 is far above that (measured: ~5e-13) and far below a
# structural error (a wrong mask or weight shows at 1e-3 of the parameter movement, ~1e-4).
PARAM_TOL = 1e-10
LOSS_TOL = 1e-12


@pytest.mark.full
def test_grpo_example_trajectories_are_equal():
    spec = importlib.util.spec_from_file_location(
        "grpo_tree", Path(__file__).resolve().parents[1] / "examples" / "grpo_tree.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    # The example's tree_compile(model) runs the rewritten graph as it is: what is compared is
    # the training (test_compile_custom.py lowers learned absolute positions, as GPT-2's).
    with eager_default_lowering():
        r = mod.run(steps=5)  # 2 PPO epochs per step: 10 optimizer steps
    assert len(r["tree_losses"]) == 10
    assert r["param_moved"] > 1e-2, "the parameters must actually move for the comparison to mean something"
    assert r["loss_diff"] <= LOSS_TOL, f"loss curves differ by {r['loss_diff']:.3e}"
    assert r["param_diff"] <= PARAM_TOL, f"parameters differ by {r['param_diff']:.3e} after 10 steps"
