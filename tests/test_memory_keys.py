"""Learned memory keys and values before the sequence's (`passes/attention/memory.py`): the
zoo (tests/zoo.py ``memory-kv``) checks the whole tree; here streamed, where the memory's
logit and value ride beside each part's prefix, and through the default lowering."""

from __future__ import annotations

import pytest
import zoo
import zoo_custom as zc

import treecompile as tc
from treecompile.stream.options import StreamOptions


@pytest.mark.full
@pytest.mark.parametrize("stream", [None, StreamOptions(budget_rows=3)], ids=["lowered", "streamed"])
def test_memory_keys_match_per_path_training(stream):
    model = zoo._custom(zc.MemoryKVLM)()
    compiled = tc.tree_compile(model, stream=stream, **({"backend": "eager"} if stream else {}))
    for _, batch, trees in zoo.batches():
        zoo.compare(model, compiled, batch, trees)
    record = compiled.compile_records[0]
    assert record.counters["rewrite_attention_pass"] == {"softmax_attention": 2}
