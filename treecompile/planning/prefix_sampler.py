"""Samplers that put samples sharing long prefixes into the same micro-batch.

Example:
    >>> from treecompile.planning.prefix_sampler import PrefixGroupedSampler
    >>> system = [7, 7, 7, 7]
    >>> samples = [system + [1, 2], [9, 9, 3], system + [1, 5], [9, 9, 4]]
    >>> sampler = PrefixGroupedSampler(samples, group_size=2, seed=0)
    >>> sorted(sorted(g) for g in sampler.groups())
    [[0, 2], [1, 3]]
    >>> sorted(sampler) == [0, 1, 2, 3]
    True

A random sampler scatters the samples that share a prefix (one system prompt and tool
schema, the earlier turns of one conversation, one prompt's completions) over different
micro-batches, so the prefix tree of each micro-batch shares little. These samplers group
them instead:

1. once: the samples are sorted by their token ids. Neighbours in that order share the
   longest prefixes: the samples are the leaves of a prefix trie in depth-first order, and
   the common prefix of two neighbours is the depth of their lowest common ancestor.
   The order and the neighbours' common prefixes are all that is kept (``O(n)``);
2. each epoch: a random depth-first order of that trie (every branching point's children
   shuffled, identical samples included: the random tie-breaking that makes epochs differ),
   cut into groups of consecutive samples, and the groups shuffled. Every sample is in
   exactly one group.

The prefix tree of consecutive samples in a depth-first order has their lengths minus each
one's common prefix with the one before in tokens, so cuts go where the common prefix lost
is smallest:

* `PrefixGroupedSampler` (a ``Sampler[int]`` for the Hugging Face and TRL ``Trainer``, whose
  data loader takes a fixed ``batch_size``): groups of exactly ``group_size`` samples and at
  most one short group, yielded last so that every ``group_size`` consecutive indices are one
  group;
* `PrefixBatchSampler` (a ``batch_sampler`` for a plain ``DataLoader``): groups of any size
  whose prefix tree has at most ``max_tokens`` tokens; the fewest tokens, then the fewest
  groups (a dynamic program over the depth-first order, ``O(n)``).

Sorting compares samples token by token: ``O(L log n)`` for ``L`` tokens in all, with one
4-byte key per token held while sorting.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from treecompile.core.errors import TreeInputError
from treecompile.core.tree_build import as_token_array

__all__ = ["PrefixBatchSampler", "PrefixGroupedSampler"]

#: Sort keys hold each token id in 4 bytes.
_MAX_TOKEN_ID = 2**32 - 1


def _keys(sequences: Sequence[Any], what: str) -> tuple[list[bytes], np.ndarray]:
    """``(sort key per sample, [n] lengths)``: each key the sample's ids as big-endian uint32
    bytes, which sort as the id sequences do (a prefix before its extensions)."""
    if isinstance(sequences, (str, bytes, dict)) or not hasattr(sequences, "__len__"):
        raise TreeInputError(f"{what} needs a sequence of samples (token id lists), got {type(sequences).__name__}")
    if len(sequences) == 0:
        raise TreeInputError(f"{what} got no samples: the dataset is empty")
    keys, lengths = [], np.empty(len(sequences), dtype=np.int64)
    for i in range(len(sequences)):
        seq = sequences[i]
        if isinstance(seq, torch.Tensor):
            seq = seq.detach().cpu().numpy()
        arr = as_token_array(seq, i, None)  # a fresh copy: the caller's data is only read
        if not arr.size:
            raise TreeInputError(f"sequence {i} is empty: a sample needs at least one token")
        if int(arr.max()) > _MAX_TOKEN_ID:
            pos = int(arr.argmax())
            raise TreeInputError(f"sequence {i}: token id {int(arr[pos])} at position {pos} is over 2**32 - 1")
        keys.append(arr.astype(">u4").tobytes())
        lengths[i] = arr.size
    return keys, lengths


def _common_prefix(a: bytes, b: bytes) -> int:
    """Tokens two keys share at their start."""
    x, y = np.frombuffer(a, dtype=np.uint32), np.frombuffer(b, dtype=np.uint32)
    m = min(x.size, y.size)
    diff = np.flatnonzero(x[:m] != y[:m])
    return int(diff[0]) if diff.size else m


class _PrefixTrie:
    """The samples' prefix trie, reduced to its branching points (the lcp-interval tree of the
    sorted samples): node ``v`` has ``depth[v]`` shared tokens and ``children[v]``, each a
    sample index (``>= 0``) or ``~w`` for node ``w``. Node 0 is the root, at depth 0."""

    def __init__(self, sequences: Sequence[Any], what: str) -> None:
        keys, self.lengths = _keys(sequences, what)
        order = sorted(range(len(keys)), key=keys.__getitem__)
        self.depth: list[int] = [0]
        self.children: list[list[int]] = [[]]
        stack = [0]  # open nodes, depths strictly increasing
        for k, i in enumerate(order):
            if k:
                h = _common_prefix(keys[order[k - 1]], keys[i])
                closed = None
                while h < self.depth[stack[-1]]:
                    closed = stack.pop()
                    if h <= self.depth[stack[-1]]:
                        self.children[stack[-1]].append(~closed)
                        closed = None
                if h > self.depth[stack[-1]]:
                    # Samples k-1 and k share more than the open node: a new branching point whose
                    # first child is what came just before k (a node just closed, or sample k-1).
                    first = ~closed if closed is not None else self.children[stack[-1]].pop()
                    self.depth.append(h)
                    self.children.append([first])
                    stack.append(len(self.depth) - 1)
            self.children[stack[-1]].append(i)
        while len(stack) > 1:
            closed = stack.pop()
            self.children[stack[-1]].append(~closed)

    def walk(self, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """A random depth-first order: ``([n] sample indices, [n] common prefix with the one before)``
        (0 for the first). Every branching point's children come in a random order."""
        n = self.lengths.size
        order = np.empty(n, dtype=np.int64)
        lcp = np.zeros(n, dtype=np.int64)
        pos, shared = 0, 0

        def shuffled(v: int) -> list[int]:
            kids = self.children[v]
            return [kids[j] for j in rng.permutation(len(kids))]

        stack = [[shuffled(0), 0, 0]]  # [children, next child, depth] of each node being walked
        while stack:
            top = stack[-1]
            kids, j, depth = top
            if j == len(kids):
                stack.pop()
                continue
            top[1] = j + 1
            if j:
                shared = depth  # the last sample and the next one meet at this node
            c = kids[j]
            if c >= 0:
                order[pos], lcp[pos] = c, shared
                pos += 1
            else:
                stack.append([shuffled(~c), 0, self.depth[~c]])
        return order, lcp


