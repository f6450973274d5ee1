import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import given
from strategies import forests, path_sets

from treecompile import TrajectoryTree, TreeInputError, pack
from treecompile.kernels.attention.masks import bind_buffers, bitmask_mask_mod, interval_mask_mod


def _trees(forest):
    return [TrajectoryTree.from_sequences(s, weights=w, loss_masks=m) for s, w, m in forest]


def _chain(batch, row):
    rows = []
    while row >= 0:
        rows.append(row)
        row = int(batch.pred_index[row])
    return rows[::-1]


@given(forests)
def test_every_path_is_recovered_by_following_pred_index(forest):
    trees = _trees(forest)
    batch = pack(trees).validate()
    seen = torch.zeros(batch.num_tokens, dtype=torch.int64)
    p = 0
    for tree in trees:
        for path in tree.paths():
            last = int(batch.node_end[batch.path_node[p]]) - 1
            rows = _chain(batch, last)
            assert batch.input_ids[rows].tolist() == path.tokens.tolist()
            assert batch.position_ids[rows].tolist() == list(range(len(rows)))
            assert batch.path_rows(p).tolist() == rows
            seen[rows] += 1
            p += 1
    assert p == batch.num_paths
    assert torch.equal(batch.path_count, seen)
    assert batch.num_tokens == sum(t.num_tokens for t in trees)


@given(forests)
def test_attention_rule_is_the_ancestor_relation(forest):
    batch = pack(_trees(forest), path_bits=True).validate()
    s = batch.num_tokens
    ancestor = torch.zeros(s, s, dtype=torch.bool)
    for q in range(s):
        ancestor[q, _chain(batch, q)] = True
    assert torch.equal(batch.reference_attention_mask(), ancestor)
    q = torch.arange(s)[:, None]
    k = torch.arange(s)[None, :]
    zero = torch.zeros((), dtype=torch.int64)
    assert torch.equal(bind_buffers(interval_mask_mod(), batch.subtree_end)(zero, zero, q, k), ancestor)
    assert torch.equal(bind_buffers(bitmask_mask_mod(batch.path_bits.shape[1]), batch.tree_ids, batch.path_bits)(zero, zero, q, k), ancestor)


def test_layout_of_a_small_tree():
    tree = TrajectoryTree.from_sequences([[1, 2, 3, 4], [1, 2, 3, 5, 6], [1, 9]], child_order="insertion")
    b = pack(tree)
    assert b.input_ids.tolist() == [1, 2, 3, 4, 5, 6, 9]
    assert b.position_ids.tolist() == [0, 1, 2, 3, 3, 4, 1]
    assert b.subtree_end.tolist() == [7, 6, 6, 4, 6, 6, 7]
    # Both children of node [2, 3] are predicted by its last row (2).
    assert b.pred_index.tolist() == [-1, 0, 1, 2, 2, 4, 0]


def test_largest_subtree_follows_its_parent_by_default():
    seqs = [[1, 2, 3, 4], [1, 2, 3, 5, 6], [1, 9], [7], [7, 8, 8]]
    b = pack(TrajectoryTree.from_sequences(seqs))
    # Under [2, 3] the 2-token child [5, 6] comes before [4]; under [1] the 4-token subtree
    # [2, 3, ...] before [9]. Roots keep their order: [1] before [7].
    assert b.input_ids.tolist() == [1, 2, 3, 5, 6, 4, 9, 7, 8, 8]
    assert b.position_ids.tolist() == [0, 1, 2, 3, 4, 3, 1, 0, 1, 2]
    # The paths are the same as in insertion order, only their rows moved.
    other = pack(TrajectoryTree.from_sequences(seqs, child_order="insertion"))
    for p in range(len(seqs)):
        assert b.input_ids[b.path_rows(p)].tolist() == other.input_ids[other.path_rows(p)].tolist() == seqs[p]
    with pytest.raises(TreeInputError, match="child_order"):
        TrajectoryTree.from_sequences(seqs, child_order="random")


