"""DFS serialization: trees packed side by side into one row, a `TreeBatch`.

Each tree's nodes are laid out in depth-first preorder, so every node's subtree
is one contiguous range of rows and every token is computed once. Several trees
sit side by side in the row as a forest. The per-row fields say everything a
model needs to compute, on that row, exactly what per-path training computes:

* ``position_ids``: the token's position on its own path (siblings repeat positions);
* ``subtree_end``: key row ``k`` is visible to query row ``q`` iff ``k <= q < subtree_end[k]``
  (``k`` is an ancestor of ``q`` or earlier in the same node);
* ``pred_index``: the row whose output predicts the token: the previous row inside a node,
  the parent's last row for a node's first token (shared by all children), -1 for a root's
  first token;
* ``target_weight``: the token's weight in the loss, summed over the paths through it.

Invariants (checked by `TreeBatch.validate`):

1. Nodes are in preorder: ``node_parent[n] < n``; the children of a node tile the rows
   from its end to its subtree's end in order; trees tile the row.
2. ``subtree_end`` is constant on a node and equals the end of its subtree; ``k`` sees
   ``q`` iff ``node(k)`` is an ancestor-or-self of ``node(q)`` and ``k <= q``.
3. ``pred_index[j] = j - 1`` inside a node, the parent's last row at a node start,
   -1 exactly at a root's first row.
4. ``position_ids[j] = position_ids[pred_index[j]] + 1``, and 0 where ``pred_index`` is -1.
5. ``target_weight`` is finite and 0 where ``pred_index`` is -1.
6. ``input_ids`` are in ``[0, vocab_size)``.
7. ``path_count`` is the number of paths through each row's node.
8. Index fields are int64; every per-row field has S entries; no node and no parent link
   crosses a tree boundary (``tree_ids``, ``tree_offsets``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from treecompile.core.advice import warn_low_por_value, warn_untrained
from treecompile.core.errors import TreeInputError
from treecompile.core.preorder import preorder_violation, root_path_rows, subtree_max, subtree_sum
from treecompile.core.tree import TrajectoryTree
from treecompile.core.weights import path_loss_coefficients, path_target_counts, tree_target_weights

__all__ = ["TreeBatch", "pack"]


@dataclass
class TreeBatch:
    """One packed row of S tokens holding a forest of trees in DFS order.

    Per-row fields are 1-D tensors of length S; node fields have length N (all
    nodes of all trees, globally numbered); path fields have length P.

    Attributes:
        input_ids: ``[S]`` int64 token ids.
        position_ids: ``[S]`` int64 position of each token on its own path.
        subtree_end: ``[S]`` int64 exclusive end row of the token's node's subtree.
        pred_index: ``[S]`` int64 row whose output predicts this token, or -1.
        target_weight: ``[S]`` float64 loss weight of predicting this token.
        tree_ids: ``[S]`` int64 index of the row's tree in the forest.
        path_count: ``[S]`` int64 number of paths through the row's token: how many times
            per-path training computes it (for per-token statistics such as an MoE router's
            load-balancing loss, which count a token once per path).
        node_start: ``[N]`` int64 first row of each node.
        node_end: ``[N]`` int64 exclusive last row of each node's own tokens.
        node_parent: ``[N]`` int64 parent node (global id), -1 for roots.
        path_node: ``[P]`` int64 node each path ends at; -1 for a path with no tokens.
        path_tree: ``[P]`` int64 tree of each path.
        path_weight: ``[P]`` float64 path weights.
        path_coef: ``[P]`` float64 per-path loss coefficients of ``loss_mode``.
        path_bits: optional ``[S, C]`` int64 Prompt Trees path bitmask: bit ``k % 64`` of
            chunk ``k // 64`` is set iff the tree's node ``k`` (numbered per tree) is on the
            row's root path.
        tree_offsets: ``[T + 1]`` int64 first row of each tree, then S.
        loss_mode: the loss mode the weights implement.
        n_targets: total target tokens over all paths (path tokens, shared ones counted per path).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    subtree_end: torch.Tensor
    pred_index: torch.Tensor
    target_weight: torch.Tensor
    tree_ids: torch.Tensor
    path_count: torch.Tensor
    node_start: torch.Tensor
    node_end: torch.Tensor
    node_parent: torch.Tensor
    path_node: torch.Tensor
    path_tree: torch.Tensor
    path_weight: torch.Tensor
    path_coef: torch.Tensor
    tree_offsets: torch.Tensor
    loss_mode: str
    n_targets: int
    path_bits: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        """Rows in the batch (S)."""
        return int(self.input_ids.shape[0])

    @property
    def num_nodes(self) -> int:
        """Nodes of all trees (N)."""
        return int(self.node_start.shape[0])

    @property
    def num_paths(self) -> int:
        """Paths of all trees (P)."""
        return int(self.path_node.shape[0])

    @property
    def num_trees(self) -> int:
        """Trees in the forest."""
        return int(self.tree_offsets.shape[0]) - 1

    @property
    def device(self) -> torch.device:
        """Where the tensors are."""
        return self.input_ids.device

    def to(self, device: torch.device | str) -> TreeBatch:
        """A copy with every tensor moved to ``device`` (a checked batch's copy is checked too:
        the copy holds the same values).

        From the CPU to a CUDA device the copies go through pinned memory and do not block the
        host (`to_device`): the next batch can be moved while the GPU still runs this step."""
        device = torch.device(device)
        return self._map(lambda t: to_device(t, device))

    def pin_memory(self) -> TreeBatch:
        """A copy whose CPU tensors are in pinned (page-locked) memory, checked as this batch
        is: what ``DataLoader(pin_memory=True)`` calls on a batch, so that `to` a CUDA device
        copies without staging."""
        return self._map(lambda t: t.pin_memory() if t.device.type == "cpu" and not t.is_pinned() else t)

    def _map(self, fn) -> TreeBatch:
        """A copy with ``fn`` applied to every tensor (one that keeps the values), the check kept."""
        moved = TreeBatch(**{
            f.name: (fn(v) if isinstance(v, torch.Tensor) else v)
            for f in dataclasses.fields(self)
            for v in [getattr(self, f.name)]
        })
        checked = self._fresh_check()
        if checked is not None:
            moved._checked = dataclasses.replace(checked, fingerprint=_fingerprint(moved),
                                                 head=tuple(fn(t) for t in checked.head))
        if self.__dict__.get("_labels_beside"):
            moved._labels_beside = True
        return moved

    def mark_labels_beside(self) -> TreeBatch:
        """Says that the ``labels`` handed beside this batch are its own targets as padded
        rows (what `treecompile.integrations.hf.TreeCollator` returns, for the ``Trainer``'s
        count of trained tokens), so that a tree-compiled model takes them without reading
        them; kept by `to` and `pin_memory`. Returns the batch."""
        self._labels_beside = True
        return self

    def _fresh_check(self) -> _Checked | None:
        """What `validate` found, if no field has changed since (see `_Checked`)."""
        checked = self.__dict__.get("_checked")
        return checked if checked is not None and checked.fingerprint == _fingerprint(self) else None

    def scaled(self, scale: torch.Tensor | float) -> TreeBatch:
        """A copy whose loss weights (``target_weight``, ``path_coef``) are multiplied by
        ``scale``, a finite positive number (a 0-d tensor or a float).

        A checked batch's copy keeps the check: scaling by a finite positive number keeps
        every invariant, so only ``scale`` is read (one scalar, none for a float).

        Raises:
            TreeInputError: ``scale`` is not finite and positive.
        """
        value = float(scale)  # the one host read
        if not (math.isfinite(value) and value > 0):
            _fail(f"the loss weights' scale is {value}: it must be finite and positive")
        if not isinstance(scale, torch.Tensor):
            scale = torch.tensor(value, dtype=torch.float64)
        out = dataclasses.replace(self, target_weight=self.target_weight * scale.to(self.target_weight.device),
                                  path_coef=self.path_coef * scale.to(self.path_coef.device))
        checked = self._fresh_check()
        if checked is not None:
            out._checked = dataclasses.replace(checked, fingerprint=_fingerprint(out))
        return out

    def head_index(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(dest [M], rows [R], slot [M])``: the rows holding a target, the distinct rows that
        predict one, and which of those predicts each target (``rows[slot] ==
        pred_index[dest]``); from the last check when nothing changed since (no device sync),
        else computed here."""
        checked = self._fresh_check()
        if checked is not None:
            return checked.head
        dest = torch.nonzero(self.pred_index >= 0).flatten()
        rows, slot = torch.unique(self.pred_index[dest], return_inverse=True)
        return dest, rows, slot

    def node_table(self) -> torch.Tensor:
        """``[N, 3]`` int64 on the CPU: each node's first row, end row and parent (what the
        sequence-scan ops read on the host); from the last check when nothing changed since."""
        checked = self._fresh_check()
        if checked is not None:
            return checked.node_table
        return torch.stack([self.node_start, self.node_end, self.node_parent], 1).cpu()

    def longest_path(self) -> tuple[int, int]:
        """``(tokens, tree)`` of the longest path: from the last check when nothing changed
        since (no read of the batch's tensors), else read from ``position_ids``."""
        checked = self._fresh_check()
        if checked is not None:
            return checked.longest, checked.longest_tree
        pos = self.position_ids.cpu()
        j = int(pos.argmax())
        return int(pos[j]) + 1, int(self.tree_ids[j])

    def path_lengths(self) -> tuple[int, ...]:
        """The distinct lengths in tokens of the paths with a target (two tokens or more),
        ascending (read from the batch's tensors)."""
        ends = self.path_node.cpu()
        ends = ends[ends >= 0]
        lengths = self.position_ids.cpu()[self.node_end.cpu()[ends] - 1] + 1
        return tuple(int(n) for n in torch.unique(lengths) if n >= 2)

    def padded(self, num_tokens: int, *, target: bool = False) -> TreeBatch:
        """A copy with rows appended up to ``num_tokens``, each a one-token tree of weight 0.

        A padding row sees only itself, no row sees it, nothing predicts from it and it has no
        target, so every other row's outputs, the loss and the gradients are unchanged.

        With ``target``, two rows more (at least) are appended and the last two form one
        two-token tree whose second token is a target of weight 0 predicted by the first: the
        batch gains a target, a predicting row and a node, and its loss and gradients are
        unchanged (the target's log-probability is multiplied by 0).
        """
        extra = max(num_tokens - self.num_tokens, 2 if target else 0)
        if extra <= 0:
            return self
        s, t = self.num_tokens, self.num_trees
        dev = self.device

        def ext(x: torch.Tensor, tail: torch.Tensor) -> torch.Tensor:
            return torch.cat([x, tail.to(device=dev, dtype=x.dtype)])

        rows = torch.arange(s, s + extra)
        zeros = torch.zeros(extra, dtype=torch.int64)
        position, pred, end, tree = zeros.clone(), zeros - 1, rows + 1, torch.arange(t, t + extra)
        starts = rows  # each appended tree's first row (and its one node)
        if target:
            a = s + extra - 2
            position[-1], pred[-1], end[-2], tree[-1] = 1, a, a + 2, tree[-2]
            starts = rows[:-1]
        n = len(starts)
        node_end = starts + 1
        node_end[-1] = s + extra
        checked = self._fresh_check()
        out = dataclasses.replace(
            self,
            input_ids=ext(self.input_ids, zeros),
            position_ids=ext(self.position_ids, position),
            subtree_end=ext(self.subtree_end, end),
            pred_index=ext(self.pred_index, pred),
            target_weight=ext(self.target_weight, zeros),
            tree_ids=ext(self.tree_ids, tree),
            path_count=ext(self.path_count, zeros),
            node_start=ext(self.node_start, starts),
            node_end=ext(self.node_end, node_end),
            node_parent=ext(self.node_parent, torch.full((n,), -1)),
            tree_offsets=ext(self.tree_offsets, torch.cat([starts[1:], torch.tensor([s + extra])])),
            path_bits=None if self.path_bits is None else ext(
                self.path_bits, torch.zeros(extra, self.path_bits.shape[1], dtype=torch.int64).index_fill_(1, torch.tensor([0]), 1)
            ),
        )
        if checked is not None:
            # The padding trees are one-token trees with no target that predict nothing (and
            # with ``target`` one two-token tree whose target has weight 0): the head index
            # gains that target, the node table one root node per tree.
            head = checked.head
            if target:
                dest, prow, slot = head
                head = (ext(dest, torch.tensor([s + extra - 1])), ext(prow, torch.tensor([s + extra - 2])),
                        ext(slot, torch.tensor([prow.shape[0]])))
            pad_nodes = torch.stack([starts, node_end, torch.full((n,), -1)], 1)
            out._checked = dataclasses.replace(
                checked, fingerprint=_fingerprint(out), max_id=max(checked.max_id, 0), head=head,
                node_table=torch.cat([checked.node_table, pad_nodes]))
        return out

    def path_rows(self, p: int) -> torch.Tensor:
        """``[T_p]`` rows of path ``p`` from its root, in path order."""
        rows = root_path_rows(self.node_start.cpu().numpy(), self.node_end.cpu().numpy(),
                              self.node_parent.cpu().numpy(), int(self.path_node[p]))
        return torch.from_numpy(rows).to(self.device)

    def reference_attention_mask(self) -> torch.Tensor:
        """``[S, S]`` bool, entry ``[q, k]`` true iff query ``q`` sees key ``k``.

        A reference for tests and small examples only: O(S^2) memory.
        """
        idx = torch.arange(self.num_tokens, device=self.device)
        q, k = idx[:, None], idx[None, :]
        return (k <= q) & (q < self.subtree_end[None, :])

    def validate(self, vocab_size: int | None = None) -> TreeBatch:
        """Checks every invariant listed in `treecompile.core.batch`; returns self.

        The check reads the batch on the host (O(S + N)), once: what it found is kept with the
        identity and version of every tensor it read, and a later call on unchanged tensors
        (in-place changes through torch bump a tensor's version; writes through a NumPy view
        do not) checks only ``vocab_size``, without reading the batch back from its device.
        `pack` checks the batch it builds, and `to` carries the check to the moved copy.

        Raises:
            TreeInputError: naming the first violated invariant and where.
        """
        checked = self._fresh_check()
        if checked is None:
            checked = _validate(self)
            self._checked = checked
        if vocab_size is not None and checked.max_id >= vocab_size:
            ids = self.input_ids.cpu().numpy()
            bad = int(np.flatnonzero(ids >= vocab_size)[0])
            _fail(f"input_ids[{bad}] = {int(ids[bad])} is out of range for vocab_size={vocab_size}")
        return self


@dataclasses.dataclass(frozen=True)
class _Checked:
    """What `TreeBatch.validate` found: the fingerprint of the fields it read (each tensor's
    ``id`` and version, the other fields' values), the largest token id and the longest path."""

    fingerprint: tuple
    max_id: int
    longest: int
    longest_tree: int
    head: tuple  # (dest, rows, slot) on the batch's device: TreeBatch.head_index
    node_table: torch.Tensor  # [N, 3] on the CPU: TreeBatch.node_table


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``t`` on ``device``. A CPU tensor bound for CUDA is pinned (unless it is already) and
    copied with ``non_blocking=True``: a copy from pageable memory waits for every kernel
    queued before it (the previous training step) and holds the host meanwhile. The pinned
    buffer is the caching host allocator's, which keeps it until the copy has run."""
    device = torch.device(device)
    if device.type == "cuda" and t.device.type == "cpu":
        return (t if t.is_pinned() else t.pin_memory()).to(device, non_blocking=True)
    return t.to(device)


def on_host(batch: TreeBatch) -> TreeBatch:
    """``batch`` on the CPU, for calls that cut it into pieces on the host and move each piece
    to the device itself (streamed parts, CP ranks): a CPU batch as it is, no transfer at all;
    a device batch read back once, its check kept, rather than tensor by tensor as the pieces
    are cut."""
    return batch if batch.device.type == "cpu" else batch.to("cpu")


def _fingerprint(b: TreeBatch) -> tuple:
    return tuple((id(v), v._version) if isinstance(v, torch.Tensor) else v
                 for v in (getattr(b, f.name) for f in dataclasses.fields(b)))


def _fail(msg: str) -> None:
    raise TreeInputError(f"invalid TreeBatch: {msg}")


def _validate(b: TreeBatch) -> _Checked:
    s = b.num_tokens
    for name in ("input_ids", "position_ids", "subtree_end", "pred_index", "target_weight", "tree_ids", "path_count"):
        t = getattr(b, name)
        if t.dim() != 1 or t.shape[0] != s:
            _fail(f"{name} has shape {tuple(t.shape)}, expected ({s},)")
    for name in ("input_ids", "position_ids", "subtree_end", "pred_index", "tree_ids", "path_count", "node_start",
                 "node_end", "node_parent", "path_node", "tree_offsets"):
        if getattr(b, name).dtype != torch.int64:
            _fail(f"{name} must be int64, got {getattr(b, name).dtype}")
    ids = b.input_ids.cpu().numpy()
    if s == 0:
        _fail("the batch is empty")
    if ids.min() < 0:
        bad = int(np.flatnonzero(ids < 0)[0])
        _fail(f"input_ids[{bad}] = {int(ids[bad])} is out of range: token ids are never negative")

    start, end, parent = (t.cpu().numpy() for t in (b.node_start, b.node_end, b.node_parent))
    n = start.shape[0]
    if n == 0 or start[0] != 0 or end[-1] != s or np.any(start[1:] != end[:-1]) or np.any(end <= start):
        _fail("nodes must tile the row in order, each with at least one token")
    why = preorder_violation(parent)
    if why is not None:
        _fail(f"node_parent: {why}")
    sub_end_node = subtree_max(parent, np.arange(1, n + 1))
    node_sub_end_row = np.append(start, s)[sub_end_node]

    lengths = end - start
    node_of_row = np.repeat(np.arange(n), lengths)
    rows = np.arange(s)
    sub = b.subtree_end.cpu().numpy()
    bad = np.flatnonzero(sub != node_sub_end_row[node_of_row])
    if bad.size:
        j = int(bad[0])
        _fail(f"subtree_end[{j}] = {int(sub[j])}, but its node's subtree ends at {int(node_sub_end_row[node_of_row[j]])}")
    first = start[node_of_row] == rows
    par = parent[node_of_row]
    expected_pred = np.where(first, np.where(par >= 0, end[np.maximum(par, 0)] - 1, -1), rows - 1)
    pred = b.pred_index.cpu().numpy()
    bad = np.flatnonzero(pred != expected_pred)
    if bad.size:
        j = int(bad[0])
        _fail(f"pred_index[{j}] = {int(pred[j])}, expected {int(expected_pred[j])}")
    pos = b.position_ids.cpu().numpy()
    expected_pos = np.where(pred >= 0, pos[np.maximum(pred, 0)] + 1, 0)
    bad = np.flatnonzero(pos != expected_pos)
    if bad.size:
        j = int(bad[0])
        _fail(f"position_ids[{j}] = {int(pos[j])}, expected {int(expected_pos[j])} (one past its predecessor's)")
    w = b.target_weight.detach().cpu().numpy()
    bad = np.flatnonzero(~np.isfinite(w) | ((pred < 0) & (w != 0)))
    if bad.size:
        j = int(bad[0])
        _fail(f"target_weight[{j}] = {w[j]}: weights must be finite and 0 where there is no predictor")
    offs = b.tree_offsets.cpu().numpy()
    if offs[0] != 0 or offs[-1] != s or np.any(np.diff(offs) <= 0):
        _fail("tree_offsets must start at 0, end at S and increase")
    tid = b.tree_ids.cpu().numpy()
    if np.any(tid != np.repeat(np.arange(len(offs) - 1), np.diff(offs))):
        _fail("tree_ids must number the trees given by tree_offsets")
    # A node, or a link from a node to its parent, never crosses a tree boundary.
    if np.any(tid[start] != tid[end - 1]) or np.any((parent >= 0) & (tid[start] != tid[start[np.maximum(parent, 0)]])):
        _fail("a node or a parent link crosses a tree boundary")
    ends = b.path_node.cpu().numpy()
    if ends.size and (ends.min() < -1 or ends.max() >= n):
        _fail("path_node holds a node id out of range (-1: a path with no tokens)")
    through = subtree_sum(parent, np.bincount(ends[ends >= 0], minlength=n))
    bad = np.flatnonzero(b.path_count.cpu().numpy() != through[node_of_row])
    if bad.size:
        j = int(bad[0])
        _fail(f"path_count[{j}] = {int(b.path_count[j])}, but {int(through[node_of_row[j]])} paths pass through it")
    if b.path_bits is not None:
        if b.path_bits.dim() != 2 or b.path_bits.shape[0] != s:
            _fail(f"path_bits has shape {tuple(b.path_bits.shape)}, expected ({s}, C)")
    j = int(pos.argmax())
    dest = np.flatnonzero(pred >= 0)
    rows_, slot = np.unique(pred[dest], return_inverse=True)
    head = tuple(torch.from_numpy(np.ascontiguousarray(x, dtype=np.int64)).to(b.device) for x in (dest, rows_, slot))
    return _Checked(fingerprint=_fingerprint(b), max_id=int(ids.max()), longest=int(pos[j]) + 1,
                    longest_tree=int(tid[j]), head=head,
                    node_table=torch.from_numpy(np.stack([start, end, parent], 1).astype(np.int64)))


def _tree_path_bits(tree: TrajectoryTree, chunks: int) -> np.ndarray:
    """``[N, chunks]`` uint64 path vectors: node ``k``'s bit on every node below it."""
    n = tree.num_nodes
    bits = np.zeros((n, chunks), dtype=np.uint64)
    for v in range(n):
        p = tree.parent[v]
        if p >= 0:
            bits[v] = bits[p]
        bits[v, v // 64] |= np.uint64(1) << np.uint64(v % 64)
    return bits


def _checked_trees(trees: Any, max_tokens: int | None, vocab_size: int | None) -> list[TrajectoryTree]:
    """``trees`` as a list of trees, refused with a `TreeInputError` when it is not one, is over
    ``max_tokens`` rows or holds an id at or above ``vocab_size``."""
    if not isinstance(trees, TrajectoryTree) and (isinstance(trees, (str, bytes, dict)) or not hasattr(trees, "__iter__")):
        raise TreeInputError(f"pack takes a TrajectoryTree or a list of them, got {type(trees).__name__}")
    if isinstance(trees, TrajectoryTree):
        trees = [trees]
    trees = list(trees)
    if not trees:
        raise TreeInputError("pack needs at least one tree")
    for i, t in enumerate(trees):
        if not isinstance(t, TrajectoryTree):
            raise TreeInputError(f"trees[{i}] is a {type(t).__name__}, not a TrajectoryTree")
    sizes = [t.num_tokens for t in trees]
    total = sum(sizes)
    if max_tokens is not None and total > max_tokens:
        biggest = int(np.argmax(sizes))
        raise TreeInputError(
            f"the batch has {total} tokens, over max_tokens={max_tokens} (largest tree: #{biggest} "
            f"with {sizes[biggest]} tokens); pack fewer trees or partition them"
        )
    if vocab_size is not None:
        for i, t in enumerate(trees):
            if t.tokens.size and t.tokens.max() >= vocab_size:
                j = int(np.argmax(t.tokens >= vocab_size))
                raise TreeInputError(
                    f"tree {i}: token id {int(t.tokens[j])} is out of range for vocab_size={vocab_size}"
                )
    return trees


def _row_columns(trees: list[TrajectoryTree], coef: np.ndarray, path_bits: bool) -> dict[str, list[np.ndarray]]:
    """Per `TreeBatch` field, its parts, tree by tree (rows, nodes and paths numbered across the
    batch): token, position, subtree end, predictor row, target weight (``coef``: the paths'
    coefficients), tree id, path count; node start, end and parent; each path's end node
    (-1: no tokens) and tree; the path bit vectors (with ``path_bits``, else none)."""
    ids, pos, sub, pred, tw, tid, pcount = [], [], [], [], [], [], []
    nstart, nend, npar, pnode, ptree = [], [], [], [], []
    row_base = node_base = path_base = 0
    chunks = max((t.num_nodes + 63) // 64 for t in trees)
    bits = []
    for ti, t in enumerate(trees):
        n, lengths, offs = t.num_nodes, t.node_lengths, t.node_offsets
        node_of_row = np.repeat(np.arange(n), lengths)
        local = np.arange(t.num_tokens) - offs[node_of_row]
        ids.append(t.tokens)
        pos.append(t.depth_start[node_of_row] + local)
        sub.append(offs[t.subtree_end_node][node_of_row] + row_base)
        parent_last = np.where(t.parent >= 0, offs[np.maximum(t.parent, 0) + 1] - 1 + row_base, -1)
        pred.append(np.where(local == 0, parent_last[node_of_row], np.arange(t.num_tokens) - 1 + row_base))
        tw.append(tree_target_weights(t, coef[path_base : path_base + t.num_paths]))
        tid.append(np.full(t.num_tokens, ti, dtype=np.int64))
        pcount.append(t.path_counts()[node_of_row])
        nstart.append(offs[:-1] + row_base)
        nend.append(offs[1:] + row_base)
        npar.append(np.where(t.parent >= 0, t.parent + node_base, -1))
        pnode.append(np.where(t.path_node >= 0, t.path_node + node_base, -1))
        ptree.append(np.full(t.num_paths, ti, dtype=np.int64))
        if path_bits:
            bits.append(_tree_path_bits(t, chunks)[node_of_row])
        row_base += t.num_tokens
        node_base += n
        path_base += t.num_paths
    return dict(input_ids=ids, position_ids=pos, subtree_end=sub, pred_index=pred, target_weight=tw, tree_ids=tid,
                path_count=pcount, node_start=nstart, node_end=nend, node_parent=npar, path_node=pnode,
                path_tree=ptree, path_bits=bits)


def pack(
    trees: TrajectoryTree | Sequence[TrajectoryTree],
    *,
    loss_mode: str = "token-mean",
    denominator: float | None = None,
    max_tokens: int | None = None,
    vocab_size: int | None = None,
    path_bits: bool = False,
    device: torch.device | str | None = None,
    warn_por: bool = True,
) -> TreeBatch:
    """Serializes trees depth-first into one packed row.

    Args:
        trees: a tree or a list of trees, placed side by side as a forest.
        loss_mode: a key of `treecompile.core.loss.LOSS_MODES`; the normalization is
            over all paths of all trees in the batch.
        denominator: replaces the batch's own normalizer (token count or path count), for
            normalizing globally over micro-batches and ranks.
        max_tokens: refuse a batch with more rows than this.
        vocab_size: refuse token ids at or above this.
        path_bits: also build the Prompt Trees path bitmask (``[S, C]`` int64).
        device: where to put the tensors.
        warn_por: warn (`treecompile.core.advice.TreeWarning`, once per call site) when the
            batch's POR is so low that per-path training may be as fast
            (`treecompile.core.advice.low_por_advice`).

    Returns:
        The `TreeBatch`.
    """
    trees = _checked_trees(trees, max_tokens, vocab_size)
    sizes = [t.num_tokens for t in trees]
    total = sum(sizes)
    per_tree = [path_target_counts(t) for t in trees]
    warn_untrained(trees, per_tree)
    counts = np.concatenate(per_tree)
    weights = np.concatenate([t.path_weight for t in trees])
    coef = path_loss_coefficients(counts, weights, loss_mode, denominator,
                                  empty=np.concatenate([t.path_node < 0 for t in trees]))

    cols = _row_columns(trees, coef, path_bits)
    bits = cols.pop("path_bits")
    tensors = {name: torch.from_numpy(np.ascontiguousarray(np.concatenate(parts))).to(
        dtype=torch.float64 if name == "target_weight" else torch.int64) for name, parts in cols.items()}

    # Per-path training would compute every row once per path through it: a batch that shares
    # too little gains nothing from the tree (once per call site, as warnings are).
    if warn_por:
        path_tokens = int(tensors["path_count"].sum())
        warn_low_por_value(1.0 - total / path_tokens if path_tokens else 0.0, stacklevel=2)

    # Built and checked on the host, then moved: the check travels with it (TreeBatch.validate),
    # so the model's call reads nothing back from the device.
    batch = TreeBatch(
        **tensors,
        path_weight=torch.from_numpy(weights.copy()),
        path_coef=torch.from_numpy(coef.copy()),
        tree_offsets=torch.tensor(np.concatenate([[0], np.cumsum(sizes)]), dtype=torch.int64),
        loss_mode=loss_mode,
        n_targets=int(counts.sum()),
        path_bits=torch.from_numpy(np.concatenate([b.view(np.int64) for b in bits])) if path_bits else None,
    ).validate()
    return batch if device is None else batch.to(device)
