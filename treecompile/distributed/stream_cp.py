"""Streamed parts split over a context-parallel group: trees larger than the group holds at once.

``tree_compile(model, cp=group, stream=StreamOptions(budget_rows=B))`` on every rank of a
group of K ranks, each calling the wrapper with the same batch:

* a batch whose CP split (`treecompile.distributed.cp_split.split_for_cp`, by work) gives no rank
  more than B rows runs as one CP call (`treecompile.distributed.context_parallel`);
* a larger one streams (`treecompile.stream.options`) in parts of at most K x B consecutive
  rows, cut and scheduled as a streamed batch's are (`plan_stream`), and each part is split
  over the ranks by rows (at most B each: the budget is what one rank holds).

Within a part, rank ``r``'s attention reads, per layer and in row order: from the KV stack,
the keys and values of the earlier parts' rows on the root path of its first row (a subset
of the part's prefix); from the part's earlier ranks, the rows of that path inside the part,
gathered in the graph by the CP exchange (``treecompile::cp_gather_rows``, whose backward
sends their gradients back); its own rows. The graph is the streamed part's with the
gathered rows appended to each attention's prefix (`treecompile.passes.cp`'s
``extend_prefix_kv_pass``), under the concatenated interval rule.

The stack is replicated: after a part's forward, the keys and values of its rows that a
later part's rank reads (its *kept rows*) are all-gathered, so every rank holds them. The
gradients the later parts' ranks add into them are summed over the group (one all-reduce per
part) right before the part's backward, and each rank hands its own rows' share to its
graph's backward. The loss, log-probabilities, router statistics and parameter gradients
are summed over the group at the end, as a CP call's are: every rank ends with the whole
tree's, equal to per-path training.

Every rank computes the same plan and splits from the batch alone, so the collectives of the
parts' forward and backward passes (and recompute mode's second forward) meet in the same
order on every rank.

Memory per rank: the parameters and optimizer state, the activations of at most B rows per
part alive (keep mode: of every part on the stack; recompute mode: of one), the stack's kept
rows' keys and values for every layer (the whole group's, on every rank), and per layer the
keys and values the running part gathers.

With ``budget_bytes`` instead, a batch streams when some rank's predicted peak of one CP
call (`CPSplit.peak_bytes`) is over it, in the largest parts whose largest rank's predicted
peak (`stream_cp_peak_bytes`) is within it (`choose_stream_cp`), split by rows.

Not covered, refused by name: hybrid models (as under CP), ``verify=True`` (as under CP).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from treecompile.capture.call import CallSetup, device_of
from treecompile.core.batch import TreeBatch, on_host, to_device
from treecompile.core.preorder import rows_before_on_path
from treecompile.kernels.collectives.cp_gather import padded_send
from treecompile.passes.cp import CPGraph
from treecompile.passes.pipeline import Pipeline, streamed_context_parallel
from treecompile.passes.stream import StreamGraph
from treecompile.distributed.cp_split import CPSplit, exchange_of, split_for_cp
from treecompile.distributed.context_parallel import CPRunner, local_structure, row_work_of
from treecompile.stream.parts import PAD_PREFIX, PAD_STATES, BatchArrays
from treecompile.stream.plan import (PartRows, StreamChoice, StreamOptions, StreamPlan, choose_stream, plan_stream,
                                     stream_peak_bytes)
from treecompile.stream.runner import StreamRunner, _RunResult
from treecompile.stream.stack import StackEntry, backward_part, gather_prefix

__all__ = ["StreamCPRunner", "PartSplit", "PAD_GATHER", "cp_runner", "split_parts", "stream_cp_peak_bytes",
           "choose_stream_cp"]

#: Always-invisible rows before the gathered ones, so that their count is never 0 or 1
#: (which Dynamo would specialise), as `PAD_PREFIX` is for the stack's.
PAD_GATHER = 2


@dataclass
class PartSplit:
    """One part split over the group.

    Attributes:
        bounds: ``[K + 1]`` global rows: rank ``r`` holds ``bounds[r]:bounds[r + 1]``.
        stack: per rank, the earlier parts' rows on the root path of its first row (read
            from the stack).
        inside: per rank, the part's rows on that path (gathered from the part's earlier
            ranks).
    """

    bounds: np.ndarray
    stack: list[np.ndarray]
    inside: list[np.ndarray]


def split_parts(batch: TreeBatch, plan: StreamPlan, ranks: int) -> tuple[list[PartSplit], list[np.ndarray]]:
    """Each part of ``plan`` split over ``ranks`` by rows, and each part's kept rows (its rows
    that a later part's rank reads from the stack), sorted. O(parts x ranks x depth)."""
    nodes = batch.node_table().numpy()
    splits, read = [], [[] for _ in range(plan.num_parts)]
    empty = np.zeros(0, np.int64)
    for j in range(plan.num_parts):
        a, b = int(plan.starts[j]), int(plan.starts[j + 1])
        bounds = a + (np.arange(ranks + 1, dtype=np.int64) * (b - a)) // ranks
        paths = [rows_before_on_path(nodes, int(bounds[r])) if bounds[r + 1] > bounds[r] else empty
                 for r in range(ranks)]
        stack = [p[p < a] for p in paths]
        for rows in stack:
            owners = plan.part_of(rows)
            for q in np.unique(owners).tolist():
                read[q].append(rows[owners == q])
        splits.append(PartSplit(bounds=bounds, stack=stack, inside=[p[p >= a] for p in paths]))
    kept = [np.unique(np.concatenate([empty, *rows])) for rows in read]
    return splits, kept


