"""verl rollout batches on trees (`treecompile.integrations.verl`), against verl's own actor
computation on the padded batch.

verl itself is not installed here (its ``DataProto`` imports ray, and verl 0.9 pins
transformers < 5.11): the batch is built in verl's documented actor layout (left-padded
``prompts``, right-padded ``responses``, ``attention_mask``, ``response_mask``,
``old_log_probs``, ``advantages``), and the reference is what verl's ``dp_actor`` computes on
it: the model on ``cat(prompts, responses)`` with the attention mask and position ids
``cumsum(mask) - 1``, log-probs of ``logits[:, Tp - 1:-1]``, and ``compute_policy_loss``
(vanilla: clip 0.2, dual-clip c = 3) aggregated by ``agg_loss(..., "token-mean")``.
"""

from __future__ import annotations

import pytest
import torch
from testing import COMPILE_TOL, perturbed_hf_model

import treecompile as tc
from treecompile.core.errors import TreeInputError
from treecompile.integrations.verl import logprobs_to_verl, tree_from_verl
from treecompile.rl.losses import PolicyLossConfig, policy_loss

transformers = pytest.importorskip("transformers")

CLIP, CLIP_C = 0.2, 3.0


def _model():
    cfg = transformers.Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    return perturbed_hf_model(cfg)


def _rollout(tp: int = 6, tr: int = 6) -> dict[str, torch.Tensor]:
    """2 GRPO groups of 3 responses in verl's layout; one response has a tool-output token
    (response_mask 0) inside it, and the two prompts share their first two tokens."""
    g = torch.Generator().manual_seed(3)
    prompts_real = [[5, 6, 7], [5, 6, 9, 10, 11]]
    lengths = [[2, 5, 3], [6, 1, 4]]
    prompts = torch.zeros(6, tp, dtype=torch.int64)
    responses = torch.zeros(6, tr, dtype=torch.int64)
    attention = torch.zeros(6, tp + tr, dtype=torch.int64)
    response_mask = torch.zeros(6, tr, dtype=torch.int64)
    for grp, prompt in enumerate(prompts_real):
        for k, n in enumerate(lengths[grp]):
            i = 3 * grp + k
            prompts[i, tp - len(prompt):] = torch.tensor(prompt)
            responses[i, :n] = torch.randint(1, 64, (n,), generator=g)
            attention[i, tp - len(prompt):tp] = 1
            attention[i, tp:tp + n] = 1
            response_mask[i, :n] = 1
    response_mask[1, 2] = 0  # a tool output inside response 1: context, not trained
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.0, 1.0, 1.0], dtype=torch.float64)
    groups = rewards.view(2, 3)
    adv = (groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + 1e-6)
    return {
        "prompts": prompts, "responses": responses, "attention_mask": attention, "response_mask": response_mask,
        "input_ids": torch.cat([prompts, responses], 1),
        "advantages": adv.reshape(6, 1).expand(6, tr) * response_mask,
    }


def _verl_log_probs(model, data) -> torch.Tensor:
    """``[B, Tr]``: verl's dp_actor log-probs on the padded batch."""
    attention = data["attention_mask"]
    position_ids = (attention.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=data["input_ids"], attention_mask=attention, position_ids=position_ids,
                   use_cache=False).logits
    tp = data["prompts"].shape[1]
    logp = torch.log_softmax(logits[:, tp - 1:-1].to(torch.float64), -1)
    return logp.gather(-1, data["responses"][..., None])[..., 0]


def _verl_policy_loss(log_probs, data) -> torch.Tensor:
    """verl's compute_policy_loss (vanilla, dual-clip) with agg_loss token-mean."""
    adv, mask, old = data["advantages"], data["response_mask"].to(log_probs.dtype), data["old_log_probs"]
    ratio = torch.exp(log_probs - old)
    pg1, pg2 = -adv * ratio, -adv * ratio.clamp(1 - CLIP, 1 + CLIP)
    clipped = torch.maximum(pg1, pg2)
    dual = torch.minimum(-adv * CLIP_C, clipped)
    pg = torch.where(adv < 0, dual, clipped)
    return (pg * mask).sum() / mask.sum()


