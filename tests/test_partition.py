"""Tree partitioning: coverage, budget, optimality against the exact DP, exact losses and gradients."""

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from strategies import path_sets
from testing import (
    TOLERANCES,
    NoModel,
    assert_grads_close,
    hash_forward,
    param_grads,
    perturbed_hf_model,
    tree_hash_logits,
)

from treecompile import LOSS_MODES, TrajectoryTree, TreeInputError, gather_logprobs, pack, tree_loss
from treecompile.planning.partition import (
    METHODS,
    CapacityError,
    greedy_groups,
    loss_denominator,
    optimal_groups,
    partition_tree,
    path_lengths,
    reuse_ratios,
    subtree,
    union_tokens,
)
from treecompile.planning.grouping import brute_force_optimum
from treecompile.core.reference import per_path_loss

# The greedy heuristic's factor (greedy total / optimal total) on the fixed sample of
# `_seeded_trees(200)`. Measured: worst 30 / 28 = 1.071, mean 1.0004, 99.5% optimal (the same
# worst as on the first 2,000 trees of that generator). No constant factor is proven: these
# guard the heuristic against regressions (one that stops merging at branch points gives
# 1.3x and more); what holds for every tree is tested by `test_greedy_between_provable_bounds`.
SAMPLE_WORST_FACTOR = 1.08
SAMPLE_MEAN_FACTOR = 1.001

VOCAB = 8  # path_sets draws token ids below 5


def _tree(drawn):
    seqs, weights, masks = drawn
    return TrajectoryTree.from_sequences(seqs, weights=weights, loss_masks=masks)


@st.composite
def tree_and_capacity(draw, max_paths=8):
    tree = _tree(draw(path_sets(max_paths=max_paths)))
    longest = int(path_lengths(tree).max())
    capacity = draw(st.integers(longest, max(longest, tree.num_tokens)))
    return tree, capacity


@st.composite
def layered_tree(draw, max_leaves=7):
    """A tree with multi-token nodes, internal endpoints and up to ``max_leaves`` leaves."""
    seqs: list[list[int]] = []
    counter = [0]

    def grow(prefix, depth):
        n = draw(st.integers(1, 6))
        seg = list(range(counter[0], counter[0] + n))
        counter[0] += n
        here = prefix + seg
        k = 0 if depth >= 3 else draw(st.integers(0, 3))
        if k == 0 or len(seqs) + k > max_leaves:
            seqs.append(here)
            return
        if draw(st.booleans()):
            seqs.append(here)
        for _ in range(k):
            grow(here, depth + 1)

    grow([], 0)
    tree = TrajectoryTree.from_sequences(seqs)
    longest = int(path_lengths(tree).max())
    capacity = draw(st.integers(longest, max(longest, min(tree.num_tokens, 2 * longest))))
    return tree, capacity


def _same_path(a, b):
    assert a.tokens.tolist() == b.tokens.tolist()
    assert a.weight == b.weight
    assert a.loss_mask.tolist() == b.loss_mask.tolist()


@pytest.mark.parametrize("method", list(METHODS))
@given(tc=tree_and_capacity())
def test_every_path_in_exactly_one_part_within_budget(method, tc):
    tree, capacity = tc
    part = partition_tree(tree, capacity, method=method)
    ids = np.concatenate(part.path_ids)
    assert sorted(ids.tolist()) == list(range(tree.num_paths)), "a path is missing or in two parts"
    for i, (t, pids) in enumerate(zip(part.parts, part.path_ids)):
        assert t.num_tokens <= capacity, f"part {i} has {t.num_tokens} tokens > C={capacity}"
        assert t.num_tokens == union_tokens(tree, pids)
        for j, p in enumerate(pids.tolist()):
            _same_path(t.path(j), tree.path(p))
    assert part.partition_tokens >= tree.num_tokens
    assert part.duplicated_tokens == part.partition_tokens - tree.num_tokens
    por, err = reuse_ratios(tree.num_tokens, int(path_lengths(tree).sum()), part.partition_tokens)
    assert part.por == pytest.approx(tree.stats().por) and part.por == por
    assert part.err == err <= part.por + 1e-12