def test_bitmask_needs_more_than_one_chunk():
    seqs = [[0, i, j] for i in range(1, 10) for j in range(1, 9)]  # 1 + 9 + 72 = 82 nodes
    b = pack(TrajectoryTree.from_sequences(seqs), path_bits=True)
    assert b.path_bits.shape[1] == 2
    s = b.num_tokens
    q, k = torch.arange(s)[:, None], torch.arange(s)[None, :]
    zero = torch.zeros((), dtype=torch.int64)
    assert torch.equal(bind_buffers(bitmask_mask_mod(b.path_bits.shape[1]), b.tree_ids, b.path_bits)(zero, zero, q, k), b.reference_attention_mask())


CORRUPTIONS = {
    "pred-index": ("pred_index", lambda t: t.index_put_((torch.tensor([3]),), torch.tensor(0)), "pred_index\\[3\\]"),
    "subtree-end": ("subtree_end", lambda t: t.index_put_((torch.tensor([1]),), torch.tensor(2)), "subtree_end\\[1\\]"),
    "positions": ("position_ids", lambda t: t.add_(1), "position_ids\\[0\\]"),
    "weight-nan": ("target_weight", lambda t: t.index_put_((torch.tensor([2]),), torch.tensor(float("nan"), dtype=torch.float64)), "finite"),
    "weight-at-root": ("target_weight", lambda t: t.index_put_((torch.tensor([0]),), torch.tensor(1.0, dtype=torch.float64)), "no predictor"),
    "negative-id": ("input_ids", lambda t: t.index_put_((torch.tensor([2]),), torch.tensor(-1)), "out of range"),
    "path-count": ("path_count", lambda t: t.add_(1), "path_count\\[0\\]"),
    "node-parent": ("node_parent", lambda t: t.index_put_((torch.tensor([2]),), torch.tensor(-1)), "not preorder"),
}


@pytest.mark.parametrize("name", list(CORRUPTIONS))
def test_validate_catches_corruption(name):
    field, corrupt, message = CORRUPTIONS[name]
    batch = pack(TrajectoryTree.from_sequences([[1, 2, 3, 4], [1, 2, 3, 5, 6], [1, 9]])).validate()
    broken = dataclasses.replace(batch, **{field: corrupt(getattr(batch, field).clone())})
    with pytest.raises(TreeInputError, match=message):
        broken.validate()


@pytest.mark.parametrize("name", list(CORRUPTIONS))
def test_an_in_place_change_after_a_check_is_checked_again(name):
    """The check is kept with each tensor's identity and version: corrupting a checked batch
    in place (torch bumps the version) or replacing a field is seen by the next check."""
    field, corrupt, message = CORRUPTIONS[name]
    batch = pack(TrajectoryTree.from_sequences([[1, 2, 3, 4], [1, 2, 3, 5, 6], [1, 9]]))
    assert batch._fresh_check() is not None  # pack checks what it builds
    corrupt(getattr(batch, field))
    with pytest.raises(TreeInputError, match=message):
        batch.validate()
    fresh = pack(TrajectoryTree.from_sequences([[1, 2, 3, 4], [1, 2, 3, 5, 6], [1, 9]]))
    setattr(fresh, field, corrupt(getattr(fresh, field).clone()))
    with pytest.raises(TreeInputError, match=message):
        fresh.validate()


def test_a_checked_batch_is_not_read_back_again(monkeypatch):
    """validate() on a packed (or moved) batch reads none of its tensors on the host; a vocab
    check uses the largest id found by the first check."""
    batch = pack(TrajectoryTree.from_sequences([[1, 2, 3, 4], [1, 2, 3, 5, 6], [1, 9]])).to("cpu")
    moved = batch.to("meta")  # a copy elsewhere keeps the check (the values are the same)
    reads = []
    for name in ("cpu", "numpy", "tolist", "item"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _real=real, _n=name, **k: reads.append(_n) or
                            _real(self, *a, **k))
    batch.validate(vocab_size=10)
    moved.validate(vocab_size=10)
    assert batch.longest_path() == (5, 0) and moved.longest_path() == (5, 0)
    assert reads == []
    with pytest.raises(TreeInputError, match=r"input_ids\[\d+\] = [45] is out of range for vocab_size=4"):
        batch.validate(vocab_size=4)


