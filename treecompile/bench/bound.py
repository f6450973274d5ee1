"""The speed-up a tree can reach over per-path training, counting attention by its pairs.

``1 / (1 - POR)`` counts tokens: it is the bound for work done once per token (the matmuls,
norms, the head). Causal attention does work per (query, key) pair, and a suffix token still
attends to its whole prefix, so the tree saves less of it: per path ``T (T + 1) / 2`` pairs,
on the tree one pair per row and ancestor (``position + 1`` for each row). With ``a`` the share
of the per-path step spent in attention (from a profile of the baseline's own step), the tree's
step costs at best

    (1 - a) * tree_tokens / path_tokens + a * tree_pairs / path_pairs

of the per-path step: the pair-aware bound is its inverse.

A profile splits one step; other steps have other lengths. `AttentionCost` keeps the profile's
split as a cost per token and per pair, so that the split of any step is estimated from its
own token and pair counts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["Work", "AttentionCost", "work_of", "pair_bound", "pair_bounds"]

#: Profile categories that are attention (`treecompile.bench.profile_cuda.CATEGORIES`).
ATTENTION = ("attention forward", "attention backward")


@dataclass(frozen=True)
class Work:
    """Token and pair counts of one step's trees, per path and on the tree.

    Attributes:
        path_tokens, tree_tokens: tokens over all paths, and rows of the tree.
        path_pairs, tree_pairs: causal (query, key) pairs over all paths, and on the tree
            (each row with itself and its ancestors).
    """

    path_tokens: int
    tree_tokens: int
    path_pairs: int
    tree_pairs: int

    @property
    def token_bound(self) -> float:
        """``1 / (1 - POR)``."""
        return self.path_tokens / self.tree_tokens

    @property
    def pair_ratio(self) -> float:
        return self.path_pairs / self.tree_pairs


def work_of(trees: list) -> Work:
    """`Work` of a list of `treecompile.TrajectoryTree` (paths with their duplicates: each is
    trained on its own per path)."""
    from treecompile.core.batch import pack

    path_tokens = path_pairs = 0
    for tree in trees:
        for p in tree.paths():
            n = len(p.tokens)
            path_tokens += n
            path_pairs += n * (n + 1) // 2
    positions = pack(trees, warn_por=False).position_ids  # each row's depth on its path
    return Work(path_tokens, int(positions.numel()), path_pairs, int((positions + 1).sum()))


def pair_bound(work: Work, attention_share: float) -> float:
    """The pair-aware bound of ``work`` for a baseline step that spends ``attention_share`` of
    its time in attention."""
    if not 0.0 <= attention_share <= 1.0:
        raise ValueError(f"attention_share must be in [0, 1], got {attention_share}")
    cost = (1.0 - attention_share) / work.token_bound + attention_share / work.pair_ratio
    return 1.0 / cost


@dataclass(frozen=True)
class AttentionCost:
    """A baseline's cost per token (all but attention) and per pair (attention), from one
    profiled step.

    Attributes:
        per_token_ms: the step's non-attention time over its path tokens.
        per_pair_ms: its attention time over its path pairs.
    """

    per_token_ms: float
    per_pair_ms: float

    @classmethod
    def from_profile(cls, categories_ms: dict[str, float], work: Work) -> AttentionCost:
        """From a profile's time per category (`treecompile.bench.profile_cuda.profile_training_step`'s
        ``categories_ms``) of a baseline step on ``work``'s paths."""
        attention = sum(categories_ms.get(c, 0.0) for c in ATTENTION)
        rest = sum(categories_ms.values()) - attention
        return cls(rest / work.path_tokens, attention / work.path_pairs)

    def share(self, work: Work) -> float:
        """The attention share of the baseline's step on ``work``."""
        attention = self.per_pair_ms * work.path_pairs
        total = attention + self.per_token_ms * work.path_tokens
        return attention / total if total > 0 else 0.0

    def bound(self, work: Work) -> float:
        return pair_bound(work, self.share(work))

    def as_dict(self) -> dict[str, Any]:
        return {"per_token_ms": self.per_token_ms, "per_pair_ms": self.per_pair_ms}


def pair_bounds(works: list[Work], profiles: dict[str, dict], order: tuple[str, ...]) -> list[float | None]:
    """The pair-aware bound of each of ``works`` from the first method of ``order`` whose profile
    (``profiles[method]["categories_ms"]``) was taken on ``works[0]``'s paths; Nones without one."""
    profile = next((profiles[m] for m in order if "categories_ms" in profiles.get(m, {})), None)
    if profile is None or not works:
        return [None] * len(works)
    cost = AttentionCost.from_profile(profile["categories_ms"], works[0])
    return [cost.bound(w) for w in works]
