"""Warnings for batches that train exactly but not well: paths past the model's positions, low POR."""

from __future__ import annotations

import doctest
import json
import re
import warnings

import pytest

from treecompile import TrajectoryTree, pack
from treecompile.core import advice
from treecompile.core.advice import (
    MEASURED_SPEEDUP,
    TreeWarning,
    low_por_advice,
    measured_speedup,
    position_overflow,
    warn_low_por,
    warn_position_overflow,
)
from treecompile.cli.main import main


def test_module_examples():
    assert doctest.testmod(advice, optionflags=doctest.ELLIPSIS).failed == 0


def test_measured_speedup_interpolates_the_docs_table():
    for por, speedup in MEASURED_SPEEDUP:
        assert measured_speedup(por) == pytest.approx(speedup)
    p0, s0 = MEASURED_SPEEDUP[1]
    p1, s1 = MEASURED_SPEEDUP[2]
    assert measured_speedup((p0 + p1) / 2) == pytest.approx((s0 + s1) / 2)
    assert measured_speedup(0.99) == MEASURED_SPEEDUP[-1][1]
    with pytest.raises(ValueError, match="POR must be in"):
        measured_speedup(1.5)


def test_the_table_is_the_one_in_the_docs():
    from pathlib import Path

    page = (Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md").read_text()
    for por, speedup in MEASURED_SPEEDUP:
        row = f"| {por:.3f} | 2048 |"
        interval = [ln for ln in page.splitlines() if row in ln and "| interval |" in ln]
        assert interval, f"no interval row at POR {por:.3f} in docs/benchmarks.md"
        assert re.search(rf"\| {speedup:.2f}x( ~)? \|", interval[0]), (interval[0], speedup)


@pytest.mark.parametrize("por, warns", [(0.0, True), (0.1, True), (0.15, True), (0.153, True), (0.154, False),
                                        (0.2, False), (0.5, False), (0.92, False)])
def test_low_por_advice(por, warns):
    message = low_por_advice(por)
    assert (message is not None) == warns
    if warns:
        assert message.startswith(f"POR {por:.3f} is low: tree training measured about {measured_speedup(por):.2f}x")
        assert "(1.03x at POR 0.00 in docs/benchmarks.md" in message
        # The break-even (0.154 from the measured table) rounded up: never the POR just called low.
        assert message.endswith("the tree pays off above about POR 0.154")


def test_warn_low_por_on_trees():
    low = TrajectoryTree.from_sequences([[1, 2, 3, 4, 5, 6, 7, 8], [1, 9, 9, 9, 9, 9, 9, 9]])  # POR 1/16
    high = TrajectoryTree.from_sequences([[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 5, 6, 7, 9]])  # POR 7/16
    with pytest.warns(TreeWarning, match=r"POR 0\.062 is low"):
        assert warn_low_por([low])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not warn_low_por([high])


class _Config:
    def __init__(self, n):
        self.max_position_embeddings = n


class _Model:
    def __init__(self, n):
        self.config = _Config(n)


def test_position_overflow_on_trees_and_batches():
    trees = [TrajectoryTree.from_sequences([[1, 2, 3]]), TrajectoryTree.from_sequences([[1, 2], [1, 3, 4, 5, 6]])]
    assert position_overflow(trees, 5) is None and position_overflow(trees, None) is None
    assert position_overflow(trees, 4).startswith(
        "the longest path has 5 tokens (tree 1, path 1), more than the model's max_position_embeddings = 4;"
    )
    batch = pack(trees)
    assert position_overflow(batch, 4).startswith(
        "the longest path has 5 tokens (tree 1), more than the model's max_position_embeddings = 4;"
    )
    with pytest.warns(TreeWarning, match="max_position_embeddings = 4"):
        assert warn_position_overflow(batch, _Model(4))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not warn_position_overflow(batch, _Model(5))
        assert not warn_position_overflow(batch, object())  # no config: nothing to check


def test_position_overflow_reads_a_hf_config():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen3Config(vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                                   max_position_embeddings=4)
    model = _Model(0)
    model.config = cfg  # the field is read from the config object, as on a HF model
    with pytest.warns(TreeWarning, match="5 tokens"):
        warn_position_overflow(pack([TrajectoryTree.from_sequences([[1, 2, 3, 4, 5]])]), model)


def test_stats_prints_the_advice(tmp_path, capsys):
    from treecompile.data.io import SequenceRecord, save_sequences

    path = tmp_path / "low.jsonl"
    save_sequences(path, [SequenceRecord([1, 2, 3, 4, 5, 6, 7, 8]), SequenceRecord([1, 9, 9, 9, 9, 9, 9, 9])])
    assert main(["stats", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["advice"] == low_por_advice(1 / 16)
    assert main(["stats", str(path)]) == 0
    flat = " ".join(capsys.readouterr().out.split())
    assert "advice: POR 0.062 is low" in flat
    assert main(["stats", "sample:gsm8k", "--tokenizer", "bytes", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["advice"] is None  # POR 0.35


def test_pack_warns_once_about_a_low_por_batch():
    low = TrajectoryTree.from_sequences([[1, 2, 3, 4, 5, 6, 7, 8], [1, 9, 9, 9, 9, 9, 9, 9]])  # POR 1/16
    high = TrajectoryTree.from_sequences([[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 5, 6, 7, 9]])  # POR 7/16
    with pytest.warns(TreeWarning, match=r"^POR 0\.062 is low: tree training measured about"):
        pack(low)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pack(high)
        pack(low, warn_por=False)