def test_a_padded_or_moved_batch_carries_the_check_a_fresh_one_finds():
    from treecompile.core.batch import _validate

    batch = pack(TrajectoryTree.from_sequences([[1, 2, 3, 4], [1, 2, 3, 5, 6], [1, 9]]))
    for other in (batch.padded(batch.num_tokens + 3), batch.to("cpu"), batch.padded(2),
                  batch.padded(2, target=True), batch.padded(batch.num_tokens + 4, target=True)):
        carried, fresh = other._fresh_check(), _validate(other)
        assert carried is not None
        assert (carried.max_id, carried.longest, carried.longest_tree) == (fresh.max_id, fresh.longest,
                                                                          fresh.longest_tree)
        assert all(torch.equal(a, b) for a, b in zip(carried.head, fresh.head))
        assert torch.equal(carried.node_table, fresh.node_table)


def test_scaled_weights_keep_the_check_and_refuse_a_zero_or_nan_scale(monkeypatch):
    from treecompile.core.padded_rows import normalised

    batch = pack(TrajectoryTree.from_sequences([[1, 2, 3, 4], [1, 2, 3, 5, 6], [1, 9]]))
    half = normalised(batch, torch.tensor(2 * batch.n_targets))  # the Trainer's count, a tensor
    assert torch.allclose(half.target_weight, batch.target_weight / 2) and half._fresh_check() is not None
    reads = []
    real = torch.Tensor.cpu
    monkeypatch.setattr(torch.Tensor, "cpu", lambda self, *a, **k: reads.append(1) or real(self, *a, **k))
    half.validate(vocab_size=10)
    assert reads == []  # no read of the batch: the check carried over
    monkeypatch.undo()
    for count in (0, torch.tensor(0), torch.tensor(float("nan"))):
        with pytest.raises(TreeInputError, match="scale is (inf|nan): it must be finite and positive"):
            normalised(batch, count)


def test_validate_checks_vocab():
    batch = pack(TrajectoryTree.from_sequences([[1, 2, 30]]))
    with pytest.raises(TreeInputError, match="vocab_size=16"):
        batch.validate(vocab_size=16)


def test_pack_refuses_bad_input():
    tree = TrajectoryTree.from_sequences([[1, 2, 3], [1, 5, 6]])
    with pytest.raises(TreeInputError, match="over max_tokens=4"):
        pack([tree], max_tokens=4)
    with pytest.raises(TreeInputError, match="out of range for vocab_size=6"):
        pack([tree], vocab_size=6)
    with pytest.raises(TreeInputError, match="not a TrajectoryTree"):
        pack([[1, 2, 3]])
    with pytest.raises(TreeInputError, match="at least one tree"):
        pack([])
    with pytest.raises(ValueError, match="valid modes: token-mean"):
        pack(tree, loss_mode="mean")


def test_to_device_and_dtypes():
    b = pack(TrajectoryTree.from_sequences([[1, 2], [1, 3]]), path_bits=True).to("cpu")
    assert b.input_ids.dtype == torch.int64 and b.target_weight.dtype == torch.float64
    assert b.path_bits.dtype == torch.int64
    assert np.isclose(b.target_weight.sum().item(), 1.0)


@given(forests)
def test_padding_rows_are_isolated_and_weightless(forest):
    batch = pack(_trees(forest), path_bits=True)
    padded = batch.padded(batch.num_tokens + 3).validate()
    s = batch.num_tokens
    assert padded.num_tokens == s + 3 and padded.num_trees == batch.num_trees + 3
    mask = padded.reference_attention_mask()
    assert torch.equal(mask[:s, :s], batch.reference_attention_mask())
    assert not mask[:s, s:].any() and not mask[s:, :s].any()
    assert torch.equal(mask[s:, s:], torch.eye(3, dtype=torch.bool))
    assert torch.all(padded.target_weight[s:] == 0) and torch.all(padded.pred_index[s:] == -1)
    q, k = torch.arange(s + 3)[:, None], torch.arange(s + 3)[None, :]
    zero = torch.zeros((), dtype=torch.int64)
    assert torch.equal(bind_buffers(bitmask_mask_mod(padded.path_bits.shape[1]), padded.tree_ids, padded.path_bits)(zero, zero, q, k), mask)
    assert batch.padded(1) is batch


