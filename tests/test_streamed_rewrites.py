"""Talking heads (scores and probabilities mixed across heads, passes/attention/head_mix.py) and
the class drop-ins (DBRX's and JetMoE's experts, treecompile/capture/drop_ins.py), streamed in
parts: the same rewrites run on each part's graph, and the tree equals per-path training (the zoo
checks them on the whole tree). MiniMax's lightning attention (a pair sum) is refused streamed."""

from __future__ import annotations

import contextlib

import pytest
import zoo
from testing import ZOO_F64_TOLERANCE, hf_float64_casts

import treecompile as tc
from treecompile.core.errors import UnsupportedModelError
from treecompile.stream.options import StreamOptions


@pytest.mark.full
@pytest.mark.parametrize("case_id", ["talking-heads-both", "talking-heads-mqa", "dbrx", "jetmoe-aux"])
def test_streamed_parts_equal_per_path_training(case_id):
    case = next(c for c in zoo.all_cases() if c.id == case_id).installed()
    if case.hf:
        pytest.importorskip("transformers")
    if case.expect != "exact":
        pytest.skip(f"{case_id} is {case.expect} on this transformers")
    model = case.build()
    compiled = tc.tree_compile(model, backend="eager", stream=StreamOptions(budget_rows=4, mode="keep"))
    with hf_float64_casts(model, methods=True) if case.hf else contextlib.nullcontext():
        for _, batch, trees in zoo.batches():
            zoo.compare(model, compiled, batch, trees, rel=ZOO_F64_TOLERANCE if case.hf else None)
            assert compiled._stream.stats.parts > 1
    assert compiled.counters  # the part graph was captured and rewritten


def test_a_pair_sum_is_refused_streamed():
    pytest.importorskip("transformers")
    case = next(c for c in zoo.all_cases() if c.id == "minimax").installed()
    if case.expect != "exact":
        pytest.skip(f"minimax is {case.expect} on this transformers")
    compiled = tc.tree_compile(case.build(), backend="eager", stream=StreamOptions(budget_rows=4))
    _, batch, _ = zoo.batches()[0]
    with pytest.raises(UnsupportedModelError, match="attention without a softmax .* is not run over streamed parts"):
        compiled(batch)


@pytest.mark.full
def test_kimi_delta_attention_streams_exactly():
    """Kimi Delta Attention (a decay per key channel) streamed: each part's tree scan starts from
    the states of earlier parts, injected through rows whose gate is zero in every channel."""
    pytest.importorskip("transformers")
    import test_compile_hybrid as hybrid
    from test_compile_models import compare_with_paths, make_batch

    hybrid._skip_if_absent("kimi_linear")
    model = hybrid._model("kimi_linear")
    compiled = tc.tree_compile(model, backend="eager", stream=StreamOptions(budget_rows=4, mode="keep"))
    with hf_float64_casts(model):
        batch, trees = make_batch("branchy")
        compare_with_paths(model, compiled, batch, trees, tol="hf")
    assert compiled._stream.stats.parts > 1
    assert compiled.counters["route_ssm_state_pass"] == {"kimi_delta_rule": 1}


@pytest.mark.full
def test_gated_linear_attention_streams_exactly():
    """fla's GLA (a decay per key channel, no delta rule) streamed: each part's tree scan starts
    from the states of earlier parts."""
    from zoo_repos.gla import GLALM

    model = zoo.perturb(GLALM(mode="naive").double().eval())
    compiled = tc.tree_compile(model, backend="eager", stream=StreamOptions(budget_rows=4, mode="keep"))
    for _, batch, trees in zoo.batches():
        zoo.compare(model, compiled, batch, trees)
    assert compiled._stream.stats.parts > 1
    assert compiled.counters["route_ssm_state_pass"] == {"gla_scan": 1}
