"""Building a `treecompile.core.tree.TrajectoryTree`: the checks of its inputs and the merge of
token sequences into a prefix tree numbered in preorder.

The checks (:func:`as_token_array`, :func:`as_mask_array`, :func:`as_weights`) return fresh
arrays and raise `TreeInputError` naming the sequence and position; `treecompile.data.io` checks
file lines with them too. :func:`merge_sequences` inserts the sequences into a trie of
mutable nodes, splitting a node where a path diverges or ends inside it, and freezes it into
preorder arrays; :func:`node_masks` picks each node's loss mask and keeps disagreements.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Any

import numpy as np

from treecompile.core.errors import TreeInputError, TreeWarning
from treecompile.core.preorder import climb, root_path_sum

__all__ = ["as_mask_array", "as_token_array", "as_weights", "merge_sequences", "node_masks", "warn_empty_paths"]


class _Node:
    """Mutable node used only while building; frozen into arrays afterwards."""

    __slots__ = ("tokens", "children", "paths_ending", "size")

    def __init__(self, tokens: np.ndarray) -> None:
        self.tokens = tokens
        self.children: dict[int, _Node] = {}
        self.paths_ending: list[int] = []
        self.size = 0  # tokens in the subtree, set by _subtree_sizes


def _subtree_sizes(roots: Iterable[_Node]) -> None:
    """Sets every node's ``size`` (tokens in its subtree), children before parents, without recursion."""
    stack: list[tuple[_Node, bool]] = [(r, False) for r in roots]
    while stack:
        node, done = stack.pop()
        if done:
            node.size = len(node.tokens) + sum(c.size for c in node.children.values())
        else:
            stack.append((node, True))
            stack.extend((c, False) for c in node.children.values())


def as_token_array(seq: Any, index: int, vocab_size: int | None) -> np.ndarray:
    """Validates one sequence and returns a fresh int64 copy (never a view of the input)."""
    if isinstance(seq, (str, bytes)):
        raise TreeInputError(f"sequence {index}: expected a list of token ids, got {type(seq).__name__}")
    try:
        arr = np.array(seq, copy=True)
    except Exception as exc:  # ragged nesting and similar
        raise TreeInputError(f"sequence {index}: cannot read as a 1-D list of token ids ({exc})") from None
    if arr.ndim != 1:
        raise TreeInputError(f"sequence {index}: expected a 1-D list of token ids, got shape {arr.shape}")
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)  # an empty path (see merge_sequences)
    if arr.dtype == object and all(isinstance(x, int) and not isinstance(x, bool) for x in arr):
        big = max(range(arr.size), key=lambda i: arr[i])
        raise TreeInputError(f"sequence {index}: token id {arr[big]!r} at position {big} is over 2**63 - 1, "
                             "the largest a token id can be")
    if arr.dtype == bool or not (np.issubdtype(arr.dtype, np.integer) or np.issubdtype(arr.dtype, np.floating)):
        raise TreeInputError(f"sequence {index}: token ids must be integers, got dtype {arr.dtype}")
    if np.issubdtype(arr.dtype, np.floating):
        bad = np.flatnonzero(~np.isfinite(arr) | (arr != np.round(arr)))
        if bad.size:
            raise TreeInputError(
                f"sequence {index}: token ids must be integers; position {int(bad[0])} holds {arr[bad[0]]!r}"
            )
    # Before the cast, which would wrap them (a float compares with 2**63, which int64 cannot hold).
    huge = np.flatnonzero(arr >= 2.0**63 if np.issubdtype(arr.dtype, np.floating) else arr > np.iinfo(np.int64).max)
    if huge.size:
        raise TreeInputError(f"sequence {index}: token id {seq[int(huge[0])]!r} at position {int(huge[0])} is over "
                             "2**63 - 1, the largest a token id can be")
    arr = arr.astype(np.int64)
    neg = np.flatnonzero(arr < 0)
    if neg.size:
        raise TreeInputError(f"sequence {index}: negative token id {int(arr[neg[0]])} at position {int(neg[0])}")
    if vocab_size is not None:
        big = np.flatnonzero(arr >= vocab_size)
        if big.size:
            raise TreeInputError(
                f"sequence {index}: token id {int(arr[big[0]])} at position {int(big[0])} "
                f"is out of range for vocab_size={vocab_size}"
            )
    return arr


def warn_empty_paths(empty: list[int]) -> None:
    """Warns once per tree (`TreeWarning`) that sequences are empty, naming them: each stays a
    path with no tokens, which trains nothing and enters no mean."""
    shown = ", ".join(map(str, empty[:8])) + (f" and {len(empty) - 8} more" if len(empty) > 8 else "")
    warnings.warn(f"treecompile: {len(empty)} empty sequence(s) (sequence {shown}): each is a path with no tokens; "
                  "it trains nothing and enters no mean (a seq-mean loss divides by the paths that have tokens)",
                  TreeWarning, stacklevel=3)


def as_mask_array(mask: Any, index: int, length: int) -> np.ndarray:
    arr = np.array(mask, copy=True)
    if arr.ndim != 1 or arr.shape[0] != length:
        raise TreeInputError(
            f"loss_masks[{index}] has shape {arr.shape}, but sequence {index} has {length} tokens"
        )
    if arr.dtype != bool:
        if not (np.issubdtype(arr.dtype, np.integer) or np.issubdtype(arr.dtype, np.floating)):
            raise TreeInputError(f"loss_masks[{index}]: expected 0/1 or bool values, got dtype {arr.dtype}")
        bad = np.flatnonzero((arr != 0) & (arr != 1))
        if bad.size:
            raise TreeInputError(
                f"loss_masks[{index}]: values must be 0 or 1; position {int(bad[0])} holds {arr[bad[0]].item()!r}"
            )
        arr = arr.astype(bool)
    return arr


