"""Trajectory trees: token sequences merged into a compressed prefix tree.

A `TrajectoryTree` holds a set of *paths* (token sequences, each with a
weight and a per-token loss mask) merged so that every shared prefix is stored
once. Each node holds a maximal run of tokens that the same set of paths passes
through; a node boundary falls wherever paths branch or a path ends. A path may
end at an internal node (a multi-turn sample that is a prefix of a later one),
and two identical sequences stay two paths that end at the same node.

Nodes are numbered in depth-first preorder, so a node's subtree is the
contiguous id range ``[n, subtree_end_node[n])`` and every parent id is smaller
than its children's. Several roots are allowed: sequences that share no first
token form a forest.

Loss masks are per path and per token. Paths that share a token usually agree
on its mask; where they do not, the tree keeps the disagreement as a sparse
exception so that the loss weights stay exact (see `treecompile.core.loss`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from treecompile.core.errors import TreeInputError
from treecompile.core.preorder import climb, preorder_violation, root_path_sum, subtree_max, subtree_sum
from treecompile.core.tree_build import (
    as_mask_array,
    as_token_array,
    as_weights,
    merge_sequences,
    node_masks,
    warn_empty_paths,
)

__all__ = ["TrajectoryTree", "TreeStats", "Path"]


@dataclass(frozen=True)
class Path:
    """One root-to-endpoint path of a tree, as per-path training sees it.

    Attributes:
        tokens: ``[T]`` int64 token ids.
        weight: the path's loss weight.
        loss_mask: ``[T]`` bool, which tokens are loss targets (position 0 never is:
            it has no preceding token to predict it from).
        end_node: the node the path ends at.
    """

    tokens: np.ndarray
    weight: float
    loss_mask: np.ndarray
    end_node: int


@dataclass(frozen=True)
class TreeStats:
    """Size and shape of one tree (or a set of trees, summed).

    ``por`` (potential overlap ratio) is the share of path tokens that the tree
    removes: ``1 - tree_tokens / path_tokens``. ``1 / (1 - por)`` bounds the
    speed-up of training on the tree over training on each path.

    Attributes:
        tree_tokens: tokens of the tree, each shared prefix counted once (the packed rows).
        path_tokens: tokens of all paths, each counted on its own (per-path training).
        por: potential overlap ratio, ``1 - tree_tokens / path_tokens``.
        n_paths: root-to-leaf paths (sequences), duplicates included.
        n_nodes: nodes of the compressed tree (runs of tokens without a branch).
        n_leaves: nodes without children.
        n_roots: nodes without a parent (more than one when sequences differ at the first token).
        depth_nodes: most nodes on one root path.
        depth_tokens: tokens of the longest path.
        max_branching: most children of one node.
        mean_branching: mean number of children of the nodes that have any.
    """

    tree_tokens: int
    path_tokens: int
    por: float
    n_paths: int
    n_nodes: int
    n_leaves: int
    n_roots: int
    depth_nodes: int
    depth_tokens: int
    max_branching: int
    mean_branching: float

    def as_dict(self) -> dict[str, Any]:
        """The statistics as a plain dict."""
        return dict(self.__dict__)


#: Child orders `TrajectoryTree.from_sequences` accepts.
CHILD_ORDERS = ("largest_first", "insertion")


class TrajectoryTree:
    """A compressed prefix tree over token sequences (paths).

    Build one with `from_sequences` or `from_messages`; the
    constructor takes the frozen arrays and is not meant to be called directly.

    Attributes:
        tokens: ``[tree_tokens]`` int64, every node's tokens in node order.
        node_offsets: ``[N + 1]`` int64, node ``n`` holds ``tokens[node_offsets[n]:node_offsets[n+1]]``.
        parent: ``[N]`` int64, parent node id, ``-1`` for a root.
        subtree_end_node: ``[N]`` int64, node ``n``'s subtree is nodes ``[n, subtree_end_node[n])``.
        depth_start: ``[N]`` int64, number of tokens on the path before node ``n``
            (the position of its first token).
        path_node: ``[P]`` int64, node each path ends at (its last token is that node's last token);
            -1 for a path with no tokens (an empty sequence).
        path_weight: ``[P]`` float64.
        node_mask: ``[tree_tokens]`` bool, the loss mask of each tree token for the
            paths that do not have an exception there.
        mask_exceptions: ``{(path, node): mask}``, the node-local mask of a path that
            disagrees with ``node_mask`` on that node.
    """

    def __init__(
        self,
        *,
        tokens: np.ndarray,
        node_offsets: np.ndarray,
        parent: np.ndarray,
        path_node: np.ndarray,
        path_weight: np.ndarray,
        node_mask: np.ndarray,
        mask_exceptions: dict[tuple[int, int], np.ndarray] | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> None:
        self.tokens = np.asarray(tokens, dtype=np.int64)
        self.node_offsets = np.asarray(node_offsets, dtype=np.int64)
        self.parent = np.asarray(parent, dtype=np.int64)
        self.path_node = np.asarray(path_node, dtype=np.int64)
        self.path_weight = np.asarray(path_weight, dtype=np.float64)
        self.node_mask = np.asarray(node_mask, dtype=bool)
        self.mask_exceptions = dict(mask_exceptions or {})
        self.metadata = dict(metadata or {})
        self._check_structure()
        n = self.num_nodes
        lengths = self.node_lengths
        # Preorder numbering: a node's subtree ends where the next node that is not its
        # descendant begins, one past the largest id in it.
        self.subtree_end_node = subtree_max(self.parent, np.arange(1, n + 1, dtype=np.int64))
        self.depth_start = root_path_sum(self.parent, lengths.astype(np.int64)) - lengths

    # ------------------------------------------------------------------ building

    @classmethod
    def from_sequences(
        cls,
        seqs: Sequence[Sequence[int]],
        *,
        weights: Sequence[float] | None = None,
        loss_masks: Sequence[Sequence[int] | None] | None = None,
        vocab_size: int | None = None,
        max_tokens: int | None = None,
        metadata: dict[str, Any] | None = None,
        child_order: str = "largest_first",
    ) -> TrajectoryTree:
        """Merges token sequences into one compressed prefix tree.

        Args:
            seqs: P sequences of token ids (lists, arrays or 1-D tensors). None is modified.
            weights: ``[P]`` non-negative path weights (default 1).
            loss_masks: per sequence, ``[T_p]`` 0/1 values or None (all ones). Position 0
                is never a target whatever its mask says.
            vocab_size: if given, ids at or above it are refused.
            max_tokens: if given, a tree with more tokens than this is refused.
            metadata: free-form, kept with the tree (and in JSONL).
            child_order: ``"largest_first"`` (default) numbers every node's children by
                decreasing subtree size in tokens (ties in first-insertion order; roots stay
                in first-insertion order); ``"insertion"`` keeps first-insertion order. The largest subtree then
                follows its parent directly in the packed row, so more attention blocks
                see one unbroken run of ancestor keys: fewer blocks to compute on real trees
                (docs/benchmarks.md, "Block layout"). The paths, and what they train, are
                the same either way.

        Returns:
            The tree. Sequences that share no first token become separate roots.

        An empty sequence (a rollout that produced nothing) is a path with no tokens
        (``path_node`` -1): it trains nothing and enters no mean (a seq-mean loss divides by
        the paths that have tokens); a warning names it.

        Raises:
            TreeInputError: on no sequences or only empty ones, non-integer, negative or out-of-range
                ids, masks of the wrong length or with values other than 0/1,
                negative or non-finite weights, or a tree over ``max_tokens``.
        """
        if isinstance(seqs, (str, bytes)) or not isinstance(seqs, Iterable):
            raise TreeInputError("seqs must be a list of token-id sequences")
        if child_order not in CHILD_ORDERS:
            raise TreeInputError(f"child_order must be one of {CHILD_ORDERS}, got {child_order!r}")
        seqs = list(seqs)
        if not seqs:
            raise TreeInputError("seqs is empty: a tree needs at least one sequence")
        arrays = [as_token_array(s, i, vocab_size) for i, s in enumerate(seqs)]
        w = as_weights(weights, len(arrays))
        if loss_masks is not None:
            loss_masks = list(loss_masks)
            if len(loss_masks) != len(arrays):
                raise TreeInputError(f"loss_masks has {len(loss_masks)} entries for {len(arrays)} sequences")
            masks = [
                None if m is None else as_mask_array(m, i, len(arrays[i])) for i, m in enumerate(loss_masks)
            ]
        else:
            masks = [None] * len(arrays)

        empty = [i for i, a in enumerate(arrays) if not a.size]
        if len(empty) == len(arrays):
            raise TreeInputError(f"every sequence is empty ({len(arrays)} of them): a tree needs at least one token")
        if empty:
            warn_empty_paths(empty)
        node_tokens, parent, path_node = merge_sequences(arrays, largest_first=child_order == "largest_first")
        lengths = np.array([len(t) for t in node_tokens], dtype=np.int64)
        offsets = np.zeros(len(node_tokens) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        if max_tokens is not None and offsets[-1] > max_tokens:
            raise TreeInputError(
                f"the tree has {int(offsets[-1])} tokens, over the budget max_tokens={max_tokens}; "
                "split its paths over several trees (see treecompile partitioning) or raise the budget"
            )
        node_mask, exceptions = node_masks(np.asarray(parent), offsets, path_node, masks)
        return cls(
            tokens=np.concatenate(node_tokens),
            node_offsets=offsets,
            parent=np.asarray(parent, dtype=np.int64),
            path_node=path_node,
            path_weight=w,
            node_mask=node_mask,
            mask_exceptions=exceptions,
            metadata=metadata,
        )

    @classmethod
    def from_messages(
        cls, conversations: Sequence[Sequence[dict]], tokenizer: Any, *, vocab_size: int | None = None, **options: Any
    ) -> TrajectoryTree:
        """Builds a tree from chat conversations; see `treecompile.chat.to_tree.tree_from_messages`."""
        from treecompile.chat.conversation import RenderOptions, render_conversations

        weights = options.pop("weights", None)
        paths = render_conversations(conversations, tokenizer, RenderOptions(**options), weights=weights)
        return cls.from_rendered(paths, vocab_size=vocab_size)

    @classmethod
    def from_rendered(cls, paths: Any, *, vocab_size: int | None = None) -> TrajectoryTree:
        """Merges rendered conversations (a `treecompile.chat.conversation.RenderedPaths`) into a tree."""
        return cls.from_sequences(paths.sequences, weights=paths.weights, loss_masks=paths.masks,
                                  vocab_size=vocab_size, metadata=paths.metadata)

    # ------------------------------------------------------------------ queries

    @property
    def num_nodes(self) -> int:
        """Number of nodes (N)."""
        return int(self.parent.shape[0])

    @property
    def num_paths(self) -> int:
        """Number of paths (P)."""
        return int(self.path_node.shape[0])

    @property
    def num_tokens(self) -> int:
        """Tokens in the tree (each shared token once)."""
        return int(self.node_offsets[-1])

    @property
    def node_lengths(self) -> np.ndarray:
        """``[N]`` tokens per node."""
        return np.diff(self.node_offsets)

    def node_tokens(self, n: int) -> np.ndarray:
        """``[len]`` the tokens of node ``n``."""
        return self.tokens[self.node_offsets[n] : self.node_offsets[n + 1]]

    def path_nodes(self, p: int) -> list[int]:
        """Node ids from the root to path ``p``'s end node."""
        return list(climb(self.parent, self.path_node[p]))[::-1]

    def path_length(self, p: int) -> int:
        """Number of tokens on path ``p``."""
        n = int(self.path_node[p])
        return int(self.depth_start[n] + self.node_lengths[n]) if n >= 0 else 0

    @property
    def empty_paths(self) -> np.ndarray:
        """Indices of the paths with no tokens (empty sequences), ascending."""
        return np.flatnonzero(self.path_node < 0)

    @property
    def num_paths_with_tokens(self) -> int:
        """Paths that have at least one token: what a seq-mean loss divides by."""
        return int((self.path_node >= 0).sum())

    def path_mask_segment(self, p: int, n: int) -> np.ndarray:
        """Path ``p``'s loss mask on node ``n``'s tokens."""
        exc = self.mask_exceptions.get((p, n))
        if exc is not None:
            return exc
        return self.node_mask[self.node_offsets[n] : self.node_offsets[n + 1]]

    def path(self, p: int) -> Path:
        """Path ``p`` exactly as it was given (tokens, weight and loss mask)."""
        nodes = self.path_nodes(p)
        if not nodes:
            return Path(tokens=np.zeros(0, dtype=np.int64), weight=float(self.path_weight[p]),
                        loss_mask=np.zeros(0, dtype=bool), end_node=-1)
        tokens = np.concatenate([self.node_tokens(n) for n in nodes])
        mask = np.concatenate([self.path_mask_segment(p, n) for n in nodes]).copy()
        return Path(tokens=tokens, weight=float(self.path_weight[p]), loss_mask=mask, end_node=nodes[-1])

    def paths(self) -> list[Path]:
        """Every path (`path`), in path order."""
        return [self.path(p) for p in range(self.num_paths)]

    def sequences(self) -> list[list[int]]:
        """Every path's tokens, as lists, in path order."""
        return [self.path(p).tokens.tolist() for p in range(self.num_paths)]

    def path_counts(self) -> np.ndarray:
        """``[N]`` number of paths through each node (a node a path ends at counts it)."""
        ends = self.path_node[self.path_node >= 0]
        return subtree_sum(self.parent, np.bincount(ends, minlength=self.num_nodes).astype(np.int64))

    def stats(self) -> TreeStats:
        """Sizes and shape; ``por = 1 - tree_tokens / path_tokens``."""
        lengths = self.node_lengths
        path_tokens = int(sum(self.path_length(p) for p in range(self.num_paths)))
        tree_tokens = self.num_tokens
        n_children = np.bincount(self.parent[self.parent >= 0], minlength=self.num_nodes)
        internal = n_children[n_children > 0]
        node_depth = root_path_sum(self.parent, np.ones(self.num_nodes, dtype=np.int64))
        return TreeStats(
            tree_tokens=tree_tokens,
            path_tokens=path_tokens,
            por=1.0 - tree_tokens / path_tokens,
            n_paths=self.num_paths,
            n_nodes=self.num_nodes,
            n_leaves=int((n_children == 0).sum()),
            n_roots=int((self.parent < 0).sum()),
            depth_nodes=int(node_depth.max()),
            depth_tokens=int((self.depth_start + lengths).max()),
            max_branching=int(n_children.max()) if self.num_nodes else 0,
            mean_branching=float(internal.mean()) if internal.size else 0.0,
        )

    def __repr__(self) -> str:
        s = self.stats()
        return (
            f"TrajectoryTree(paths={s.n_paths}, nodes={s.n_nodes}, tree_tokens={s.tree_tokens}, "
            f"path_tokens={s.path_tokens}, por={s.por:.3f})"
        )

    # ------------------------------------------------------------------ checks

    def _check_structure(self) -> None:
        n = self.parent.shape[0]
        if n == 0:
            raise TreeInputError("a tree needs at least one node (one token)")
        if self.node_offsets.shape != (n + 1,) or self.node_offsets[0] != 0:
            raise TreeInputError("node_offsets must have N+1 entries starting at 0")
        if np.any(np.diff(self.node_offsets) <= 0):
            raise TreeInputError("every node must hold at least one token")
        if self.tokens.shape != (int(self.node_offsets[-1]),) or self.node_mask.shape != self.tokens.shape:
            raise TreeInputError("tokens and node_mask must hold node_offsets[-1] entries")
        why = preorder_violation(self.parent)
        if why is not None:
            raise TreeInputError(f"nodes must be in depth-first preorder: {why}")
        if self.path_node.size and (self.path_node.min() < -1 or self.path_node.max() >= n):
            raise TreeInputError("path_node holds a node id out of range (-1: a path with no tokens)")
        if self.path_weight.shape != self.path_node.shape:
            raise TreeInputError("path_weight must hold one weight per path")
        if np.any(~np.isfinite(self.path_weight)) or np.any(self.path_weight < 0):
            raise TreeInputError("path weights must be finite and >= 0")
        if self.tokens.size and self.tokens.min() < 0:
            raise TreeInputError("token ids must be >= 0")
        covered = np.zeros(n, dtype=bool)
        covered[self.path_node[self.path_node >= 0]] = True
        n_children = np.bincount(self.parent[self.parent >= 0], minlength=n)
        bad = np.flatnonzero((n_children == 0) & ~covered)
        if bad.size:
            raise TreeInputError(f"leaf node {int(bad[0])} is not the end of any path")
        for (p, v), m in self.mask_exceptions.items():
            if not (0 <= p < self.path_node.size and 0 <= v < n):
                raise TreeInputError(f"mask exception for path {p} on node {v}: no such path or node")
            if m.shape != (int(self.node_offsets[v + 1] - self.node_offsets[v]),):
                raise TreeInputError(f"mask exception for path {p} on node {v} has the wrong length")

    # ------------------------------------------------------------------ (de)serialization

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (see ``docs/data-format.md``)."""
        nodes = []
        for v in range(self.num_nodes):
            seg = self.node_mask[self.node_offsets[v] : self.node_offsets[v + 1]]
            entry: dict[str, Any] = {"parent": int(self.parent[v]), "tokens": self.node_tokens(v).tolist()}
            if not seg.all():
                entry["loss_mask"] = seg.astype(np.int8).tolist()
            nodes.append(entry)
        paths = []
        for p in range(self.num_paths):
            entry = {"node": int(self.path_node[p]), "weight": float(self.path_weight[p])}
            exc = {str(v): m.astype(np.int8).tolist() for (q, v), m in self.mask_exceptions.items() if q == p}
            if exc:
                entry["mask_exceptions"] = exc
            paths.append(entry)
        out: dict[str, Any] = {"format": "treecompile.core.tree/1", "nodes": nodes, "paths": paths}
        if self.metadata:
            out["metadata"] = self.metadata
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrajectoryTree:
        """The inverse of `to_dict`; checks the structure like the constructor does."""
        if not isinstance(d, dict):
            raise TreeInputError(f"from_dict takes the dict TrajectoryTree.to_dict gives, got a {type(d).__name__}")
        if d.get("format") != "treecompile.core.tree/1":
            raise TreeInputError(f"unknown tree format {d.get('format')!r}; expected 'treecompile.core.tree/1'")
        missing = [k for k in ("nodes", "paths") if not isinstance(d.get(k), list)]
        if missing:
            raise TreeInputError(f"a tree dict needs the lists {', '.join(map(repr, missing))}")
        nodes = d["nodes"]
        if not nodes:
            raise TreeInputError("a tree dict needs at least one node (one token)")
        toks = [as_token_array(n["tokens"], i, None) for i, n in enumerate(nodes)]
        masks = [np.array(n.get("loss_mask", [1] * len(t)), dtype=bool) for n, t in zip(nodes, toks)]
        offsets = np.zeros(len(nodes) + 1, dtype=np.int64)
        np.cumsum([len(t) for t in toks], out=offsets[1:])
        exceptions = {}
        for p, entry in enumerate(d["paths"]):
            for v, m in entry.get("mask_exceptions", {}).items():
                try:
                    node = int(v)
                except (TypeError, ValueError):
                    raise TreeInputError(f"path {p}: mask_exceptions key {v!r} is not a node index") from None
                exceptions[(p, node)] = np.array(m, dtype=bool)
        return cls(
            tokens=np.concatenate(toks),
            node_offsets=offsets,
            parent=np.array([n["parent"] for n in nodes], dtype=np.int64),
            path_node=np.array([e["node"] for e in d["paths"]], dtype=np.int64),
            path_weight=as_weights([e.get("weight", 1.0) for e in d["paths"]], len(d["paths"])),
            node_mask=np.concatenate(masks),
            mask_exceptions=exceptions,
            metadata=d.get("metadata"),
        )
