"""Empty sequences (a rollout that produced nothing): a path with no tokens.

It stays a path (its index, weight and per-path values keep their place), trains nothing
and enters no mean; a warning names it. The ground truth is the same data without the
empty sequences, run path by path on the unmodified model.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from test_compile_models import NanoGPT, tiny

from treecompile import TrajectoryTree, pack, tree_compile
from treecompile.core.advice import TreeWarning
from treecompile.core.errors import TreeInputError
from treecompile.core.path_sets import subtree
from treecompile.core.reference import per_path_loss
from treecompile.core.padded_rows import batch_from_rows
from treecompile.planning.partition import loss_denominator, partition_tree
from treecompile.distributed.shard import SHARD_METHODS, shard_paths
from treecompile.rl.losses import PolicyLossConfig, build_rl_batch, policy_loss

MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "sum"]
# Two batches of different lengths; each has empty sequences at the start, inside and at the end.
BATCHES = [
    ([[], [1, 2, 3, 4], [], [1, 2, 5, 6, 7], [3, 4]], [0.7, 1.0, 2.0, 0.5, 1.5],
     [[], [1, 1, 0, 1], [], None, [1, 1]]),
    ([[2, 3, 4, 5, 6, 7, 1], [2, 3, 4, 0], [], [2, 3, 4, 5, 6, 7, 1]], [1.0, 0.3, 3.0, 2.0], None),
]


def _model():
    model = tiny(NanoGPT)
    torch.manual_seed(1)
    with torch.no_grad():  # no identity norm, no zero bias
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model


MODEL = _model()
COMPILED = tree_compile(MODEL, backend="eager")


def _tree(seqs, weights=None, masks=None):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TreeWarning)
        return TrajectoryTree.from_sequences(seqs, weights=weights, loss_masks=masks)


def _grads(model):
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def _close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_an_empty_sequence_is_a_path_with_no_tokens_and_a_warning_names_it():
    seqs = [[1, 2, 3], [], [1, 2, 4], []]
    before = repr(seqs)
    with pytest.warns(TreeWarning, match=r"2 empty sequence\(s\) \(sequence 1, 3\).*enters no mean") as record:
        tree = TrajectoryTree.from_sequences(seqs, weights=[1.0, 2.0, 3.0, 4.0], loss_masks=[None, [], None, None])
    assert len(record) == 1
    assert repr(seqs) == before
    assert tree.num_paths == 4 and tree.path_node[1] == tree.path_node[3] == -1
    assert tree.empty_paths.tolist() == [1, 3] and tree.num_paths_with_tokens == 2
    assert tree.sequences() == [[1, 2, 3], [], [1, 2, 4], []]
    assert tree.path_length(1) == 0 and tree.path(1).weight == 2.0 and tree.path(1).loss_mask.size == 0
    assert tree.stats().path_tokens == 6 and tree.path_counts().tolist() == [2, 1, 1]
    again = TrajectoryTree.from_dict(tree.to_dict())
    assert again.sequences() == tree.sequences() and again.path_weight.tolist() == [1.0, 2.0, 3.0, 4.0]


@pytest.mark.parametrize("seqs", [[[]], [[], []]], ids=["one", "two"])
def test_a_tree_of_empty_sequences_only_is_refused(seqs):
    with pytest.raises(TreeInputError, match="every sequence is empty"):
        TrajectoryTree.from_sequences(seqs)


@pytest.mark.parametrize("mode", MODES)
def test_loss_and_gradients_are_those_without_the_empty_sequences(mode):
    for seqs, weights, masks in BATCHES:
        keep = [i for i, s in enumerate(seqs) if s]
        tree = _tree(seqs, weights, masks)
        batch = pack(tree, loss_mode=mode)
        assert batch.path_node[[i for i, s in enumerate(seqs) if not s]].tolist() == [-1] * (len(seqs) - len(keep))
        out = COMPILED(batch)
        out.loss.backward()
        got = _grads(MODEL)
        ref = per_path_loss(MODEL, [seqs[i] for i in keep], weights=[weights[i] for i in keep],
                            loss_masks=None if masks is None else [masks[i] for i in keep], loss_mode=mode)
        ref.loss.backward()
        want = _grads(MODEL)
        _close(out.loss.detach(), ref.loss.detach())
        assert got.keys() == want.keys()
        for name in want:
            _close(got[name], want[name])
        for j, i in enumerate(keep):
            _close(out.logprobs.detach()[batch.path_rows(i)], ref.logprobs[j])
        assert all(batch.path_rows(i).numel() == 0 for i in range(len(seqs)) if i not in keep)
        # The per-path reference of the tree itself agrees (it skips the empty paths too).
        _close(per_path_loss(MODEL, tree, loss_mode=mode).loss.detach(), ref.loss.detach())


def test_a_batch_of_several_trees_keeps_each_empty_path_in_place():
    a, b = _tree([[5, 6], [], [5, 7]]), _tree([[], [1, 2, 3]])
    batch = pack([a, b]).validate()
    assert batch.path_node.tolist() == [1, -1, 2, -1, 3]
    assert batch.path_tree.tolist() == [0, 0, 0, 1, 1]
    assert batch.path_coef[[1, 3]].tolist() == [0.0, 0.0]


@pytest.mark.parametrize("mode", ["seq-mean-token-mean", "token-mean"])
def test_parts_of_a_partition_add_up_with_empty_paths(mode):
    seqs, weights, masks = BATCHES[0]
    tree = _tree(seqs, weights, masks)
    part = partition_tree(tree, capacity=6)
    assert sorted(np.concatenate(part.path_ids).tolist()) == list(range(len(seqs)))
    assert len(part.parts) > 1
    d = loss_denominator(tree, mode)
    if mode.startswith("seq-mean"):
        assert d == 3.0  # the paths with tokens
    total = sum(COMPILED(pack(t, loss_mode=mode, denominator=d)).loss for t in part.parts)
    _close(total.detach(), COMPILED(pack(tree, loss_mode=mode)).loss.detach())


@pytest.mark.parametrize("method", SHARD_METHODS)
def test_sharding_places_every_empty_path_once(method):
    trees = [_tree(s, w, m) for s, w, m in BATCHES]
    sharding = shard_paths(trees, 3, method=method)
    placed = sorted((ti, int(p)) for shard in sharding.shards for ti, ids in shard.pieces for p in ids)
    assert placed == sorted((ti, p) for ti, t in enumerate(trees) for p in range(t.num_paths))


def test_a_subtree_keeps_its_empty_paths_and_refuses_only_empty_ones():
    tree = _tree([[1, 2, 3], [], [1, 2, 4], [7]])
    cut = subtree(tree, [1, 2])
    assert cut.sequences() == [[], [1, 2, 4]] and cut.path_node.tolist() == [-1, 0]
    with pytest.raises(TreeInputError, match="at least one path with tokens"):
        subtree(tree, [1])


def test_rl_batch_with_an_empty_rollout_is_the_batch_without_it():
    seqs = [[1, 2, 3, 4], [], [1, 2, 5]]
    masks = [[0, 0, 1, 1], [], [0, 0, 1]]
    adv = [0.5, 2.0, -1.0]
    old = [[0.0, 0.0, -1.2, -0.7], [], [0.0, 0.0, -2.1]]
    config = PolicyLossConfig(eps_low=0.2, eps_high=0.2)
    losses = []
    for keep in ([0, 1, 2], [0, 2]):
        tree = _tree([seqs[i] for i in keep], masks=[masks[i] for i in keep])
        rl = build_rl_batch(tree, advantages=[adv[i] for i in keep], old_logprobs=[old[i] for i in keep],
                            loss_agg_mode="seq-mean-token-mean")
        losses.append(policy_loss(COMPILED(rl.batch).logprobs, rl, config).loss)
    _close(losses[0].detach(), losses[1].detach())


def test_a_padded_row_of_padding_only_is_an_empty_path():
    ids = torch.tensor([[1, 2, 3, 0], [0, 0, 0, 0], [1, 2, 5, 6]])
    mask = torch.tensor([[1, 1, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]])
    with pytest.warns(TreeWarning, match=r"sequence 1\)"):
        batch = batch_from_rows(ids, attention_mask=mask)
    alone = batch_from_rows(ids[[0, 2]], attention_mask=mask[[0, 2]])
    assert batch.num_paths == 3 and batch.path_node[1] == -1
    _close(COMPILED(batch).loss.detach(), COMPILED(alone).loss.detach())


def test_coefficients_leave_empty_paths_out_of_p_and_keep_a_given_denominator():
    from treecompile.core.weights import path_loss_coefficients

    n, w, empty = np.array([2.0, 0.0, 3.0]), np.array([1.0, 5.0, 2.0]), np.array([False, True, False])
    got = path_loss_coefficients(n, w, "seq-mean-token-mean", empty=empty)
    np.testing.assert_allclose(got, [1 / (2 * 2), 0.0, 2 / (2 * 3)])
    got = path_loss_coefficients(n, w, "seq-mean-token-mean", denominator=0.5, empty=empty)
    np.testing.assert_allclose(got, [1 / (0.5 * 2), 0.0, 2 / (0.5 * 3)])
    np.testing.assert_allclose(path_loss_coefficients(n, w, "seq-mean-token-sum", empty=empty), [0.5, 0.0, 1.0])
    assert not path_loss_coefficients(n, w, "seq-mean-token-sum", empty=np.ones(3, bool)).any()
