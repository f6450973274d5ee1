"""The schedule of a streamed batch: its options, where its parts end, the order of their
backward passes, and the ``treecompile plan --stream`` report (see `treecompile.stream.options`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from treecompile.core.batch import TreeBatch
from treecompile.core.preorder import rows_before_on_path
from treecompile.core.errors import unknown_choice

__all__ = ["MODES", "CUTS", "StreamOptions", "StreamPlan", "StreamStats", "StreamChoice", "plan_stream", "root_path",
           "plan_stream_report", "stream_cost_model", "stream_peak_bytes", "choose_stream", "STREAM_ROW_BYTES",
           "MAX_STREAM_PARTS", "PART_OVERHEAD_ROWS", "STREAM_PEAK_MARGIN_PERCENT", "BYTE_BUDGET_MODES",
           "PREFIX_INDEX_BYTES", "PartRows"]

#: ``StreamOptions.mode`` choices.
MODES = ("keep", "recompute")
#: With ``budget_bytes``, also ``"auto"``: the mode is chosen per batch (`choose_stream`).
BYTE_BUDGET_MODES = (*MODES, "auto")
#: ``StreamOptions.cuts`` choices: ``"subtree"`` ends a part, where it can within the budget,
#: where none of its rows is an ancestor of the next row (so no later part reads it);
#: ``"rows"`` cuts every ``budget_rows`` rows.
CUTS = ("subtree", "rows")


@dataclass(frozen=True)
class StreamOptions:
    """How `tree_compile` runs a batch larger than its budget.

    Give exactly one of ``budget_rows`` and ``budget_bytes``.

    Attributes:
        budget_rows: the most rows one part holds; a batch with more rows streams.
        mode: ``"keep"`` (ancestor parts keep their graphs) or ``"recompute"`` (they keep
            only their keys and values and run forward again for their backward); with
            ``budget_bytes`` also ``"auto"``: per batch, the mode with less work within the
            budget (`choose_stream`).
        cuts: a key of `CUTS`: where parts end (see `plan_stream`).
        budget_bytes: the memory of the whole training step instead (parameters,
            gradients and optimizer state included): a batch whose step
            `treecompile.planning.budget.CostModel` predicts within it runs as one call; a larger
            one streams in the largest parts whose streamed step, with everything the
            stack holds, is predicted within it (`stream_peak_bytes`, chosen per batch by
            `choose_stream`), for the model's config, parameter dtype and device.
            `StreamStats` reports the choice and the predicted peak.
        config: for ``budget_bytes``, what `CostModel.from_config` reads (a Hugging Face
            config, a dict with its keys, or a `treecompile.planning.budget.ModelDims`); None takes
            the model's ``config`` (a Hugging Face model).
        optimizer: for ``budget_bytes``, the optimizer whose state the budget holds (a name
            in `treecompile.planning.budget.OPTIMIZERS`).
    """

    budget_rows: int | None = None
    mode: str = "keep"
    cuts: str = "subtree"
    budget_bytes: int | None = None
    config: Any = field(default=None, compare=False)
    optimizer: str = "adamw"

    def __post_init__(self) -> None:
        if (self.budget_rows is None) == (self.budget_bytes is None):
            raise ValueError(
                "give exactly one of budget_rows (rows per part) and budget_bytes (memory per part), got "
                f"budget_rows={self.budget_rows!r}, budget_bytes={self.budget_bytes!r}")
        for name in ("budget_rows", "budget_bytes"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if self.mode not in BYTE_BUDGET_MODES:
            raise ValueError(unknown_choice("stream mode", self.mode, BYTE_BUDGET_MODES, "modes"))
        if self.mode == "auto" and self.budget_bytes is None:
            raise ValueError("mode='auto' chooses by memory: it needs budget_bytes (with budget_rows, pick keep or "
                             "recompute)")
        if self.cuts not in CUTS:
            raise ValueError(unknown_choice("cuts", self.cuts, CUTS, "cuts"))
        from treecompile.planning.budget import OPTIMIZERS

        if self.optimizer not in OPTIMIZERS:
            raise ValueError(unknown_choice("optimizer", self.optimizer, OPTIMIZERS))


def stream_cost_model(model, options: StreamOptions):
    """The `treecompile.planning.budget.CostModel` that resolves ``options.budget_bytes`` for ``model``:
    ``options.config`` (else the model's ``config``), the widest floating dtype of its
    parameters, their device and ``options.optimizer``.

    Raises:
        BudgetError: no config to read, or a config the cost model does not cover (mixture of
            experts).
    """
    import torch

    from treecompile.planning.budget import BudgetError, CostModel

    config = options.config if options.config is not None else getattr(model, "config", None)
    if config is None:
        raise BudgetError(
            f"StreamOptions(budget_bytes=...) needs the model's dimensions: {type(model).__name__} has no config; "
            "pass StreamOptions(config=...) (a dict with the Hugging Face keys or a treecompile.planning.budget.ModelDims) "
            "or give budget_rows")
    params = [p for p in model.parameters() if p.is_floating_point()]
    dtype = max((p.dtype for p in params), key=lambda d: torch.finfo(d).bits, default=torch.float32)
    device = params[0].device.type if params else "cpu"
    return CostModel.from_config(config, dtype=dtype, optimizer=options.optimizer,
                                 device="cuda" if device == "cuda" else "cpu")


@dataclass
class StreamPlan:
    """The schedule of one streamed batch.

    Attributes:
        starts: ``[n + 1]`` first row of each part, then S.
        prefix: per part, the global rows of its prefix (the root path of its first row,
            root first), ``[P_j]``.
        last_reader: ``[n]`` per part, the part after whose forward its backward runs: the
            latest such part of the parts that read it (itself if none reads it).
        release: per part ``j``, the parts whose backward runs after ``j``'s forward, latest first.
    """

    starts: np.ndarray
    prefix: list[np.ndarray]
    last_reader: np.ndarray
    release: list[list[int]] = field(default_factory=list)

    @property
    def num_parts(self) -> int:
        return len(self.starts) - 1

    def part_of(self, rows: np.ndarray) -> np.ndarray:
        """The part holding each row."""
        return np.searchsorted(self.starts, rows, side="right") - 1

    @property
    def stack_depth(self) -> int:
        """The most parts alive at once (on the stack, plus the running one)."""
        alive = 0
        depth = 0
        for j in range(self.num_parts):
            alive += 1
            depth = max(depth, alive)
            alive -= len(self.release[j])
        return depth

    def forward_rows(self, mode: str, aux_loss: bool = False) -> int:
        """Rows run forward by a step with grad: S in keep mode; in recompute mode also the
        rows of every part that a later part reads (they run again for their backward).
        ``aux_loss``: the model adds a router auxiliary loss, whose gradient needs the router
        sums of the whole tree first: one more forward pass of every row, without a graph
        (`StreamRunner`), so even keep mode's ERR is below the POR."""
        rows = int(self.starts[-1])
        extra = rows if aux_loss else 0
        if mode == "keep":
            return rows + extra
        sizes = np.diff(self.starts)
        return rows + extra + int(sizes[self.last_reader != np.arange(self.num_parts)].sum())

    @property
    def max_prefix(self) -> int:
        """The longest prefix (rows of keys and values a part reads from the stack)."""
        return max((len(p) for p in self.prefix), default=0)


def root_path(batch: TreeBatch, row: int, nodes: np.ndarray | None = None) -> np.ndarray:
    """``[P]`` the rows before ``row`` on its root path, root first (``P`` is its position):
    the earlier rows a run of rows starting at ``row`` may see. ``nodes``: the batch's
    ``node_table()`` as a numpy array, when the caller has it (read on the host, from the
    batch's check: no device read)."""
    return rows_before_on_path(nodes if nodes is not None else batch.node_table().numpy(), row)


def plan_stream(batch: TreeBatch, budget_rows: int, cuts: str = "subtree") -> StreamPlan:
    """Cuts ``batch`` into parts of at most ``budget_rows`` consecutive rows and schedules them.

    With ``cuts="subtree"`` a part ends at the last row ``r`` within the budget such that no
    row of the part is an ancestor of row ``r`` (``max(subtree_end[a:r]) <= r``): no later
    part reads it, so its backward runs right after its forward and it never sits on the
    stack. Where there is no such row (a node longer than the budget), the part takes the
    full budget and the next part starts inside the node. ``cuts="rows"`` always takes the
    full budget.

    O(S + parts x depth in nodes). A part's prefix is the root path of its first row up to
    that row: for every row of the part, the earlier rows it may see are a subset of that
    path (key ``k`` before the part is visible to row ``q`` iff ``q < subtree_end[k]``, and
    ``subtree_end[k] > q >= start`` holds for every such ``q`` once it holds for ``start``).
    """
    if cuts not in CUTS:
        raise ValueError(unknown_choice("cuts", cuts, CUTS, "cuts"))
    s = batch.num_tokens
    if cuts == "rows":
        starts = np.append(np.arange(0, s, budget_rows), s)
    else:
        sub = batch.subtree_end.cpu().numpy()
        bounds, a = [0], 0
        while a < s:
            b = min(a + budget_rows, s)
            if b < s:
                reach = np.maximum.accumulate(sub[a:b])  # the furthest subtree end of rows a .. a + i
                ok = np.flatnonzero(reach <= np.arange(a + 1, b + 1))
                if ok.size:
                    b = a + int(ok[-1]) + 1
            bounds.append(b)
            a = b
        starts = np.asarray(bounds, dtype=np.int64)
    nodes = batch.node_table().numpy()
    prefix = [root_path(batch, a, nodes) for a in starts[:-1].tolist()]
    n = len(starts) - 1
    # A part's backward must come after that of every part that reads it (they add its
    # keys' and values' gradients), and so after theirs in turn: done[q] is the latest
    # ``done`` of its readers. Readers come later in row order, so one sweep backwards.
    readers: list[list[int]] = [[] for _ in range(n)]
    for j, rows in enumerate(prefix):
        if rows.size:
            for q in np.unique(np.searchsorted(starts, rows, side="right") - 1).tolist():
                readers[q].append(j)
    done = np.arange(n)
    for q in range(n - 1, -1, -1):
        if readers[q]:
            done[q] = max(q, int(done[readers[q]].max()))
    release: list[list[int]] = [[] for _ in range(n)]
    for p in range(n - 1, -1, -1):
        release[int(done[p])].append(p)
    return StreamPlan(starts=starts, prefix=prefix, last_reader=done, release=release)


#: Margin on the replayed part of `stream_peak_bytes`, in percent: with parts under one
#: attention block the replay measured up to 1.4% under the CPU allocator's peak
#: (tests/test_budget.py), from buffers it does not itemise.
STREAM_PEAK_MARGIN_PERCENT = 5

#: Bytes per key of a part's prefix attention index buffers (``kv_end``, ``kv_pos``: int64).
PREFIX_INDEX_BYTES = 16

#: Bytes per row of the whole batch a streamed call holds besides the parts (its float64
#: log-probabilities and loss terms).
STREAM_ROW_BYTES = 16


@dataclass(frozen=True)
class PartRows:
    """What one process holds of each part of a streamed plan, where it is not the whole
    part (a part split over a CP group, `treecompile.distributed.stream_cp`), for
    `stream_peak_bytes`. Each ``[n]``, per part.

    Attributes:
        rows: the rows it computes.
        prefix: the rows of earlier keys and values it reads (the stack's and gathered ones).
        kept: the rows of keys and values it keeps on the stack for later parts (the whole
            group's, replicated), with as many of their gradients.
        after: transient rows of keys and values (every layer) right after the part's
            forward (the all-gather of its kept rows).
        exchange: transient rows of one layer's keys and values while the part runs (the
            exchange's send and receive buffers).
        summed: transient rows of keys and values (every layer) during the part's backward
            (its kept rows' gradients summed over the group).
    """

    rows: np.ndarray
    prefix: np.ndarray
    kept: np.ndarray
    after: np.ndarray
    exchange: np.ndarray
    summed: np.ndarray


def stream_peak_bytes(plan: StreamPlan, cost, mode: str, parts: PartRows | None = None) -> int:
    """Predicted peak bytes of one streamed training step with this plan, stack included.

    Replays the schedule with `treecompile.planning.budget.CostModel.part_bytes` per part: a part
    with a graph holds its saved activations (`CostModel.part_bytes`) and the prefix keys
    and values it read (a copy, with their gradients), from its forward to its backward; a
    part that later parts read also holds its keys' and values' gradients (keep mode) or,
    in recompute mode, only its keys and values and their gradients, its graph rebuilt when
    its backward is due. Every event adds the running part's largest transient (attention
    over its own rows plus its prefix). The static memory, the optimizer step and
    `STREAM_ROW_BYTES` per row of the batch come on top, and `STREAM_PEAK_MARGIN_PERCENT`
    on the replayed part. Every buffer it names is counted from its first possible
    allocation to its last use; ``tests/test_budget.py`` measures the whole against the
    CPU allocator (an upper bound there, by 1% to 31%).

    ``parts``: what this process holds of each part, where that is not the whole part
    (`PartRows`; None: the whole part, its prefix, its rows kept).
    """
    if mode not in MODES:
        raise ValueError(unknown_choice("stream mode", mode, MODES, "modes"))
    d = cost.dims
    kv_row = 2 * d.layers * d.kv_heads * d.head_dim * cost.dtype_bytes  # keys and values, every layer
    n_parts = plan.num_parts
    read = (plan.last_reader != np.arange(n_parts)).tolist()  # a later part reads it
    if parts is None:
        sizes = np.diff(plan.starts)
        none = np.zeros(n_parts, np.int64)
        parts = PartRows(rows=sizes, prefix=np.array([len(p) for p in plan.prefix], dtype=np.int64), kept=sizes,
                         after=none, exchange=none, summed=none)
    sizes, kept_rows = parts.rows.tolist(), parts.kept.tolist()
    keep = mode == "keep"
    held = 0  # bytes of the parts on the stack
    on_stack: dict[int, int] = {}
    peak = 0

    def part(j: int) -> tuple[int, int]:
        """``(held, transient)`` of part ``j`` with its graph: its saved activations, the
        prefix copy it read and the concatenated prefix-and-own keys and values its
        attention saves (with their index buffers); then its largest transient plus the
        prefix gradient twice (the attention's key and value gradients over its prefix and
        own rows, every layer, which the backward's outputs, views of them, keep alive until
        it ends, and their copies on the prefix leaves) and the exchange's buffers."""
        n, pre = sizes[j], int(parts.prefix[j])
        saved, transient = cost.part_bytes(max(n, 1), n + pre)
        return (saved + kv_row * (2 * pre + n) + PREFIX_INDEX_BYTES * (pre + n),
                transient + kv_row * (2 * pre + n) + kv_row * int(parts.exchange[j]) // d.layers)

    for j in range(n_parts):
        held_j, transient_j = part(j)
        peak = max(peak, held + held_j + transient_j)
        if read[j]:
            # Keep: its graph, with the loss head's saved tensors and its kept keys and
            # values; recompute: its kept keys and values only. Both: their gradients, which
            # its readers add.
            vals = kv_row * kept_rows[j]
            kept = held_j + cost.head_saved_bytes(sizes[j]) + vals if keep else vals
            on_stack[j] = kept + vals
            held += on_stack[j]
        peak = max(peak, held + (held_j if not read[j] or not keep else 0) + kv_row * int(parts.after[j]))
        for q in plan.release[j]:
            if q != j:  # its backward (recompute mode: its forward again first), then it goes
                stay = on_stack.pop(q)
                held -= stay
                # Keep mode: its graph is the one counted on the stack, now with its transient;
                # recompute mode: its graph built again beside its keys and values. Both: the
                # gradient of its own keys and values (and a copy of the kept rows' summed one).
                held_q, transient_q = part(q)
                peak = max(peak, held + held_q + transient_q + kv_row * sizes[q] * (2 if keep else 1)
                           + (0 if keep else stay) + kv_row * int(parts.summed[q]))
    # The parts' parameter gradients, held aside until ``loss.backward()`` (besides the
    # gradients the static memory counts, which the call sets aside and adds them to).
    held_grads = cost.dims.num_parameters * cost.dtype_bytes
    replayed = -(-max(peak, cost.optimizer_step_bytes()) * (100 + STREAM_PEAK_MARGIN_PERCENT) // 100)
    return cost.static_bytes() + held_grads + replayed + STREAM_ROW_BYTES * int(plan.starts[-1])


@dataclass(frozen=True)
class StreamChoice:
    """How a byte budget streams one batch (`choose_stream`).

    Attributes:
        rows: the most rows of a part.
        mode: ``"keep"`` or ``"recompute"``.
        peak_bytes: `stream_peak_bytes` of that plan.
        plan: the plan.
        why: one line: the choice and what it was weighed against.
    """

    rows: int
    mode: str
    peak_bytes: int
    plan: StreamPlan
    why: str


#: What one more part costs, in rows run forward, when ``mode="auto"`` weighs keep mode's
#: smaller parts against recompute mode's second forward of the parts later parts read (a
#: part is one compiled call; on CPU, with the small models of docs/benchmarks.md, a call
#: costs about as much as 200 rows).
PART_OVERHEAD_ROWS = 256

#: The most parts `choose_stream` cuts a batch into: smaller parts are not tried (each
#: part is one compiled call, and planning grows with parts times depth).
MAX_STREAM_PARTS = 1024


def _largest_rows(plan_of, peak, budget: int, mode: str, top: int, least: int):
    """A large part size ``least <= C <= top`` whose plan (``plan_of(C)``) fits ``budget``
    (``peak(plan, mode)``), with its plan and peak, or ``(None, smallest peak seen)``. The
    peak is not monotone in C (small parts stack more prefix copies), so: ``least`` (the
    size of at most `MAX_STREAM_PARTS` parts) times powers of two up to ``top`` (and
    ``top``), then a binary search between the largest one that fits and the next; every
    answer is checked."""
    def peak_of(c):
        plan = plan_of(c)
        return plan, peak(plan, mode)

    grid = sorted({least, *(c for c in (least << i for i in range(top.bit_length())) if c < top), top})
    seen = {c: peak_of(c) for c in grid}
    fit = [c for c in grid if seen[c][1] <= budget]
    if not fit:
        return None, min(peak for _, peak in seen.values())
    lo = fit[-1]
    hi = next((c for c in grid if c > lo), lo + 1) - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        seen[mid] = peak_of(mid)
        if seen[mid][1] <= budget:
            lo = mid
        else:
            hi = mid - 1
    return (lo, *seen[lo]), None


def choose_stream(batch: TreeBatch, cost, budget_bytes: int, mode: str = "auto", cuts: str = "subtree", *,
                  ranks: int = 1, rank_peak=None) -> StreamChoice:
    """The parts (and, for ``mode="auto"``, the mode) that stream ``batch`` within
    ``budget_bytes``, by `stream_peak_bytes`: the largest part size whose whole streamed
    step, stack included, is predicted within the budget.

    ``"auto"`` takes the mode with less work, counting a part as `PART_OVERHEAD_ROWS` rows
    run forward: keep mode runs every row forward once, recompute mode runs the parts that
    later parts read once more but may fit larger parts (fewer calls) in the budget.

    ``ranks``, ``rank_peak``: a batch streamed over a CP group of ``ranks``
    (`treecompile.distributed.stream_cp.choose_stream_cp`): the size chosen is the rows per rank,
    parts of ``ranks`` times as many rows, and ``rank_peak(plan, mode)`` the largest rank's
    predicted peak. The choice's ``rows`` are a part's.

    Raises:
        BudgetError: not even one row per part fits (the message gives the smallest peak).
    """
    from treecompile.planning.budget import BudgetError

    if mode not in BYTE_BUDGET_MODES:
        raise ValueError(unknown_choice("stream mode", mode, BYTE_BUDGET_MODES, "modes"))
    top = max((batch.num_tokens - 1) // ranks, 1)
    least = min(-(-batch.num_tokens // (MAX_STREAM_PARTS * ranks)), top)
    plans: dict[int, StreamPlan] = {}  # one plan per part size, for both modes

    def plan_of(c: int) -> StreamPlan:
        if c not in plans:
            plans[c] = plan_stream(batch, c * ranks, cuts)
        return plans[c]

    def whole_part(plan: StreamPlan, m: str) -> int:
        return stream_peak_bytes(plan, cost, m)

    modes = MODES if mode == "auto" else (mode,)
    found = {m: _largest_rows(plan_of, rank_peak or whole_part, budget_bytes, m, top, least) for m in modes}
    ok = {m: f for m, (f, _) in found.items() if f is not None}
    if not ok:
        need = min(least for _, least in found.values())
        raise BudgetError(
            f"a budget of {budget_bytes:,} bytes cannot stream this batch of {batch.num_tokens:,} rows in "
            f"{' or '.join(modes)} mode: the smallest predicted peak of the part sizes tried is {need:,} bytes "
            f"(static memory {cost.static_bytes():,})" + ("" if "recompute" in modes else
                                                          "; recompute mode keeps less on the stack"))
    if ranks > 1:  # rows per part, and per rank in the reason
        ok = {m: (rows * ranks, plan, p) for m, (rows, plan, p) in ok.items()}
    if len(ok) == 1:
        (m, (rows, plan, peak)), = ok.items()
        why = f"{m} mode{'' if mode != 'auto' else ' (keep mode does not fit)'}: parts of at most {rows} rows"
    else:
        (k_rows, k_plan, k_peak), (r_rows, r_plan, r_peak) = ok["keep"], ok["recompute"]
        extra = r_plan.forward_rows("recompute") - r_plan.forward_rows("keep")
        more_parts = k_plan.num_parts - r_plan.num_parts
        if extra >= PART_OVERHEAD_ROWS * more_parts:
            m, rows, plan, peak = "keep", k_rows, k_plan, k_peak
            why = (f"keep mode: {k_plan.num_parts} parts of at most {k_rows} rows; recompute mode would allow "
                   f"{r_rows} rows per part ({r_plan.num_parts} parts) and run {extra:,} rows forward again")
        else:
            m, rows, plan, peak = "recompute", r_rows, r_plan, r_peak
            why = (f"recompute mode: {r_plan.num_parts} parts of at most {r_rows} rows, {extra:,} rows forward "
                   f"again; keep mode fits only {k_rows} rows per part ({k_plan.num_parts} parts: its kept graphs "
                   f"fill the budget)")
    per_rank = f" ({rows // ranks} per rank of {ranks})" if ranks > 1 else ""
    return StreamChoice(rows=rows, mode=m, peak_bytes=peak, plan=plan,
                        why=f"{why}{per_rank}; predicted peak {peak:,} of {budget_bytes:,} bytes")


@dataclass
class StreamStats:
    """What the latest streamed call did.

    Attributes:
        parts: number of parts.
        stack_depth: the most parts alive at once.
        max_prefix: the longest prefix read from the stack, in rows.
        forward_rows: rows run forward over all parts (S in keep mode; more with recompute).
        rows: rows of the batch.
        budget_rows: the most rows of a part (chosen for the batch under ``budget_bytes``).
        mode: the mode it ran in (``"auto"`` resolved).
        peak_bytes: under ``budget_bytes``, the predicted peak of the step
            (`stream_peak_bytes`); None under ``budget_rows``.
        why: one line: the parts and mode, and why.
    """

    parts: int
    stack_depth: int
    max_prefix: int
    forward_rows: int
    rows: int
    budget_rows: int = 0
    mode: str = "keep"
    peak_bytes: int | None = None
    why: str = ""


def plan_stream_report(names: list[str], trees: list, header: dict, args, start: float) -> int:
    """``treecompile plan --stream MODE``: per tree, the streaming schedule at ``--capacity``
    rows: parts, stack depth, longest prefix, rows run forward, ERR and the predicted peak in
    rows (keep: the parts alive at once times the capacity; recompute: one part), plus the
    prefix rows every part reads. With ``--budget-bytes`` the parts are chosen per tree
    (`choose_stream`, MODE may be ``auto``) and the peak is predicted in bytes
    (`stream_peak_bytes`); a tree whose whole step fits runs as one call. ``--aux-loss`` (a
    model with a router auxiliary loss) counts the extra forward pass without a graph in the
    rows run forward and the ERR."""
    import json
    import time

    from treecompile.core.batch import pack
    from treecompile.planning.budget import BudgetError

    capacity = args.capacity or max(-(-max(t.num_tokens for t in trees) // 2), 1)
    aux = bool(getattr(args, "aux_loss", False))
    cost = getattr(args, "cost_model", None)
    out = []
    for name, tree in zip(names, trees):
        batch = pack(tree, warn_por=False)
        stats = tree.stats()
        row = {"name": name, "rows": tree.num_tokens, "path_tokens": stats.path_tokens, "por": stats.por}
        if cost is not None:
            if tree.num_tokens <= capacity:
                peak = cost.peak_bytes(tree.num_tokens)
                out.append({**row, "mode": "one call", "part_rows": tree.num_tokens, "parts": 1, "stack_depth": 1,
                            "max_prefix": 0, "forward_rows": tree.num_tokens, "aux_pass_rows": 0,
                            "err": 1 - tree.num_tokens / stats.path_tokens, "predicted_peak_bytes": peak,
                            "why": "the whole step fits", "schedule": [[0]]})
                continue
            try:
                choice = choose_stream(batch, cost, args.budget_bytes, args.stream)
            except BudgetError as e:
                out.append({**row, "error": str(e)})
                continue
            plan, mode = choice.plan, choice.mode
            extra = {"mode": mode, "part_rows": choice.rows, "predicted_peak_bytes": choice.peak_bytes,
                     "why": choice.why}
        else:
            plan, mode = plan_stream(batch, capacity), args.stream
            live = plan.stack_depth * capacity if mode == "keep" else capacity
            extra = {"peak_activation_rows": live}
        fwd = plan.forward_rows(mode, aux_loss=aux)
        out.append({**row, "parts": plan.num_parts, "stack_depth": plan.stack_depth, "max_prefix": plan.max_prefix,
                    "forward_rows": fwd, "aux_pass_rows": tree.num_tokens if aux else 0,
                    "err": 1 - fwd / stats.path_tokens, **extra,
                    "schedule": [[int(x) for x in r] for r in plan.release]})
    if args.json:
        print(json.dumps({**header, "capacity": capacity, "mode": args.stream, "aux_loss": aux, "trees": out,
                          "seconds": round(time.perf_counter() - start, 3)}, indent=1))
        return 0
    budget = header.get("budget")
    if budget:
        print(f"treecompile plan --stream {args.stream} {header['file']}: within --budget-bytes "
              f"{budget['budget_bytes']:,} for the whole step; a tree of at most {capacity} rows runs as one call")
    else:
        print(f"treecompile plan --stream {args.stream} {header['file']}: parts of at most {capacity} rows")
    if aux:
        print("--aux-loss: the router auxiliary loss's gradient needs the whole tree's router sums first, so each "
              "step runs every row forward once more without a graph (counted in fwd rows: ERR < POR)")
    last = "peak MiB" if budget else "peak rows"
    print(f"{'tree':<40} {'rows':>8} {'parts':>6} {'stack':>6} {'prefix':>7} {'fwd rows':>9} {'POR':>6} {'ERR':>6} "
          f"{last:>10}" + (f" {'mode':>9} {'part rows':>9}" if budget else ""))
    for t in out[: max(args.rows, 0)]:
        if "error" in t:
            print(f"{t['name'][:40]:<40} {t['rows']:>8} does not stream within the budget: {t['error']}")
            continue
        peak = f"{t['predicted_peak_bytes'] / 2**20:.1f}" if budget else t["peak_activation_rows"]
        print(f"{t['name'][:40]:<40} {t['rows']:>8} {t['parts']:>6} {t['stack_depth']:>6} {t['max_prefix']:>7} "
              f"{t['forward_rows']:>9} {t['por']:>6.3f} {t['err']:>6.3f} {peak:>10}"
              + (f" {t['mode']:>9} {t['part_rows']:>9}" if budget else ""))
    print("stack: most parts alive at once; prefix: most rows of keys/values a part reads from the stack; "
          + ("peak MiB: the predicted peak of the whole streamed step (treecompile.stream.plan.stream_peak_bytes)"
             if budget else "peak rows: rows whose activations are held at once (plus the prefix keys/values)")
          + ("" if aux else "; a model with a router auxiliary loss runs one more forward pass (--aux-loss)"))
    return 0
