"""The per-path reference against the dense-mask tree forward of a Hugging Face model."""

import pytest
import torch
from testing import TOLERANCES, assert_grads_close, param_grads

from treecompile import LOSS_MODES, TrajectoryTree, gather_logprobs, pack, tree_loss
from treecompile.core.reference import dense_mask_logits, path_logprobs, per_path_loss

transformers = pytest.importorskip("transformers")

RTOL, ATOL = TOLERANCES[("float64", "hf")]


def tiny_qwen3(vocab=32):
    cfg = transformers.Qwen3Config(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8,
    )
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg).double().eval()


SEQS = [[1, 2, 3, 4, 5], [1, 2, 3, 6], [1, 2, 3], [1, 2, 3], [7, 8, 9], [1, 10, 11, 12]]
MASKS = [[1] * 5, [0, 0, 0, 1], None, [1, 1, 0], None, [0, 1, 1, 1]]


@pytest.mark.parametrize("mode", list(LOSS_MODES))
def test_dense_tree_forward_matches_per_path_training(mode):
    model = tiny_qwen3()
    tree = TrajectoryTree.from_sequences(SEQS, weights=[1, 2, 1, 0.5, 1, 3], loss_masks=MASKS)
    ref = per_path_loss(model, tree, loss_mode=mode)
    ref.loss.backward()
    ref_grads = param_grads(model)
    model.zero_grad(set_to_none=True)
    batch = pack(tree, loss_mode=mode)
    loss = tree_loss(gather_logprobs(dense_mask_logits(model, batch), batch), batch)
    loss.backward()
    torch.testing.assert_close(loss, ref.loss, rtol=RTOL, atol=ATOL)
    assert_grads_close(param_grads(model), ref_grads, ("float64", "hf"))


def test_per_path_logprobs_are_what_the_model_says():
    model = tiny_qwen3()
    lp = path_logprobs(model, [1, 2, 3])
    logits = model(input_ids=torch.tensor([[1, 2, 3]]), use_cache=False).logits[0]
    expected = torch.log_softmax(logits, -1)
    assert lp[0] == 0
    torch.testing.assert_close(lp[1:], torch.stack([expected[0, 2], expected[1, 3]]))


def test_a_wrong_mask_is_detected():
    # Guards the guard: a plain causal mask over the packed row must disagree with per-path training.
    model = tiny_qwen3()
    tree = TrajectoryTree.from_sequences([[1, 2, 3, 4], [1, 2, 5, 6]])
    batch = pack(tree)
    ref = per_path_loss(model, tree).loss
    broken = pack(tree)
    broken.subtree_end = torch.full_like(broken.subtree_end, broken.num_tokens)
    wrong = tree_loss(gather_logprobs(dense_mask_logits(model, broken), batch), batch)
    assert (wrong - ref).abs() > 1e-4