def choose_stream_cp(batch: TreeBatch, cost, budget_bytes: int, mode: str, cuts: str,
                     ranks: int) -> tuple[StreamChoice, list[PartSplit], list[np.ndarray]]:
    """`choose_stream` for ``batch`` streamed over ``ranks`` CP ranks: the largest rows per
    rank whose largest rank's predicted peak (`stream_cp_peak_bytes`) is within
    ``budget_bytes``; the choice, with its parts' splits and kept rows (`split_parts`, once
    per part size tried).

    Raises:
        BudgetError: as `choose_stream`.
    """
    found: dict[bytes, tuple[list[PartSplit], list[np.ndarray]]] = {}

    def splits_of(plan: StreamPlan) -> tuple[list[PartSplit], list[np.ndarray]]:
        key = plan.starts.tobytes()
        if key not in found:
            found[key] = split_parts(batch, plan, ranks)
        return found[key]

    def rank_peak(plan: StreamPlan, m: str) -> int:
        return int(stream_cp_peak_bytes(plan, *splits_of(plan), cost, m).max())

    choice = choose_stream(batch, cost, budget_bytes, mode, cuts, ranks=ranks, rank_peak=rank_peak)
    return (choice, *splits_of(choice.plan))


def cp_runner(setup: CallSetup, group: dist.ProcessGroup, stream: StreamOptions | None = None):
    """The runner of ``tree_compile(cp=group, stream=stream)``: a `CPRunner` (split by the
    model's work, `row_work_of`), inside a `StreamCPRunner` with ``stream``."""
    runner = CPRunner(setup, group, row_work_of(setup.model))
    return runner if stream is None else StreamCPRunner(setup, stream, group, runner)


