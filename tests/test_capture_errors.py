"""Models Dynamo cannot capture are refused with one readable first line: what failed, the
model's source line, and why; never Dynamo's raw message or a FakeTensor traceback."""

from __future__ import annotations

import pytest
import torch
from test_compile_models import NanoGPT, make_batch, tiny

import treecompile as tc
from treecompile.core.errors import UnsupportedModelError


class BranchOnValues(NanoGPT):
    def forward(self, idx):
        y = super().forward(idx)
        if y.sum() > 0:
            return y
        return -y


class ReadsAttentionMask(NanoGPT):
    def forward(self, idx, attention_mask=None):
        scale = attention_mask.dtype
        return super().forward(idx) * (scale is not None)


class FixedLength(NanoGPT):
    def forward(self, idx):
        return super().forward(idx).view(1, 3, -1, 7)


class SplitSizesFromValues(NanoGPT):
    """Tokens grouped by a value-dependent split (an expert loop written with ``.tolist()``)."""

    def forward(self, idx):
        y = super().forward(idx)
        counts = torch.bincount(idx[0] % 2, minlength=2).tolist()
        parts = y[0].split(counts)
        return torch.cat([p * (i + 1) for i, p in enumerate(parts)])[None]


CASES = {
    "data-dependent-branch": (
        BranchOnValues,
        r"^treecompile cannot capture this model: `if y\.sum\(\) > 0:` at .*test_capture_errors\.py:\d+: "
        r"it branches on a tensor's value, which cannot be captured as one graph \(Data-dependent branching\)\.$",
    ),
    "exception-in-model-code": (
        ReadsAttentionMask,
        r"^treecompile cannot capture this model: `scale = attention_mask\.dtype` at .*test_capture_errors\.py:\d+: "
        r"it raises AttributeError\('dtype'\) when traced \(Observed exception\)\.$",
    ),
    "fake-tensor-error": (
        FixedLength,
        r"^treecompile cannot capture this model: `return super\(\)\.forward\(idx\)\.view\(1, 3, -1, 7\)` at "
        r".*test_capture_errors\.py:\d+: it raises RuntimeError\(\"shape '\[1, 3, -1, 7\]' is invalid",
    ),
    "data-dependent-sizes": (
        SplitSizesFromValues,
        r"^treecompile cannot capture this model: `counts = torch\.bincount\(idx\[0\] % 2, minlength=2\)\.tolist\(\)` "
        r"at .*test_capture_errors\.py:\d+: a tensor's values decide a size or a Python number .* "
        r"\(GuardOnDataDependentSymNode\)\.$",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_capture_failures_are_refused_with_a_readable_first_line(case):
    cls, first_line = CASES[case]
    batch, _ = make_batch("branchy")
    with pytest.raises(UnsupportedModelError) as info:
        tc.tree_compile(tiny(cls))(batch)
    message = str(info.value)
    if case == "data-dependent-sizes":  # nothing to do with the packed row's length
        assert "pack fewer rows" not in message, message
    assert __import__("re").match(first_line, message.splitlines()[0]), message
    assert "Developer debug context" not in message and "FakeTensor(" not in message
    assert info.value.__cause__ is None and info.value.__suppress_context__


def test_an_error_inside_a_pass_is_a_refusal_naming_the_pass_and_the_node():
    """A pass that fails (an internal error) refuses the model naming the pass, the node it was
    at and the model's source line; the original error is chained for the report."""
    from treecompile.compile.wrapper import TreeCompiledModel
    from treecompile.passes.pipeline import PASSES, Pipeline

    def rewrite_softmax_pass(gm, ctx):
        for node in gm.graph.nodes:
            if node.op == "call_function" and "linear" in str(node.target):
                raise RuntimeError("cannot rewrite this linear")
        return gm

    passes = Pipeline(PASSES[:1] + (rewrite_softmax_pass,) + PASSES[1:])
    batch, _ = make_batch("branchy")
    with pytest.raises(UnsupportedModelError) as info:
        TreeCompiledModel(tiny(NanoGPT), mask="interval", backend="eager", verify="probe", passes=passes)(batch)
    first = str(info.value).splitlines()[0]
    assert first.startswith("treecompile cannot make this model exact on a tree: rewrite_softmax_pass failed at node "), first
    assert "(RuntimeError: cannot rewrite this linear)" in first and "test_compile_models.py:" in first, first
    assert "internal error of treecompile" in str(info.value)
    assert isinstance(info.value.__cause__, RuntimeError)


class NeedsThreeInputs(NanoGPT):
    def forward(self, idx, y, z):
        return super().forward(idx)


def test_a_model_that_takes_other_arguments_is_told_so_without_unrelated_advice():
    """A forward(x, y, z) model: one line saying how tree_compile calls it, and no advice about
    the packed row's length (which has nothing to do with it)."""
    batch, _ = make_batch("branchy")
    with pytest.raises(UnsupportedModelError) as info:
        tc.tree_compile(tiny(NeedsThreeInputs))(batch)
    message = str(info.value)
    assert message.splitlines()[0] == ("treecompile cannot capture this model: its forward cannot be called as "
                                       "model(input_ids) (a plain PyTorch model must take the token ids [1, S] as its "
                                       "one required argument).")
    assert "pack fewer rows" not in message
