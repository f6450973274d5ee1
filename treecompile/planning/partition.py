"""Tree partitioning: split a tree into subtrees of at most C tokens each.

Example:
    >>> from treecompile import TrajectoryTree
    >>> from treecompile.planning.partition import partition_tree
    >>> tree = TrajectoryTree.from_sequences([[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 6, 7], [1, 8, 9]])
    >>> part = partition_tree(tree, capacity=6)
    >>> [t.num_tokens for t in part.parts], part.duplicated_tokens
    ([5, 6], 2)

Every path of the tree goes to exactly one part; a part is the `TrajectoryTree` of its
paths (tokens, weights and loss masks as in the whole tree), so the tokens it shares with
another part are computed in both: the *duplicated* tokens. Which paths go together
decides how many tokens are duplicated (Tree Training, §3.2 and Appendix A).

The cost of a part is its number of tree tokens: the union of its paths' root paths. The
problem is to cover every path with parts of at most ``C`` tokens, minimizing the sum of
part tokens. Two facts simplify it: paths that end at the same node, and a path that
ends inside another path's root path, can join a part that holds that node for free; so
only the tree's leaves need assigning, and the other paths follow (``_attach_endpoints``).

Two methods (`METHODS`, in :mod:`treecompile.planning.grouping`; the path sets they measure and cut
in :mod:`treecompile.core.path_sets`):

* ``"greedy"`` (`greedy_groups`): bottom-up over the preorder arrays. At each branching
  node the parts coming up from its children are merged by best-fit decreasing: largest
  first (the deepest leaves), each into the fullest part it still fits in, so parts of
  similar size end up together. A merge at node ``v`` saves the ``depth_end(v)`` tokens
  of ``v``'s root path, so merging as deep as possible is what saves the most. O(N + G log G)
  per branching node for G parts passing through it; 100k-node trees take about a second.
* ``"optimal"`` (`optimal_groups`): the exact dynamic program of Appendix A (multi-path):
  each node keeps the set of achievable multisets of part sizes, children are combined by
  trying every way to merge their parts. Exponential; for small trees and as ground truth.

What is guaranteed: ``tree tokens <= optimum <= greedy <= path tokens``, and greedy returns
the whole tree as one part whenever it fits in ``C``. No constant factor over the optimum is
proven. Measured: at most 1.14 on 20,000 small random trees; on the tests' fixed sample of
200 trees the worst is 1.071 and the mean 1.0004, and the tests assert at most 1.08 and 1.001
there (see ``docs/partitioning.md``).

Loss normalization: pack each part with ``denominator=loss_denominator(all_trees, mode)``,
the normalizer of the whole batch, so that the parts' losses (and gradients) add up to
the whole tree's loss exactly (`treecompile.core.loss`).

Metrics (Tree Training §4.1), with ``path_tokens`` the tokens of every path counted
separately, ``tree_tokens`` those of the whole tree and ``partition_tokens`` the sum over
parts: ``POR = 1 - tree_tokens / path_tokens`` (the best any partition can do) and
``ERR = 1 - partition_tokens / path_tokens`` (what this partition achieves; ERR = POR
when nothing is duplicated).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from treecompile.planning.grouping import greedy_groups, optimal_groups
from treecompile.core.path_sets import CapacityError, check_capacity, path_lengths, subtree, union_tokens
from treecompile.core.tree import TrajectoryTree
from treecompile.core.weights import LOSS_MODES, path_target_counts
from treecompile.core.errors import unknown_choice

__all__ = [
    "METHODS",
    "CapacityError",
    "Partition",
    "greedy_groups",
    "loss_denominator",
    "optimal_groups",
    "partition_tree",
    "partition_trees",
    "path_lengths",
    "reuse_ratios",
    "subtree",
    "union_tokens",
]


def reuse_ratios(tree_tokens: int, path_tokens: int, partition_tokens: int) -> tuple[float, float]:
    """``(POR, ERR)`` of Tree Training §4.1.

    ``POR = 1 - tree_tokens / path_tokens``; ``ERR = 1 - partition_tokens / path_tokens``.
    """
    if path_tokens <= 0:
        return 0.0, 0.0
    return 1.0 - tree_tokens / path_tokens, 1.0 - partition_tokens / path_tokens


def loss_denominator(trees: TrajectoryTree | Sequence[TrajectoryTree], loss_mode: str) -> float | None:
    """The normalizer of a whole batch, to pass as ``pack(..., denominator=)`` to every part.

    token-mean: the total number of target tokens over all paths (``path_target_counts``);
    the seq-mean modes: the total number of paths; ``sum``: None (no normalizer).
    With it, the losses of any split of the batch's paths into parts (micro-batches,
    ranks) add up to the loss of the whole batch.

    Returns:
        The denominator, or None where the mode has none or the batch has no target token
        (then every coefficient is 0 anyway).
    """
    if loss_mode not in LOSS_MODES:
        raise ValueError(unknown_choice("loss mode", loss_mode, LOSS_MODES, "modes"))
    if isinstance(trees, TrajectoryTree):
        trees = [trees]
    if loss_mode == "sum":
        return None
    if loss_mode == "token-mean":
        n = int(sum(int(path_target_counts(t).sum()) for t in trees))
        return float(n) if n > 0 else None
    n = sum(t.num_paths_with_tokens for t in trees)  # a path with no tokens enters no mean
    return float(n) if n > 0 else None


# ---------------------------------------------------------------------------- partitions

METHODS: dict[str, Callable[[TrajectoryTree, int], np.ndarray]] = {
    "greedy": greedy_groups,
    "optimal": optimal_groups,
}
"""Partitioning methods: name -> ``fn(tree, capacity) -> [P] part index of each path``."""


class ReuseStats:
    """Duplicated tokens, POR and ERR of a split, from its ``tree_tokens``, ``path_tokens`` and
    ``partition_tokens`` (tokens computed over all its parts), which subclasses provide."""

    @property
    def duplicated_tokens(self) -> int:
        """Tokens computed more than once because parts share them: ``partition - tree``."""
        return self.partition_tokens - self.tree_tokens

    @property
    def por(self) -> float:
        """``1 - tree_tokens / path_tokens``: the reuse of the whole tree (see `reuse_ratios`)."""
        return reuse_ratios(self.tree_tokens, self.path_tokens, self.partition_tokens)[0]

    @property
    def err(self) -> float:
        """``1 - partition_tokens / path_tokens``: the reuse the split keeps."""
        return reuse_ratios(self.tree_tokens, self.path_tokens, self.partition_tokens)[1]


@dataclass
class Partition(ReuseStats):
    """A tree split into parts of at most ``capacity`` tokens.

    Attributes:
        tree: the whole tree.
        capacity: the token budget C of one part.
        method: the key of `METHODS` used.
        path_ids: per part, ``[P_i]`` the whole tree's path indices it holds (in order).
        parts: per part, its `TrajectoryTree` (path ``j`` is ``path_ids[i][j]`` of ``tree``).
        tree_tokens: tokens of the whole tree.
        path_tokens: tokens of all paths counted separately.
    """

    tree: TrajectoryTree
    capacity: int
    method: str
    path_ids: list[np.ndarray]
    parts: list[TrajectoryTree] = field(repr=False)
    tree_tokens: int = 0
    path_tokens: int = 0

    @property
    def part_tokens(self) -> list[int]:
        """Tree tokens of each part."""
        return [t.num_tokens for t in self.parts]

    @property
    def partition_tokens(self) -> int:
        """Tokens over all parts (what training computes)."""
        return int(sum(self.part_tokens))

    def summary(self) -> dict[str, Any]:
        """Plain-dict summary: sizes, POR, ERR, duplicated tokens."""
        return {
            "method": self.method,
            "capacity": self.capacity,
            "n_parts": len(self.parts),
            "part_tokens": self.part_tokens,
            "tree_tokens": self.tree_tokens,
            "path_tokens": self.path_tokens,
            "partition_tokens": self.partition_tokens,
            "duplicated_tokens": self.duplicated_tokens,
            "por": self.por,
            "err": self.err,
        }


def partition_tree(tree: TrajectoryTree, capacity: int, *, method: str = "greedy") -> Partition:
    """Splits ``tree`` into parts of at most ``capacity`` tokens; every path in exactly one.

    Args:
        tree: the tree.
        capacity: the token budget C of one part (see `treecompile.planning.budget` to derive it
            from a memory budget).
        method: a key of `METHODS`: ``"greedy"`` (fast, any size) or ``"optimal"``
            (exact DP, small trees).

    Returns:
        The `Partition`; a tree that fits is one part holding every path.

    Raises:
        CapacityError: if a path is longer than ``capacity`` (the message says what fits).
        ValueError: for an unknown method.
    """
    if method not in METHODS:
        raise ValueError(unknown_choice("partitioning method", method, METHODS, "methods"))
    capacity = int(capacity)
    check_capacity(tree, capacity)
    path_tokens = int(path_lengths(tree).sum())
    if tree.num_tokens <= capacity:
        groups = np.zeros(tree.num_paths, dtype=np.int64)
    else:
        groups = METHODS[method](tree, capacity)
        # A path with no tokens rides with the tree's first path that has tokens: it costs nothing.
        empty = tree.path_node < 0
        groups = np.where(empty, groups[np.argmax(~empty)], groups)
    order = np.argsort(groups, kind="stable")
    bounds = np.flatnonzero(np.diff(groups[order])) + 1
    path_ids = [a for a in np.split(order, bounds)]
    parts = [tree if len(path_ids) == 1 else subtree(tree, ids) for ids in path_ids]
    for i, t in enumerate(parts):
        if t.num_tokens > capacity:  # a bug in a method, never the input
            raise AssertionError(f"{method} partitioning made part {i} with {t.num_tokens} > {capacity} tokens")
    return Partition(
        tree=tree,
        capacity=capacity,
        method=method,
        path_ids=path_ids,
        parts=parts,
        tree_tokens=tree.num_tokens,
        path_tokens=path_tokens,
    )


def partition_trees(trees: Sequence[TrajectoryTree], capacity: int, *, method: str = "greedy") -> list[Partition]:
    """`partition_tree` on each tree."""
    return [partition_tree(t, capacity, method=method) for t in trees]