def as_weights(weights: Any, n: int) -> np.ndarray:
    if weights is None:
        return np.ones(n, dtype=np.float64)
    arr = np.array(weights, dtype=np.float64, copy=True)
    if arr.shape != (n,):
        raise TreeInputError(f"weights has shape {arr.shape}, expected ({n},): one weight per sequence")
    bad = np.flatnonzero(~np.isfinite(arr))
    if bad.size:
        raise TreeInputError(f"weights[{int(bad[0])}] is {arr[bad[0]]}: weights must be finite")
    neg = np.flatnonzero(arr < 0)
    if neg.size:
        raise TreeInputError(f"weights[{int(neg[0])}] is {arr[neg[0]]}: weights must be >= 0")
    return arr


def merge_sequences(arrays: list[np.ndarray], *, largest_first: bool) -> tuple[list[np.ndarray], list[int], np.ndarray]:
    """Merges checked sequences into a prefix tree and numbers its nodes in preorder.

    Args:
        arrays: P token arrays (from :func:`as_token_array`).
        largest_first: number every node's children by decreasing subtree size in tokens
            (ties in first-insertion order); else in first-insertion order. Roots stay in
            first-insertion order either way.

    Returns:
        ``(node_tokens, parent, path_node)``: ``[N]`` token runs and parent ids (-1 for a
        root) in preorder, and ``[P]`` the node each path ends at (-1 for an empty sequence:
        a path with no tokens).
    """
    roots: dict[int, _Node] = {}
    for p, seq in enumerate(arrays):
        if seq.size:
            _insert(roots, seq, p)
    if largest_first:
        _subtree_sizes(roots.values())

    # Freeze into preorder arrays: roots in first-insertion order, children in child order.
    order = _largest_first if largest_first else lambda nodes: nodes
    node_tokens: list[np.ndarray] = []
    parent: list[int] = []
    path_node = np.full(len(arrays), -1, dtype=np.int64)
    stack: list[tuple[_Node, int]] = [(r, -1) for r in reversed(list(roots.values()))]
    while stack:
        node, par = stack.pop()
        nid = len(node_tokens)
        node_tokens.append(node.tokens)
        parent.append(par)
        for p in node.paths_ending:
            path_node[p] = nid
        for child in reversed(order(list(node.children.values()))):
            stack.append((child, nid))
    return node_tokens, parent, path_node


def _largest_first(nodes: list[_Node]) -> list[_Node]:
    """``nodes`` by decreasing subtree size in tokens, ties in their given order."""
    return sorted(nodes, key=lambda n: -n.size)


def _insert(roots: dict[int, _Node], seq: np.ndarray, path: int) -> None:
    """Inserts one sequence, splitting nodes where it diverges or ends inside one."""
    children = roots
    pos = 0
    while True:
        first = int(seq[pos])
        node = children.get(first)
        if node is None:
            node = _Node(seq[pos:])
            children[first] = node
            node.paths_ending.append(path)
            return
        seg = node.tokens
        rest = seq[pos:]
        k = min(len(seg), len(rest))
        diff = np.flatnonzero(seg[:k] != rest[:k])
        common = int(diff[0]) if diff.size else k
        if common < len(seg):
            _split(node, common)
        pos += common
        if pos == len(seq):
            node.paths_ending.append(path)
            return
        children = node.children


def _split(node: _Node, at: int) -> None:
    """Splits ``node`` after ``at`` tokens; the tail becomes its only child.

    Paths that ended at ``node`` covered all of it, so they now end at the tail.
    """
    tail = _Node(node.tokens[at:])
    tail.children = node.children
    tail.paths_ending = node.paths_ending
    node.tokens = node.tokens[:at]
    node.children = {int(tail.tokens[0]): tail}
    node.paths_ending = []


def node_masks(
    parent: np.ndarray, offsets: np.ndarray, path_node: np.ndarray, masks: list[np.ndarray | None]
) -> tuple[np.ndarray, dict[tuple[int, int], np.ndarray]]:
    """Chooses each node's default mask (the first path's through it) and records disagreements."""
    total = int(offsets[-1])
    node_mask = np.ones(total, dtype=bool)
    if all(m is None for m in masks):
        return node_mask, {}
    n = parent.shape[0]
    assigned = np.zeros(n, dtype=bool)
    exceptions: dict[tuple[int, int], np.ndarray] = {}
    lengths = np.diff(offsets).astype(np.int64)
    depth_start = root_path_sum(parent, lengths) - lengths
    for p, m in enumerate(masks):
        for v in climb(parent, path_node[p]):
            a, b = int(offsets[v]), int(offsets[v + 1])
            seg = np.ones(b - a, dtype=bool) if m is None else m[depth_start[v] : depth_start[v] + b - a]
            if not assigned[v]:
                node_mask[a:b] = seg
                assigned[v] = True
            elif not np.array_equal(node_mask[a:b], seg):
                exceptions[(p, v)] = seg.copy()
    return node_mask, exceptions
