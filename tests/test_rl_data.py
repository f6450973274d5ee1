"""RL data: GRPO groups, multi-turn samples, tree-search rollouts, TRL/verl records and the
collator; each checked for exactness against per-path computation on prefix-hash logits."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_rl_objectives import CONFIGS, VOCAB, _compare, _noise, _path_terms, _per_path_logits
from testing import TOLERANCES, tree_hash_logits

from treecompile import gather_logprobs
from treecompile.core.errors import TreeInputError
from treecompile.rl.losses import PolicyLossConfig, per_path_policy_loss, policy_loss
from treecompile.rl.data import (
    RLCollator,
    group_advantages,
    grpo_group,
    multi_turn_sample,
    records_from_trl,
    records_from_verl,
    tot_search_samples,
)

RTOL, ATOL = TOLERANCES[("float64", "pure")]


def test_group_advantages_match_grpo_and_dr_grpo():
    r = [1.0, 0.0, 0.0, 1.0, 1.0, 5.0]
    g = ["a", "a", "a", "a", "b", "c"]
    adv = group_advantages(r, g, eps=0.0)
    a = np.array([1.0, 0.0, 0.0, 1.0])
    np.testing.assert_allclose(adv[:4], (a - a.mean()) / a.std(ddof=1), rtol=1e-15)
    assert adv[4] == 0.0 and adv[5] == 0.0  # a group of one
    np.testing.assert_allclose(group_advantages(r, g, scale="none")[:4], a - a.mean(), rtol=1e-15)
    with pytest.raises(ValueError, match="valid"):
        group_advantages(r, g, scale="max")


def _seq_terms(seqs, vocab=VOCAB):
    return [_path_terms(lg, s) for lg, s in zip(_per_path_logits(seqs, vocab), seqs)]


def test_grpo_group_trains_completions_only_and_is_exact():
    prompt = [0, 1, 2, 3]
    completions = [[4, 1, 1], [4, 1, 2, 0], [2, 2], [4, 1, 1], [3]]
    rewards = [1.0, 0.0, 1.0, 0.5, 0.0]
    olds = [[_noise(("o", i, t), 1.0) - 1.5 for t in range(len(c))] for i, c in enumerate(completions)]
    sample = grpo_group(prompt, completions, rewards, old_logprobs=olds)
    tree = sample.tree
    assert tree.num_paths == 5 and tree.sequences()[1] == prompt + completions[1]
    assert tree.path(1).loss_mask.tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    np.testing.assert_allclose(sample.advantages, group_advantages(rewards), rtol=1e-15)
    for mode in ("token-mean", "seq-mean-token-mean"):
        _compare([tree], sample.advantages, sample.old_logprobs, None, CONFIGS["ppo-sym"], mode)


def test_multi_turn_sample_one_path_per_assistant_turn():
    conv = [
        {"role": "user", "content": "Book a flight to Paris."},
        {"role": "assistant", "content": "Which date?"},
        {"role": "user", "content": "Friday."},
        {"role": "assistant", "content": "Booked for Friday."},
    ]
    conv2 = conv[:3] + [{"role": "assistant", "content": "Sorry, no seats left."}]
    sample = multi_turn_sample([conv, conv2], "sample", [[0.5, 1.0], -1.0], on_drift="ignore")
    tree = sample.tree
    assert tree.num_paths == 4 and sample.advantages == [0.5, 1.0, -1.0, -1.0]
    seqs = tree.sequences()
    assert seqs[0] == seqs[1][: len(seqs[0])]  # each turn's sample extends the previous one
    vocab = int(tree.tokens.max()) + 1
    _compare([tree], sample.advantages, None, None, CONFIGS["ppo-sym"], "seq-mean-token-mean", use_old=False,
             vocab=vocab)


def test_tot_search_tree_is_exact(shared_data):
    [sample] = tot_search_samples(shared_data / "tot" / "game24-search-tree-gpt-4.json", "sample", problems=[0])
    tree = sample.tree
    stats = tree.stats()
    assert stats.n_paths > stats.n_leaves, "kept partial solutions are internal endpoints"
    assert stats.por > 0.5
    adv = np.array(sample.advantages)
    assert (adv > 0).any() and (adv < 0).any()
    vocab = int(tree.tokens.max()) + 1
    _compare([tree], sample.advantages, None, None, PolicyLossConfig(objective="pg"),
             "token-mean", use_old=False, vocab=vocab)


def _trl_records():
    rows = []
    prompts = [[0, 1, 2], [3, 3]]
    comps = [[[4, 1], [4, 2, 2], [0]], [[1, 1, 1], [1, 1, 0], [2]]]
    rewards = [[1.0, 0.0, 0.5], [0.0, 0.0, 1.0]]
    for p, cs, rs in zip(prompts, comps, rewards):
        for i, (c, r) in enumerate(zip(cs, rs)):
            rows.append({"prompt_ids": p, "completion_ids": c, "reward": r,
                         "old_per_token_logps": [_noise(("o", tuple(p + c[: t + 1])), 1.0) - 1.5
                                                 for t in range(len(c))]})
    return rows


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_collator_batches_sum_to_the_per_path_loss(mode):
    rows = _trl_records()
    collator = RLCollator(max_tokens=9, loss_agg_mode=mode, max_len=8)
    batches = collator(rows)
    assert len(batches) == 2 and all(b.batch.num_tokens <= 9 for b in batches)
    config = PolicyLossConfig(eps_low=0.1, eps_high=0.3, clip_c=1.5)
    total = sum(policy_loss(gather_logprobs(tree_hash_logits(b.batch, VOCAB), b.batch), b, config).loss
                for b in batches)
    seqs = [r["prompt_ids"] + r["completion_ids"] for r in rows]
    masks = [[0] * len(r["prompt_ids"]) + [1] * len(r["completion_ids"]) for r in rows]
    adv = group_advantages([r["reward"] for r in rows], [tuple(r["prompt_ids"]) for r in rows])
    olds = [[0.0] * len(r["prompt_ids"]) + r["old_per_token_logps"] for r in rows]
    ref = per_path_policy_loss([t[0] for t in _seq_terms(seqs)], masks, advantages=list(adv), old_logprobs=olds,
                               config=config, loss_agg_mode=mode, max_len=8)
    torch.testing.assert_close(total, ref, rtol=RTOL, atol=ATOL)


def test_verl_batch_reads_like_trl_records():
    rows = _trl_records()
    tp = max(len(r["prompt_ids"]) for r in rows)
    tr = max(len(r["completion_ids"]) for r in rows) + 1
    b = len(rows)
    prompts = np.zeros((b, tp), dtype=np.int64)
    responses = np.zeros((b, tr), dtype=np.int64)
    attn = np.zeros((b, tp + tr), dtype=np.int64)
    rewards = np.zeros((b, tr))
    old = np.zeros((b, tr))
    for i, r in enumerate(rows):
        p, c = r["prompt_ids"], r["completion_ids"]
        prompts[i, tp - len(p):] = p  # left padding
        responses[i, : len(c)] = c
        attn[i, tp - len(p): tp] = 1
        attn[i, tp: tp + len(c)] = 1
        rewards[i, len(c) - 1] = r["reward"]  # outcome reward on the last token
        old[i, : len(c)] = r["old_per_token_logps"]
    recs = records_from_verl({"prompts": torch.tensor(prompts), "responses": torch.tensor(responses),
                              "attention_mask": torch.tensor(attn), "token_level_rewards": torch.tensor(rewards),
                              "old_log_probs": torch.tensor(old)})
    trl = records_from_trl(rows)
    for a, t in zip(recs, trl):
        assert a.prompt_ids == t.prompt_ids and a.completion_ids == t.completion_ids and a.reward == t.reward
        np.testing.assert_array_equal(a.old_logprobs, t.old_logprobs)
    collator = RLCollator(max_tokens=64)
    [x] = collator.batches(collator.samples(recs))
    [y] = collator(rows)
    assert torch.equal(x.adv_pos, y.adv_pos) and torch.equal(x.old_logprobs, y.old_logprobs)


def test_verl_response_mask_zeros_are_context_not_targets():
    recs = records_from_verl({
        "prompts": np.array([[0, 5, 6]]), "responses": np.array([[7, 8, 9, 1, 0]]),
        "attention_mask": np.array([[0, 1, 1, 1, 1, 1, 1, 0]]),
        "response_mask": np.array([[1, 0, 0, 1, 0]]),  # a tool output (8, 9) inside the response
        "advantages": np.array([[1.0, 1.0, 1.0, 1.0, 0.0]]),
    })
    [s] = RLCollator(max_tokens=16).samples(recs)
    assert s.tree.sequences() == [[5, 6, 7, 8, 9, 1]]
    assert s.tree.path(0).loss_mask.tolist() == [0, 0, 1, 0, 0, 1]


def test_collator_refusals():
    with pytest.raises(TreeInputError, match="max_tokens"):
        RLCollator(max_tokens=4)(_trl_records())
    rows = _trl_records()
    rows[1].pop("old_per_token_logps")
    with pytest.raises(TreeInputError, match="old_logprobs"):
        RLCollator(max_tokens=64)(rows)
    with pytest.raises(ValueError, match="valid"):
        RLCollator(max_tokens=64, loss_agg_mode="mean")


def test_trl_padded_records_keep_their_masks():
    """TRL's padded layout: prompt padding dropped, completion padding dropped, tool outputs
    inside a completion kept as context but not trained; per-token values cut to match."""
    rows = {
        "prompt_ids": torch.tensor([[0, 0, 5, 6], [0, 4, 5, 6]]),
        "prompt_mask": torch.tensor([[0, 0, 1, 1], [0, 1, 1, 1]]),
        "completion_ids": torch.tensor([[7, 8, 9, 0, 0], [7, 3, 0, 0, 0]]),
        "completion_mask": torch.tensor([[1, 1, 1, 0, 0], [1, 1, 0, 0, 0]]),
        "tool_mask": torch.tensor([[1, 0, 1, 1, 1], [1, 1, 1, 1, 1]]),
        "advantages": torch.tensor([0.5, -0.5]),
        "old_per_token_logps": torch.tensor([[-1.0, -2.0, -3.0, 0.0, 0.0], [-4.0, -5.0, 0.0, 0.0, 0.0]]),
    }
    before = {k: v.clone() for k, v in rows.items()}
    a, b = records_from_trl(rows)
    assert (a.prompt_ids, a.completion_ids, a.completion_mask) == ([5, 6], [7, 8, 9], [1, 0, 1])
    assert (b.prompt_ids, b.completion_ids, b.completion_mask) == ([4, 5, 6], [7, 3], [1, 1])
    assert a.advantages == 0.5 and b.old_logprobs.tolist() == [-4.0, -5.0]
    assert all(torch.equal(rows[k], before[k]) for k in rows)
    [s1, s2] = RLCollator(max_tokens=32).samples([a, b])
    assert s1.tree.sequences() == [[5, 6, 7, 8, 9]]  # no pad token is a path token, none is trained
    assert s1.tree.path(0).loss_mask.tolist() == [0, 0, 1, 0, 1]


def test_trl_records_refuse_misaligned_masks():
    with pytest.raises(TreeInputError, match="completion_mask has 2 values for 3"):
        records_from_trl([{"prompt_ids": [1], "completion_ids": [2, 3, 4], "completion_mask": [1, 1]}])
    with pytest.raises(TreeInputError, match="prompt is empty"):
        records_from_trl([{"prompt_ids": [0, 0], "prompt_mask": [0, 0], "completion_ids": [2]}])
    with pytest.raises(TreeInputError, match="needs prompt_ids and completion_ids, or prompt and completion"):
        records_from_trl([{"prompt_ids": [1]}])
