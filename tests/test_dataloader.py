"""The step planner and the torch.utils.data sampler/collator: budget, coverage, global normalization."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from strategies import path_sets
from testing import TOLERANCES, NoModel, hash_forward, tree_hash_logits

from treecompile import LOSS_MODES, TrajectoryTree, gather_logprobs, tree_loss
from treecompile.planning.dataloader import StepSampler, TreeCollator, as_tree, plan_step
from treecompile.planning.partition import path_lengths
from treecompile.core.reference import per_path_loss

VOCAB = 8


def _trees(forest):
    return [TrajectoryTree.from_sequences(s, weights=w, loss_masks=m) for s, w, m in forest]


@st.composite
def step(draw):
    trees = _trees(draw(st.lists(path_sets(max_paths=4), min_size=1, max_size=4)))
    longest = max(int(path_lengths(t).max()) for t in trees)
    capacity = draw(st.integers(longest, longest + 12))
    return trees, capacity, draw(st.integers(1, 3)), draw(st.sampled_from(list(LOSS_MODES)))


def _paths(trees):
    return sorted((tuple(p.tokens.tolist()), p.weight, tuple(p.loss_mask.tolist())) for t in trees for p in t.paths())


@given(step())
def test_every_rank_and_micro_step_adds_up_to_the_whole_loss(args):
    trees, capacity, ranks, mode = args
    plan = plan_step(trees, capacity=capacity, ranks=ranks, loss_mode=mode)
    assert len({len(m) for m in plan.micro}) == 1, "ranks must run the same number of micro-steps"
    seen = [t for m in plan.micro for mb in m for t in mb]
    assert _paths(seen) == _paths(trees), "a path is lost or duplicated"
    total = torch.zeros((), dtype=torch.float64)
    for r in range(ranks):
        for batch in plan.batches(r):
            assert batch.num_tokens <= capacity
            total = total + tree_loss(gather_logprobs(tree_hash_logits(batch, VOCAB), batch), batch)
    ref = per_path_loss(NoModel(), trees, loss_mode=mode, forward=hash_forward(VOCAB)).loss
    rtol, atol = TOLERANCES[("float64", "pure")]
    torch.testing.assert_close(total, ref.to(torch.float64), rtol=rtol, atol=atol)
    assert plan.partition_tokens >= plan.tree_tokens and plan.err <= plan.por + 1e-12


def test_padding_micro_steps_have_zero_weight():
    trees = [TrajectoryTree.from_sequences([[1, 2, 3, 4, 5], [1, 2, 3, 6, 7], [1, 8, 9, 10, 11]])]
    plan = plan_step(trees, capacity=5, ranks=2)
    lens = [len([mb for mb in m if mb]) for m in plan.micro]
    assert sorted(lens) == [1, 2] and plan.micro_steps == 2
    pad = [b for r in range(2) for b, mb in zip(plan.batches(r), plan.micro[r]) if not mb]
    assert len(pad) == 1 and pad[0].num_tokens == 1 and float(pad[0].target_weight.abs().sum()) == 0.0


def test_torch_dataloader_yields_each_ranks_micro_batches():
    data = [
        TrajectoryTree.from_sequences([[1, 2, 3], [1, 2, 4]]),
        [[5, 6, 7, 8], [5, 6, 9]],
        {"sequences": [[10, 11], [10, 12, 13]], "weights": [1.0, 2.0]},
        TrajectoryTree.from_sequences([[14, 15, 16]]),
    ]
    sampler = StepSampler(len(data), trees_per_step=2, seed=3)
    steps = {}
    for rank in range(2):
        loader = torch.utils.data.DataLoader(
            data, batch_sampler=sampler, collate_fn=TreeCollator(capacity=6, rank=rank, world_size=2)
        )
        steps[rank] = list(loader)
    assert len(steps[0]) == len(steps[1]) == len(sampler) == 2
    for i, idx in enumerate(sampler):
        trees = [as_tree(data[j]) for j in idx]
        tokens = sum(b.input_ids.numel() for r in range(2) for b in steps[r][i] if b.target_weight.abs().sum() > 0)
        assert tokens >= sum(t.num_tokens for t in trees)
        assert len(steps[0][i]) == len(steps[1][i])
    sampler.set_epoch(1)
    assert sorted(sum(list(sampler), [])) == [0, 1, 2, 3]


def test_bad_items_and_ranks_are_refused():
    with pytest.raises(ValueError, match="rank 2 out of range"):
        TreeCollator(capacity=4, rank=2, world_size=2)
    with pytest.raises(ValueError, match="sequences"):
        as_tree({"input_ids": [1, 2]})
