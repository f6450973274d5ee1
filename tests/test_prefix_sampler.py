"""Prefix-grouping samplers: every sample once per epoch, groups of samples sharing prefixes,
the cuts' dynamic programs against brute force, and bad input refused."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from strategies import path_sets

from treecompile import TrajectoryTree
from treecompile.core.errors import TreeInputError
from treecompile.planning.prefix_sampler import (
    PrefixBatchSampler,
    PrefixGroupedSampler,
    _budget_cuts,
    _fixed_cuts,
    _PrefixTrie,
)


def _tree_tokens(seqs, group) -> int:
    return TrajectoryTree.from_sequences([seqs[i] for i in group]).num_tokens


def _common(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _clusters(n_clusters: int, per: int, prefix: int = 20, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """``n_clusters`` clusters of ``per`` samples: a ``prefix``-token start of the cluster's own, then
    3 tokens of the sample's own; shuffled. Returns the samples and each one's cluster."""
    rng = np.random.default_rng(seed)
    seqs, cluster = [], []
    for c in range(n_clusters):
        head = [100 + c] + rng.integers(0, 50, prefix - 1).tolist()
        for k in range(per):
            seqs.append(head + [60 + k, 61, 62])
            cluster.append(c)
    perm = rng.permutation(len(seqs))
    return [seqs[i] for i in perm], [cluster[i] for i in perm]


# ---------------------------------------------------------------------------- the trie's walks


@given(path_sets(max_paths=8, with_masks=False), st.integers(0, 3))
def test_walk_is_a_depth_first_order_with_its_common_prefixes(data, seed):
    seqs = data[0]
    order, lcp = _PrefixTrie(seqs, "test").walk(np.random.default_rng(seed))
    assert sorted(order.tolist()) == list(range(len(seqs))), "a sample is lost or repeated"
    for k in range(1, len(seqs)):
        a, b = seqs[order[k - 1]], seqs[order[k]]
        assert lcp[k] == _common(a, b), f"position {k}: lcp {lcp[k]}, the samples share {_common(a, b)}"
        # Depth-first: no earlier sample shares more with sample k than its neighbour does.
        assert max(_common(seqs[order[j]], b) for j in range(k)) == lcp[k], f"position {k}: not depth-first"
    for a, b in itertools.combinations(range(len(seqs) + 1), 2):
        expected = _tree_tokens(seqs, order[a:b].tolist())
        assert int(sum(len(seqs[i]) for i in order[a:b]) - lcp[a + 1:b].sum()) == expected


def test_walks_differ_between_seeds_and_shuffle_identical_samples():
    seqs = [[1, 2, 3]] * 4 + [[1, 2, 4], [5]]
    orders = {tuple(_PrefixTrie(seqs, "test").walk(np.random.default_rng(s))[0].tolist()) for s in range(20)}
    assert len(orders) > 5, f"only {len(orders)} different orders in 20 walks"
    for order in orders:  # identical samples stay together
        pos = sorted(order.index(i) for i in range(4))
        assert pos[-1] - pos[0] == 3, order


# ---------------------------------------------------------------------------- the cuts


@st.composite
def orders(draw, max_n: int = 9):
    """Lengths and common prefixes of a depth-first order (any values with lcp <= both lengths)."""
    n = draw(st.integers(1, max_n))
    lengths = np.array(draw(st.lists(st.integers(1, 12), min_size=n, max_size=n)), dtype=np.int64)
    lcp = np.zeros(n, dtype=np.int64)
    for k in range(1, n):
        lcp[k] = draw(st.integers(0, int(min(lengths[k - 1], lengths[k]))))
    return lengths, lcp


def _partitions(n: int):
    """Every split of ``range(n)`` into consecutive runs, as (start, stop) lists."""
    for mask in range(1 << (n - 1)):
        starts = [0] + [k for k in range(1, n) if mask >> (k - 1) & 1]
        yield list(zip(starts, starts[1:] + [n]))


def _tokens(lengths, lcp, a, b) -> int:
    return int(lengths[a:b].sum() - lcp[a + 1:b].sum())


@given(orders(), st.integers(0, 30))
def test_budget_cuts_are_the_fewest_tokens_then_the_fewest_groups(data, extra):
    lengths, lcp = data
    budget = int(lengths.max()) + extra
    cuts = _budget_cuts(lengths, lcp, budget)
    assert [a for a, _ in cuts] == sorted({a for a, _ in cuts}) and cuts[0][0] == 0 and cuts[-1][1] == lengths.size
    assert all(b == c for (_, b), (c, _) in zip(cuts, cuts[1:])), f"not consecutive: {cuts}"
    assert all(_tokens(lengths, lcp, a, b) <= budget for a, b in cuts)
    best = min((sum(_tokens(lengths, lcp, a, b) for a, b in p), len(p)) for p in _partitions(lengths.size)
               if all(_tokens(lengths, lcp, a, b) <= budget for a, b in p))
    got = (sum(_tokens(lengths, lcp, a, b) for a, b in cuts), len(cuts))
    assert got == best, f"budget {budget}: cuts {cuts} give (tokens, groups) {got}, the best is {best}"


@given(orders(max_n=12), st.integers(1, 5), st.integers(0, 5))
def test_fixed_cuts_place_the_short_group_best_and_last(data, size, seed):
    lengths, lcp = data
    n = lengths.size
    cuts = _fixed_cuts(lcp, size, np.random.default_rng(seed))
    sizes = [b - a for a, b in cuts]
    assert sorted(a for a, _ in cuts) == [a for a, _ in sorted(cuts)] and sum(sizes) == n
    assert sizes[:-1] == [size] * (len(sizes) - 1) and 1 <= sizes[-1] <= size, f"group sizes {sizes}"
    if n % size:
        assert sizes[-1] == n % size
    lost = sum(int(lcp[a]) for a, _ in cuts if a)
    # Brute force: the short group at every slot.
    m, s = divmod(n, size)
    best = lost
    for j in range(m + 1 if s else 1):
        starts = [k * size for k in range(j + 1)] + [j * size + s + k * size for k in range(m - j)] if s else \
            list(range(0, n, size))
        best = min(best, sum(int(lcp[a]) for a in starts if a))
    assert lost == best


# ---------------------------------------------------------------------------- PrefixGroupedSampler


@pytest.mark.parametrize("n,size,drop_last", [(24, 4, False), (25, 4, False), (25, 4, True), (7, 3, False),
                                              (3, 4, False), (3, 4, True), (1, 1, False)],
                         ids=lambda v: str(v))
def test_grouped_sampler_yields_every_sample_once_per_epoch(n, size, drop_last):
    seqs = [[i % 5, i % 3, i] for i in range(n)]
    sampler = PrefixGroupedSampler(seqs, group_size=size, seed=3, drop_last=drop_last)
    kept = n - n % size if drop_last else n
    assert len(sampler) == kept
    for epoch in range(3):
        sampler.set_epoch(epoch)
        got = list(sampler)
        assert len(got) == kept and len(set(got)) == kept and set(got) <= set(range(n))
        groups = sampler.groups()
        assert [i for g in groups for i in g] == got
        # Every group_size consecutive indices are one group: what a data loader's batches are.
        assert [got[a:a + size] for a in range(0, kept, size)] == groups
        assert len(list(torch.utils.data.BatchSampler(sampler, size, drop_last))) == \
            len(torch.utils.data.BatchSampler(sampler, size, drop_last))


def test_grouped_sampler_puts_each_cluster_in_one_group():
    seqs, cluster = _clusters(6, 4)
    for size, per_group in ((4, 1), (8, 2)):
        sampler = PrefixGroupedSampler(seqs, group_size=size)
        for epoch in range(4):
            sampler.set_epoch(epoch)
            for g in sampler.groups():
                clusters = {cluster[i] for i in g}
                assert len(clusters) == per_group, f"group size {size}, epoch {epoch}: clusters {clusters}"


def test_grouped_sampler_leaves_the_odd_sample_as_the_short_group():
    seqs, cluster = _clusters(6, 4)
    seqs = seqs + [[999, 1, 2]]
    for drop_last in (False, True):
        groups = PrefixGroupedSampler(seqs, group_size=4, drop_last=drop_last).groups()
        assert all(len({cluster[i] for i in g}) == 1 for g in groups if 24 not in g)
        assert (groups[-1] == [24]) != drop_last and all(24 not in g for g in groups[:6])


def test_grouped_sampler_epochs_differ_and_repeat():
    seqs, _ = _clusters(8, 4)
    a, b = PrefixGroupedSampler(seqs, group_size=4, seed=1), PrefixGroupedSampler(seqs, group_size=4, seed=1)
    first = list(a)
    assert list(b) == first and list(a) == first, "the same seed and epoch must give the same order"
    a.set_epoch(1)
    assert list(a) != first
    assert list(PrefixGroupedSampler(seqs, group_size=4, seed=2)) != first


def test_grouped_sampler_breaks_ties_at_random():
    seqs = [[5, 6, 7]] * 8
    seen = set()
    sampler = PrefixGroupedSampler(seqs, group_size=4)
    for epoch in range(10):
        sampler.set_epoch(epoch)
        seen.add(frozenset(frozenset(g) for g in sampler.groups()))
    assert len(seen) > 3, f"identical samples grouped the same way in {10 - len(seen) + 1} of 10 epochs"


# ---------------------------------------------------------------------------- PrefixBatchSampler


@pytest.mark.parametrize("budget", [32, 40, 64, 200])
def test_batch_sampler_holds_every_sample_once_under_the_budget(budget):
    seqs, cluster = _clusters(6, 4)
    sampler = PrefixBatchSampler(seqs, max_tokens=budget, seed=0)
    for epoch in range(3):
        sampler.set_epoch(epoch)
        batches = list(sampler)
        assert len(batches) == len(sampler)
        assert sorted(i for b in batches for i in b) == list(range(len(seqs)))
        sizes = [_tree_tokens(seqs, b) for b in batches]
        assert max(sizes) <= budget, f"epoch {epoch}: tree tokens {sizes} over {budget}"
    # A cluster's tree is 20 + 4 * 3 = 32 tokens: whole clusters, as many as fit.
    per_batch = budget // 32
    if per_batch <= 6:
        assert sorted(len({cluster[i] for i in b}) for b in batches) == sorted(
            [per_batch] * (6 // per_batch) + ([6 % per_batch] if 6 % per_batch else []))


def test_batch_sampler_epochs_differ_and_feed_a_data_loader():
    from treecompile.integrations.hf import TreeCollator

    seqs, _ = _clusters(8, 4)
    sampler = PrefixBatchSampler(seqs, max_tokens=64, seed=0)
    first = list(sampler)
    sampler.set_epoch(1)
    assert list(sampler) != first
    records = [{"input_ids": s} for s in seqs]
    loader = torch.utils.data.DataLoader(records, batch_sampler=sampler, collate_fn=TreeCollator())
    assert len(loader) == len(sampler)
    for out, group in zip(loader, sampler):
        assert out["batch"].num_tokens == _tree_tokens(seqs, group) <= 64
        assert out["batch"].num_paths == len(group)


# ---------------------------------------------------------------------------- input


def test_caller_data_is_only_read():
    arrays = [np.array([3, 1, 2]), np.array([3, 1, 5])]
    tensors = [torch.tensor([3, 1, 2]), torch.tensor([3, 1, 5])]
    lists = [[3, 1, 2], [3, 1, 5]]
    copies = ([a.copy() for a in arrays], [t.clone() for t in tensors], [list(x) for x in lists])
    for data in (arrays, tensors, lists):
        list(PrefixGroupedSampler(data, group_size=2))
        list(PrefixBatchSampler(data, max_tokens=8))
    assert all((a == b).all() for a, b in zip(arrays, copies[0]))
    assert all(torch.equal(a, b) for a, b in zip(tensors, copies[1]))
    assert lists == copies[2]


@pytest.mark.parametrize("data,message", [
    ([], "no samples"),
    ([[1, 2], []], "sequence 1 is empty"),
    ([[1, 2], [1.5, 2]], "must be integers"),
    ([["a", "b"]], "must be integers"),
    ([[True, False]], "must be integers"),
    ([[1, -3]], "negative token id -3"),
    ([[1, 2**32]], "over 2\\*\\*32 - 1"),
    ([[1, [2, 3]]], "sequence 0"),
    ("abc", "sequence of samples"),
], ids=["empty", "empty-sample", "float", "str", "bool", "negative", "huge", "ragged", "a-string"])
def test_bad_samples_are_refused(data, message):
    for make in (lambda: PrefixGroupedSampler(data, group_size=2), lambda: PrefixBatchSampler(data, max_tokens=8)):
        with pytest.raises(TreeInputError, match=message):
            make()


def test_a_sample_over_the_budget_is_refused():
    with pytest.raises(TreeInputError, match="sample 1 has 5 tokens, more than max_tokens=4"):
        PrefixBatchSampler([[1, 2], [1, 2, 3, 4, 5]], max_tokens=4)


@pytest.mark.parametrize("kwargs", [{"group_size": 0}, {"group_size": 2.0}, {"group_size": 2, "seed": -1}])
def test_bad_options_are_refused(kwargs):
    with pytest.raises(ValueError):
        PrefixGroupedSampler([[1, 2]], **kwargs)
    with pytest.raises(ValueError, match="max_tokens"):
        PrefixBatchSampler([[1, 2]], max_tokens=0)
