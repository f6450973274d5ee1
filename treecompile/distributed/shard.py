"""Load-balanced sharding of a batch's paths across K data-parallel ranks.

Example:
    >>> from treecompile import TrajectoryTree
    >>> from treecompile.distributed.shard import shard_paths
    >>> tree = TrajectoryTree.from_sequences([[1, 2, 3], [1, 2, 4], [1, 5, 6], [7, 8]])
    >>> s = shard_paths([tree], ranks=2)
    >>> s.rank_tokens, s.duplicated_tokens
    ([4, 5], 1)

AReaL-DTA §4, Algorithm 4 (``method="dfs"``): put the paths of all trees in DFS order
(paths sharing a prefix become neighbours), then cut that list into K contiguous groups
minimizing the largest group cost, by binary search on the cost threshold with a greedy
feasibility scan. A group's cost is its tree tokens (plus, optionally, an attention
term, `ShardCost`), computed incrementally: a path adds only the tokens past its longest
common prefix with the previous path of the group. Contiguous DFS groups keep most
sharing: at most ``K - 1`` root paths are duplicated.

Baselines for comparison (the paper's Figures 7-9):

* ``"greedy_tokens"``: longest path first, each to the rank with the fewest path tokens so
  far (LPT by token count; blind to sharing);
* ``"greedy_tree"``: paths in data order, each to the rank whose tree would be smallest
  after adding it (balances tree tokens, but splits prefixes between ranks).

The tree-token cost is what the tree forward computes (MLP and projections are linear in
it). Attention adds work proportional to the visible (query, key) pairs, which grows with
the square of the depth; set ``ShardCost(attention=...)`` from a measurement on the
target device to include it (it is 0 by default: not measured yet on a GPU).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from treecompile.core.errors import TreeInputError, unknown_choice
from treecompile.planning.partition import path_lengths, subtree, union_tokens
from treecompile.core.preorder import climb
from treecompile.core.tree import TrajectoryTree

__all__ = ["SHARD_METHODS", "Shard", "ShardCost", "Sharding", "dfs_path_order", "shard_paths"]

SHARD_METHODS = {
    "dfs": "AReaL-DTA Algorithm 4: DFS order, K contiguous groups, min-max tree tokens by binary search",
    "greedy_tokens": "longest path first to the rank with the fewest path tokens (LPT; ignores sharing)",
    "greedy_tree": "paths in data order to the rank whose tree stays smallest",
}
"""Sharding methods and what they do."""


@dataclass(frozen=True)
class ShardCost:
    """Cost of a group of paths: ``tokens * tree_tokens + attention * attended_pairs``.

    ``attended_pairs`` sums, over the group's tree tokens, the keys each one attends to
    (its position + 1).
    """

    tokens: float = 1.0
    attention: float = 0.0

    def increment(self, length: int, lcp: int) -> float:
        """Cost a path of ``length`` tokens adds to a group sharing ``lcp`` of them."""
        new = length - lcp
        pairs = (length * (length + 1) - lcp * (lcp + 1)) // 2
        return self.tokens * new + self.attention * pairs


@dataclass
class Shard:
    """One rank's share: per tree, the path indices it holds.

    Attributes:
        pieces: ``[(tree index, [P_i] path indices)]`` in DFS order.
    """

    pieces: list[tuple[int, np.ndarray]] = field(default_factory=list)

    @property
    def num_paths(self) -> int:
        return int(sum(len(ids) for _, ids in self.pieces))

    def trees(self, trees: Sequence[TrajectoryTree]) -> list[TrajectoryTree]:
        """The rank's trees: per piece, the subtree of its paths (`treecompile.planning.partition.subtree`)."""
        out = []
        for ti, ids in self.pieces:
            t = trees[ti]
            out.append(t if len(ids) == t.num_paths else subtree(t, ids))
        return out


@dataclass
class Sharding:
    """Paths of a batch split across ranks, and how good the split is.

    Attributes:
        method: a key of `SHARD_METHODS`.
        shards: one `Shard` per rank.
        rank_tokens: tree tokens of each rank (what it computes).
        rank_path_tokens: path tokens of each rank (what per-path training would compute).
        tree_tokens: tree tokens of the whole batch on one device.
    """

    method: str
    shards: list[Shard]
    rank_tokens: list[int]
    rank_path_tokens: list[int]
    tree_tokens: int

    @property
    def duplicated_tokens(self) -> int:
        """Tokens computed on more than one rank: ``sum(rank_tokens) - tree_tokens``."""
        return int(sum(self.rank_tokens)) - self.tree_tokens

    @property
    def max_load(self) -> int:
        return int(max(self.rank_tokens))

    @property
    def mean_load(self) -> float:
        return float(np.mean(self.rank_tokens))

    @property
    def imbalance(self) -> float:
        """``max / mean`` of the ranks' tree tokens (1 is perfect)."""
        return self.max_load / self.mean_load if self.mean_load > 0 else 1.0

    def summary(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "ranks": len(self.shards),
            "rank_tokens": list(self.rank_tokens),
            "rank_paths": [s.num_paths for s in self.shards],
            "duplicated_tokens": self.duplicated_tokens,
            "max_load": self.max_load,
            "mean_load": self.mean_load,
            "imbalance": self.imbalance,
        }