def test_verl_batch_on_a_tree_gives_verls_log_probs_loss_and_gradients():
    model = _model()
    data = _rollout()
    with torch.no_grad():
        behaviour = _verl_log_probs(model, data)
    # Old log-probs off the current policy, so that ratios clip on both sides and dual-clip acts.
    noise = torch.randn(behaviour.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    data["old_log_probs"] = (behaviour + 0.4 * noise) * data["attention_mask"][:, 6:]

    model.zero_grad(set_to_none=True)
    ref_lp = _verl_log_probs(model, data)
    ref_loss = _verl_policy_loss(ref_lp, data)
    ref_loss.backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    tree = tree_from_verl(data)
    assert tree.batch.num_paths == 6
    assert tree.batch.num_tokens < int(data["attention_mask"].sum())  # prompts computed once
    compiled = tc.tree_compile(model, backend="eager")
    out = compiled(tree.batch)
    loss = policy_loss(out.logprobs, tree.rl, PolicyLossConfig(eps_low=CLIP, eps_high=CLIP, clip_c=CLIP_C)).loss
    loss.backward()

    rtol, atol = COMPILE_TOL["hf"]
    real = data["attention_mask"][:, 6:].bool()
    got_lp = logprobs_to_verl(out.logprobs.detach(), tree)
    torch.testing.assert_close(got_lp[real], ref_lp.detach()[real], rtol=rtol, atol=atol)
    assert (got_lp[~real] == 0).all()
    torch.testing.assert_close(loss.detach(), ref_loss.detach(), rtol=rtol, atol=atol)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[n], rtol=rtol, atol=atol, msg=lambda m, n=n: f"grad of {n}: {m}")
    # Guard: the old log-probs made the clipping matter (the loss is not the plain policy gradient).
    ratio = torch.exp(ref_lp.detach() - data["old_log_probs"])[data["response_mask"].bool()]
    assert ((ratio < 1 - CLIP) | (ratio > 1 + CLIP)).any()


def test_logprobs_to_verl_is_differentiable_and_checks_its_input():
    data = _rollout()
    data["old_log_probs"] = torch.zeros(6, 6, dtype=torch.float64)
    tree = tree_from_verl(data)
    lp = torch.arange(tree.batch.num_tokens, dtype=torch.float64, requires_grad=True)
    out = logprobs_to_verl(lp, tree)
    assert out.shape == (6, 6)
    out.sum().backward()
    assert int((lp.grad > 0).sum()) == int(data["attention_mask"][:, 6:].sum())  # shared rows counted per path
    with pytest.raises(ValueError, match=r"logprobs has shape \(3,\)"):
        logprobs_to_verl(torch.zeros(3), tree)


@pytest.mark.parametrize("edit, match", [
    (lambda d: d.pop("advantages"), "the verl batch has no 'advantages'"),
    (lambda d: d["attention_mask"].__setitem__((0, 5), 0), "row 0: the prompt is not left-padded"),
    (lambda d: d["attention_mask"].__setitem__((0, 6), 0), "row 0: the response is not right-padded"),
    (lambda d: d["response_mask"].__setitem__((0, 5), 1), "row 0: response_mask is 1 on padding"),
    (lambda d: d.__setitem__("advantages", d["advantages"][:, :3]), r"advantages has shape \(6, 3\)"),
], ids=["no-advantages", "prompt-padding", "response-padding", "mask-on-padding", "advantage-shape"])
def test_malformed_verl_batches_are_refused_and_left_alone(edit, match):
    data = _rollout()
    edit(data)
    kept = {k: v.clone() for k, v in data.items()}
    with pytest.raises(TreeInputError, match=match):
        tree_from_verl(data)
    assert all(torch.equal(data[k], v) for k, v in kept.items())
