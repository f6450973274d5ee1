"""Splitting one packed tree row over the ranks of a context-parallel (CP) group, by work.

Example:
    >>> import treecompile as tc
    >>> from treecompile.distributed.cp_split import RowWork, equal_rows_split, split_for_cp
    >>> tree = tc.TrajectoryTree.from_sequences([[1] * 60 + [2] * 20, [1] * 60 + [3] * 20, [1] * 60 + [4] * 20])
    >>> batch = tc.pack(tree, warn_por=False)
    >>> work = RowWork(dense=1.0, attention=0.05, head=0.5)
    >>> split = split_for_cp(batch, 2, work)
    >>> split.bounds.tolist(), [round(x, 2) for x in split.shares()]
    ([0, 72, 120], [0.5, 0.5])
    >>> [round(x, 2) for x in equal_rows_split(batch, 2, work).shares()]  # by rows: the prompt is cheap
    [0.38, 0.62]
    >>> split.ancestor_rows.tolist()  # rank 1 reads the root path of its first row
    [0, 72]

Each rank takes a contiguous run of the row (``bounds[r]:bounds[r + 1]``): its queries, their
layers' matmuls and their LM-head rows. What costs differ along a DFS row: a row's attention
reads the keys of its root path, ``position_ids[i] + 1`` of them, so late rows of a deep
branch cost more than early rows of the prompt; and only rows that predict a target run the
LM head. Splitting by row count leaves the ranks unequal; `split_for_cp` splits so that the
largest rank's work is the least any contiguous split allows (a bisection on that bound,
each candidate checked greedily over the row's prefix sums: O(S + K log S) per candidate).

What a rank must read from the others (per layer, K and V): under the tree mask a query
``i`` sees key ``j < i`` iff ``j``'s subtree holds ``i``, so the keys of earlier ranks that
rank ``r`` needs are the root path of its first row, ``position_ids[bounds[r]]`` rows
(`CPSplit.ancestor_rows`); an all-gather (what torch's FlexAttention CP does) moves every
other rank's rows instead. `CPSplit.kv_bytes` gives both, `CPSplit.peak_bytes` each rank's
predicted peak memory.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from treecompile.core.batch import TreeBatch
from treecompile.core.errors import TreeInputError, unknown_choice
from treecompile.core.preorder import rows_before_on_path

__all__ = ["RowWork", "CPSplit", "split_for_cp", "equal_rows_split", "exchange_of"]


@dataclass(frozen=True)
class RowWork:
    """Forward FLOPs of one row's parts, summed over layers (backward scales all alike).

    Attributes:
        dense: the projections and MLP of one row.
        attention: one (query, key) pair the mask allows (``Q K^T`` and ``P V``).
        head: the LM head of one predicting row.
    """

    dense: float
    attention: float
    head: float

    @classmethod
    def from_dims(cls, dims) -> RowWork:
        """From a `treecompile.planning.budget.ModelDims` (dense layers: q, k, v, o and a
        gated MLP)."""
        q, kv = dims.heads * dims.head_dim, dims.kv_heads * dims.head_dim
        per_layer = 2 * (dims.hidden * q + 2 * dims.hidden * kv + q * dims.hidden + 3 * dims.hidden * dims.intermediate)
        return cls(dense=float(dims.layers * per_layer), attention=float(dims.layers * 4 * q),
                   head=float(2 * dims.hidden * dims.vocab))


@dataclass
class CPSplit:
    """A row split over ``K`` CP ranks (`split_for_cp`).

    Attributes:
        bounds: ``[K + 1]`` rank ``r`` holds rows ``bounds[r]:bounds[r + 1]``.
        rows, attention_pairs, head_rows: ``[K]`` per rank: its rows, the (query, key) pairs
            its queries see, its rows that predict a target.
        work: ``[K]`` per rank, in `RowWork`'s units.
        ancestor_rows: ``[K]`` rows of earlier ranks its queries see (the root path of its
            first row).
        live_keys: ``[K]`` the most keys one CPU attention call over its queries reads (up to
            512 rows from a block's first row ``q``: the root path of ``q``,
            ``position_ids[q]`` rows, and the call's own rows).
        paths: per rank, ``[ancestor_rows[r]]`` int64: the global rows of earlier ranks its
            queries see (the root path of its first row, root first; empty for rank 0 and a
            rank without rows).
    """

    bounds: np.ndarray
    rows: np.ndarray
    attention_pairs: np.ndarray
    head_rows: np.ndarray
    work: np.ndarray
    ancestor_rows: np.ndarray
    live_keys: np.ndarray
    paths: tuple = ()

    @property
    def sent_rows(self) -> np.ndarray:
        """``[K]`` rows each rank sends the later ones per layer (for K, and as many for V):
        its rows on their paths, a row counted once per rank that reads it."""
        rows = np.concatenate([np.zeros(0, np.int64), *self.paths])
        return np.bincount(self.owner(rows), minlength=self.ranks).astype(np.int64)

    def owner(self, rows: np.ndarray) -> np.ndarray:
        """The rank that holds each of ``rows`` (global row numbers)."""
        return _owner(self.bounds, rows)

    def exchange(self, rank: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """What ``rank`` sends and receives in a layer's exchange of keys (or values):
        ``(send_rows, send_counts, recv_counts)``: its own rows (local numbers) that the other
        ranks read, grouped by the reading rank in rank order; ``[K]`` rows it sends to each
        rank; ``[K]`` rows it receives from each. What it receives, concatenated in rank
        order, is ``paths[rank]`` in order (a root path runs through the ranks in order)."""
        return exchange_of(self.bounds, self.paths, rank)

    @property
    def ranks(self) -> int:
        return len(self.rows)

    def shares(self) -> list[float]:
        """Each rank's fraction of the work."""
        total = float(self.work.sum())
        return [float(w) / total if total else 0.0 for w in self.work]

    def imbalance(self) -> float:
        """The largest rank's work over the mean (1.0: perfectly even)."""
        mean = float(self.work.mean())
        return float(self.work.max()) / mean if mean else 1.0

    def kv_bytes(self, kv_heads: int, head_dim: int, dtype_bytes: int, gather: str = "needed") -> np.ndarray:
        """``[K]`` bytes of K and V each rank receives per layer: ``"needed"``, the root path
        of its first row; ``"all"``, an all-gather of every other rank's rows, each padded to
        the longest rank's (collectives move equal chunks)."""
        per_row = 2 * kv_heads * head_dim * dtype_bytes
        if gather == "needed":  # what `treecompile::cp_gather_rows` moves
            return self.ancestor_rows * per_row
        if gather == "all":
            return np.full(self.ranks, (self.ranks - 1) * int(self.rows.max()) * per_row, dtype=np.int64)
        raise ValueError(unknown_choice("gather", gather, ("needed", "all")))


    def peak_bytes(self, cost, gather: str = "needed") -> np.ndarray:
        """``[K]`` predicted peak bytes of each rank's step (`treecompile.planning.budget.CostModel`):
        the static bytes (parameters, gradients and optimizer state: each CP rank holds them
        all), the activations autograd keeps over the rank's own rows, the K and V it
        received for every layer (autograd keeps each layer's gathered keys and values for
        that layer's backward) and the largest transient: the attention's over its own rows
        and the keys one CPU attention call over them reads (`live_keys`), or the exchange's buffers of one
        layer's keys, whichever is larger. The exchange's buffers: ``"needed"``, the rows it
        sends (`sent_rows`) and receives; ``"all"``, an all-gather's (every rank's rows,
        padded to the longest rank's)."""
        d = cost.dims
        received = self.kv_bytes(d.kv_heads, d.head_dim, cost.dtype_bytes, gather)
        per_row = 2 * d.kv_heads * d.head_dim * cost.dtype_bytes
        if self.ranks == 1:
            buffers = np.zeros(1, np.int64)
        elif gather == "all":
            buffers = np.full(self.ranks, self.ranks * int(self.rows.max()) * per_row // 2, dtype=np.int64)
        else:
            buffers = (self.sent_rows + self.ancestor_rows) * per_row // 2
        out = []
        for rows, got, live, buf in zip(self.rows.tolist(), received.tolist(), self.live_keys.tolist(),
                                        buffers.tolist()):
            rows = max(rows, 1)
            saved, transient = cost.part_bytes(rows, max(1, min(rows + got // per_row, live)))
            out.append(cost.static_bytes() + saved + d.layers * got + max(transient, buf))
        return np.asarray(out, dtype=np.int64)


def exchange_of(bounds: np.ndarray, paths, rank: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`CPSplit.exchange` of the runs ``bounds[r]:bounds[r + 1]`` (``[K + 1]``, global rows)
    whose ranks read ``paths[r]`` (global rows within ``bounds[0]:bounds[r]``, in order)."""
    ranks = len(bounds) - 1
    a = int(bounds[rank])
    send = [np.zeros(0, np.int64)] * ranks
    for r, path in enumerate(paths):
        if r != rank and len(path):
            send[r] = path[_owner(bounds, path) == rank] - a
    recv = np.bincount(_owner(bounds, paths[rank]), minlength=ranks).astype(np.int64)
    return (np.concatenate(send).astype(np.int64), np.array([len(x) for x in send], dtype=np.int64), recv)


def _owner(bounds: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """The run ``bounds[r]:bounds[r + 1]`` holding each of ``rows`` (an empty run holds none)."""
    return np.searchsorted(bounds, rows, side="right") - 1


def _row_costs(batch: TreeBatch, work: RowWork) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``[S]`` attention pairs, LM-head flags and cost of each row."""
    pairs = batch.position_ids.detach().cpu().numpy().astype(np.int64) + 1
    pred = batch.pred_index.detach().cpu().numpy()
    head = np.zeros(batch.num_tokens, dtype=np.int64)
    head[pred[pred >= 0]] = 1
    cost = work.dense + work.attention * pairs + work.head * head
    return pairs, head, cost


def _live_keys(pairs: np.ndarray, a: int, b: int) -> int:
    """The most keys one CPU attention call over queries in rows ``[a, b)`` reads
    (`CPSplit.live_keys`): a call starts at a block and takes up to `CPU_CALL_ROWS` rows."""
    from treecompile.planning.budget import CPU_BLOCK_ROWS, CPU_CALL_ROWS

    if b <= a:
        return 0
    starts = np.arange(a, b, CPU_BLOCK_ROWS)
    return int((pairs[starts] - 1 + np.minimum(CPU_CALL_ROWS, b - starts)).max())


def _with_paths(batch: TreeBatch, split: CPSplit) -> CPSplit:
    """``split`` with its `CPSplit.paths` (O(ranks x depth))."""
    nodes = batch.node_table().numpy()  # on the host, from the batch's check
    b = split.bounds
    paths = tuple(rows_before_on_path(nodes, int(b[r])) if b[r + 1] > b[r] else np.zeros(0, np.int64)
                  for r in range(split.ranks))
    return dataclasses.replace(split, paths=paths)


def _summary(bounds: np.ndarray, costs: tuple[np.ndarray, np.ndarray, np.ndarray]) -> CPSplit:
    """The `CPSplit` of ``bounds`` over the rows' ``(pairs, head, cost)`` (`_row_costs`)."""
    pairs, head, cost = costs
    seg = [slice(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]
    return CPSplit(
        bounds=bounds,
        rows=np.diff(bounds),
        attention_pairs=np.array([pairs[s].sum() for s in seg], dtype=np.int64),
        head_rows=np.array([head[s].sum() for s in seg], dtype=np.int64),
        work=np.array([cost[s].sum() for s in seg], dtype=np.float64),
        # A row's root path before it: its position (pairs - 1).
        ancestor_rows=np.array([pairs[s.start] - 1 if s.stop > s.start else 0 for s in seg], dtype=np.int64),
        live_keys=np.array([_live_keys(pairs, s.start, s.stop) for s in seg], dtype=np.int64),
    )


def _check(batch: TreeBatch, ranks: int) -> None:
    if not isinstance(ranks, (int, np.integer)) or ranks < 1:
        raise TreeInputError(f"ranks must be a positive integer, got {ranks!r}")
    if batch.num_tokens < ranks:
        raise TreeInputError(f"a row of {batch.num_tokens} tokens cannot be split over {ranks} ranks")


def equal_rows_split(batch: TreeBatch, ranks: int, work: RowWork, *, align: int = 1) -> CPSplit:
    """The split by row count alone (what a sequence-parallel split of a flat row does), for
    comparison; with ``align``, each cut rounded to the nearest multiple of it (the row's end
    aside), as `split_for_cp`'s cuts are."""
    _check(batch, ranks)
    if align < 1:
        raise TreeInputError(f"align must be at least 1, got {align}")
    s = batch.num_tokens
    cuts = [min(s, int(round((r * s // ranks) / align)) * align) for r in range(ranks)]
    bounds = np.array([*cuts, s], dtype=np.int64)
    return _with_paths(batch, _summary(bounds, _row_costs(batch, work)))


def _greedy_cuts(prefix: np.ndarray, ranks: int, bound: float, align: int) -> np.ndarray | None:
    """Cuts giving each rank the most rows whose work stays within ``bound`` (cuts on
    multiples of ``align`` but the last); None if ``ranks`` runs cannot cover the row."""
    s = len(prefix) - 1
    cuts = [0]
    for _ in range(ranks):
        start = cuts[-1]
        if start == s:
            cuts.append(s)
            continue
        end = int(np.searchsorted(prefix, prefix[start] + bound, side="right")) - 1
        if end < s:
            end -= end % align
        if end <= start:
            return None
        cuts.append(min(end, s))
    return np.asarray(cuts, dtype=np.int64) if cuts[-1] == s else None


def split_for_cp(batch: TreeBatch, ranks: int, work: RowWork | None = None, *, align: int = 1) -> CPSplit:
    """Splits ``batch``'s packed row over ``ranks`` CP ranks, the largest rank's work least.

    Args:
        batch: one packed tree row (``treecompile.pack``).
        ranks: the CP group's size K.
        work: the per-row costs (`RowWork.from_dims` of the model); default: a dense layer
            of 1, an attention pair of 0 and an LM-head row of 0, i.e. by rows.
        align: cuts on multiples of this many rows (an attention block, 128 on GPUs), the
            row's end aside.

    Returns:
        The `CPSplit`; a rank may hold no rows when the row is shorter than K aligned blocks.

    Raises:
        TreeInputError: fewer rows than ranks, or ``ranks`` < 1.
    """
    _check(batch, ranks)
    if align < 1:
        raise TreeInputError(f"align must be at least 1, got {align}")
    work = work or RowWork(dense=1.0, attention=0.0, head=0.0)
    costs = _row_costs(batch, work)
    cost = costs[2]
    prefix = np.concatenate([[0.0], np.cumsum(cost)])
    block = np.add.reduceat(cost, np.arange(0, len(cost), align))
    lo, hi = max(float(prefix[-1]) / ranks, float(block.max())), float(prefix[-1])
    best = _greedy_cuts(prefix, ranks, hi, align)
    for _ in range(60):  # bisection on the largest rank's work, to float resolution
        if hi - lo <= 1e-9 * hi:
            break
        mid = (lo + hi) / 2
        cuts = _greedy_cuts(prefix, ranks, mid, align)
        if cuts is None:
            lo = mid
        else:
            best, hi = cuts, mid
    return _with_paths(batch, _summary(best, costs))