@given(drawn=path_sets(max_paths=6), data=st.data())
def test_subtree_is_the_tree_of_its_paths(drawn, data):
    tree = _tree(drawn)
    ids = data.draw(st.lists(st.integers(0, tree.num_paths - 1), min_size=1, unique=True))
    sub = subtree(tree, ids)
    paths = [tree.path(p) for p in ids]
    rebuilt = TrajectoryTree.from_sequences(
        [p.tokens for p in paths], weights=[p.weight for p in paths], loss_masks=[p.loss_mask for p in paths]
    )
    assert (sub.num_nodes, sub.num_tokens) == (rebuilt.num_nodes, rebuilt.num_tokens), "not compressed like from_sequences"
    assert sorted(map(tuple, sub.sequences())) == sorted(map(tuple, rebuilt.sequences()))
    for j, p in enumerate(ids):
        _same_path(sub.path(j), tree.path(p))
    rtol, atol = TOLERANCES[("float64", "pure")]  # the weights are summed in another node order
    torch.testing.assert_close(pack(sub).target_weight.sum(), pack(rebuilt).target_weight.sum(), rtol=rtol, atol=atol)


@given(tc=st.one_of(layered_tree(max_leaves=6), tree_and_capacity(max_paths=5)))
def test_dynamic_program_is_optimal(tc):
    tree, capacity = tc
    best = brute_force_optimum(tree, capacity)
    assert partition_tree(tree, capacity, method="optimal").partition_tokens == best


@given(tc=st.one_of(layered_tree(max_leaves=8), tree_and_capacity(max_paths=8)))
def test_greedy_between_provable_bounds(tc):
    """tree tokens <= optimum <= greedy <= path tokens, and one part whenever the tree fits.

    Every token of the tree is in some part (first inequality); the optimum is the least
    total (second); each part is the union of its paths' tokens, at most their sum, and a path
    ending inside another path's root path adds nothing (third). When the whole tree fits,
    every merge of best-fit decreasing succeeds bottom-up, so greedy returns the tree itself.
    """
    tree, capacity = tc
    greedy = partition_tree(tree, capacity, method="greedy")
    best = partition_tree(tree, capacity, method="optimal").partition_tokens
    path_tokens = int(path_lengths(tree).sum())
    assert tree.num_tokens <= best <= greedy.partition_tokens <= path_tokens, (
        f"tree {tree.num_tokens}, optimum {best}, greedy {greedy.partition_tokens}, paths {path_tokens} at C={capacity}"
    )
    if tree.num_tokens <= capacity:
        assert len(greedy.parts) == 1 and greedy.partition_tokens == best == tree.num_tokens


def _seeded_trees(n: int, seed: int = 0):
    """``n`` random (tree, capacity): 2 to 9 paths, each branching off an earlier one at a random
    point, tokens below 5, C between the longest path and twice it (version-independent: numpy)."""
    rng = np.random.default_rng(seed)
    for _ in range(n):
        seqs = [rng.integers(0, 5, int(rng.integers(1, 13))).tolist()]
        for _ in range(int(rng.integers(1, 9))):
            base = seqs[int(rng.integers(len(seqs)))]
            cut = int(rng.integers(0, len(base) + 1))
            seqs.append(base[:cut] + rng.integers(0, 5, int(rng.integers(1, 13))).tolist())
        tree = TrajectoryTree.from_sequences(seqs)
        longest = int(path_lengths(tree).max())
        yield tree, int(rng.integers(longest, max(longest, min(tree.num_tokens, 2 * longest)) + 1))


