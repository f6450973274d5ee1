"""Sets of a tree's paths: how many tokens they span, and the tree they span.

What partitioning (:mod:`treecompile.planning.partition`) and sharding (:mod:`treecompile.distributed.shard`)
measure and cut: a path's length (`path_lengths`), the tree tokens of a set of paths (the
union of their root paths, `union_tokens`), the check that every path fits a token
capacity on its own (`check_capacity`), and the `TrajectoryTree` of a subset of paths
(`subtree`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from treecompile.core.errors import TreeInputError
from treecompile.core.preorder import at_path_ends, climb
from treecompile.core.tree import TrajectoryTree

__all__ = ["CapacityError", "check_capacity", "path_lengths", "subtree", "union_tokens"]


class CapacityError(TreeInputError):
    """A path is longer than the token capacity on its own: no partition can hold it."""


def path_lengths(tree: TrajectoryTree) -> np.ndarray:
    """``[P]`` tokens on each path (its end node's depth plus the node's length; 0 for a path
    with no tokens)."""
    return at_path_ends(tree.depth_start + tree.node_lengths, tree.path_node)


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



def subtree(tree: TrajectoryTree, path_ids: Sequence[int] | np.ndarray) -> TrajectoryTree:
    """The tree of a subset of paths, cut from ``tree`` without re-inserting sequences.

    Keeps the nodes on the given paths' root paths (in the same preorder), merges the
    chains that lose their branching (so the result is compressed like `from_sequences`
    output), and carries weights and loss masks over. Path ``i`` of the result is
    ``path_ids[i]`` of ``tree``.

    Args:
        tree: the whole tree.
        path_ids: ``[P']`` distinct path indices of ``tree``, at least one with tokens.
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
    if not (ends >= 0).any():
        raise TreeInputError("subtree needs at least one path with tokens")
    for end in ends.tolist():
        for v in climb(parent, end, stop=keep):
            keep[v] = True
    kept = np.flatnonzero(keep)
    ends_here = np.zeros(n, dtype=bool)
    ends_here[ends[ends >= 0]] = True
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
        path_node=at_path_ends(new_id[head], ends, fill=-1),
        path_weight=tree.path_weight[ids],
        node_mask=np.concatenate(mask_parts),
        mask_exceptions=exceptions,
        metadata=dict(tree.metadata),
    )
