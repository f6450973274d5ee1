"""Tree primitives over a parent array in depth-first preorder, written once.

A forest of ``N`` nodes is ``parent: [N]`` int, ``-1`` at a root, with every parent
numbered before its children (``parent[v] < v``). Then a reverse sweep visits every child
before its parent (sums and maxima over subtrees) and a forward sweep every parent before
its children (sums along root paths). Each function here is that one loop, in O(N), so
that `TrajectoryTree`, `TreeBatch`, the loss, the partitioner, RL and sharding do not
each write it again.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

__all__ = ["preorder_violation", "subtree_sum", "subtree_max", "root_path_sum", "climb", "at_path_ends",
           "root_path_rows", "rows_before_on_path"]


def preorder_violation(parent: np.ndarray) -> str | None:
    """None if ``parent`` is a forest in depth-first preorder, else what breaks it, naming
    the first node that does.

    Depth-first preorder: every parent is an earlier node (or -1 at a root), and each
    subtree is contiguous, i.e. a node's parent is on the chain of open ancestors of the
    node before it (a node whose parent's subtree has already been left is out of order).
    `TrajectoryTree` and `TreeBatch.validate` both check their parent arrays with it.
    """
    parent = np.asarray(parent)
    n = len(parent)
    bad = np.flatnonzero((parent >= np.arange(n)) | (parent < -1))
    if bad.size:
        v = int(bad[0])
        return f"node {v} has parent {int(parent[v])}: a parent must be an earlier node, or -1 at a root (not preorder)"
    stack: list[int] = []
    for v in range(n):
        p = int(parent[v])
        while stack and stack[-1] != p:
            stack.pop()
        if p >= 0 and not stack:
            return (f"node {v} has parent {p}, whose subtree ended before node {v} (not preorder: a subtree must be "
                    "contiguous)")
        stack.append(v)
    return None


def subtree_sum(parent: np.ndarray, values: np.ndarray) -> np.ndarray:
    """``[N]`` sum of ``values`` over each node's subtree (itself included); a new array."""
    out = np.array(values, copy=True)
    for v in range(len(parent) - 1, -1, -1):
        p = parent[v]
        if p >= 0:
            out[p] += out[v]
    return out


def subtree_max(parent: np.ndarray, values: np.ndarray) -> np.ndarray:
    """``[N]`` maximum of ``values`` over each node's subtree (itself included); a new array.

    With ``values = arange(1, N + 1)`` it is one past each subtree's last node.
    """
    out = np.array(values, copy=True)
    for v in range(len(parent) - 1, -1, -1):
        p = parent[v]
        if p >= 0 and out[v] > out[p]:
            out[p] = out[v]
    return out


def root_path_sum(parent: np.ndarray, values: np.ndarray) -> np.ndarray:
    """``[N]`` sum of ``values`` from each node's root down to the node (itself included).

    ``root_path_sum(parent, lengths) - lengths`` is each node's first path position;
    ``root_path_sum(parent, ones)`` its depth in nodes.
    """
    out = np.array(values, copy=True)
    for v in range(len(parent)):
        p = parent[v]
        if p >= 0:
            out[v] += out[p]
    return out


def climb(parent: np.ndarray, v: int, stop: np.ndarray | None = None) -> Iterator[int]:
    """``v``, its parent, ... up to its root: the root path, leaf first.

    Args:
        parent: ``[N]`` parent ids.
        v: the node to start from.
        stop: ``[N]`` bool, read as the walk goes: it ends before the first node marked
            (so a caller marking the nodes it is given walks each node once over many calls).
    """
    v = int(v)
    while v >= 0 and (stop is None or not stop[v]):
        yield v
        v = int(parent[v])


def at_path_ends(values: np.ndarray, path_node: np.ndarray, fill: int = 0) -> np.ndarray:
    """``[P]`` ``values[path_node[p]]``, and ``fill`` for a path with no tokens (``path_node`` -1,
    which NumPy would read as the last node)."""
    return np.where(path_node >= 0, values[np.maximum(path_node, 0)], fill)


def root_path_rows(start: np.ndarray, end: np.ndarray, parent: np.ndarray, v: int) -> np.ndarray:
    """``[T]`` int64: the rows of node ``v``'s root path, root first, where node ``u`` holds rows
    ``start[u]:end[u]`` (empty for ``v`` -1, a path with no tokens). O(depth)."""
    chain = [np.arange(start[u], end[u], dtype=np.int64) for u in climb(parent, v)]
    return np.concatenate(chain[::-1]) if chain else np.zeros(0, dtype=np.int64)


def rows_before_on_path(nodes: np.ndarray, row: int) -> np.ndarray:
    """``[P]`` int64: the rows before ``row`` on its root path, root first, in a packed row of
    nodes ``nodes`` ``[N, 3]`` (each node's first row, end row and parent, in preorder: the
    batch's ``node_table()``): the earlier rows ``row`` and the rows after it in its subtree
    may attend to. O(depth)."""
    start, end, parent = nodes[:, 0], nodes[:, 1], nodes[:, 2]
    v = int(np.searchsorted(start, row, side="right")) - 1
    chain = [np.arange(start[v], row)]
    u = int(parent[v])
    while u >= 0:
        chain.append(np.arange(start[u], end[u]))
        u = int(parent[u])
    return np.concatenate(chain[::-1]).astype(np.int64)
