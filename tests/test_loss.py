import pytest
import torch
from hypothesis import given
from strategies import forests
from testing import TOLERANCES, NoModel, hash_forward, tree_hash_logits

from treecompile import LOSS_MODES, TrajectoryTree, gather_logprobs, pack, tree_loss
from treecompile.core.reference import per_path_loss

VOCAB = 5
RTOL, ATOL = TOLERANCES[("float64", "pure")]


@pytest.mark.parametrize("mode", list(LOSS_MODES))
@given(forest=forests)
def test_tree_loss_equals_per_path_loss(mode, forest):
    trees = [TrajectoryTree.from_sequences(s, weights=w, loss_masks=m) for s, w, m in forest]
    batch = pack(trees, loss_mode=mode)
    tree_value = tree_loss(gather_logprobs(tree_hash_logits(batch, VOCAB), batch), batch)
    ref = per_path_loss(NoModel(), trees, loss_mode=mode, forward=hash_forward(VOCAB))
    torch.testing.assert_close(tree_value, ref.loss.to(tree_value.dtype), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("mode", list(LOSS_MODES))
def test_denominator_override_scales_the_loss(mode):
    tree = TrajectoryTree.from_sequences([[1, 2, 3], [1, 2, 4, 0]], loss_masks=[[1, 1, 1], [0, 1, 1, 1]])
    own = pack(tree, loss_mode=mode)
    forced = pack(tree, loss_mode=mode, denominator=7.0)
    ref = per_path_loss(NoModel(), tree, loss_mode=mode, denominator=7.0, forward=hash_forward(VOCAB))
    lp = gather_logprobs(tree_hash_logits(forced, VOCAB), forced)
    torch.testing.assert_close(tree_loss(lp, forced), ref.loss, rtol=RTOL, atol=ATOL)
    assert not torch.allclose(own.target_weight, forced.target_weight)


def test_branch_point_is_predicted_by_the_parent_last_row():
    tree = TrajectoryTree.from_sequences([[1, 2, 3], [1, 2, 4]])
    batch = pack(tree, loss_mode="sum")
    logits = torch.zeros(batch.num_tokens, VOCAB, dtype=torch.float64)
    logits[1, 3] = 5.0  # row 1 (token 2) is the last row of the shared node
    lp = gather_logprobs(logits, batch)
    assert lp[2] > lp[3]  # token 3 is favoured by row 1's output; token 4 is predicted from the same row
    assert batch.pred_index.tolist() == [-1, 0, 1, 1]


def test_weights_sum_to_one_in_token_mean():
    tree = TrajectoryTree.from_sequences([[1, 2, 3], [1, 2], [1, 2, 3]], weights=[1, 1, 1])
    b = pack(tree)
    assert b.n_targets == 2 + 1 + 2
    assert b.target_weight.sum().item() == pytest.approx(1.0, rel=1e-15)


def test_no_targets_gives_zero_loss():
    tree = TrajectoryTree.from_sequences([[1, 2]], loss_masks=[[1, 0]])
    b = pack(tree)
    assert b.target_weight.abs().sum().item() == 0.0
