"""RL objectives on trees against the same objectives computed path by path.

The pure tests use prefix-hash logits (an exact float64 stand-in for a model): the tree
side gathers log-probs from one ``[S, V]`` logits table, the per-path side runs every path
alone. Values and gradients with respect to the logits are compared (per-path gradients
are summed onto the tree row that computes the same prefix).
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import forests
from testing import TOLERANCES, examples, hash_forward, tree_hash_logits

from treecompile import TrajectoryTree, gather_logprobs, pack
from treecompile.rl.losses import (
    LOSS_AGG_MODES,
    PolicyLossConfig,
    build_rl_batch,
    per_path_policy_loss,
    policy_loss,
)

VOCAB = 5
RTOL, ATOL = TOLERANCES[("float64", "pure")]
MAX_LEN = 16.0

CONFIGS = {
    "ppo-sym": PolicyLossConfig(eps_low=0.2, eps_high=0.2),
    "ppo-asym-dualclip-k3-entropy": PolicyLossConfig(eps_low=0.1, eps_high=0.28, clip_c=1.3, kl_coef=0.3,
                                                     kl_estimator="k3", entropy_coef=0.05),
    "ppo-k1": PolicyLossConfig(eps_low=0.2, eps_high=0.3, kl_coef=0.5, kl_estimator="k1"),
    "pg-k2-entropy": PolicyLossConfig(objective="pg", kl_coef=0.2, kl_estimator="k2", entropy_coef=0.1),
}


def _noise(key: tuple, scale: float) -> float:
    """A fixed pseudo-random number in [-scale, scale] for a key (a prefix, or (path, prefix))."""
    # The leading 0 is a salt, chosen so that FIXED hits every clip region (asserted below).
    digest = hashlib.blake2b(repr((0, *key)).encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "little") / 2**64 * 2 - 1) * scale


def _entropy_rows(logits: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(logits, dim=-1)
    return -(logp.exp() * logp).sum(-1)


def _per_path_logits(seqs, vocab=VOCAB):
    fwd = hash_forward(vocab)
    return [fwd(None, torch.tensor([s]))[0].clone().requires_grad_(True) for s in seqs]


def _path_terms(logits: torch.Tensor, seq: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``[T]`` log-probs and entropies of one path, by the usual label shift (0 at position 0)."""
    logp = torch.log_softmax(logits[:-1], dim=-1)
    ids = torch.tensor(seq[1:])
    lp = torch.cat([logits.new_zeros(1), logp.gather(-1, ids[:, None])[:, 0]])
    ent = torch.cat([logits.new_zeros(1), -(logp.exp() * logp).sum(-1)])
    return lp, ent


def _inputs(seqs, adv_spec, per_path_old_noise: bool):
    """Advantages, old and reference log-probs per path. Old/ref are the true log-probs plus
    noise keyed by the prefix, so paths agree on shared tokens unless ``per_path_old_noise``."""
    true = [_path_terms(lg.detach(), s)[0].numpy() for lg, s in zip(_per_path_logits(seqs), seqs)]
    olds, refs = [], []
    for p, (s, lp) in enumerate(zip(seqs, true)):
        o = np.array([lp[t] + _noise(("old", tuple(s[: t + 1])), 0.7) for t in range(len(s))])
        if per_path_old_noise:
            o += np.array([_noise(("path", p, t), 0.3) if t % 2 else 0.0 for t in range(len(s))])
        olds.append(o)
        refs.append(np.array([lp[t] + _noise(("ref", tuple(s[: t + 1])), 0.5) for t in range(len(s))]))
    advs = []
    for p, s in enumerate(seqs):
        kind, value = adv_spec[p % len(adv_spec)]
        if kind == "scalar":
            advs.append(value)
        else:
            advs.append(np.array([_noise(("adv", p, t), 2.0) for t in range(len(s))]))
    return advs, olds, refs