@given(forests)
def test_a_padding_target_is_an_isolated_two_token_tree_of_weight_zero(forest):
    batch = pack(_trees(forest), path_bits=True)
    s = batch.num_tokens
    padded = batch.padded(s + 3, target=True).validate()
    assert padded.num_tokens == s + 3 and padded.num_trees == batch.num_trees + 2
    assert padded.num_nodes == batch.num_nodes + 2
    mask = padded.reference_attention_mask()
    assert torch.equal(mask[:s, :s], batch.reference_attention_mask())
    assert not mask[:s, s:].any() and not mask[s:, :s].any()
    assert torch.equal(mask[s:, s:], torch.tensor([[1, 0, 0], [0, 1, 0], [0, 1, 1]], dtype=torch.bool))
    assert padded.pred_index[s:].tolist() == [-1, -1, s + 1] and torch.all(padded.target_weight[s:] == 0)
    dest, rows, slot = padded.head_index()
    assert dest[-1] == s + 2 and rows[slot[-1]] == s + 1
    q, k = torch.arange(s + 3)[:, None], torch.arange(s + 3)[None, :]
    zero = torch.zeros((), dtype=torch.int64)
    assert torch.equal(bind_buffers(bitmask_mask_mod(padded.path_bits.shape[1]), padded.tree_ids, padded.path_bits)(zero, zero, q, k), mask)
    assert batch.padded(s, target=True).num_tokens == s + 2


def test_a_batch_bound_for_cuda_is_pinned_and_copied_without_blocking_the_host(monkeypatch):
    """A copy from pageable memory waits for every kernel queued before it (the previous step):
    to("cuda") pins each CPU tensor and copies it with non_blocking=True, keeping the check.
    CUDA stands in here: the tensors record what was asked and stay where they are."""
    batch = pack(TrajectoryTree.from_sequences([[1, 2, 3, 4], [1, 2, 3, 5, 6], [1, 9]]))
    tensors = [v for v in vars(batch).values() if isinstance(v, torch.Tensor)]
    pinned, moves = set(), []
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: id(self) in pinned)

    def pin(self):
        pinned.add(id(self))
        return self

    def to(self, *args, **kwargs):
        moves.append((id(self), torch.device(args[0]) if args else None, kwargs.get("non_blocking", False)))
        return self

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin)
    monkeypatch.setattr(torch.Tensor, "to", to)
    moved = batch.to("cuda")
    head = batch._fresh_check().head
    assert len(moves) == len(tensors) + len(head)
    assert all(device == torch.device("cuda") and non_blocking and i in pinned for i, device, non_blocking in moves)
    assert moved._fresh_check() is not None  # the copy keeps the check
    pinned.clear(), moves.clear()
    assert batch.pin_memory()._fresh_check() is not None and len(pinned) == len(tensors) + len(head)
    # DataLoader(pin_memory=True) pins what TreeCollator hands it (a list of batches) this way
    from torch.utils.data._utils.pin_memory import pin_memory as loader_pin

    pinned.clear()
    (out,) = loader_pin([batch])
    assert isinstance(out, type(batch)) and len(pinned) == len(tensors) + len(head)
    batch.to("cpu")  # anything but CPU -> CUDA copies as before: blocking, nothing pinned
    assert moves and not any(non_blocking for _, _, non_blocking in moves) and len(pinned) == len(tensors) + len(head)


def test_a_tree_that_trains_no_token_is_named_once_per_batch():
    """A conversation without an assistant turn (masks all 0) trains nothing: pack says so,
    naming the tree by its metadata, once per batch, and the whole batch when none trains."""
    import warnings

    from treecompile.core.advice import TreeWarning

    idle = TrajectoryTree.from_sequences([[1, 2, 3], [1, 2, 4]], loss_masks=[[0, 0, 0], [0, 0, 0]],
                                            metadata={"group": "task-7"})
    busy = TrajectoryTree.from_sequences([[5, 6, 7]])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pack([busy, idle], warn_por=False)
        pack([idle], warn_por=False)
        pack([busy], warn_por=False)
    said = [str(w.message) for w in caught if issubclass(w.category, TreeWarning)]
    assert len(said) == 2, said
    assert "1 tree(s) of the batch train no token: #1 (group='task-7')" in said[0] and "whole batch" not in said[0]
    assert "(the whole batch: its loss is 0 and no gradient flows)" in said[1]
    # A data loader's padding micro-step trains nothing on purpose: no warning.
    from treecompile.planning.dataloader import padding_tree

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pack([padding_tree()], warn_por=False)
        pack([busy, padding_tree()], warn_por=False)