def test_greedy_factor_on_a_fixed_sample():
    factors = []
    for tree, capacity in _seeded_trees(200):
        greedy = partition_tree(tree, capacity, method="greedy").partition_tokens
        best = partition_tree(tree, capacity, method="optimal").partition_tokens
        factors.append(greedy / best)
    factors = np.array(factors)
    assert factors.min() >= 1.0
    assert factors.max() <= SAMPLE_WORST_FACTOR, f"worst factor {factors.max():.3f} (measured 1.071)"
    assert factors.mean() <= SAMPLE_MEAN_FACTOR, f"mean factor {factors.mean():.5f} (measured 1.0004)"


def test_a_known_split():
    tree = TrajectoryTree.from_sequences([[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 6, 7], [1, 8, 9]])
    for method in METHODS:
        part = partition_tree(tree, 6, method=method)
        assert [p.tolist() for p in part.path_ids] == [[0, 1], [2, 3]]
        assert part.part_tokens == [5, 6] and part.duplicated_tokens == 2
        assert part.por == pytest.approx(1 - 9 / 15) and part.err == pytest.approx(1 - 11 / 15)


def test_a_tree_that_fits_is_one_part_and_err_equals_por():
    tree = TrajectoryTree.from_sequences([[1, 2, 3], [1, 2, 4], [5]])
    part = partition_tree(tree, tree.num_tokens)
    assert len(part.parts) == 1 and part.parts[0] is tree
    assert part.err == part.por and part.duplicated_tokens == 0


def test_a_forest_merges_roots_into_parts():
    tree = TrajectoryTree.from_sequences([[1, 2], [3, 4], [5, 6, 7], [8]])
    part = partition_tree(tree, 5)
    assert part.duplicated_tokens == 0
    assert sorted(part.part_tokens) == [3, 5]


def test_a_path_longer_than_capacity_says_what_fits():
    tree = TrajectoryTree.from_sequences([[1, 2, 3, 4, 5, 6], [1, 2, 7], [1, 8, 9, 10, 11, 12, 13]])
    with pytest.raises(CapacityError, match=r"path 2 has 7 tokens.*C=5.*2 of 3 paths.*at least 7 tokens"):
        partition_tree(tree, 5)
    assert issubclass(CapacityError, TreeInputError)
    with pytest.raises(CapacityError, match="at least 1 token"):
        partition_tree(tree, 0)


def test_unknown_method_lists_the_valid_ones():
    tree = TrajectoryTree.from_sequences([[1, 2]])
    with pytest.raises(ValueError, match="greedy, optimal"):
        partition_tree(tree, 4, method="fast")


def test_the_exact_dp_refuses_a_tree_too_large():
    tree = TrajectoryTree.from_sequences([[0, i, j] for i in range(1, 6) for j in range(6, 10)])
    with pytest.raises(RuntimeError, match="max_states"):
        optimal_groups(tree, 12, max_states=50)


def _big_tree(n_nodes: int, seed: int = 0) -> TrajectoryTree:
    """A random preorder tree: each node hangs off a random node of the open (rightmost) path."""
    rng = np.random.default_rng(seed)
    parent = np.empty(n_nodes, np.int64)
    parent[0] = -1
    stack = [0]
    for v in range(1, n_nodes):
        k = min(int(rng.geometric(0.45)) - 1, len(stack) - 1)
        if k:
            del stack[-k:]
        parent[v] = stack[-1]
        stack.append(v)
    lengths = rng.integers(1, 40, size=n_nodes)
    offs = np.zeros(n_nodes + 1, np.int64)
    np.cumsum(lengths, out=offs[1:])
    leaves = np.flatnonzero(np.bincount(parent[1:], minlength=n_nodes) == 0)
    return TrajectoryTree(
        tokens=rng.integers(0, 1000, size=offs[-1]), node_offsets=offs, parent=parent,
        path_node=leaves, path_weight=np.ones(len(leaves)), node_mask=np.ones(offs[-1], bool),
    )


