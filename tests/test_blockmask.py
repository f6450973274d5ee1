import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import path_sets
from testing import examples

from treecompile import TrajectoryTree, pack
from treecompile.kernels.attention.blockmask import tree_block_mask
from treecompile.kernels.attention.masks import bind_buffers, bitmask_mask_mod, interval_mask_mod
from torch.nn.attention.flex_attention import create_block_mask


def random_tree_batch(seed: int, target_tokens: int):
    g = torch.Generator().manual_seed(seed)
    seqs = []
    total = 0
    while total < target_tokens:
        if seqs and torch.rand(1, generator=g).item() < 0.7:
            base = seqs[int(torch.randint(len(seqs), (1,), generator=g))]
            cut = int(torch.randint(1, len(base) + 1, (1,), generator=g))
            new = base[:cut] + torch.randint(0, 50, (int(torch.randint(1, 40, (1,), generator=g)),), generator=g).tolist()
        else:
            new = torch.randint(0, 50, (int(torch.randint(1, 60, (1,), generator=g)),), generator=g).tolist()
        seqs.append(new)
        total = TrajectoryTree.from_sequences(seqs).num_tokens
    return pack(TrajectoryTree.from_sequences(seqs))


def assert_same_block_mask(ours, ref):
    for name in ("kv_num_blocks", "full_kv_num_blocks", "q_num_blocks", "full_q_num_blocks"):
        assert torch.equal(getattr(ours, name), getattr(ref, name)), name
    for num, idx in (("kv_num_blocks", "kv_indices"), ("full_kv_num_blocks", "full_kv_indices"),
                     ("q_num_blocks", "q_indices"), ("full_q_num_blocks", "full_q_indices")):
        n = getattr(ref, num)[0, 0]
        for row, count in enumerate(n.tolist()):
            a = getattr(ours, idx)[0, 0, row, :count]
            b = getattr(ref, idx)[0, 0, row, :count]
            assert torch.equal(a.sort().values, b.sort().values), f"{idx} row {row}"


@pytest.mark.parametrize("size", [1, 17, 63, 64, 65, 127, 130, 300], ids=lambda s: f"S~{s}")
@pytest.mark.parametrize("block", [16, 32, 128], ids=lambda b: f"B{b}")
def test_equals_create_block_mask(size, block):
    batch = random_tree_batch(seed=size * 7 + block, target_tokens=size)
    s = batch.num_tokens
    mm = bind_buffers(interval_mask_mod(), batch.subtree_end)
    ref = create_block_mask(mm, 1, 1, s, s, device="cpu", BLOCK_SIZE=block)
    assert_same_block_mask(tree_block_mask(batch.subtree_end, block_size=block), ref)


@settings(max_examples=examples(40))
@given(path_sets(), st.sampled_from([1, 2, 3, 8]))
def test_equals_create_block_mask_on_hypothesis_trees(case, block):
    seqs, _, _ = case
    batch = pack(TrajectoryTree.from_sequences(seqs))
    s = batch.num_tokens
    ref = create_block_mask(bind_buffers(interval_mask_mod(), batch.subtree_end), 1, 1, s, s, device="cpu", BLOCK_SIZE=block)
    assert_same_block_mask(tree_block_mask(batch.subtree_end, block_size=block), ref)


@pytest.mark.parametrize("block", [2, 4, 16])
def test_interval_classes_are_the_bitmask_rules_classes(block):
    """The bitmask rule is the same relation, so its create_block_mask classes are ours."""
    trees = [TrajectoryTree.from_sequences([[1, 2, 3, 4, 5, 6], [1, 2, 3, 7, 8], [1, 9], [1, 2, 3, 7, 10, 11, 12]]),
             TrajectoryTree.from_sequences([[5, 6, 7], [5, 8]])]
    batch = pack(trees, path_bits=True)
    s = batch.num_tokens
    ref = create_block_mask(bind_buffers(bitmask_mask_mod(batch.path_bits.shape[1]), batch.tree_ids, batch.path_bits), 1, 1, s, s, device="cpu",
                            BLOCK_SIZE=block)
    assert_same_block_mask(tree_block_mask(batch.subtree_end, block_size=block), ref)