def dfs_path_order(trees: Sequence[TrajectoryTree]) -> tuple[list[tuple[int, int]], np.ndarray, np.ndarray]:
    """All paths of ``trees`` that have tokens, in DFS order, with lengths and shared prefixes.

    Returns:
        ``(order, lengths, lcp)``: ``order[i] = (tree, path)``; ``lengths[i]`` its tokens;
        ``lcp[i]`` the tokens it shares with path ``i - 1`` (0 for the first path of a tree).
        O(nodes + paths): the common prefix of consecutive paths in preorder is the depth of
        their lowest common ancestor, found by walking up from the later end node.
    """
    order: list[tuple[int, int]] = []
    lens: list[int] = []
    lcps: list[int] = []
    for ti, t in enumerate(trees):
        ends = t.path_node
        perm = np.argsort(ends, kind="stable")  # preorder of end nodes: a DFS leaf order
        plen = path_lengths(t)
        depth_end = (t.depth_start + t.node_lengths).tolist()
        sub_end = t.subtree_end_node.tolist()
        parent = t.parent.tolist()
        prev = -1
        for p in perm.tolist():
            v = int(ends[p])
            if v < 0:  # a path with no tokens has no place in the order (see _with_empty_paths)
                continue
            if prev < 0:
                lcp = 0
            else:
                # The deepest ancestor-or-self of v whose subtree holds prev.
                x = next((u for u in climb(parent, v) if u <= prev < sub_end[u]), -1)
                lcp = depth_end[x] if x >= 0 else 0
            order.append((ti, p))
            lens.append(int(plen[p]))
            lcps.append(int(lcp))
            prev = v
    return order, np.array(lens, dtype=np.int64), np.array(lcps, dtype=np.int64)


def _greedy_cuts(incr: np.ndarray, full: np.ndarray, tau: float) -> list[int] | None:
    """Start indices of groups when each group's cost stays <= tau; None if a path alone exceeds it."""
    starts = [0]
    c = full[0]
    if c > tau:
        return None
    for i in range(1, len(incr)):
        if c + incr[i] > tau:
            if full[i] > tau:
                return None
            starts.append(i)
            c = full[i]
        else:
            c += incr[i]
    return starts


