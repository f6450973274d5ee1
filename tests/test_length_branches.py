"""A Python branch of the model on the sequence length (treecompile.passes.length_branches):
the graph holds the branch its row count takes, per-path training takes each path's. A batch
whose paths go the other way is warned about, naming the line, once per graph and line (the
zoo's `length-branch` is still wrong there: a strict xfail); a batch whose paths all take the
graph's branch runs exactly and silently, and a streamed part judges its own branch."""

from __future__ import annotations

import warnings

import pytest
import zoo

import treecompile as tc
from treecompile.passes.length_branches import LengthBranchWarning
from treecompile.stream.options import StreamOptions

#: Paths of 3 to 6 tokens in 11 rows (the branch at 8 splits the packed row from its paths).
SHORT = [[1, 2, 3, 4], [1, 2, 5], [1, 2, 3, 4, 6], [1, 7, 8, 9, 10, 11]]
#: Paths of 10 and 12 tokens: every path takes the branch the packed row takes.
LONG = [[(3 * i) % 29 + 1 for i in range(10)], [(3 * i) % 29 + 1 for i in range(6)] + [4, 5, 6, 7, 8, 9]]


def _batch(sequences):
    trees = [tc.TrajectoryTree.from_sequences(sequences)]
    return tc.pack(trees), trees


def _branch_warnings(call) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        call()
    return [str(w.message) for w in caught if issubclass(w.category, LengthBranchWarning)]


def test_a_path_that_goes_the_other_way_is_warned_about_once_naming_the_line():
    model = zoo.BY_ID["length-branch"].build()
    compiled = tc.tree_compile(model, backend="eager")
    batch, _ = _batch(SHORT)
    said = _branch_warnings(lambda: compiled(batch))
    assert len(said) == 1, said
    first = said[0].splitlines()[0]
    assert "a Python branch of the model on the sequence length at zoo_custom.py:" in first, first
    assert "(`if idx.shape[1] > 8:`)" in first and "a path of 3 tokens" in first, first
    assert _branch_warnings(lambda: compiled(batch)) == []  # once per graph and line


def test_paths_that_take_the_graphs_branch_run_exactly_without_a_warning():
    model = zoo.BY_ID["length-branch"].build()
    compiled = tc.tree_compile(model, backend="eager")
    batch, trees = _batch(LONG)
    assert _branch_warnings(lambda: zoo.compare(model, compiled, batch, trees)) == []


def test_a_streamed_part_is_judged_at_its_paths():
    """Parts of 4 rows do not take the branch (4 <= 8), nor do paths of at most 6 tokens: the
    short tree, wrong as one call, streams exactly and silently; the long one (paths of 10 and
    12 tokens) is warned about streamed."""
    model = zoo.BY_ID["length-branch"].build()
    streamed = tc.tree_compile(model, backend="eager", stream=StreamOptions(budget_rows=4))
    batch, trees = _batch(SHORT)
    assert _branch_warnings(lambda: zoo.compare(model, streamed, batch, trees)) == []
    assert streamed._stream.stats.parts > 1, streamed._stream.stats
    said = _branch_warnings(lambda: streamed(_batch(LONG)[0]))
    assert len(said) == 1 and "a path of 10 tokens" in said[0].splitlines()[0], said


def test_a_branch_the_probe_forest_and_the_batch_agree_on_is_not_judged_from_the_forest():
    """The first-call probe runs the graph on forests of its own; only the call's batch is
    judged (a batch of long paths: no warning, though the probe's forests are shorter)."""
    model = zoo.BY_ID["length-branch"].build()
    compiled = tc.tree_compile(model, backend="eager", verify="probe")
    assert _branch_warnings(lambda: compiled(_batch(LONG)[0])) == []
    assert compiled.probed, "the probe ran"


@pytest.mark.parametrize("case", ["nanochat", "h3"])
def test_a_branch_between_two_spellings_of_one_function_is_warned_about_and_exact(case):
    """nanochat's ``if window >= T: causal SDPA else a windowed mask`` and H3's ``if k.size(-1) <
    L: pad k``: the packed row takes the general side, exact for every path (the zoo checks it);
    the warning names the line."""
    model = zoo.BY_ID[case].build() if case in zoo.BY_ID else {c.id: c for c in zoo.all_cases()}[case].build()
    compiled = tc.tree_compile(model, backend="eager")
    batch, trees = _batch(SHORT)
    said = _branch_warnings(lambda: zoo.compare(model, compiled, batch, trees))
    assert len(said) == 1 and "on the sequence length at" in said[0], said


def test_a_part_that_would_not_fill_a_table_its_paths_fill_is_warned_about():
    """``FilledTableLM`` run eagerly on 12 tokens, then streamed in parts of 4 rows over a
    20-token chain: a part does not take ``if T > self.filled`` (4 <= 12), its paths (20 and 15
    tokens) do (still wrong: a strict xfail in tests/test_compile_state.py)."""
    import torch
    from test_compile_state import _build
    from zoo_repos.common import VOCAB
    from zoo_repos.state import FilledTableLM

    model = _build(FilledTableLM)
    chain = [1 + (i * 7) % (VOCAB - 1) for i in range(20)]
    with torch.no_grad():
        model(torch.tensor([chain[:12]]))
    streamed = tc.tree_compile(model, backend="eager", stream=StreamOptions(budget_rows=4))
    said = _branch_warnings(lambda: streamed(_batch([chain, chain[:12] + [5, 6, 7]])[0]))
    assert len(said) == 1, said
    first = said[0].splitlines()[0]
    assert "on the sequence length at state.py:" in first and "(`if T > self.filled:`)" in first, first
    assert "a path of 15 tokens" in first, first
