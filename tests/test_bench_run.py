"""The training-run benchmark (`treecompile.bench.run`) as its CPU dry run, and the pair-aware
bound it reports (`treecompile.bench.bound`)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from treecompile import TrajectoryTree
from treecompile.bench import run as bench_run
from treecompile.bench.bound import AttentionCost, Work, pair_bound, work_of

pytest.importorskip("transformers")


def test_work_counts_tokens_and_pairs_per_path_and_on_the_tree():
    tree = TrajectoryTree.from_sequences([[1, 2, 3, 4], [1, 2, 5], [1, 2, 3, 4]])
    w = work_of([tree])
    # Per path 10 + 6 + 10 pairs; on the tree one per row and ancestor: 1 + 2 + 3 + 4 + 3.
    assert w == Work(path_tokens=11, tree_tokens=5, path_pairs=26, tree_pairs=13)
    assert pair_bound(w, 0.0) == pytest.approx(11 / 5) and pair_bound(w, 1.0) == pytest.approx(2.0)
    # Between the two, weighted by the share of the time (not of the bounds).
    assert pair_bound(w, 0.25) == pytest.approx(1 / (0.75 * 5 / 11 + 0.25 * 13 / 26))
    with pytest.raises(ValueError, match="attention_share"):
        pair_bound(w, 1.5)


def test_a_profiles_split_carries_to_steps_of_other_lengths():
    profiled = Work(path_tokens=1000, tree_tokens=1000, path_pairs=500_500, tree_pairs=500_500)
    cost = AttentionCost.from_profile({"matmuls": 80.0, "attention forward": 5.0, "attention backward": 15.0}, profiled)
    assert cost.share(profiled) == pytest.approx(0.2)
    longer = Work(path_tokens=2000, tree_tokens=400, path_pairs=2_002_000, tree_pairs=600_000)
    # Twice the tokens, four times the pairs: attention weighs 80 / (160 + 80) of this step.
    assert cost.share(longer) == pytest.approx(80 / 240)
    assert cost.bound(longer) == pytest.approx(1 / ((160 / 240) * 400 / 2000 + (80 / 240) * 600_000 / 2_002_000))


def test_steps_bring_a_new_tree_each_with_real_ones_among_them():
    cfg = dataclasses.replace(bench_run.CPU_RUN, steps=9)
    steps = bench_run.step_trees(cfg, vocab=2048)
    labels = [label for label, _ in steps]
    assert len(steps) == 9 and len(set(labels)) >= 7
    assert sum(not label.startswith("group") for label in labels) == 3  # every third step is real
    rows = {work_of(trees).tree_tokens for _, trees in steps}
    assert len(rows) == 9  # the row count changes at every step


@pytest.mark.full
def test_the_dry_run_compiles_the_tree_once_and_reports_the_run_against_its_bound():
    cfg = dataclasses.replace(bench_run.CPU_RUN, steps=5, real_every=2, profile_step=2)
    result = bench_run.run_benchmark(cfg, device="cpu", command="test")
    tree, base = result["tree"], result["baseline"]
    assert tree["steps"] == base["steps"] == 5
    assert tree["compiles"] == 1 and tree["compiled_at_steps"] == [0], tree["recompile_reasons"]
    # The same initial weights and paths: the first step's losses agree (float32).
    assert tree["losses"][0] == pytest.approx(base["losses"][0], rel=1e-4)
    assert all(math.isfinite(x) for x in tree["losses"] + base["losses"])
    assert tree["total_s"] == pytest.approx(sum(tree["step_s"]))
    bound = result["bound"]
    assert "error" not in bound, bound
    assert len(bound["step_bounds"]) == 5 and all(b > 1 for b in bound["step_bounds"])
    assert bound["run_bound_s"] > 0 and bound["tree_over_bound"] == pytest.approx(bound["tree_total_s"] / bound["run_bound_s"])
    text = bench_run.markdown_report(result)
    assert "pair-aware bound" in text and "| tree | 5 |" in text
    torch._dynamo.reset()
