"""RL objectives on trees, exact on shared tokens.

Per-path RL training computes, for every path ``p`` and target token ``t`` of it,

    loss = sum_p c_p * sum_t m_pt * l(logp_pt; A_pt, old_pt, ref_pt)  [- entropy bonus],

with ``c_p`` the aggregation mode's per-path coefficient (`LOSS_AGG_MODES`), ``m_pt`` the
path's loss mask, ``A_pt`` its advantage (a scalar per path or one per token), ``old_pt``
the log-probability the rollout (behaviour) policy gave the token and ``ref_pt`` the
reference policy's. On a tree a shared token has *one* ``logp`` (its prefix is the same on
every path through it), but each path brings its own advantage. The per-token terms are
piecewise linear in the advantage with one piece per sign (see ``docs/rl.md``):

    A >= 0:  l_pg = -A * min(r, 1 + eps_high)
    A <  0:  l_pg = |A| * min(c, max(r, 1 - eps_low))        (c = dual-clip, inf if off)

with ``r = exp(logp - old)``. So the sum over the paths through a token is

    sum_p c_p m_p l_p = -min(r, 1 + eps_high) * Apos + min(c, max(r, 1 - eps_low)) * Aneg,

``Apos = sum c_p m_p max(A_p, 0)`` and ``Aneg = sum c_p m_p max(-A_p, 0)``: two per-row
aggregates computed once per batch on the data side (`build_rl_batch`), O(path tokens).
Paths through a token that carry different ``old`` (or ``ref``) log-probabilities (a
rollout engine's numerics can differ between requests) get different ratios: the
aggregates are kept per distinct ``(old, ref)`` pair, a ``[S, K]`` table, so nothing is
averaged away. K is 1 when the engine is consistent.

Everything here is exact in value and gradient: the tree loss is the same function of
each row's log-probability as the sum of the per-path losses.

Kept as one module (over 450 lines): the RL objective on trees and, beside it, the per-path
reference (`per_path_policy_loss`) it is tested against.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

import numpy as np
import torch

from treecompile.core.weights import MODES
from treecompile.core.batch import TreeBatch, pack
from treecompile.core.errors import TreeInputError, unknown_choice
from treecompile.kernels.dtypes import compute_dtype
from treecompile.core.loss import path_loss_coefficients
from treecompile.core.preorder import root_path_rows
from treecompile.core.tree import TrajectoryTree

__all__ = [
    "LOSS_AGG_MODES",
    "OBJECTIVES",
    "KL_ESTIMATORS",
    "PolicyLossConfig",
    "RLBatch",
    "PolicyLossOutput",
    "rl_path_coefficients",
    "build_rl_batch",
    "policy_loss",
    "per_token_policy_terms",
    "per_path_policy_loss",
]

LOSS_AGG_MODES: dict[str, str] = {m: MODES[m] for m in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                                                          "seq-mean-token-sum-norm")}
"""The loss aggregation modes (verl's ``loss_agg_mode``): rows of `treecompile.core.weights.MODES`.
``L`` is ``max_len``; verl's ``seq-mean-token-sum-norm`` divides the batch sum by ``L`` only: pass
``denominator=1`` for that."""

OBJECTIVES: dict[str, str] = {
    "ppo": "clipped surrogate (PPO/GRPO): asymmetric eps_low/eps_high and optional dual-clip c",
    "pg": "plain policy gradient: -A * logp (old log-probs unused)",
}

KL_ESTIMATORS: dict[str, str] = {
    "k1": "logp - ref",
    "k2": "(logp - ref)^2 / 2",
    "k3": "exp(ref - logp) - (ref - logp) - 1  (GRPO's unbiased, non-negative estimator)",
}


def _check_choice(kind: str, value: str, valid: dict) -> None:
    if value not in valid:
        raise ValueError(unknown_choice(kind, value, valid))


@dataclass(frozen=True)
class PolicyLossConfig:
    """What the policy loss computes.

    Attributes:
        objective: a key of `OBJECTIVES`.
        eps_low: lower clip range: the ratio is clipped below at ``1 - eps_low``.
        eps_high: upper clip range (DAPO's clip-higher uses a larger value than ``eps_low``).
        clip_c: dual-clip constant ``c > 1``, bounding the loss of negative-advantage tokens at
            ``|A| * c``; None disables it.
        kl_coef: weight of the KL penalty against the reference log-probs (0: off).
        kl_estimator: a key of `KL_ESTIMATORS`.
        entropy_coef: weight of the entropy bonus (subtracted from the loss; 0: off).
    """

    objective: str = "ppo"
    eps_low: float = 0.2
    eps_high: float = 0.2
    clip_c: float | None = None
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0

    def __post_init__(self) -> None:
        _check_choice("objective", self.objective, OBJECTIVES)
        _check_choice("kl_estimator", self.kl_estimator, KL_ESTIMATORS)
        if not (self.eps_low >= 0 and self.eps_high >= 0):
            raise ValueError(f"clip ranges must be >= 0, got eps_low={self.eps_low}, eps_high={self.eps_high}")
        if self.clip_c is not None and not self.clip_c > 1:
            raise ValueError(f"dual-clip constant clip_c must be > 1, got {self.clip_c}")


def rl_path_coefficients(
    n_targets: np.ndarray,
    weights: np.ndarray,
    mode: str,
    *,
    max_len: float | None = None,
    denominator: float | None = None,
    empty: np.ndarray | None = None,
) -> np.ndarray:
    """``[P]`` per-path coefficients ``c_p`` of an aggregation mode (see `LOSS_AGG_MODES`).

    Args:
        n_targets: ``[P]`` target tokens per path.
        weights: ``[P]`` path weights.
        mode: a key of `LOSS_AGG_MODES`.
        max_len: the constant ``L`` of ``seq-mean-token-sum-norm`` (required there).
        denominator: replaces ``N`` or ``P``.
        empty: ``[P]`` bool, the paths with no tokens (in no mean).
    """
    _check_choice("loss aggregation mode", mode, LOSS_AGG_MODES)
    if mode != "seq-mean-token-sum-norm":
        return path_loss_coefficients(n_targets, weights, mode, denominator, empty=empty)
    # Dr. GRPO: each path's token sum over a constant length L, then the mean over paths.
    if max_len is None or not max_len > 0:
        raise ValueError("seq-mean-token-sum-norm needs max_len, the constant length L to divide by (> 0)")
    per_path_sum = path_loss_coefficients(n_targets, weights, "seq-mean-token-sum", denominator, empty=empty)
    return per_path_sum / float(max_len)


@dataclass
class RLBatch:
    """A `TreeBatch` with the per-row RL aggregates of one batch.

    Row ``j`` has K variant slots; slot ``k`` stands for the paths through ``j`` that share
    one ``(old, ref)`` log-prob pair (unused slots have zero weights). Sums run over those
    paths ``p`` with the token as a target (``m_pj = 1``).

    Attributes:
        batch: the packed trees.
        adv_pos: ``[S, K]`` float64 ``sum c_p max(A_pj, 0)``.
        adv_neg: ``[S, K]`` float64 ``sum c_p max(-A_pj, 0)``.
        weight: ``[S, K]`` float64 ``sum c_p``.
        old_logprobs: ``[S, K]`` float64 behaviour log-probs, or None: on-policy (the ratio
            is ``exp(logp - logp.detach())``, 1 with the policy gradient).
        ref_logprobs: ``[S, K]`` float64 reference log-probs, or None (no KL term possible).
        path_coef: ``[P]`` float64 the mode's ``c_p``.
        loss_agg_mode: the aggregation mode.
        max_variants: K.
    """

    batch: TreeBatch
    adv_pos: torch.Tensor
    adv_neg: torch.Tensor
    weight: torch.Tensor
    old_logprobs: torch.Tensor | None
    ref_logprobs: torch.Tensor | None
    path_coef: torch.Tensor
    loss_agg_mode: str
    max_variants: int = 1
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def entropy_weight(self) -> torch.Tensor:
        """``[S]`` ``sum_p c_p m_pj`` over every path through row ``j``."""
        return self.weight.sum(dim=1)

    def to(self, device: torch.device | str) -> RLBatch:
        """A copy with every tensor on ``device``."""
        moved = {}
        for f in fields(self):
            v = getattr(self, f.name)
            moved[f.name] = v.to(device) if isinstance(v, (torch.Tensor, TreeBatch)) else v
        return replace(self, **moved)


def _per_path(values: Any, name: str, n_paths: int) -> list[Any]:
    if values is None:
        return [None] * n_paths
    values = list(values)
    if len(values) != n_paths:
        raise TreeInputError(f"{name} has {len(values)} entries for {n_paths} paths (one per path, in batch order)")
    return values


def _token_values(v: Any, name: str, p: int, length: int, scalar_ok: bool) -> np.ndarray:
    arr = np.asarray(v.detach().cpu() if isinstance(v, torch.Tensor) else v, dtype=np.float64)
    if arr.ndim == 0:
        if not scalar_ok:
            raise TreeInputError(f"{name}[{p}] is a scalar; expected one value per token ({length})")
        arr = np.full(length, float(arr))
    if arr.shape != (length,):
        raise TreeInputError(f"{name}[{p}] has shape {arr.shape}; path {p} has {length} tokens (align with the path)")
    return arr


def _target_entries(batch: TreeBatch, paths: list, targets: list[np.ndarray], coef: np.ndarray, adv: list,
                    old: list | None, ref: list | None) -> dict[str, np.ndarray]:
    """One entry per (path, target token): its row, its old and reference log-probs (0 when not
    given), ``c_p * max(A, 0)``, ``c_p * max(-A, 0)`` and ``c_p``; non-finite values refused."""
    rows_l, old_l, ref_l, apos_l, aneg_l, c_l = [], [], [], [], [], []
    node_start, node_end = batch.node_start.cpu().numpy(), batch.node_end.cpu().numpy()
    node_parent = batch.node_parent.cpu().numpy()
    for p, path in enumerate(paths):
        length = len(path.tokens)
        rows = root_path_rows(node_start, node_end, node_parent, int(batch.path_node[p]))
        t = targets[p]
        a = _token_values(adv[p], "advantages", p, length, scalar_ok=True)[t]
        rows_l.append(rows[t])
        apos_l.append(coef[p] * np.maximum(a, 0.0))
        aneg_l.append(coef[p] * np.maximum(-a, 0.0))
        c_l.append(np.full(len(t), coef[p]))
        old_l.append(_token_values(old[p], "old_logprobs", p, length, False)[t] if old else np.zeros(len(t)))
        ref_l.append(_token_values(ref[p], "ref_logprobs", p, length, False)[t] if ref else np.zeros(len(t)))
    e = dict(rows=np.concatenate(rows_l).astype(np.int64), old=np.concatenate(old_l), ref=np.concatenate(ref_l),
             apos=np.concatenate(apos_l), aneg=np.concatenate(aneg_l), coef=np.concatenate(c_l))
    for name, arr in (("advantages", e["apos"] - e["aneg"]), ("old_logprobs", e["old"]), ("ref_logprobs", e["ref"])):
        bad = np.flatnonzero(~np.isfinite(arr))
        if bad.size:
            raise TreeInputError(f"{name}: non-finite value {arr[bad[0]]} at a target token (row {e['rows'][bad[0]]})")
    return e


def _row_tables(e: dict[str, np.ndarray], s: int) -> tuple[dict[str, np.ndarray], int, int]:
    """``(tables, K, rows with variants)``: the entries grouped by (row, old, ref), exact float
    equality (so a difference is never merged), each group in a slot of its row: ``[S, K]``
    sums of ``apos``, ``aneg`` and ``coef`` per group, and each group's old and ref values."""
    rows, olds, refs = e["rows"], e["old"], e["ref"]
    order = np.lexsort((refs, olds, rows))
    r_s, o_s, f_s = rows[order], olds[order], refs[order]
    new_group = np.ones(len(order), dtype=bool)
    new_group[1:] = (r_s[1:] != r_s[:-1]) | (o_s[1:] != o_s[:-1]) | (f_s[1:] != f_s[:-1])
    group = np.cumsum(new_group) - 1
    g_row = r_s[new_group]
    g_first = np.flatnonzero(new_group)
    # Slot of each group within its row: its rank among the row's groups.
    row_first_group = np.searchsorted(g_row, g_row, side="left")
    slot = np.arange(len(g_row)) - row_first_group
    k = int(slot.max()) + 1 if len(slot) else 1
    n_groups = len(g_row)

    def table(values: np.ndarray) -> np.ndarray:
        out = np.zeros((s, k), dtype=np.float64)
        if n_groups:
            per_group = np.zeros(n_groups)
            np.add.at(per_group, group, values[order])
            out[g_row, slot] = per_group
        return out

    def key_table(values: np.ndarray) -> np.ndarray:
        out = np.zeros((s, k), dtype=np.float64)
        if n_groups:
            out[g_row, slot] = values[order][g_first]
        return out

    tables = dict(adv_pos=table(e["apos"]), adv_neg=table(e["aneg"]), weight=table(e["coef"]), old=key_table(olds),
                  ref=key_table(refs))
    return tables, k, int(np.unique(g_row[slot > 0]).size) if n_groups else 0


def build_rl_batch(
    trees: TrajectoryTree | Sequence[TrajectoryTree],
    *,
    advantages: Sequence[Any],
    old_logprobs: Sequence[Any] | None = None,
    ref_logprobs: Sequence[Any] | None = None,
    loss_agg_mode: str = "token-mean",
    max_len: float | None = None,
    denominator: float | None = None,
    batch: TreeBatch | None = None,
    device: torch.device | str | None = None,
) -> RLBatch:
    """Packs trees and computes the per-row aggregates of the RL loss, O(path tokens).

    Paths are numbered as `treecompile.pack` numbers them: tree by tree, each tree's paths in
    order. Per-token values are aligned with the whole path (prompt included); entries at
    positions that are not targets are ignored.

    Args:
        trees: the trees (their loss masks pick the targets, their weights scale ``c_p``).
        advantages: per path, a scalar or ``[T_p]`` per-token advantages.
        old_logprobs: per path ``[T_p]`` behaviour log-probs, or None for on-policy.
        ref_logprobs: per path ``[T_p]`` reference log-probs, or None.
        loss_agg_mode: a key of `LOSS_AGG_MODES`.
        max_len: ``L`` for ``seq-mean-token-sum-norm``.
        denominator: replaces ``N`` or ``P`` (global normalisation).
        batch: an existing ``pack(trees)`` to reuse (must be of these trees).
        device: where to put the tensors.

    Returns:
        The `RLBatch`.

    Raises:
        TreeInputError: misaligned or non-finite inputs; old log-probs given for some paths only.
    """
    if isinstance(trees, TrajectoryTree):
        trees = [trees]
    trees = list(trees)
    if batch is None:
        batch = pack(trees, device=device)
    paths = [path for t in trees for path in t.paths()]
    n_paths = len(paths)
    if batch.num_paths != n_paths:
        raise TreeInputError(f"batch has {batch.num_paths} paths but the trees have {n_paths}")
    adv = _per_path(advantages, "advantages", n_paths)
    old = _per_path(old_logprobs, "old_logprobs", n_paths)
    ref = _per_path(ref_logprobs, "ref_logprobs", n_paths)
    for name, vals in (("old_logprobs", old), ("ref_logprobs", ref)):
        given = [v is not None for v in vals]
        if any(given) and not all(given):
            raise TreeInputError(f"{name} is given for some paths only (path {given.index(False)} has none)")
    has_old, has_ref = old[0] is not None, ref[0] is not None

    targets = []
    for p, path in enumerate(paths):
        m = path.loss_mask.copy()
        m[:1] = False
        targets.append(np.flatnonzero(m))
    counts = np.array([len(t) for t in targets], dtype=np.float64)
    weights = np.array([path.weight for path in paths], dtype=np.float64)
    empty = np.array([len(path.tokens) == 0 for path in paths], dtype=bool)
    coef = rl_path_coefficients(counts, weights, loss_agg_mode, max_len=max_len, denominator=denominator,
                                empty=empty)

    e = _target_entries(batch, paths, targets, coef, adv, old if has_old else None, ref if has_ref else None)
    tables, k, variant_rows = _row_tables(e, batch.num_tokens)

    def t(x: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(x).to(device=batch.device)

    return RLBatch(
        batch=batch,
        adv_pos=t(tables["adv_pos"]),
        adv_neg=t(tables["adv_neg"]),
        weight=t(tables["weight"]),
        old_logprobs=t(tables["old"]) if has_old else None,
        ref_logprobs=t(tables["ref"]) if has_ref else None,
        path_coef=t(coef.copy()),
        loss_agg_mode=loss_agg_mode,
        max_variants=k,
        meta={"rows_with_variants": variant_rows},
    )


@dataclass
class PolicyLossOutput:
    """The loss and its parts (each already aggregated; ``loss = pg + kl - entropy``).

    Attributes:
        loss: scalar, differentiable.
        pg_loss: the policy-gradient (surrogate) part.
        kl_loss: ``kl_coef`` times the aggregated KL estimate (0 when off).
        entropy_bonus: ``entropy_coef`` times the aggregated entropy (0 when off).
    """

    loss: torch.Tensor
    pg_loss: torch.Tensor
    kl_loss: torch.Tensor
    entropy_bonus: torch.Tensor


def _kl(logp: torch.Tensor, ref: torch.Tensor, estimator: str) -> torch.Tensor:
    d = logp - ref
    if estimator == "k1":
        return d
    if estimator == "k2":
        return 0.5 * d * d
    return torch.exp(-d) + d - 1.0


def policy_loss(
    logprobs: torch.Tensor,
    rl: RLBatch,
    config: PolicyLossConfig = PolicyLossConfig(),
    *,
    entropy: torch.Tensor | None = None,
) -> PolicyLossOutput:
    """The RL loss of a tree batch, equal to the per-path loss (`per_path_policy_loss`).

    A few elementwise ops on ``[S, K]``: no per-path copy of any row.

    Args:
        logprobs: ``[S]`` log-probability of each row's token (``compiled(batch).logprobs``).
        rl: from `build_rl_batch`.
        config: the objective.
        entropy: ``[S]`` entropy of the distribution predicting each row's token (needed when
            ``entropy_coef != 0``; see ``tree_compile(model, outputs=("entropy",))``).

    Returns:
        `PolicyLossOutput`.
    """
    if logprobs.shape != (rl.batch.num_tokens,):
        raise ValueError(f"logprobs has shape {tuple(logprobs.shape)}, expected ({rl.batch.num_tokens},)")
    dtype = compute_dtype(logprobs.dtype)
    lp = logprobs.to(dtype)[:, None]
    apos, aneg, w = (x.to(dtype) for x in (rl.adv_pos, rl.adv_neg, rl.weight))
    if config.objective == "pg":
        pg = -(lp * (apos - aneg)).sum()
    else:
        old = lp.detach() if rl.old_logprobs is None else rl.old_logprobs.to(dtype)
        ratio = torch.exp(lp - old)
        # A >= 0 paths: -A * min(r, 1 + eps_high). A < 0 paths: |A| * min(c, max(r, 1 - eps_low)).
        up = torch.clamp(ratio, max=1.0 + config.eps_high)
        down = torch.clamp(ratio, min=1.0 - config.eps_low)
        if config.clip_c is not None:
            down = torch.clamp(down, max=config.clip_c)
        pg = (-up * apos + down * aneg).sum()
    zero = pg.new_zeros(())
    kl = zero
    if config.kl_coef:
        if rl.ref_logprobs is None:
            raise ValueError("kl_coef is set but the RLBatch has no ref_logprobs (pass them to build_rl_batch)")
        kl = config.kl_coef * (_kl(lp, rl.ref_logprobs.to(dtype), config.kl_estimator) * w).sum()
    ent = zero
    if config.entropy_coef:
        if entropy is None:
            raise ValueError("entropy_coef is set but no entropy was passed (tree_compile(model, outputs=('entropy',)) gives it)")
        ent = config.entropy_coef * (entropy.to(dtype) * rl.entropy_weight.to(dtype)).sum()
    return PolicyLossOutput(loss=pg + kl - ent, pg_loss=pg, kl_loss=kl, entropy_bonus=ent)


# --------------------------------------------------------------------------- per-path reference


def per_token_policy_terms(
    logp: torch.Tensor,
    advantages: torch.Tensor,
    old: torch.Tensor | None,
    ref: torch.Tensor | None,
    config: PolicyLossConfig,
    entropy: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[T]`` one path's per-token loss, written the way verl/TRL write it (the reference).

    ``max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))``, then for ``A < 0`` with dual-clip
    ``min(that, -A c)``; plus ``kl_coef * kl`` minus ``entropy_coef * entropy``.
    """
    if config.objective == "pg":
        pg = -advantages * logp
    else:
        old = logp.detach() if old is None else old
        ratio = torch.exp(logp - old)
        l1 = -advantages * ratio
        l2 = -advantages * torch.clamp(ratio, 1.0 - config.eps_low, 1.0 + config.eps_high)
        pg = torch.maximum(l1, l2)
        if config.clip_c is not None:
            pg = torch.where(advantages < 0, torch.minimum(pg, -advantages * config.clip_c), pg)
    out = pg
    if config.kl_coef:
        out = out + config.kl_coef * _kl(logp, ref, config.kl_estimator)
    if config.entropy_coef:
        out = out - config.entropy_coef * entropy
    return out


def per_path_policy_loss(
    logprobs: Sequence[torch.Tensor],
    loss_masks: Sequence[Any],
    *,
    advantages: Sequence[Any],
    old_logprobs: Sequence[Any] | None = None,
    ref_logprobs: Sequence[Any] | None = None,
    entropies: Sequence[torch.Tensor] | None = None,
    weights: Sequence[float] | None = None,
    config: PolicyLossConfig = PolicyLossConfig(),
    loss_agg_mode: str = "token-mean",
    max_len: float | None = None,
    denominator: float | None = None,
) -> torch.Tensor:
    """The RL loss computed path by path, straight from the aggregation mode's definition.

    The ground truth for `policy_loss`: it shares no aggregation code with the tree side.
    ``logprobs[p]`` is path ``p``'s ``[T_p]`` log-probs from running it alone (e.g.
    `treecompile.core.reference.path_logprobs`); position 0 is never a target.
    """
    _check_choice("loss aggregation mode", loss_agg_mode, LOSS_AGG_MODES)
    w = [1.0] * len(logprobs) if weights is None else [float(x) for x in weights]
    n_paths = sum(1 for lp in logprobs if lp.shape[0])  # a path with no tokens enters no mean
    sums, counts = [], []
    for p, lp in enumerate(logprobs):
        t_p = lp.shape[0]
        if not t_p:
            continue
        m = torch.as_tensor(np.asarray(loss_masks[p], dtype=bool) if loss_masks[p] is not None
                            else np.ones(t_p, dtype=bool)).clone()
        m[0] = False

        def per_token(v):
            if v is None:
                return None
            return torch.as_tensor(np.asarray(v.detach().cpu() if torch.is_tensor(v) else v, dtype=np.float64)
                                   ).to(lp.dtype).expand(t_p)

        terms = per_token_policy_terms(
            lp, per_token(advantages[p]), per_token(None if old_logprobs is None else old_logprobs[p]),
            per_token(None if ref_logprobs is None else ref_logprobs[p]), config,
            None if entropies is None else entropies[p],
        )
        sums.append(w[p] * (terms * m.to(lp.dtype)).sum())
        counts.append(int(m.sum()))
    if loss_agg_mode == "token-mean":
        d = float(sum(counts)) if denominator is None else float(denominator)
        return sum(sums) / d if d > 0 else 0.0 * sums[0]  # no targets: zero, as in treecompile.core.loss
    d = float(n_paths) if denominator is None else float(denominator)
    if loss_agg_mode == "seq-mean-token-sum":
        return sum(sums) / d
    if loss_agg_mode == "seq-mean-token-sum-norm":
        return sum(sums) / (d * float(max_len))
    return sum(s / c for s, c in zip(sums, counts) if c > 0) / d + 0.0 * sums[0]