def _compare(trees, advs, olds, refs, config, mode, use_old=True, vocab=VOCAB):
    """Tree loss and logits gradient against the per-path computation; returns the tree RLBatch."""
    paths = [path for t in trees for path in t.paths()]
    seqs = [p.tokens.tolist() for p in paths]
    rl = build_rl_batch(trees, advantages=advs, old_logprobs=olds if use_old else None, ref_logprobs=refs,
                        loss_agg_mode=mode, max_len=MAX_LEN)
    batch = rl.batch
    logits = tree_hash_logits(batch, vocab).requires_grad_(True)
    lp = gather_logprobs(logits, batch)
    ent_rows = _entropy_rows(logits)
    ent = torch.where(batch.pred_index >= 0, ent_rows[batch.pred_index.clamp(min=0)], 0.0)
    out = policy_loss(lp, rl, config, entropy=ent)
    out.loss.backward()

    per_logits = _per_path_logits(seqs, vocab)
    terms = [_path_terms(lg, s) for lg, s in zip(per_logits, seqs)]
    ref_loss = per_path_policy_loss(
        [t[0] for t in terms], [p.loss_mask for p in paths], advantages=advs,
        old_logprobs=olds if use_old else None, ref_logprobs=refs, entropies=[t[1] for t in terms],
        weights=[p.weight for p in paths], config=config, loss_agg_mode=mode, max_len=MAX_LEN,
    )
    ref_loss.backward()
    torch.testing.assert_close(out.loss, ref_loss, rtol=RTOL, atol=ATOL)
    summed = torch.zeros_like(logits)
    for p, lg in enumerate(per_logits):
        if lg.grad is not None:  # None: a one-token path, nothing reads its logits
            summed.index_add_(0, batch.path_rows(p), lg.grad)
    err = (logits.grad - summed).abs()
    assert err.max().item() <= ATOL + RTOL * summed.abs().max().item(), (
        f"logits gradient differs at row {int(err.max(dim=1).values.argmax())}: max {err.max().item():.3e}"
    )
    return rl


adv_specs = st.lists(
    st.one_of(st.tuples(st.just("scalar"), st.sampled_from([-2.0, -0.5, 0.0, 0.75, 3.0])),
              st.tuples(st.just("tokens"), st.just(None))),
    min_size=1, max_size=4,
)


@pytest.mark.parametrize("mode", list(LOSS_AGG_MODES))
@pytest.mark.parametrize("cfg", list(CONFIGS))
@settings(max_examples=examples(8))
@given(forest=forests, adv_spec=adv_specs, variants=st.booleans())
def test_tree_objective_equals_per_path(mode, cfg, forest, adv_spec, variants):
    trees = [TrajectoryTree.from_sequences(s, weights=w, loss_masks=m) for s, w, m in forest]
    seqs = [path.tokens.tolist() for t in trees for path in t.paths()]
    advs, olds, refs = _inputs(seqs, adv_spec, per_path_old_noise=variants)
    _compare(trees, advs, olds, refs, CONFIGS[cfg], mode)


# A fixed tree with every awkward feature: a branch point, a 1-token node, internal endpoints
# (a path that is a prefix of another), duplicate paths and a second root.
FIXED = [
    [0, 1, 2, 3, 4, 1, 2],
    [0, 1, 2, 3, 4, 1, 2],  # duplicate
    [0, 1, 2, 3],  # ends inside the first
    [0, 1, 2, 3, 0, 4, 4, 3],
    [0, 1, 3, 2, 2, 1],
    [0, 1, 3],
    [2, 4, 1, 0, 3, 3],  # another root
]
FIXED_ADV = [("scalar", 3.0), ("scalar", -2.0), ("scalar", 0.75), ("tokens", None), ("scalar", -0.5),
             ("scalar", 0.0), ("tokens", None)]


@pytest.mark.parametrize("mode", list(LOSS_AGG_MODES))
@pytest.mark.parametrize("cfg", list(CONFIGS))
def test_fixed_tree_with_clipping_active_on_both_sides(mode, cfg):
    tree = TrajectoryTree.from_sequences(FIXED, weights=[1, 1, 0.5, 2, 1, 1, 1.5])
    advs, olds, refs = _inputs(FIXED, FIXED_ADV, per_path_old_noise=False)
    rl = _compare([tree], advs, olds, refs, CONFIGS[cfg], mode)
    assert rl.max_variants == 1
    # The test only means something if every clip region is hit on shared tokens.
    b = rl.batch
    lp = gather_logprobs(tree_hash_logits(b, VOCAB), b)
    r = torch.exp(lp - rl.old_logprobs[:, 0])
    shared = b.path_count >= 2
    assert ((r > 1.28) & (rl.adv_pos[:, 0] > 0) & shared).any(), "no upper clipping of a positive advantage"
    assert ((r < 0.8) & (rl.adv_neg[:, 0] > 0) & shared).any(), "no lower clipping of a negative advantage"
    assert ((r > 1.3) & (rl.adv_neg[:, 0] > 0) & shared).any(), "dual-clip never active"
    assert ((rl.adv_pos[:, 0] > 0) & (rl.adv_neg[:, 0] > 0)).any(), "no token with mixed-sign advantages"