class StreamCPRunner(StreamRunner):
    """Runs a `TreeCompiledModel`'s batches over a CP group, streamed where a rank's share is
    over the budget (see the module docstring).

    Attributes:
        group: the process group.
        cp: the `CPRunner` that runs batches within the budget.
        splits: per part of the latest streamed batch, its `PartSplit`.
        kept_rows: per part of it, its kept rows (`split_parts`).
    """

    def __init__(self, setup: CallSetup, options: StreamOptions, group: dist.ProcessGroup, cp: CPRunner) -> None:
        super().__init__(setup, options)
        self.group = group
        self.cp = cp
        self.splits: list[PartSplit] = []
        self.kept_rows: list[np.ndarray] = []
        self._batch: TreeBatch | None = None  # the latest streamed batch (on the host)

    rank = property(lambda self: self.cp.rank, doc="This process's rank in the group.")
    world = property(lambda self: self.cp.world, doc="The group's size.")

    def wants(self, batch: TreeBatch) -> bool:
        """Whether ``batch`` streams (`one_call_split` is None)."""
        return self.one_call_split(batch) is None

    def one_call_split(self, batch: TreeBatch) -> CPSplit | None:
        """The CP split (of ``batch`` padded to the group's size) that runs it as one call, or
        None where it streams: the split gives some rank more than ``budget_rows`` (with
        ``budget_bytes``: some rank's predicted peak, `CPSplit.peak_bytes`, is over it)."""
        o, k = self.options, self.world
        if o.budget_rows is not None and batch.num_tokens > o.budget_rows * k:
            return None
        split = split_for_cp(batch.padded(k), k, self.cp.work, align=self.cp.align)
        fits = (int(split.rows.max()) <= o.budget_rows if o.budget_rows is not None
                else int(split.peak_bytes(self._cost_model()[0]).max()) <= o.budget_bytes)
        return split if fits else None

    def __call__(self, batch: TreeBatch):
        batch = on_host(batch)
        self.cp.check(batch, self._device())
        split = self.one_call_split(batch)
        if split is not None:
            return self.cp(batch, checked=True, split=split)
        try:
            return super().__call__(batch)
        finally:
            self._batch = None

    def choose(self, batch: TreeBatch) -> StreamChoice:
        """The parts and mode of ``batch``: parts of ``budget_rows`` per rank; with
        ``budget_bytes``, the largest whose largest rank's predicted peak
        (`stream_cp_peak_bytes`) is within it (`choose_stream`); sets `splits` and `kept_rows`."""
        o, k = self.options, self.world
        self._batch = batch
        if o.budget_bytes is not None:
            from treecompile.planning.budget import BudgetError

            try:
                choice, self.splits, self.kept_rows = choose_stream_cp(batch, self._cost_model()[0], o.budget_bytes,
                                                                       o.mode, o.cuts, k)
            except BudgetError as e:
                raise BudgetError(f"StreamOptions(budget_bytes={o.budget_bytes}) over {k} CP ranks: {e}") from None
            return choice
        rows = o.budget_rows * k
        plan = plan_stream(batch, rows, o.cuts)
        self.splits, self.kept_rows = split_parts(batch, plan, k)
        return StreamChoice(rows=rows, mode=o.mode, peak_bytes=None, plan=plan,
                            why=f"{o.mode} mode: parts of at most {rows} rows, {o.budget_rows} per rank of {k} "
                                "(budget_rows)")

    # ------------------------------------------------------------------ compile

    _GRAPH = "stream_cp_forward"

    def _pipeline(self, pipeline: Pipeline) -> Pipeline:
        return streamed_context_parallel(pipeline, StreamGraph(), CPGraph(group=self.cp.group_name))

    @staticmethod
    def _args(inputs, block_tensors, structure, stack, extra=()) -> tuple:
        # The CP marker's data: the keys' visibility (the stream marker's), then the exchange's.
        index, send_rows, counts = extra
        for t in (index, send_rows):
            torch._dynamo.maybe_mark_dynamic(t, 0)
        kv_end, kv_pos = inputs[9:11]
        return StreamRunner._args(inputs, block_tensors, structure, stack, [kv_end, kv_pos, index, send_rows, counts])

    # ------------------------------------------------------------------ a part on this rank

    def _part_inputs(self, data: BatchArrays, plan: StreamPlan, j: int) -> tuple[list, torch.Tensor, list]:
        split, r = self.splits[j], self.rank
        a, b = int(split.bounds[r]), int(split.bounds[r + 1])
        inside = split.inside[r]
        prefix = np.concatenate([split.stack[r], np.full(PAD_GATHER, -1, np.int64), inside])
        inputs, dest = data.part_inputs(a, b, prefix)
        # The gathered rows in the exchange's coordinates (see treecompile::cp_gather_rows):
        # padding reads the zero row, then the rows received, in rank order (the path's).
        index = np.concatenate([np.zeros(PAD_GATHER, np.int64), 1 + np.arange(len(inside), dtype=np.int64)])
        send_rows, send_counts, recv_counts = exchange_of(split.bounds, split.inside, r)
        send_rows = padded_send(send_rows)
        device = self._device()
        extra = [to_device(torch.from_numpy(index), device), to_device(torch.from_numpy(send_rows), device),
                 torch.from_numpy(np.stack([send_counts, recv_counts]))]  # counts: read on the host
        return inputs, dest, extra

    def _device(self) -> torch.device:
        return device_of(self.setup.model)

    def _structure(self, data: BatchArrays, plan: StreamPlan, j: int, dk: int, device) -> tuple:
        # Recurrent and conv layers are refused under CP by the graph's passes; a model with
        # them gets its rows' own structure, so that the capture reaches that refusal.
        split, r = self.splits[j], self.rank
        a, b = int(split.bounds[r]), int(split.bounds[r + 1])
        s_run = data.run_rows(a, b)
        keys = PAD_PREFIX + len(split.stack[r]) + PAD_GATHER + len(split.inside[r]) + s_run
        tables = local_structure(self._batch, a, b, s_run, device) if self.setup.structure else []
        return (tables, torch.full((keys,), -1, dtype=torch.int64, device=device),
                torch.zeros(PAD_STATES, dtype=torch.int64, device=device))

    def _stack(self, plan: StreamPlan, data: BatchArrays, j: int, entries: dict, device) -> tuple[list, list, list]:
        """Part ``j``'s keys and values from the stack on this rank: ``[1, Hkv, PAD_PREFIX + P, D]``
        per slot, padding then the rows of `PartSplit.stack`."""
        return gather_prefix(plan, data, j, entries, self._shapes, device, self.splits[j].stack[self.rank],
                             self._kept_index)

    def _kept_index(self, q: int, rows: np.ndarray) -> np.ndarray:
        """The places of ``rows`` in part ``q``'s kept rows (its stack entry's values)."""
        return np.searchsorted(self.kept_rows[q], rows)

    def _own_kept(self, j: int) -> tuple[np.ndarray, int, int]:
        """``(this rank's local rows of part j's kept rows, their first and end index in them)``."""
        kept, split, r = self.kept_rows[j], self.splits[j], self.rank
        lo, hi = np.searchsorted(kept, split.bounds[r:r + 2])
        return kept[lo:hi] - split.bounds[r], int(lo), int(hi)

    def _kept(self, plan: StreamPlan, j: int, kv: list[torch.Tensor]) -> list[torch.Tensor]:
        """Every rank's kept rows of part ``j`` (all-gathered): ``[1, Hkv, n_kept, D]`` per slot."""
        local, _, _ = self._own_kept(j)
        counts = np.diff(np.searchsorted(self.kept_rows[j], self.splits[j].bounds)).tolist()
        idx = to_device(torch.from_numpy(local.astype(np.int64)), self._device())
        mine = [t.detach().index_select(2, idx) for t in kv]
        return _all_gather_rows(mine, counts, self.group)

    def _backward_part(self, plan: StreamPlan, data: BatchArrays, p: int, e: StackEntry, entries: dict) -> None:
        """Part ``p``'s backward on this rank (`backward_part`), its outputs' gradients this
        rank's share of its kept rows' gradients summed over the group."""
        if len(self.kept_rows[p]):
            summed = _all_reduce([g if g is not None else torch.zeros_like(v) for g, v in zip(e.grads, e.vals)],
                                 self.group)
            local, lo, hi = self._own_kept(p)
            idx = to_device(torch.from_numpy(local.astype(np.int64)), e.loss.device)
            e.grads = [None] * len(e.outs) if hi == lo else [
                torch.zeros_like(out).index_copy_(2, idx, g[:, :, lo:hi].to(out.dtype)) for out, g in zip(e.outs, summed)]
        backward_part(plan, data, p, e, entries, self._shapes, self.splits[p].stack[self.rank], self._kept_index)

    # ------------------------------------------------------------------ the group's sums

    def _finish(self, result: _RunResult) -> _RunResult:
        """The loss, log-probabilities (entropies) and router sums of every rank, summed."""
        pieces = [result.loss.reshape(1), result.logprobs]
        for t in (result.entropy, result.router_stats):
            if t is not None:
                pieces.append(t.reshape(-1))
        summed = torch.cat([t.to(torch.float64) for t in pieces])
        dist.all_reduce(summed, group=self.group)
        s = result.logprobs.shape[0]
        out = summed[1 + s:]
        entropy, stats = result.entropy, result.router_stats
        if entropy is not None:
            entropy, out = out[:s], out[s:]
        if stats is not None:
            stats = out.reshape(stats.shape)
        return _RunResult(loss=summed[0], logprobs=summed[1:1 + s], entropy=entropy, router_stats=stats,
                          forward_rows=result.forward_rows)

    def _reduce_grads(self, params: list, grads: list) -> list:
        """Every parameter's gradient summed over the group (zeros where a rank has none, so
        that every rank sends the same tensors)."""
        full = [g if g is not None else torch.zeros_like(p) for p, g in zip(params, grads)]
        for work in [dist.all_reduce(g, group=self.group, async_op=True) for g in full]:
            work.wait()
        return full


