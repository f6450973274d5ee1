"""Tree partitioning: split a tree into subtrees of at most C tokens each.

Example:
    >>> from treecompile import TrajectoryTree
    >>> from treecompile.partition import partition_tree
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

Two methods (`METHODS`):

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
the whole tree's loss exactly (`treecompile.loss`).

Metrics (Tree Training §4.1), with ``path_tokens`` the tokens of every path counted
separately, ``tree_tokens`` those of the whole tree and ``partition_tokens`` the sum over
parts: ``POR = 1 - tree_tokens / path_tokens`` (the best any partition can do) and
``ERR = 1 - partition_tokens / path_tokens`` (what this partition achieves; ERR = POR
when nothing is duplicated).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from treecompile.errors import TreeInputError
from treecompile.loss import LOSS_MODES, path_target_counts
from treecompile.preorder import climb
from treecompile.tree import TrajectoryTree

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


class CapacityError(TreeInputError):
    """A path is longer than the token capacity on its own: no partition can hold it."""


# ---------------------------------------------------------------------------- basic quantities


def path_lengths(tree: TrajectoryTree) -> np.ndarray:
    """``[P]`` tokens on each path (its end node's depth plus the node's length)."""
    return tree.depth_start[tree.path_node] + tree.node_lengths[tree.path_node]


def _depth_end(tree: TrajectoryTree) -> np.ndarray:
    """``[N]`` tokens from the root to the end of each node (inclusive)."""
    return tree.depth_start + tree.node_lengths


def _children(tree: TrajectoryTree) -> list[list[int]]:
    kids: list[list[int]] = [[] for _ in range(tree.num_nodes)]
    for v, p in enumerate(tree.parent.tolist()):
        if p >= 0:
            kids[p].append(v)
    return kids


def union_tokens(tree: TrajectoryTree, path_ids: Sequence[int] | np.ndarray) -> int:
    """Tree tokens of a set of paths: the size of the union of their root paths.

    O(nodes of the union); walks up from each end node until a node already counted.
    """
    seen = np.zeros(tree.num_nodes, dtype=bool)
    lengths = tree.node_lengths
    parent = tree.parent
    total = 0
    for p in np.asarray(path_ids, dtype=np.int64).tolist():
        for v in climb(parent, tree.path_node[p], stop=seen):
            seen[v] = True
            total += int(lengths[v])
    return total


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
        raise ValueError(f"unknown loss mode {loss_mode!r}; valid modes: {', '.join(LOSS_MODES)}")
    if isinstance(trees, TrajectoryTree):
        trees = [trees]
    if loss_mode == "sum":
        return None
    if loss_mode == "token-mean":
        n = int(sum(int(path_target_counts(t).sum()) for t in trees))
        return float(n) if n > 0 else None
    n = sum(t.num_paths for t in trees)
    return float(n) if n > 0 else None


def check_capacity(tree: TrajectoryTree, capacity: int) -> None:
    """Raises `CapacityError` if a path is longer than ``capacity`` on its own.

    The message names the longest path, how many paths do not fit, and what would fit.
    """
    if capacity < 1:
        raise CapacityError(f"capacity must be at least 1 token, got {capacity}")
    lengths = path_lengths(tree)
    over = np.flatnonzero(lengths > capacity)
    if not over.size:
        return
    worst = int(over[np.argmax(lengths[over])])
    shown = ", ".join(str(int(p)) for p in over[:8]) + (", ..." if over.size > 8 else "")
    raise CapacityError(
        f"path {worst} has {int(lengths[worst])} tokens, more than the capacity C={capacity}: no partition "
        f"can hold it (a path is never split). {over.size} of {tree.num_paths} paths are longer than C "
        f"(paths {shown}). A capacity of at least {int(lengths.max())} tokens fits every path; at C={capacity}, "
        f"drop those paths or truncate them to {capacity} tokens."
    )


# ---------------------------------------------------------------------------- subtrees


def subtree(tree: TrajectoryTree, path_ids: Sequence[int] | np.ndarray) -> TrajectoryTree:
    """The tree of a subset of paths, cut from ``tree`` without re-inserting sequences.

    Keeps the nodes on the given paths' root paths (in the same preorder), merges the
    chains that lose their branching (so the result is compressed like `from_sequences`
    output), and carries weights and loss masks over. Path ``i`` of the result is
    ``path_ids[i]`` of ``tree``.

    Args:
        tree: the whole tree.
        path_ids: ``[P']`` distinct path indices of ``tree``, at least one.
    """
    ids = np.asarray(path_ids, dtype=np.int64)
    if ids.ndim != 1 or ids.size == 0:
        raise TreeInputError("subtree needs a non-empty 1-D list of path indices")
    if ids.min() < 0 or ids.max() >= tree.num_paths:
        raise TreeInputError(f"path indices must be in [0, {tree.num_paths})")
    if np.unique(ids).size != ids.size:
        raise TreeInputError("subtree path indices must be distinct")
    n = tree.num_nodes
    parent = tree.parent
    keep = np.zeros(n, dtype=bool)
    ends = tree.path_node[ids]
    for end in ends.tolist():
        for v in climb(parent, end, stop=keep):
            keep[v] = True
    kept = np.flatnonzero(keep)
    ends_here = np.zeros(n, dtype=bool)
    ends_here[ends] = True
    kept_children = np.bincount(parent[kept][parent[kept] >= 0], minlength=n)
    # A kept node whose parent has it as its only kept child and where no kept path ends
    # continues its parent's node (preorder puts it right after the parent).
    head = np.full(n, -1, dtype=np.int64)
    heads: list[int] = []
    for v in kept.tolist():
        p = int(parent[v])
        if p >= 0 and kept_children[p] == 1 and not ends_here[p]:
            head[v] = head[p]
        else:
            head[v] = v
            heads.append(v)
    new_id = np.full(n, -1, dtype=np.int64)
    new_id[heads] = np.arange(len(heads))
    members: list[list[int]] = [[] for _ in heads]
    for v in kept.tolist():
        members[new_id[head[v]]].append(v)
    offs = tree.node_offsets
    tok_parts, mask_parts = [], []
    for mem in members:
        # A chain's nodes need not be adjacent in the whole tree (dropped siblings sit
        # between them), so their token ranges are gathered one by one.
        tok_parts.append(np.concatenate([tree.tokens[offs[v] : offs[v + 1]] for v in mem]))
        mask_parts.append(np.concatenate([tree.node_mask[offs[v] : offs[v + 1]] for v in mem]))
    lengths = np.array([len(t) for t in tok_parts], dtype=np.int64)
    new_offsets = np.zeros(len(heads) + 1, dtype=np.int64)
    np.cumsum(lengths, out=new_offsets[1:])
    new_parent = np.array(
        [int(new_id[head[parent[h]]]) if parent[h] >= 0 else -1 for h in heads], dtype=np.int64
    )
    pos_of = {int(p): i for i, p in enumerate(ids.tolist())}
    exceptions: dict[tuple[int, int], np.ndarray] = {}
    touched: dict[tuple[int, int], None] = {}
    for (p, v) in tree.mask_exceptions:
        if p in pos_of and keep[v]:
            touched[(pos_of[p], int(new_id[head[v]]))] = None
    for (i, h) in touched:
        p = int(ids[i])
        segs = [tree.path_mask_segment(p, v) for v in members[h]]
        exceptions[(i, h)] = np.concatenate(segs).astype(bool)
    return TrajectoryTree(
        tokens=np.concatenate(tok_parts),
        node_offsets=new_offsets,
        parent=new_parent,
        path_node=new_id[head[ends]],
        path_weight=tree.path_weight[ids],
        node_mask=np.concatenate(mask_parts),
        mask_exceptions=exceptions,
        metadata=dict(tree.metadata),
    )


# ---------------------------------------------------------------------------- the greedy heuristic


class _UnionFind:
    def __init__(self) -> None:
        self.parent: list[int] = []

    def make(self) -> int:
        self.parent.append(len(self.parent))
        return len(self.parent) - 1

    def find(self, x: int) -> int:
        root = x
        while self.parent[root] != root:
            root = self.parent[root]
        while self.parent[x] != root:
            self.parent[x], x = root, self.parent[x]
        return root

    def union(self, a: int, b: int) -> int:
        ra, rb = self.find(a), self.find(b)
        self.parent[rb] = ra
        return ra


def _attach_endpoints(tree: TrajectoryTree, leaf_group: dict[int, int]) -> np.ndarray:
    """``[P]`` group of each path, given the group of each leaf.

    A path ending at an internal node joins the group of a leaf below it (free: that
    group already holds the path's tokens). The leaf chosen is the first one in preorder.
    """
    n = tree.num_nodes
    node_group = np.full(n, -1, dtype=np.int64)
    for v, g in leaf_group.items():
        node_group[v] = g
    for v in range(n - 1, -1, -1):  # children after parents: a reverse sweep fills parents
        p = int(tree.parent[v])
        if p >= 0 and node_group[v] >= 0:
            node_group[p] = node_group[v]  # ends as the group of the first child in preorder
    return node_group[tree.path_node]


def greedy_groups(tree: TrajectoryTree, capacity: int) -> np.ndarray:
    """``[P]`` part index of each path, by bottom-up best-fit-decreasing merging.

    Every part has at most ``capacity`` tree tokens. Parts are numbered in preorder of
    their first leaf.

    Each part is summarized by its size (tree tokens). At a branching node ``v`` with
    root path of ``D = depth_end(v)`` tokens, parts coming from different children share
    exactly those D tokens, so merging parts of sizes ``s_i`` gives ``sum(s_i) - (k-1) D``
    tokens; in terms of the free space ``C - s`` (which does not change as a part moves
    up), an item of residual ``s - D`` fits a part whose free space is at least that.
    Two parts from the same child share more than D tokens, so the formula is an upper
    bound there: the result is never over capacity.

    Raises:
        CapacityError: if a path is longer than ``capacity``.
    """
    check_capacity(tree, capacity)
    n = tree.num_nodes
    kids = _children(tree)
    depth_end = _depth_end(tree).tolist()
    uf = _UnionFind()
    leaf_group: dict[int, int] = {}
    # parts[v]: list of (size, group id) of the parts covering v's subtree, built bottom-up.
    parts: list[list[tuple[int, int]] | None] = [None] * n
    top: list[list[tuple[int, int]]] = []
    for v in range(n - 1, -1, -1):
        ks = kids[v]
        if not ks:
            g = uf.make()
            leaf_group[v] = g
            here = [(depth_end[v], g)]
        elif len(ks) == 1:
            here = parts[ks[0]]
            parts[ks[0]] = None
        else:
            items = []
            for c in ks:
                items.extend(parts[c])
                parts[c] = None
            here = _best_fit_merge(items, capacity, depth_end[v], uf)
        if tree.parent[v] < 0:
            top.append(here)
        else:
            parts[v] = here
    if len(top) > 1:  # a forest: roots share nothing (D = 0)
        here = _best_fit_merge([it for t in top for it in t], capacity, 0, uf)
    # Number the parts in preorder of their first leaf.
    leaf_root = {v: uf.find(g) for v, g in leaf_group.items()}
    order: dict[int, int] = {}
    for v in sorted(leaf_root):
        order.setdefault(leaf_root[v], len(order))
    groups = _attach_endpoints(tree, {v: order[r] for v, r in leaf_root.items()})
    return groups


def _best_fit_merge(items: list[tuple[int, int]], capacity: int, d: int, uf: _UnionFind) -> list[tuple[int, int]]:
    """Merges parts sharing a ``d``-token root path: best fit, largest first."""
    items.sort(key=lambda it: -it[0])
    frees: list[tuple[int, int]] = []  # sorted (free space, group id) of the open parts
    sizes: dict[int, int] = {}
    for size, g in items:
        residual = size - d
        i = bisect.bisect_left(frees, (residual, -1))
        if i < len(frees):
            free, h = frees.pop(i)
            root = uf.union(h, g)
            sizes[root] = sizes.pop(h) + residual
            bisect.insort(frees, (free - residual, root))
        else:
            sizes[g] = size
            bisect.insort(frees, (capacity - size, g))
    return [(sizes[g], g) for _, g in frees]


# ---------------------------------------------------------------------------- the exact DP


def optimal_groups(tree: TrajectoryTree, capacity: int, *, max_states: int = 200_000) -> np.ndarray:
    """``[P]`` part index of each path in a partition with the fewest total tokens.

    The multi-path dynamic program of Tree Training Appendix A.2. A *state* at node ``v``
    is the sorted tuple of the sizes (tree tokens, counted from the root) of the parts that
    cover ``v``'s leaves; what happens above ``v`` depends only on these sizes, so one
    witness partition per state is enough. Children are folded in one at a time: each part
    of the next child either starts a new part or joins one existing part that has no part
    of this child yet (parts sharing ``v``'s root path of ``D`` tokens merge into
    ``s_a + s_b - D`` tokens; two parts of the same child were already offered merged by
    that child's states). The answer is the state of least total size at the top.

    Exponential in the number of leaves: for small trees and as ground truth.

    Raises:
        CapacityError: if a path is longer than ``capacity``.
        RuntimeError: if a node has more than ``max_states`` states.
    """
    check_capacity(tree, capacity)
    n = tree.num_nodes
    kids = _children(tree)
    depth_end = _depth_end(tree).tolist()
    State = dict  # sizes tuple -> tuple of frozensets of leaves, aligned with the sizes
    states: list[State | None] = [None] * n
    top: list[State] = []
    for v in range(n - 1, -1, -1):
        ks = kids[v]
        if not ks:
            here: State = {(depth_end[v],): (frozenset([v]),)}
        else:
            here = states[ks[0]]
            for c in ks[1:]:
                here = _fold_states(here, states[c], capacity, depth_end[v], max_states)
            for c in ks:
                states[c] = None
        if tree.parent[v] < 0:
            top.append(here)
        else:
            states[v] = here
    here = top[0]
    for t in top[1:]:
        here = _fold_states(here, t, capacity, 0, max_states)
    best = min(here, key=sum)
    leaf_group = {leaf: i for i, leaves in enumerate(here[best]) for leaf in leaves}
    groups = _attach_endpoints(tree, leaf_group)
    # Renumber in preorder of first leaf, like greedy_groups.
    first: dict[int, int] = {}
    for v in sorted(leaf_group):
        first.setdefault(leaf_group[v], len(first))
    return np.array([first[g] for g in groups.tolist()], dtype=np.int64)


def _fold_states(a: dict, b: dict, capacity: int, d: int, max_states: int) -> dict:
    out: dict = {}
    for sa, wa in a.items():
        for sb, wb in b.items():
            for sizes, wit in _merges(list(sa), list(wa), sb, wb, capacity, d):
                key = tuple(sorted(sizes))
                if key not in out:
                    order = sorted(range(len(sizes)), key=lambda i: sizes[i])
                    out[key] = tuple(wit[i] for i in order)
                    if len(out) > max_states:
                        raise RuntimeError(
                            f"optimal partitioning needs more than max_states={max_states} states at one node; "
                            "the tree is too large for the exact DP (use method='greedy')"
                        )
    return out


def _merges(sa: list[int], wa: list, sb: tuple[int, ...], wb: tuple, capacity: int, d: int):
    """Every way to merge each part of ``b`` into a distinct part of ``a`` or keep it alone."""
    k = len(sb)

    def rec(j: int, used: tuple[bool, ...], sizes: list[int], wit: list):
        if j == k:
            yield sizes, wit
            return
        # alone
        yield from rec(j + 1, used, sizes + [sb[j]], wit + [wb[j]])
        for i in range(len(sa)):
            if used[i]:
                continue
            merged = sizes[i] + sb[j] - d
            if merged <= capacity:
                s2 = list(sizes)
                s2[i] = merged
                w2 = list(wit)
                w2[i] = wit[i] | wb[j]
                u2 = used[:i] + (True,) + used[i + 1 :]
                yield from rec(j + 1, u2, s2, w2)

    yield from rec(0, tuple([False] * len(sa)), list(sa), list(wa))


def brute_force_optimum(tree: TrajectoryTree, capacity: int) -> int:
    """The least total tokens over every set partition of the leaves (for tests; tiny trees)."""
    check_capacity(tree, capacity)
    n_children = np.bincount(tree.parent[tree.parent >= 0], minlength=tree.num_nodes)
    leaves = np.flatnonzero(n_children == 0).tolist()
    leaf_path = {}
    for p, v in enumerate(tree.path_node.tolist()):
        leaf_path.setdefault(v, p)
    best = None
    for blocks in _set_partitions(leaves):
        sizes = [union_tokens(tree, [leaf_path[v] for v in blk]) for blk in blocks]
        if max(sizes) <= capacity:
            total = sum(sizes)
            best = total if best is None else min(best, total)
    assert best is not None
    return best


def _set_partitions(items: list[int]):
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for sub in _set_partitions(rest):
        yield [[first]] + sub
        for i in range(len(sub)):
            yield sub[:i] + [[first] + sub[i]] + sub[i + 1 :]


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
        capacity: the token budget C of one part (see `treecompile.budget` to derive it
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
        raise ValueError(f"unknown partitioning method {method!r}; valid methods: {', '.join(METHODS)}")
    capacity = int(capacity)
    check_capacity(tree, capacity)
    path_tokens = int(path_lengths(tree).sum())
    if tree.num_tokens <= capacity:
        groups = np.zeros(tree.num_paths, dtype=np.int64)
    else:
        groups = METHODS[method](tree, capacity)
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
