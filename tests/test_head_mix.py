"""Talking heads (scores and probabilities mixed across heads, passes/attention/head_mix.py) and
DBRX's experts drop-in, streamed in parts: the same rewrites run on each part's graph, and the
tree equals per-path training (the zoo checks them on the whole tree)."""

from __future__ import annotations

import pytest
import zoo

import treecompile as tc
from treecompile.stream.options import StreamOptions


@pytest.mark.full
@pytest.mark.parametrize("case_id", ["talking-heads-both", "talking-heads-mqa", "dbrx"])
def test_streamed_parts_equal_per_path_training(case_id):
    case = next(c for c in zoo.all_cases() if c.id == case_id).installed()
    if case.hf:
        pytest.importorskip("transformers")
    if case.expect != "exact":
        pytest.skip(f"{case_id} is {case.expect} on this transformers")
    model = case.build()
    compiled = tc.tree_compile(model, backend="eager", stream=StreamOptions(budget_rows=4, mode="keep"))
    for _, batch, trees in zoo.batches():
        zoo.compare(model, compiled, batch, trees)
        assert compiled._stream.stats.parts > 1
    assert compiled.counters  # the part graph was captured and rewritten
