"""The exact tree loss: per-path loss modes turned into per-token weights.

Every supported loss mode is a weighted sum over paths and their target tokens,

    L = sum_p  c_p * sum_t  m_pt * (-log p(x_pt | x_p,<t)),

with a per-path coefficient ``c_p`` (the path weight times the mode's
normalization) and the path's loss mask ``m_pt``. A token shared by several paths
has the same log-probability on each of them (its prefix is the same), so the sum
can be regrouped per distinct token:

    L = sum_tokens  W_t * (-log p(x_t | prefix)),   W_t = sum_{p through t} c_p * m_pt.

That is the whole trick: ``W_t`` is ``target_weight`` in a `treecompile.TreeBatch`.
When all paths through a node agree on its mask, ``W_t = m_t * C_node`` with ``C_node``
the sum of ``c_p`` over the paths through the node, a subtree sum computed in one
bottom-up sweep, O(nodes). Paths whose mask differs on a node add a sparse
correction for that node only.

The first token of a path has no predecessor and is never a target.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from treecompile.core.errors import TreeInputError, unknown_choice
from treecompile.core.preorder import at_path_ends, root_path_sum, subtree_sum

if TYPE_CHECKING:
    from treecompile.core.tree import TrajectoryTree

__all__ = ["MODES", "LOSS_MODES", "path_loss_coefficients", "path_target_counts", "tree_target_weights"]

#: Every way a batch's per-path losses are combined, as its per-path coefficient ``c_p``:
#: ``w_p`` is the path weight, ``n_p`` its number of target tokens, ``P`` the number of paths,
#: ``N`` the total number of target tokens over all paths and ``L`` a constant length. A
#: ``denominator`` replaces ``N`` (token-mean) or ``P`` (seq-mean modes): a global count across
#: micro-batches and ranks. The one table: `LOSS_MODES` (what ``pack(loss_mode=...)`` builds
#: from the tree alone) and `treecompile.rl.losses.LOSS_AGG_MODES` (verl's ``loss_agg_mode``)
#: are its rows.
MODES: dict[str, str] = {
    "token-mean": "c_p = w_p / N: the mean over every target token of every path",
    "seq-mean-token-mean": "c_p = w_p / (P * n_p): each path's token mean, then the mean over paths",
    "seq-mean-token-sum": "c_p = w_p / P: each path's token sum, then the mean over paths",
    "sum": "c_p = w_p: the plain sum over paths and their target tokens",
    "seq-mean-token-sum-norm": "c_p = w_p / (P * L): each path's sum over a constant length L (Dr. GRPO)",
}

LOSS_MODES: dict[str, str] = {m: MODES[m] for m in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "sum")}
"""The loss modes ``pack`` and `tree_compile` take (rows of :data:`MODES`)."""


def _check_mode(mode: str) -> None:
    if mode not in LOSS_MODES:
        raise ValueError(unknown_choice("loss mode", mode, LOSS_MODES, "modes"))


def path_loss_coefficients(
    n_targets: np.ndarray, weights: np.ndarray, mode: str, denominator: float | None = None,
    *, empty: np.ndarray | None = None,
) -> np.ndarray:
    """Per-path coefficients ``c_p`` of a loss mode (see `LOSS_MODES`).

    Args:
        n_targets: ``[P]`` target tokens per path (mask ones, position 0 excluded).
        weights: ``[P]`` path weights.
        mode: a key of `LOSS_MODES`.
        denominator: overrides ``N`` (token-mean) or ``P`` (seq-mean modes), or divides
            the ``sum`` mode; use it to normalise globally across micro-batches or ranks.
        empty: ``[P]`` bool, the paths with no tokens (empty sequences): coefficient 0, and
            not counted in ``P``.

    Returns:
        ``[P]`` float64 coefficients. A batch with no target tokens gets zeros.
    """
    _check_mode(mode)
    n = np.asarray(n_targets, dtype=np.float64)
    w = np.asarray(weights, dtype=np.float64)
    if denominator is not None and not (np.isfinite(denominator) and denominator > 0):
        raise TreeInputError(f"denominator must be a positive finite number, got {denominator!r}")
    if empty is not None:
        empty = np.asarray(empty, dtype=bool)
        w = np.where(empty, 0.0, w)
    if mode == "token-mean":
        d = float(n.sum()) if denominator is None else float(denominator)
        return w / d if d > 0 else np.zeros_like(w)
    if mode == "sum":
        return w / (1.0 if denominator is None else float(denominator))
    paths = len(w) - (0 if empty is None else int(empty.sum()))
    d = float(paths) if denominator is None else float(denominator)
    if d <= 0:  # every path is empty: nothing to train
        return np.zeros_like(w)
    if mode == "seq-mean-token-sum":
        return w / d
    # seq-mean-token-mean: a path without targets contributes nothing (and counts in P,
    # unless it has no tokens at all).
    return np.where(n > 0, w / (d * np.maximum(n, 1.0)), 0.0)


def _effective_masks(tree: TrajectoryTree) -> tuple[np.ndarray, dict[tuple[int, int], np.ndarray]]:
    """The tree's masks with each root's first token cleared (it is never a target)."""
    roots = np.flatnonzero(tree.parent < 0)
    node_mask = tree.node_mask.copy()
    node_mask[tree.node_offsets[roots]] = False
    exceptions = {}
    for (p, v), m in tree.mask_exceptions.items():
        if tree.parent[v] < 0:
            m = m.copy()
            m[0] = False
        exceptions[(p, v)] = m
    return node_mask, exceptions


def path_target_counts(tree: TrajectoryTree) -> np.ndarray:
    """``[P]`` number of target tokens of each path, in O(nodes + exceptions)."""
    node_mask, exceptions = _effective_masks(tree)
    per_node = (np.add.reduceat(node_mask.astype(np.int64), tree.node_offsets[:-1]) if tree.num_nodes
                else np.zeros(0, dtype=np.int64))
    counts = at_path_ends(root_path_sum(tree.parent, per_node), tree.path_node)
    for (p, v), m in exceptions.items():
        a, b = tree.node_offsets[v], tree.node_offsets[v + 1]
        counts[p] += int(m.sum()) - int(node_mask[a:b].sum())
    return counts


def tree_target_weights(tree: TrajectoryTree, coef: np.ndarray) -> np.ndarray:
    """``[tree_tokens]`` weights ``W_t = sum_{p through t} c_p m_pt`` in node order.

    Args:
        tree: the tree.
        coef: ``[P]`` per-path coefficients (`path_loss_coefficients`).
    """
    node_mask, exceptions = _effective_masks(tree)
    through = np.zeros(tree.num_nodes, dtype=np.float64)
    ends = tree.path_node >= 0  # a path with no tokens weighs no row
    np.add.at(through, tree.path_node[ends], np.asarray(coef)[ends])
    through = subtree_sum(tree.parent, through)
    lengths = tree.node_lengths
    weight = node_mask * np.repeat(through, lengths)
    for (p, v), m in exceptions.items():
        a, b = tree.node_offsets[v], tree.node_offsets[v + 1]
        # This path's own mask replaces the default one on this node.
        weight[a:b] += coef[p] * (m.astype(np.float64) - node_mask[a:b])
    return weight
