"""The tree engine's map between a verl micro-batch and its tree (`micro_batch_tree`), without
verl: verl's micro-batch layout is torch's nested (jagged) tensors.

The engine itself, against verl's own actor engine, is tested in tests/needs_verl/ (run by
scripts/test_verl.sh, in a venv with verl installed).
"""

from __future__ import annotations

import pytest
import torch

from treecompile.core.errors import TreeInputError
from treecompile.integrations.verl_actor import micro_batch_tree, tree_engine_class

# A GRPO group of three responses to one prompt, and a second prompt sharing its first two
# tokens; one response is a single token, one sequence is a prefix of another.
SEQS = [[5, 6, 7, 8, 9], [5, 6, 7, 8, 10, 11], [5, 6, 7, 12], [5, 6, 13, 14, 15], [5, 6, 7, 8]]


def _nested(seqs):
    ids = torch.nested.nested_tensor_from_jagged(torch.tensor([t for s in seqs for t in s]),
                                                  torch.tensor([0, *torch.tensor([len(s) for s in seqs]).cumsum(0)]))
    pos = torch.nested.nested_tensor_from_jagged(torch.cat([torch.arange(len(s)) for s in seqs]), ids.offsets())
    return ids, pos


def test_each_entry_maps_to_the_row_of_the_next_token_on_its_own_path():
    ids, pos = _nested(SEQS)
    tree = micro_batch_tree(ids, pos)
    batch = tree.batch
    assert batch.num_paths == len(SEQS)
    assert batch.num_tokens == 11  # 24 tokens; the shared prefixes once
    flat_index, flat_valid = tree.index.tolist(), tree.valid.tolist()
    offsets = tree.offsets.tolist()
    for b, seq in enumerate(SEQS):
        rows = batch.path_rows(b).tolist()
        for i in range(len(seq)):
            e = offsets[b] + i
            if i == len(seq) - 1:
                assert not flat_valid[e], f"sequence {b}: its last entry predicts nothing"
                continue
            assert flat_valid[e] and flat_index[e] == rows[i + 1], f"sequence {b}, entry {i}"
            assert int(batch.input_ids[flat_index[e]]) == seq[i + 1]


def test_values_go_back_to_verls_nested_layout_with_gradients():
    ids, pos = _nested(SEQS)
    tree = micro_batch_tree(ids, pos)
    values = torch.arange(tree.batch.num_tokens, dtype=torch.float64, requires_grad=True)
    out = tree.to_verl(values)
    assert out.is_nested and torch.equal(out.offsets(), ids.offsets())
    flat = out.values()
    assert torch.equal(flat[~tree.valid], torch.zeros(len(SEQS), dtype=torch.float64))
    flat.sum().backward()
    # A row's gradient counts the sequences whose next token it is (the shared prefix rows).
    expected = torch.zeros(tree.batch.num_tokens, dtype=torch.float64)
    expected.index_add_(0, tree.index[tree.valid], torch.ones(int(tree.valid.sum()), dtype=torch.float64))
    assert torch.equal(values.grad, expected)
    # The root token predicts nothing; token 6 is next on all five sequences, 7 on four, 8 on three.
    assert [int(batch_token) for batch_token in tree.batch.input_ids[:4]] == [5, 6, 7, 8]
    assert values.grad[:4].tolist() == [0, 5, 4, 3]
    with pytest.raises(ValueError, match=r"values has shape \(3,\)"):
        tree.to_verl(torch.zeros(3))


@pytest.mark.parametrize("edit, match", [
    (lambda ids, pos: (ids.values(), pos), "must be nested"),
    (lambda ids, pos: (ids, torch.nested.nested_tensor_from_jagged(pos.values() + 1, pos.offsets())),
     r"sequence 0: position id 1 at token 0; the tree engine needs position ids 0, 1"),
    (lambda ids, pos: (ids, torch.nested.nested_tensor_from_jagged(
        torch.cat([pos.values()[:7], torch.tensor([9]), pos.values()[8:]]), pos.offsets())),
     r"sequence 1: position id 9 at token 2"),
], ids=["not-nested", "positions-from-1", "position-jump"])
def test_layouts_the_tree_cannot_reproduce_are_refused(edit, match):
    ids, pos = _nested(SEQS)
    with pytest.raises(TreeInputError, match=match):
        micro_batch_tree(*edit(ids, pos))


def test_temperature_and_outputs_come_from_the_micro_batch_not_the_class():
    for key in ("temperature", "outputs"):
        with pytest.raises(ValueError, match=f"{key} is not an option here"):
            tree_engine_class(object, **{key: 1.0})
