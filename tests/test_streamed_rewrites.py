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


@pytest.mark.parametrize("case_id", ["bmm-tril", "baddbmm"])
def test_attention_over_folded_heads_streams_exactly(case_id):
    """Attention over ``[B * H, T, d]`` (``torch.bmm`` / ``baddbmm`` scores): the rewrite unfolds
    the heads, and the part graph keeps the keys' and values' shapes for the stack (an internal
    error before, reading a shape the unfolded operands did not carry)."""
    model = zoo.BY_ID[case_id].build()
    compiled = tc.tree_compile(model, backend="eager", stream=StreamOptions(budget_rows=4))
    for _, batch, trees in zoo.batches():
        zoo.compare(model, compiled, batch, trees)
        assert compiled._stream.stats.parts > 1


def test_a_rewrite_that_reads_earlier_rows_of_a_path_is_refused_streamed():
    """The zoo's ``fill-conv`` (causal convs padded with the first row or a constant, rewritten
    into taps over each row's ancestors): a part's predecessor table stops at its first row, so
    its taps would read the padding where the path's earlier rows are in earlier parts (loss 3.685
    vs 3.804 per path before). Refused naming the model's line, the model as it was; its
    zero-padded convs (``conv-act-cut``) still stream exactly."""
    from test_compile_state import _assert_same, _snapshot

    model = zoo.BY_ID["fill-conv"].build()
    before = _snapshot(model)
    _, batch, _ = zoo.batches()[0]
    with pytest.raises(UnsupportedModelError) as info:
        tc.tree_compile(model, backend="eager", stream=StreamOptions(budget_rows=4))(batch)
    first = str(info.value).splitlines()[0]
    assert first.startswith("treecompile cannot stream this model: an op at zoo_custom.py:"), first
    assert "reads earlier rows of each path (tap_conv)" in first, first
    _assert_same(before, _snapshot(model))
    model = zoo.BY_ID["conv-act-cut"].build()
    compiled = tc.tree_compile(model, backend="eager", stream=StreamOptions(budget_rows=4))
    for _, batch, trees in zoo.batches():
        zoo.compare(model, compiled, batch, trees)
