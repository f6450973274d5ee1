"""benchmarks/block_layout.py: its layouts keep the trees' content, and its block counts are the library's."""

import functools
import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given
from strategies import forests, path_sets

from treecompile import TrajectoryTree, pack
from treecompile.kernels.attention.blockmask import block_classes, tree_block_mask

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "block_layout.py"
_spec = importlib.util.spec_from_file_location("block_layout", SCRIPT)
bl = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = bl  # dataclasses look their module up there
_spec.loader.exec_module(bl)

REORDERS = {"largest-first": bl.largest_first, "smallest-first": bl.smallest_first}


def _path_key(p):
    return (tuple(p.tokens.tolist()), p.weight, tuple(p.loss_mask.tolist()))


def _siblings(tree, roots: bool = True):
    groups = {}
    for v in range(tree.num_nodes):
        if roots or tree.parent[v] >= 0:
            groups.setdefault(int(tree.parent[v]), []).append(v)
    return groups.values()


@pytest.mark.parametrize("name", REORDERS)
@given(case=path_sets())
def test_reorder_keeps_every_path(name, case):
    seqs, weights, masks = case
    tree = TrajectoryTree.from_sequences(seqs, weights=weights, loss_masks=masks)
    new = REORDERS[name](tree)  # the constructor checks preorder and every leaf ending a path
    assert new.num_paths == tree.num_paths and new.num_tokens == tree.num_tokens
    for p in range(tree.num_paths):
        assert _path_key(new.path(p)) == _path_key(tree.path(p)), f"{name}: path {p} changed"
    assert sorted(map(_path_key, new.paths())) == sorted(map(_path_key, tree.paths()))
    size = bl.subtree_tokens(new)
    sign = -1 if name == "largest-first" else 1
    for group in _siblings(new, roots=name != "largest-first"):  # from_sequences keeps the roots' order
        keys = [sign * int(size[v]) for v in group]
        assert keys == sorted(keys), f"{name}: siblings {group} have subtree sizes {size[group].tolist()}"
    a, b = pack(tree).validate(), pack(new).validate()
    assert a.n_targets == b.n_targets
    assert torch.allclose(a.target_weight.sum(), b.target_weight.sum(), rtol=1e-12, atol=0)


def test_largest_first_moves_the_big_subtree_first():
    tree = TrajectoryTree.from_sequences([[0, 1], [0, 2, 3, 4], [0, 5, 6]])
    new = bl.largest_first(tree)
    assert [new.node_tokens(v).tolist() for v in range(new.num_nodes)] == [[0], [2, 3, 4], [5, 6], [1]]
    assert new.sequences() == tree.sequences()


@pytest.mark.parametrize("what", bl.ALIGNMENTS)
@pytest.mark.parametrize("block", [4, 16], ids=lambda b: f"B{b}")
@given(case=forests)
def test_alignment_padding_changes_no_real_row(what, block, case):
    batch = pack([TrajectoryTree.from_sequences(seqs) for seqs, _, _ in case])
    starts = bl.boundaries(batch, what)
    se, real = bl.aligned_subtree_end(batch.subtree_end.numpy(), starts, block)
    rows = np.flatnonzero(real)
    assert rows.shape[0] == batch.num_tokens
    assert np.all(rows[starts] % block == 0), f"{what}: rows {starts.tolist()} not moved to block starts"
    idx = np.arange(se.shape[0])
    visible = (idx[None, :] <= idx[:, None]) & (idx[:, None] < se[None, :])  # [q, k]
    assert np.array_equal(visible[np.ix_(rows, rows)], batch.reference_attention_mask().numpy())
    assert not visible[np.ix_(rows, np.flatnonzero(~real))].any(), "a real row sees a padding row"


@functools.cache
def _sample_row(name):
    """A packed row of real trees: one bundled tau-bench task, or 12 bundled GSM8K groups."""
    from treecompile.chat.to_tree import tree_from_messages
    from treecompile.data.samples import sample_gsm8k, sample_tau_bench

    def tree(convs):
        return tree_from_messages(convs, "sample", on_drift="ignore")

    if name == "tau-bench task":
        return pack(tree(next(iter(sample_tau_bench().values()))))
    return pack([tree(g) for g in list(sample_gsm8k().values())[:12]])


@pytest.mark.parametrize("align", [None, "subtrees"])
@pytest.mark.parametrize("block", [16, 64, 128], ids=lambda b: f"B{b}")
@pytest.mark.parametrize("name", ["tau-bench task", "gsm8k 12 groups"])
def test_counts_match_the_library_block_classes(name, block, align):
    batch = _sample_row(name)
    se, real = batch.subtree_end.numpy(), None
    if align is not None:
        se, real = bl.aligned_subtree_end(se, bl.boundaries(batch, align), block)
    visible, _ = bl.block_pair_counts(se, block, real)
    lib_partial, lib_full = block_classes(torch.from_numpy(se), block)
    full = visible == block * block
    partial = (visible > 0) & ~full
    for what, ours, lib in (("full", full, lib_full.numpy()), ("partial", partial, lib_partial.numpy())):
        assert np.array_equal(ours, lib), f"{name} B{block}: {int((ours != lib).sum())} {what} blocks differ"
    mask = tree_block_mask(torch.from_numpy(se), block_size=block)
    counts = bl.count_blocks(se, block, real)
    assert counts.partial == int(mask.kv_num_blocks.sum())
    assert counts.full == int(mask.full_kv_num_blocks.sum())


@pytest.mark.parametrize("block", [3, 8], ids=lambda b: f"B{b}")
@given(case=forests)
def test_pair_counts_equal_the_dense_mask(block, case):
    batch = pack([TrajectoryTree.from_sequences(seqs) for seqs, _, _ in case])
    s = batch.num_tokens
    nb = -(-s // block)
    dense = np.zeros((nb * block, nb * block), dtype=np.int64)
    dense[:s, :s] = batch.reference_attention_mask().numpy()
    expected = dense.reshape(nb, block, nb, block).sum(axis=(1, 3))
    visible, real_visible = bl.block_pair_counts(batch.subtree_end.numpy(), block)
    assert np.array_equal(visible, expected) and np.array_equal(real_visible, expected)
    area = block * block
    counts = bl.count_blocks(batch.subtree_end.numpy(), block)
    partial = (expected > 0) & (expected < area)
    assert counts.partial == int(partial.sum()) and counts.live == int((expected > 0).sum())
    assert round(counts.masked * area) == int((area - expected[partial]).sum())