def _fixed_cuts(lcp: np.ndarray, size: int, rng: np.random.Generator) -> list[tuple[int, int]]:
    """Groups of ``size`` consecutive samples and, if ``n % size``, one short group: placed where
    the cuts lose the fewest shared tokens (ties broken at random). The short group is last."""
    n = lcp.size
    m, s = divmod(n, size)
    if not s:
        return [(a, a + size) for a in range(0, n, size)]
    # Short group at slot j: cuts at k * size (k = 1..j), then at s + k * size (k = j..m-1).
    before = np.concatenate([[0], np.cumsum(lcp[size:m * size + 1:size])])
    after = np.concatenate([[0], np.cumsum(lcp[s:s + (m - 1) * size + 1:size])])
    cost = before + (after[m] - after)
    j = int(rng.choice(np.flatnonzero(cost == cost.min())))
    starts = [k * size for k in range(j + 1)] + [j * size + s + k * size for k in range(m - j)]
    cuts = [(a, b) for a, b in zip(starts, starts[1:] + [n])]
    short = cuts.pop(j)
    return cuts + [short]


def _budget_cuts(lengths: np.ndarray, lcp: np.ndarray, max_tokens: int) -> list[tuple[int, int]]:
    """Consecutive groups of at most ``max_tokens`` tree tokens: the fewest tokens lost at the
    cuts, then the fewest groups. ``cost[i]``: best cost of the first ``i`` samples, a cut
    before sample ``j`` costing ``lcp[j] * (n + 1) + 1`` (lexicographic: tokens, then groups).
    The tree tokens of a group shrink as its start moves right, so the feasible starts for an
    end form a window that only moves right: a sliding-window minimum, ``O(n)``."""
    n = lengths.size
    weight = n + 1
    sum_len = np.concatenate([[0], np.cumsum(lengths)])
    sum_lcp = np.concatenate([[0], np.cumsum(lcp)])

    def tokens(a: int, b: int) -> int:  # tree tokens of samples a..b-1
        return int(sum_len[b] - sum_len[a] - (sum_lcp[b] - sum_lcp[a + 1]))

    cost = [0] * (n + 1)
    back = [0] * (n + 1)
    window: deque[tuple[int, int]] = deque()  # (start, cost up to it + its cut), costs increasing
    lo = 0
    for i in range(1, n + 1):
        j = i - 1
        c = cost[j] + int(lcp[j]) * weight + 1
        while window and window[-1][1] >= c:
            window.pop()
        window.append((j, c))
        while tokens(lo, i) > max_tokens:
            lo += 1
        while window[0][0] < lo:
            window.popleft()
        back[i], cost[i] = window[0]
    cuts, i = [], n
    while i:
        cuts.append((back[i], i))
        i = back[i]
    return cuts[::-1]


