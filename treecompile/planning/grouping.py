"""Which paths go together: the partitioning methods of :mod:`treecompile.planning.partition`.

Each method maps a tree and a token capacity ``C`` to ``[P]``, the part of each path, with
every part at most ``C`` tree tokens. Only the leaves are assigned; a path ending at an
internal node joins a part holding a leaf below it, for free (`_attach_endpoints`).

* `greedy_groups`: bottom-up best-fit-decreasing merging at each branching node.
* `optimal_groups`: the exact dynamic program of Tree Training, Appendix A.2 (small trees).
* `brute_force_optimum`: every set partition of the leaves, for tests on tiny trees.
"""

from __future__ import annotations

import bisect

import numpy as np

from treecompile.core.path_sets import check_capacity, union_tokens
from treecompile.core.preorder import at_path_ends
from treecompile.core.tree import TrajectoryTree

__all__ = ["greedy_groups", "optimal_groups", "brute_force_optimum"]


def _depth_end(tree: TrajectoryTree) -> np.ndarray:
    """``[N]`` tokens from the root to the end of each node (inclusive)."""
    return tree.depth_start + tree.node_lengths


def _children(tree: TrajectoryTree) -> list[list[int]]:
    kids: list[list[int]] = [[] for _ in range(tree.num_nodes)]
    for v, p in enumerate(tree.parent.tolist()):
        if p >= 0:
            kids[p].append(v)
    return kids


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
    return at_path_ends(node_group, tree.path_node)  # a path with no tokens gets its part from partition_tree


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
