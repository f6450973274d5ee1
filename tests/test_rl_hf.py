"""RL objectives and log-prob extraction through tree_compile on a tiny HF model, float64,
against the unmodified model run on each path alone."""

from __future__ import annotations

import pytest
import torch
from test_rl_objectives import CONFIGS, _noise
from testing import TOLERANCES, assert_grads_close, param_grads, perturbed_hf_model

from treecompile import TrajectoryTree
from treecompile.compile.wrapper import tree_compile
from treecompile.compile.extract import logprobs
from treecompile.core.reference import model_logits
from treecompile.rl.losses import LOSS_AGG_MODES, build_rl_batch, per_path_policy_loss, policy_loss

transformers = pytest.importorskip("transformers")
RTOL, ATOL = TOLERANCES[("float64", "hf")]

# Branch points, a 1-token node, a path ending inside another, duplicates, a second root.
SEQS = [
    [5, 9, 17, 3, 40, 41, 7],
    [5, 9, 17, 3, 40, 41, 7],
    [5, 9, 17, 3],
    [5, 9, 17, 3, 22, 8, 8, 60],
    [5, 9, 30, 2, 2, 11],
    [5, 9, 30],
    [12, 50, 1, 0, 33, 33],
]
MASKS = [[0, 0, 1, 1, 1, 1, 1], None, [0, 1, 1, 1], [0, 0, 0, 1, 1, 1, 1, 1], None, [0, 0, 1], [0, 1, 1, 1, 1, 1]]
ADVS = [2.5, -1.5, 0.5, "tokens", -0.75, 0.0, "tokens"]


@pytest.fixture(scope="module")
def model_and_compiled():
    cfg = transformers.Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    model = perturbed_hf_model(cfg)
    return model, tree_compile(model, outputs=("entropy",), backend="eager")


def _path_terms(model, seq):
    logits = model_logits(model, torch.tensor([seq]))[0]
    logp = torch.log_softmax(logits[:-1], dim=-1)
    lp = torch.cat([logits.new_zeros(1), logp.gather(-1, torch.tensor(seq[1:])[:, None])[:, 0]])
    ent = torch.cat([logits.new_zeros(1), -(logp.exp() * logp).sum(-1)])
    return lp, ent


def test_logprobs_equal_each_path_alone(model_and_compiled):
    model, compiled = model_and_compiled
    tree = TrajectoryTree.from_sequences(SEQS)
    out = logprobs(compiled, [tree, TrajectoryTree.from_sequences([[1, 2]])])
    assert len(out.per_path) == len(SEQS) + 1
    worst = 0.0
    with torch.no_grad():
        for p, seq in enumerate(SEQS + [[1, 2]]):
            lp, ent = _path_terms(model, seq)
            torch.testing.assert_close(out.per_path[p], lp, rtol=RTOL, atol=ATOL, msg=f"log-probs of path {p}")
            torch.testing.assert_close(out.entropy_per_path[p], ent, rtol=RTOL, atol=ATOL, msg=f"entropy of path {p}")
            worst = max(worst, (out.per_path[p] - lp).abs().max().item())
    assert not out.row_logprobs.requires_grad


@pytest.mark.parametrize("cfg", ["ppo-asym-dualclip-k3-entropy", "pg-k2-entropy"])
@pytest.mark.parametrize("mode", list(LOSS_AGG_MODES))
def test_policy_loss_and_grads_equal_per_path(model_and_compiled, cfg, mode):
    model, compiled = model_and_compiled
    config = CONFIGS[cfg]
    tree = TrajectoryTree.from_sequences(SEQS, loss_masks=MASKS)
    old = logprobs(compiled, tree)  # the "rollout engine", with noise keyed by prefix and per path
    olds, refs, advs = [], [], []
    for p, seq in enumerate(SEQS):
        base = old.per_path[p]
        jitter = [(_noise(("path", p, t), 0.2) if p == 1 and t == 5 else 0.0) for t in range(len(seq))]
        olds.append(base + torch.tensor([_noise(("old", tuple(seq[: t + 1])), 0.6) + jitter[t]
                                         for t in range(len(seq))], dtype=torch.float64))
        refs.append(base + torch.tensor([_noise(("ref", tuple(seq[: t + 1])), 0.4) for t in range(len(seq))],
                                        dtype=torch.float64))
        advs.append([_noise(("adv", p, t), 2.0) for t in range(len(seq))] if ADVS[p] == "tokens" else ADVS[p])
    rl = build_rl_batch(tree, advantages=advs, old_logprobs=olds, ref_logprobs=refs, loss_agg_mode=mode,
                        max_len=12)
    assert rl.max_variants == 2  # path 1 disagrees with path 0 on one shared token

    model.zero_grad()
    out = compiled(rl.batch)
    tree_loss = policy_loss(out.logprobs, rl, config, entropy=out.entropy).loss
    tree_loss.backward()
    tree_grads = param_grads(model)

    model.zero_grad()
    terms = [_path_terms(model, s) for s in SEQS]
    paths = tree.paths()
    ref_loss = per_path_policy_loss(
        [t[0] for t in terms], [p.loss_mask for p in paths], advantages=advs, old_logprobs=olds,
        ref_logprobs=refs, entropies=[t[1] for t in terms], config=config, loss_agg_mode=mode, max_len=12,
    )
    ref_loss.backward()
    torch.testing.assert_close(tree_loss, ref_loss, rtol=RTOL, atol=ATOL)
    assert_grads_close(tree_grads, param_grads(model), ("float64", "hf"))
