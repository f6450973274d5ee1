"""Models Dynamo cannot capture are refused with one readable first line: what failed, the
model's source line, and why; never Dynamo's raw message or a FakeTensor traceback."""

from __future__ import annotations

import pytest
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
}


@pytest.mark.parametrize("case", list(CASES))
def test_capture_failures_are_refused_with_a_readable_first_line(case):
    cls, first_line = CASES[case]
    batch, _ = make_batch("branchy")
    with pytest.raises(UnsupportedModelError) as info:
        tc.tree_compile(tiny(cls))(batch)
    message = str(info.value)
    assert __import__("re").match(first_line, message.splitlines()[0]), message
    assert "Developer debug context" not in message and "FakeTensor(" not in message
    assert info.value.__cause__ is None and info.value.__suppress_context__