def test_differing_old_logprobs_are_kept_per_path():
    """Old log-probs that differ between paths on a shared token get their own ratio."""
    tree = TrajectoryTree.from_sequences(FIXED)
    advs, olds, refs = _inputs(FIXED, FIXED_ADV, per_path_old_noise=True)
    rl = _compare([tree], advs, olds, refs, CONFIGS["ppo-asym-dualclip-k3-entropy"], "token-mean")
    assert rl.max_variants >= 3 and rl.meta["rows_with_variants"] > 0
    # Merging them (e.g. the mean) would change the loss: the difference is not dropped.
    mean_old = []
    rows = [rl.batch.path_rows(p) for p in range(len(FIXED))]
    table: dict[int, list[float]] = {}
    for p, rws in enumerate(rows):
        for t, j in enumerate(rws.tolist()):
            table.setdefault(j, []).append(olds[p][t])
    for p, rws in enumerate(rows):
        mean_old.append(np.array([np.mean(table[j]) for j in rws.tolist()]))
    merged = build_rl_batch(tree, advantages=advs, old_logprobs=mean_old)
    lp = gather_logprobs(tree_hash_logits(rl.batch, VOCAB), rl.batch)
    a = policy_loss(lp, rl, CONFIGS["ppo-sym"]).loss
    b = policy_loss(lp, merged, CONFIGS["ppo-sym"]).loss
    assert abs(a - b) > 1e-6


def test_on_policy_ratio_when_old_logprobs_are_absent():
    tree = TrajectoryTree.from_sequences(FIXED)
    advs, olds, refs = _inputs(FIXED, FIXED_ADV, per_path_old_noise=False)
    _compare([tree], advs, olds, refs, CONFIGS["ppo-asym-dualclip-k3-entropy"], "seq-mean-token-mean", use_old=False)


def test_on_policy_ppo_gradient_equals_policy_gradient():
    """With r = 1 the clipped surrogate's gradient is the plain policy gradient's."""
    tree = TrajectoryTree.from_sequences(FIXED)
    advs, _, _ = _inputs(FIXED, FIXED_ADV, per_path_old_noise=False)
    rl = build_rl_batch(tree, advantages=advs)
    grads = []
    for cfg in (PolicyLossConfig(), PolicyLossConfig(objective="pg")):
        logits = tree_hash_logits(rl.batch, VOCAB).requires_grad_(True)
        policy_loss(gather_logprobs(logits, rl.batch), rl, cfg).loss.backward()
        grads.append(logits.grad)
    torch.testing.assert_close(grads[0], grads[1], rtol=RTOL, atol=ATOL)


def test_misaligned_inputs_are_refused():
    from treecompile.core.errors import TreeInputError

    tree = TrajectoryTree.from_sequences([[1, 2, 3], [1, 2]])
    with pytest.raises(TreeInputError, match="2 paths"):
        build_rl_batch(tree, advantages=[1.0])
    with pytest.raises(TreeInputError, match="shape"):
        build_rl_batch(tree, advantages=[1.0, [1.0, 2.0, 3.0]])
    with pytest.raises(TreeInputError, match="some paths only"):
        build_rl_batch(tree, advantages=[1.0, 1.0], old_logprobs=[[0, 0, 0], None])
    with pytest.raises(ValueError, match="max_len"):
        build_rl_batch(tree, advantages=[1.0, 1.0], loss_agg_mode="seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="valid"):
        PolicyLossConfig(objective="dpo")
    with pytest.raises(ValueError, match="clip_c"):
        PolicyLossConfig(clip_c=0.5)
    rl = build_rl_batch(tree, advantages=[1.0, 1.0])
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss(torch.zeros(rl.batch.num_tokens), rl, PolicyLossConfig(kl_coef=0.1))


def test_packing_is_shared_with_pack():
    trees = [TrajectoryTree.from_sequences(FIXED[:3]), TrajectoryTree.from_sequences(FIXED[3:])]
    rl = build_rl_batch(trees, advantages=[1.0] * len(FIXED))
    assert torch.equal(rl.batch.input_ids, pack(trees).input_ids)
    # token-mean weights over all paths sum to 1, like pack's target_weight.
    assert rl.weight.sum().item() == pytest.approx(1.0, rel=1e-14)