def _by_dtype(tensors: list[torch.Tensor]) -> dict[torch.dtype, list[int]]:
    """The indices of ``tensors``, grouped by dtype (in order)."""
    groups: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault(t.dtype, []).append(i)
    return groups


def _all_gather_rows(tensors: list[torch.Tensor], counts: list[int], group) -> list[torch.Tensor]:
    """``[1, H_i, sum(counts), D_i]`` per tensor: every rank's ``tensors`` (``[1, H_i,
    counts[rank], D_i]``) concatenated along the rows in rank order, in one all-gather per
    dtype (each rank's rows padded to the most any rank has)."""
    total, most = sum(counts), max(counts, default=0)
    if total == 0:
        return [t[:, :, :0] for t in tensors]
    out: list[torch.Tensor | None] = [None] * len(tensors)
    world = dist.get_world_size(group)
    for members in _by_dtype(tensors).values():
        rows = [tensors[i][0].transpose(0, 1).reshape(tensors[i].shape[2], tensors[i].shape[1] * tensors[i].shape[3])
                for i in members]  # [n, H * D]
        flat = torch.cat(rows, dim=1)
        buf = flat.new_zeros(most, flat.shape[1])
        buf[:flat.shape[0]] = flat
        got = [torch.empty_like(buf) for _ in range(world)]
        dist.all_gather(got, buf, group=group)
        joined = torch.cat([x[:n] for x, n in zip(got, counts)])
        offset = 0
        for i in members:
            _, h, _, d = tensors[i].shape
            out[i] = joined[:, offset:offset + h * d].reshape(total, h, d).transpose(0, 1).unsqueeze(0).contiguous()
            offset += h * d
    return out


