import re

import numpy as np
import pytest
from hypothesis import given
from strategies import path_sets

import treecompile as tc
from treecompile import TrajectoryTree, TreeInputError


def _mask_or_ones(masks, i, n):
    return np.ones(n, bool) if masks is None or masks[i] is None else np.asarray(masks[i], bool)


@given(path_sets())
def test_paths_round_trip(case):
    seqs, weights, masks = case
    tree = TrajectoryTree.from_sequences(seqs, weights=weights, loss_masks=masks)
    assert tree.num_paths == len(seqs)
    for i, s in enumerate(seqs):
        path = tree.path(i)
        assert path.tokens.tolist() == s
        assert path.weight == (1.0 if weights is None else weights[i])
        assert np.array_equal(path.loss_mask, _mask_or_ones(masks, i, len(s)))
    again = TrajectoryTree.from_dict(tree.to_dict())
    assert again.sequences() == seqs
    assert [p.loss_mask.tolist() for p in again.paths()] == [p.loss_mask.tolist() for p in tree.paths()]


@given(path_sets(with_masks=False))
def test_nodes_are_maximal_and_distinct(case):
    seqs, _, _ = case
    tree = TrajectoryTree.from_sequences(seqs)
    n = tree.num_nodes
    children = [[] for _ in range(n)]
    for v in range(n):
        if tree.parent[v] >= 0:
            children[tree.parent[v]].append(v)
    ends = set(tree.path_node.tolist())
    for v in range(n):
        # Maximal: a node with one child and no path ending at it would merge with the child.
        assert not (len(children[v]) == 1 and v not in ends), f"node {v} is not maximal"
        firsts = [int(tree.node_tokens(c)[0]) for c in children[v]]
        assert len(firsts) == len(set(firsts)), f"children of node {v} start with the same token"
    roots = [int(tree.node_tokens(v)[0]) for v in range(n) if tree.parent[v] < 0]
    assert len(roots) == len(set(roots))
    # Each distinct prefix is stored once: tree tokens = number of distinct non-empty prefixes.
    prefixes = {tuple(s[: k + 1]) for s in seqs for k in range(len(s))}
    assert tree.num_tokens == len(prefixes)


def test_internal_endpoints_and_duplicates():
    seqs = [[1, 2, 3, 4], [1, 2], [1, 2, 3, 4], [1, 2, 5]]
    tree = TrajectoryTree.from_sequences(seqs)
    assert [tree.node_tokens(v).tolist() for v in range(tree.num_nodes)] == [[1, 2], [3, 4], [5]]
    assert tree.path_node.tolist() == [1, 0, 1, 2]
    assert tree.path_counts().tolist() == [4, 2, 1]
    s = tree.stats()
    assert (s.tree_tokens, s.path_tokens, s.n_paths) == (5, 4 + 2 + 4 + 3, 4)
    assert s.por == pytest.approx(1 - 5 / 13)
    assert (s.depth_nodes, s.depth_tokens, s.max_branching, s.n_leaves) == (2, 4, 2, 2)


def test_forest_of_roots():
    tree = TrajectoryTree.from_sequences([[1, 2], [3], [1, 4]])
    assert tree.parent.tolist() == [-1, 0, 0, -1]
    assert tree.stats().n_roots == 2


def test_masks_may_differ_on_shared_tokens():
    tree = TrajectoryTree.from_sequences([[1, 2, 3], [1, 2, 4]], loss_masks=[[1, 1, 1], [0, 0, 1]])
    assert [p.loss_mask.tolist() for p in tree.paths()] == [[True, True, True], [False, False, True]]
    assert (1, 0) in tree.mask_exceptions


BAD_INPUTS = {
    "empty-list": (dict(seqs=[]), "seqs is empty"),
    "only-empty-sequences": (dict(seqs=[[], []]), "every sequence is empty \\(2 of them\\)"),
    "negative-id": (dict(seqs=[[1, -3]]), "negative token id -3 at position 1"),
    "float-id": (dict(seqs=[[1, 2.5]]), "must be integers"),
    "string": (dict(seqs=["hello"]), "expected a list of token ids"),
    "nested": (dict(seqs=[[[1, 2]]]), "1-D"),
    "over-vocab": (dict(seqs=[[1, 9]], vocab_size=9), "out of range for vocab_size=9"),
    "mask-length": (dict(seqs=[[1, 2, 3]], loss_masks=[[1, 1]]), "loss_masks\\[0\\] has shape"),
    "mask-values": (dict(seqs=[[1, 2]], loss_masks=[[1, 2]]), "values must be 0 or 1"),
    "mask-count": (dict(seqs=[[1, 2]], loss_masks=[[1, 1], [1]]), "2 entries for 1 sequences"),
    "nan-weight": (dict(seqs=[[1, 2], [1]], weights=[1.0, float("nan")]), "weights\\[1\\] is nan"),
    "negative-weight": (dict(seqs=[[1, 2]], weights=[-1.0]), "must be >= 0"),
    "weight-count": (dict(seqs=[[1, 2]], weights=[1.0, 2.0]), "one weight per sequence"),
    "over-budget": (dict(seqs=[[1, 2, 3], [1, 4, 5]], max_tokens=4), "5 tokens, over the budget max_tokens=4"),
}


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_bad_input_is_refused_and_left_untouched(name):
    kwargs, message = BAD_INPUTS[name]
    seqs = kwargs.pop("seqs")
    before = repr((seqs, kwargs))
    with pytest.raises(TreeInputError, match=message):
        TrajectoryTree.from_sequences(seqs, **kwargs)
    assert repr((seqs, kwargs)) == before


def test_inputs_are_copied_not_aliased():
    seq = np.array([1, 2, 3])
    mask = np.array([1, 1, 0])
    tree = TrajectoryTree.from_sequences([seq], loss_masks=[mask])
    seq[0] = 7
    mask[0] = 0
    assert tree.path(0).tokens.tolist() == [1, 2, 3]
    assert tree.path(0).loss_mask.tolist() == [True, True, False]


@pytest.mark.parametrize("token", [2**63, 2**64, 2**70, 1e30], ids=["2^63", "2^64", "2^70", "1e30"])
def test_a_token_id_over_int64_is_named_without_a_numpy_warning(token):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no numpy cast warning on the way
        with pytest.raises(TreeInputError, match=r"sequence 0: token id \S+ at position 1 is over 2\*\*63 - 1"):
            TrajectoryTree.from_sequences([[1, token]])


@pytest.mark.parametrize("call, message", [
    (lambda: tc.TrajectoryTree.from_dict([1, 2, 3]), "from_dict takes the dict TrajectoryTree.to_dict gives, got a list"),
    (lambda: tc.TrajectoryTree.from_dict({"format": "treecompile.core.tree/1"}), "needs the lists 'nodes', 'paths'"),
    (lambda: tc.TrajectoryTree.from_dict({"format": "treecompile.core.tree/1", "nodes": [{"tokens": [1, 2], "parent": -1}],
                                          "paths": [{"node": 0, "mask_exceptions": {"root": [1, 1]}}]}),
     "path 0: mask_exceptions key 'root' is not a node index"),
    (lambda: tc.pack(None), "pack takes a TrajectoryTree or a list of them, got NoneType"),
], ids=["list", "no-nodes", "root-key", "pack-none"])
def test_malformed_inputs_are_one_clear_error(call, message):
    with pytest.raises(tc.TreeInputError, match=re.escape(message)):
        call()