def _dfs_groups(trees: Sequence[TrajectoryTree], ranks: int, cost: ShardCost) -> list[list[tuple[int, int]]]:
    order, lens, lcps = dfs_path_order(trees)
    n = len(order)
    full = np.array([cost.increment(int(L), 0) for L in lens], dtype=np.float64)
    incr = np.array([cost.increment(int(L), int(c)) for L, c in zip(lens, lcps)], dtype=np.float64)
    incr[0] = full[0]
    lo, hi = float(full.max()), float(full[0] + incr[1:].sum())
    integral = cost.attention == 0 and float(cost.tokens).is_integer()
    if integral:
        lo_i, hi_i = int(lo), int(hi)
        while lo_i < hi_i:
            mid = (lo_i + hi_i) // 2
            cuts = _greedy_cuts(incr, full, mid)
            if cuts is not None and len(cuts) <= ranks:
                hi_i = mid
            else:
                lo_i = mid + 1
        tau = float(lo_i)
    else:
        for _ in range(100):
            if hi - lo <= 1e-9 * max(hi, 1.0):
                break
            mid = (lo + hi) / 2
            cuts = _greedy_cuts(incr, full, mid)
            if cuts is not None and len(cuts) <= ranks:
                hi = mid
            else:
                lo = mid
        tau = hi
    starts = _greedy_cuts(incr, full, tau)
    assert starts is not None and len(starts) <= ranks
    bounds = starts + [n]
    groups = [order[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
    # Fewer groups than ranks: split the costliest splittable group in two (Algorithm 4, l. 30).
    while len(groups) < min(ranks, n):
        costs = [_group_cost(g, trees, cost) if len(g) > 1 else -1.0 for g in groups]
        i = int(np.argmax(costs))
        g = groups[i]
        groups[i : i + 1] = [g[: len(g) // 2], g[len(g) // 2 :]]
    return groups + [[] for _ in range(ranks - len(groups))]


def _group_cost(group: list[tuple[int, int]], trees: Sequence[TrajectoryTree], cost: ShardCost) -> float:
    by_tree: dict[int, list[int]] = {}
    for ti, p in group:
        by_tree.setdefault(ti, []).append(p)
    total = 0.0
    for ti, ps in by_tree.items():
        _, lens, lcps = dfs_path_order([subtree(trees[ti], ps)])
        total += sum(cost.increment(int(L), int(c)) for L, c in zip(lens, lcps))
    return total


def _with_empty_paths(trees: Sequence[TrajectoryTree], groups: list[list[tuple[int, int]]]) -> None:
    """Adds each path with no tokens (the methods place only paths with tokens) to the first
    group holding a path of its tree: it costs nothing and keeps every path on a rank."""
    home: dict[int, int] = {}
    for gi, g in enumerate(groups):
        for ti, _ in g:
            home.setdefault(ti, gi)
    for ti, t in enumerate(trees):
        for p in t.empty_paths.tolist():
            groups[home[ti]].append((ti, p))


def _greedy_tokens_groups(trees: Sequence[TrajectoryTree], ranks: int) -> list[list[tuple[int, int]]]:
    items = [(int(L), ti, p) for ti, t in enumerate(trees) for p, L in enumerate(path_lengths(t).tolist())
             if t.path_node[p] >= 0]
    items.sort(key=lambda x: -x[0])  # stable: ties keep data order
    heap = [(0, r) for r in range(ranks)]
    groups: list[list[tuple[int, int]]] = [[] for _ in range(ranks)]
    for L, ti, p in items:
        load, r = heapq.heappop(heap)
        groups[r].append((ti, p))
        heapq.heappush(heap, (load + L, r))
    return groups


def _greedy_tree_groups(trees: Sequence[TrajectoryTree], ranks: int) -> list[list[tuple[int, int]]]:
    covered = [[np.zeros(t.num_nodes, dtype=bool) for t in trees] for _ in range(ranks)]
    load = [0] * ranks
    groups: list[list[tuple[int, int]]] = [[] for _ in range(ranks)]
    for ti, t in enumerate(trees):
        lengths = t.node_lengths
        for p in np.flatnonzero(t.path_node >= 0).tolist():
            best = None
            for r in range(ranks):
                add = sum(int(lengths[v]) for v in climb(t.parent, t.path_node[p], stop=covered[r][ti]))
                key = (load[r] + add, r)
                if best is None or key < best[0]:
                    best = (key, add)
            (new_load, r), add = best
            load[r] = new_load
            for v in climb(t.parent, t.path_node[p], stop=covered[r][ti]):
                covered[r][ti][v] = True
            groups[r].append((ti, p))
    return groups


def shard_paths(
    trees: TrajectoryTree | Sequence[TrajectoryTree],
    ranks: int,
    *,
    method: str = "dfs",
    cost: ShardCost | None = None,
) -> Sharding:
    """Splits the paths of a batch of trees across ``ranks`` data-parallel ranks.

    Args:
        trees: the global batch (one tree per task or prompt group).
        ranks: K, the number of ranks.
        method: a key of `SHARD_METHODS`.
        cost: the group cost for ``"dfs"`` (default: tree tokens).

    Returns:
        The `Sharding`: per rank its paths (by tree), tree tokens, and the duplication and
        balance against the whole batch on one device. A rank gets no paths only when the
        batch has fewer paths than ranks.
    """
    if isinstance(trees, TrajectoryTree):
        trees = [trees]
    trees = list(trees)
    if ranks < 1:
        raise ValueError(f"ranks must be at least 1, got {ranks}")
    if not trees:
        raise TreeInputError("shard_paths needs at least one tree")
    if method == "dfs":
        groups = _dfs_groups(trees, ranks, cost or ShardCost())
    elif method == "greedy_tokens":
        groups = _greedy_tokens_groups(trees, ranks)
    elif method == "greedy_tree":
        groups = _greedy_tree_groups(trees, ranks)
    else:
        raise ValueError(unknown_choice("sharding method", method, SHARD_METHODS, "methods"))
    _with_empty_paths(trees, groups)
    shards, rank_tokens, rank_path_tokens = [], [], []
    plens = [path_lengths(t) for t in trees]
    for g in groups:
        by_tree: dict[int, list[int]] = {}
        for ti, p in g:
            by_tree.setdefault(ti, []).append(p)
        pieces = []
        for ti in sorted(by_tree):
            ids = np.array(by_tree[ti], dtype=np.int64)
            ids = ids[np.argsort(trees[ti].path_node[ids], kind="stable")]  # DFS order inside the piece
            pieces.append((ti, ids))
        shards.append(Shard(pieces))
        rank_tokens.append(int(sum(union_tokens(trees[ti], ids) for ti, ids in pieces)))
        rank_path_tokens.append(int(sum(int(plens[ti][ids].sum()) for ti, ids in pieces)))
    return Sharding(
        method=method,
        shards=shards,
        rank_tokens=rank_tokens,
        rank_path_tokens=rank_path_tokens,
        tree_tokens=int(sum(t.num_tokens for t in trees)),
    )