def test_greedy_scales_to_100k_nodes():
    import time

    tree = _big_tree(100_000)
    longest = int(path_lengths(tree).max())
    start = time.perf_counter()
    groups = greedy_groups(tree, 2 * longest)
    seconds = time.perf_counter() - start
    # 0.45 s on 2 CPU cores; a quadratic step would take minutes.
    assert seconds < 5, f"greedy partitioning of 100k nodes took {seconds:.1f} s"
    sizes = [union_tokens(tree, np.flatnonzero(groups == g)) for g in range(int(groups.max()) + 1)]
    assert max(sizes) <= 2 * longest
    # Most reuse is kept: fewer than 3% of the tree's tokens are duplicated.
    assert sum(sizes) - tree.num_tokens < 0.03 * tree.num_tokens


# ---------------------------------------------------------------------------- exact losses


@pytest.mark.parametrize("mode", list(LOSS_MODES))
@given(tc=tree_and_capacity(max_paths=6))
def test_part_losses_sum_to_the_per_path_loss(mode, tc):
    tree, capacity = tc
    ref = per_path_loss(NoModel(), tree, loss_mode=mode, forward=hash_forward(VOCAB)).loss
    den = loss_denominator(tree, mode)
    total = torch.zeros((), dtype=torch.float64)
    for part in partition_tree(tree, capacity).parts:
        batch = pack(part, loss_mode=mode, denominator=den)
        total = total + tree_loss(gather_logprobs(tree_hash_logits(batch, VOCAB), batch), batch)
    rtol, atol = TOLERANCES[("float64", "pure")]
    torch.testing.assert_close(total, ref.to(torch.float64), rtol=rtol, atol=atol)


def test_without_the_global_denominator_the_parts_do_not_add_up():
    # Guards the test above: normalizing each part by itself is a different loss.
    tree = TrajectoryTree.from_sequences([[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 6, 7], [1, 6, 1]])
    ref = per_path_loss(NoModel(), tree, forward=hash_forward(VOCAB)).loss
    total = 0.0
    for part in partition_tree(tree, 6).parts:
        batch = pack(part)
        total = total + tree_loss(gather_logprobs(tree_hash_logits(batch, VOCAB), batch), batch)
    assert abs(float(total) - float(ref)) > 1e-3


transformers = pytest.importorskip("transformers")


def tiny_qwen3(vocab=32):
    cfg = transformers.Qwen3Config(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8,
    )
    return perturbed_hf_model(cfg)


SEQS = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 7], [1, 2, 3, 8, 9, 10], [1, 2, 3], [1, 11, 12, 13], [14, 15, 16]]
MASKS = [[0, 1, 1, 1, 1, 1], None, [0, 0, 0, 1, 1, 0], [1, 1, 0], None, [0, 1, 1]]


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_accumulated_part_gradients_equal_per_path_training(mode):
    from treecompile.core.reference import dense_mask_logits

    model = tiny_qwen3()
    tree = TrajectoryTree.from_sequences(SEQS, weights=[1, 2, 0.5, 1, 3, 1], loss_masks=MASKS)
    ref = per_path_loss(model, tree, loss_mode=mode)
    ref.loss.backward()
    ref_grads = param_grads(model)
    model.zero_grad(set_to_none=True)
    part = partition_tree(tree, 9)
    assert len(part.parts) >= 3 and part.duplicated_tokens > 0  # the split is real
    den = loss_denominator(tree, mode)
    total = 0.0
    for sub in part.parts:
        batch = pack(sub, loss_mode=mode, denominator=den)
        loss = tree_loss(gather_logprobs(dense_mask_logits(model, batch), batch), batch)
        loss.backward()
        total += loss.item()
    rtol, atol = TOLERANCES[("float64", "hf")]
    torch.testing.assert_close(torch.tensor(total, dtype=torch.float64), ref.loss.detach(), rtol=rtol, atol=atol)
    assert_grads_close(param_grads(model), ref_grads, ("float64", "hf"))