def _all_reduce(tensors: list[torch.Tensor], group) -> list[torch.Tensor]:
    """``tensors`` summed over the group, one all-reduce per dtype."""
    out: list[torch.Tensor | None] = [None] * len(tensors)
    for members in _by_dtype(tensors).values():
        flat = torch.cat([tensors[i].reshape(-1) for i in members])
        dist.all_reduce(flat, group=group)
        offset = 0
        for i in members:
            n = tensors[i].numel()
            out[i] = flat[offset:offset + n].reshape(tensors[i].shape)
            offset += n
    return out


def stream_cp_peak_bytes(plan: StreamPlan, splits: list[PartSplit], kept: list[np.ndarray], cost,
                         mode: str) -> np.ndarray:
    """``[K]`` predicted peak bytes of each rank's streamed step over a CP group
    (`stream_peak_bytes` with the rank's `PartRows`): per part, its rows, the prefix it reads
    (the stack's rows, the gathered ones and their padding), the kept rows every rank holds
    (with their gradients), the all-gather of those rows after the part's forward (one
    buffer per rank of the most rows any rank sends, then the joined rows), the exchange's
    buffers of one layer, and the kept rows' summed gradients during its backward."""
    ranks = len(splits[0].bounds) - 1 if splits else 1
    kept_n = np.array([len(k) for k in kept], dtype=np.int64)
    most = np.array([int(np.diff(np.searchsorted(k, s.bounds)).max(initial=0)) for k, s in zip(kept, splits)],
                    dtype=np.int64)
    out = []
    for r in range(ranks):
        moved = []
        for s in splits:
            send_rows, _, recv = exchange_of(s.bounds, s.inside, r)
            moved.append(len(send_rows) + int(recv.sum()))
        parts = PartRows(rows=np.array([s.bounds[r + 1] - s.bounds[r] for s in splits], dtype=np.int64),
                         prefix=np.array([len(s.stack[r]) + PAD_GATHER + len(s.inside[r]) for s in splits],
                                         dtype=np.int64),
                         kept=kept_n, after=(ranks + 1) * most + kept_n, exchange=np.array(moved, dtype=np.int64),
                         summed=kept_n)
        out.append(stream_peak_bytes(plan, cost, mode, parts))
    return np.asarray(out, dtype=np.int64)
