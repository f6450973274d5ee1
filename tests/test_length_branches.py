"""A Python branch of the model on the sequence length (treecompile.passes.length_branches,
treecompile.compile.length_check): the graph holds the side its row count takes, per-path
training takes each path's. A batch with a path on the other side of a line is checked once
against the model run on such a path: refused naming the line where the sides compute
otherwise (and so is every later such batch, before the graph runs), settled silently where
they compute the same; warned about where no check can run (verify=False). A batch whose paths
all take the graph's side runs exactly and silently, and a streamed part judges its own side."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import zoo

import treecompile as tc
from treecompile.compile.length_check import LengthBranchRefused
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


def test_a_path_on_the_other_side_that_computes_otherwise_is_refused_naming_the_line():
    """``if idx.shape[1] > 8: x = x * 0.5``: 11 rows take it, paths of 3 to 6 tokens do not. The
    call is refused naming the line and a path's length; the same batch again is refused before
    the graph runs (no new check: the model's copy is not run again); a batch whose paths all
    take the graph's side runs exactly; the model is as it was."""
    model = zoo.BY_ID["length-branch"].build()
    twin = copy.deepcopy(model)
    compiled = tc.tree_compile(model, backend="eager")
    batch, _ = _batch(SHORT)
    with pytest.raises(LengthBranchRefused) as info:
        compiled(batch)
    first = str(info.value).splitlines()[0]
    assert "a Python branch of the model on the sequence length at zoo_custom.py:" in first, first
    assert "(`if idx.shape[1] > 8:`) goes the other way for a path of 3 tokens" in first, first
    checks = []
    import treecompile.compile.length_check as length_check

    real = length_check._check
    length_check._check = lambda *a: checks.append(a) or real(*a)
    try:
        with pytest.raises(LengthBranchRefused):
            compiled(batch)
    finally:
        length_check._check = real
    assert checks == [], "a line refused once is refused before the graph runs"
    long_batch, long_trees = _batch(LONG)
    zoo.compare(model, compiled, long_batch, long_trees)
    zoo.assert_unchanged(model, twin, lengths=(5, 11))


def test_without_checks_a_path_on_the_other_side_is_warned_about_once_naming_the_line():
    model = zoo.BY_ID["length-branch"].build()
    compiled = tc.tree_compile(model, backend="eager", verify=False)
    batch, _ = _batch(SHORT)
    said = _branch_warnings(lambda: compiled(batch))
    assert len(said) == 1, said
    first = said[0].splitlines()[0]
    assert "a Python branch of the model on the sequence length at zoo_custom.py:" in first, first
    assert "(`if idx.shape[1] > 8:`)" in first and "a path of 3 tokens" in first, first
    assert "which was not checked: tree_compile(verify=False)" in first, first
    assert _branch_warnings(lambda: compiled(batch)) == []  # once per graph and line


def test_paths_that_take_the_graphs_branch_run_exactly_without_a_warning():
    model = zoo.BY_ID["length-branch"].build()
    compiled = tc.tree_compile(model, backend="eager")
    batch, trees = _batch(LONG)
    assert _branch_warnings(lambda: zoo.compare(model, compiled, batch, trees)) == []


def test_a_streamed_part_is_judged_at_its_paths():
    """Parts of 4 rows do not take the branch (4 <= 8), nor do paths of at most 6 tokens: the
    short tree, wrong as one call, streams exactly and silently; the long one (paths of 10 and
    12 tokens, which take it) is refused streamed."""
    model = zoo.BY_ID["length-branch"].build()
    streamed = tc.tree_compile(model, backend="eager", stream=StreamOptions(budget_rows=4))
    batch, trees = _batch(SHORT)
    assert _branch_warnings(lambda: zoo.compare(model, streamed, batch, trees)) == []
    assert streamed._stream.stats.parts > 1, streamed._stream.stats
    with pytest.raises(LengthBranchRefused) as info:
        streamed(_batch(LONG)[0])
    assert "a path of 10 tokens" in str(info.value).splitlines()[0], str(info.value)


def test_a_branch_the_probe_forest_and_the_batch_agree_on_is_not_judged_from_the_forest():
    """The first-call probe runs the graph on forests of its own; only the call's batch is
    judged (a batch of long paths: no warning, though the probe's forests are shorter)."""
    model = zoo.BY_ID["length-branch"].build()
    compiled = tc.tree_compile(model, backend="eager", verify="probe")
    assert _branch_warnings(lambda: compiled(_batch(LONG)[0])) == []
    assert compiled.probed, "the probe ran"


@pytest.mark.parametrize("case", ["nanochat", "h3"])
def test_a_branch_between_two_spellings_of_one_function_is_checked_once_and_exact(case):
    """nanochat's ``if window >= T: causal SDPA else a windowed mask`` and H3's ``if k.size(-1) <
    L: pad k``: the packed row takes the general side, exact for every path. The check on a path
    of the other side settles the line: no warning, no refusal, not checked again."""
    model = zoo.BY_ID[case].build() if case in zoo.BY_ID else {c.id: c for c in zoo.all_cases()}[case].build()
    compiled = tc.tree_compile(model, backend="eager")
    batch, trees = _batch(SHORT)
    assert _branch_warnings(lambda: zoo.compare(model, compiled, batch, trees)) == []
    settled = [r.branch_verdicts.same for r in compiled.compile_records if r.length_branches]
    assert settled and all(settled), settled
    assert all(not r.branch_verdicts.pending for r in compiled.compile_records)


def test_a_part_that_would_not_fill_a_table_its_paths_fill_is_refused():
    """``FilledTableLM`` run eagerly on 12 tokens, then streamed in parts of 4 rows over a
    20-token chain: a part does not take ``if T > self.filled`` (4 <= 12), its paths (20 and 15
    tokens) do, and read rows the part never filled: refused naming the line. The check ran on a
    copy: the model's own table is still filled for 12 positions only."""
    from test_compile_state import _build
    from zoo_repos.common import VOCAB
    from zoo_repos.state import FilledTableLM

    model = _build(FilledTableLM)
    chain = [1 + (i * 7) % (VOCAB - 1) for i in range(20)]
    with torch.no_grad():
        model(torch.tensor([chain[:12]]))
    filled, table = model.filled, model.table.clone()
    streamed = tc.tree_compile(model, backend="eager", stream=StreamOptions(budget_rows=4))
    with pytest.raises(LengthBranchRefused) as info:
        streamed(_batch([chain, chain[:12] + [5, 6, 7]])[0])
    first = str(info.value).splitlines()[0]
    assert "on the sequence length at state.py:" in first and "(`if T > self.filled:`)" in first, first
    assert "a path of 15 tokens" in first, first
    assert model.filled == filled and torch.equal(model.table, table)


def test_a_model_that_draws_random_numbers_is_warned_about_not_checked():
    """Dropout in training mode (``dropout="shared"``): two runs of the model on a path differ
    anyway, so no run can settle the line; it is warned about, naming why."""
    from zoo_custom import LengthBranchLM

    class DropLM(LengthBranchLM):
        def __init__(self):
            super().__init__()
            self.drop = torch.nn.Dropout(0.25)

        def forward(self, idx):
            x = self.drop(self.emb(idx))
            if idx.shape[1] > 8:
                x = x * 0.5
            for blk in self.blocks:
                x = blk(x)
            return self.head(self.norm(x))

    torch.manual_seed(0)
    model = zoo.perturb(DropLM().double().train())
    compiled = tc.tree_compile(model, backend="eager", dropout="shared")
    said = _branch_warnings(lambda: compiled(_batch(SHORT)[0]))
    assert len(said) == 1 and "the model draws random numbers in its mode" in said[0].splitlines()[0], said