class _PrefixSampler(torch.utils.data.Sampler):
    """The trie, the seed and the epoch; a plan of groups per epoch."""

    _what = "a prefix sampler"

    def __init__(self, sequences: Sequence[Any], seed: int) -> None:
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise ValueError(f"seed must be a non-negative int, got {seed!r}")
        self._trie = _PrefixTrie(sequences, self._what)
        self.num_samples = int(self._trie.lengths.size)
        self.seed = int(seed)
        self.epoch = 0
        self._plan: tuple[int, list[list[int]]] | None = None

    def set_epoch(self, epoch: int) -> None:
        """Sets the epoch: each epoch has its own groups and order (the same on every rank)."""
        self.epoch = int(epoch)

    def _cuts(self, lengths: np.ndarray, lcp: np.ndarray, rng: np.random.Generator) -> list[tuple[int, int]]:
        raise NotImplementedError

    def _shuffle(self, groups: list[list[int]], rng: np.random.Generator) -> list[list[int]]:
        return [groups[k] for k in rng.permutation(len(groups))]

    def groups(self) -> list[list[int]]:
        """This epoch's groups, in the order they are yielded: lists of dataset indices."""
        if self._plan is None or self._plan[0] != self.epoch:
            rng = np.random.default_rng([self.seed, self.epoch])
            order, lcp = self._trie.walk(rng)
            lengths = self._trie.lengths[order]
            groups = [order[a:b].tolist() for a, b in self._cuts(lengths, lcp, rng)]
            self._plan = (self.epoch, self._shuffle(groups, rng))
        return self._plan[1]


class PrefixGroupedSampler(_PrefixSampler):
    """Dataset indices in groups of ``group_size`` samples sharing long prefixes; a new random
    grouping and order each epoch (`set_epoch`).

    Give it as the ``sampler`` of a data loader whose ``batch_size`` is ``group_size``: each
    batch is then one group. The groups are cut from a random depth-first order of the samples'
    prefix trie, at the places that lose the fewest shared tokens; the full groups come in a
    random order, then the short group (``len(sequences) % group_size`` samples) if any, so
    that every ``group_size`` consecutive indices stay one group.

    Args:
        sequences: ``n`` token id sequences (lists, arrays or 1-D tensors), one per dataset
            item, in dataset order. Only read.
        group_size: samples per group: the data loader's ``batch_size``.
        seed: seeds each epoch's order (with the epoch); the same on every rank.
        drop_last: leave out the short group, as a data loader with ``drop_last=True`` does.

    Raises:
        TreeInputError: no samples, an empty sample, or a token id that is not a non-negative
            integer below 2**32.
        ValueError: ``group_size`` below 1 or a negative ``seed``.
    """

    _what = "PrefixGroupedSampler"

    def __init__(self, sequences: Sequence[Any], group_size: int, *, seed: int = 0, drop_last: bool = False) -> None:
        if isinstance(group_size, bool) or not isinstance(group_size, (int, np.integer)) or group_size < 1:
            raise ValueError(f"group_size must be an int of at least 1, got {group_size!r}")
        super().__init__(sequences, seed)
        self.group_size = int(group_size)
        self.drop_last = bool(drop_last)

    def _cuts(self, lengths, lcp, rng):
        return _fixed_cuts(lcp, self.group_size, rng)

    def _shuffle(self, groups, rng):
        short = [g for g in groups if len(g) < self.group_size]
        full = [g for g in groups if len(g) == self.group_size]
        return super()._shuffle(full, rng) + ([] if self.drop_last else short)

    def __iter__(self) -> Iterator[int]:
        for g in self.groups():
            yield from g

    def __len__(self) -> int:
        if self.drop_last:
            return self.num_samples - self.num_samples % self.group_size
        return self.num_samples


class PrefixBatchSampler(_PrefixSampler):
    """Batches of dataset indices whose prefix tree has at most ``max_tokens`` tokens, samples
    sharing long prefixes together; a new random grouping and order each epoch (`set_epoch`).

    Give it as the ``batch_sampler`` of a ``DataLoader``. The batches are cut from a random
    depth-first order of the samples' prefix trie: the fewest shared tokens lost at the cuts,
    then the fewest batches. Every sample is in exactly one batch per epoch; the number of
    batches can change from epoch to epoch (``len()`` is the current epoch's).

    Args:
        sequences: ``n`` token id sequences (lists, arrays or 1-D tensors), one per dataset
            item, in dataset order. Only read.
        max_tokens: token budget of one batch's prefix tree (the packed row's tokens).
        seed: seeds each epoch's order (with the epoch); the same on every rank.

    Raises:
        TreeInputError: no samples, an empty sample, a token id that is not a non-negative
            integer below 2**32, or a sample longer than ``max_tokens``.
        ValueError: ``max_tokens`` below 1 or a negative ``seed``.
    """

    _what = "PrefixBatchSampler"

    def __init__(self, sequences: Sequence[Any], max_tokens: int, *, seed: int = 0) -> None:
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, (int, np.integer)) or max_tokens < 1:
            raise ValueError(f"max_tokens must be an int of at least 1, got {max_tokens!r}")
        super().__init__(sequences, seed)
        self.max_tokens = int(max_tokens)
        longest = int(self._trie.lengths.argmax())
        if self._trie.lengths[longest] > self.max_tokens:
            raise TreeInputError(
                f"sample {longest} has {int(self._trie.lengths[longest])} tokens, more than max_tokens="
                f"{self.max_tokens}: a batch holds whole samples (raise max_tokens or cut the sample)"
            )

    def _cuts(self, lengths, lcp, rng):
        return _budget_cuts(lengths, lcp, self.max_tokens)

    def __iter__(self) -> Iterator[list[int]]:
        yield from (list(g) for g in self.groups())

    def __len__(self) -> int:
        return len(self.groups())
