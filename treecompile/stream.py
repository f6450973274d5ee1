"""Streaming execution: a tree larger than the row budget, trained exactly with a KV stack.

    model = tree_compile(model, stream=StreamOptions(budget_rows=4096))
    out = model(batch)        # a batch over 4096 rows streams; smaller ones run as one call
    out.loss.backward()       # the same gradients as per-path training

The packed row (depth-first) is cut into parts of at most ``budget_rows`` consecutive rows;
every row is in exactly one part, so no token is computed twice (a part may start inside a
node). Parts run in row order. A part's attention reads, per layer, the keys and values of
the rows before it on the root path of its first row (its *prefix*: the KV stack), from the
earlier parts that computed them, besides its own (`treecompile.passes.stream`); in a
hybrid model its causal convs read the prefix rows' conv inputs the same way, and its
recurrent layers start from the states after its *entry rows* (`_BatchArrays.structure`),
which the parts holding those rows read out. Its gradients with respect to what it read
are added into the stack entries of the parts that produced them; a part runs its own
backward once every later part that reads it has run its backward (see `StreamPlan`), so
each part's graph lives only while a descendant part still needs it.

Modes (`StreamOptions.mode`):

* ``"keep"``: a part keeps its autograd graph while it is on the stack; each part runs
  forward once and backward once (the effective reuse ratio equals the POR).
* ``"recompute"``: a part that later parts read keeps only its keys and values (detached)
  and is run forward again, with grad, when its backward is due; at most one part's graph
  is alive at a time, for one extra forward of such parts (AReaL-DTA's trade).

The backward runs during the call (it must, to free each part's graph); the gradients are
held aside and land on the parameters when ``out.loss.backward()`` is called, scaled by
the gradient it receives. So only losses expressed through the batch's ``target_weight``
(every loss mode) stream, plus a MoE model's router auxiliary loss (from the parts' router
sums, with one more forward pass without a graph for its gradient; see
`RouterAux.tree_stats`); ``out.logprobs`` and ``out.entropy`` are values (no gradient) in a
streamed call.
"""

from __future__ import annotations

import contextlib
import dataclasses
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from treecompile.batch import TreeBatch
from treecompile.call import gathered_entropy
from treecompile.errors import UnsupportedModelError
from treecompile.kernels.flex import BLOCK_SIZE, interval_block_mask, split_block_mask
from treecompile.passes.attention import rewrite_attention_pass
from treecompile.passes.pipeline import Pipeline, make_backend
from treecompile.passes.ssm_state import route_ssm_state_pass
from treecompile.passes.stream import KVLayout, StreamGraph, stream_passes
from treecompile.passes.subgraphs import inline_subgraphs_pass

if TYPE_CHECKING:
    from treecompile import TreeCompiledModel
    from treecompile.call import TreeOutput

__all__ = ["MODES", "CUTS", "StreamOptions", "StreamPlan", "StreamStats", "plan_stream", "StreamRunner", "stream_logprob_loss"]

#: ``StreamOptions.mode`` choices.
MODES = ("keep", "recompute")
#: ``StreamOptions.cuts`` choices: ``"subtree"`` ends a part, where it can within the budget,
#: where none of its rows is an ancestor of the next row (so no later part reads it);
#: ``"rows"`` cuts every ``budget_rows`` rows.
CUTS = ("subtree", "rows")

#: Rows of the always-invisible padding prefix: the prefix length is never 0 or 1, which
#: Dynamo would specialise (one graph for every part).
PAD_PREFIX = 2
#: Zero states before a part's entry states, and unused readouts before its own, for the
#: same reason (hybrid models).
PAD_STATES = 2


@dataclass(frozen=True)
class StreamOptions:
    """How `tree_compile` runs a batch larger than its budget.

    Attributes:
        budget_rows: the most rows one part holds; a batch with more rows streams.
        mode: ``"keep"`` (ancestor parts keep their graphs) or ``"recompute"`` (they keep
            only their keys and values and run forward again for their backward).
        cuts: a key of `CUTS`: where parts end (see `plan_stream`).
    """

    budget_rows: int
    mode: str = "keep"
    cuts: str = "subtree"

    def __post_init__(self) -> None:
        if isinstance(self.budget_rows, bool) or not isinstance(self.budget_rows, int) or self.budget_rows < 1:
            raise ValueError(f"budget_rows must be a positive int, got {self.budget_rows!r}")
        if self.mode not in MODES:
            raise ValueError(f"unknown stream mode {self.mode!r}; valid modes: {', '.join(MODES)}")
        if self.cuts not in CUTS:
            raise ValueError(f"unknown cuts {self.cuts!r}; valid cuts: {', '.join(CUTS)}")


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

    def forward_rows(self, mode: str) -> int:
        """Rows run forward by a step with grad: S in keep mode; in recompute mode also the
        rows of every part that a later part reads (they run again for their backward)."""
        rows = int(self.starts[-1])
        if mode == "keep":
            return rows
        sizes = np.diff(self.starts)
        return rows + int(sizes[self.last_reader != np.arange(self.num_parts)].sum())

    @property
    def max_prefix(self) -> int:
        """The longest prefix (rows of keys and values a part reads from the stack)."""
        return max((len(p) for p in self.prefix), default=0)


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
        raise ValueError(f"unknown cuts {cuts!r}; valid cuts: {', '.join(CUTS)}")
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
    n_start, n_end, parent = (t.cpu().numpy() for t in (batch.node_start, batch.node_end, batch.node_parent))
    prefix = []
    for a in starts[:-1].tolist():
        v = int(np.searchsorted(n_start, a, side="right")) - 1
        chain = [np.arange(n_start[v], a)]
        u = int(parent[v])
        while u >= 0:
            chain.append(np.arange(n_start[u], n_end[u]))
            u = int(parent[u])
        prefix.append(np.concatenate(chain[::-1]).astype(np.int64))
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
        for j in readers[q]:
            done[q] = max(done[q], done[j])
    release: list[list[int]] = [[] for _ in range(n)]
    for p in range(n - 1, -1, -1):
        release[int(done[p])].append(p)
    return StreamPlan(starts=starts, prefix=prefix, last_reader=done, release=release)


@dataclass
class StreamStats:
    """What the latest streamed call did.

    Attributes:
        parts: number of parts.
        stack_depth: the most parts alive at once.
        max_prefix: the longest prefix read from the stack, in rows.
        forward_rows: rows run forward over all parts (S in keep mode; more with recompute).
        rows: rows of the batch.
    """

    parts: int
    stack_depth: int
    max_prefix: int
    forward_rows: int
    rows: int


@dataclass
class _Entry:
    vals: list[torch.Tensor]  # the part's own keys/values per stack slot, detached
    outs: list[torch.Tensor] | None  # the same, attached to the part's graph (None: not kept)
    loss: torch.Tensor | None
    leaves: list[torch.Tensor]  # the prefix tensors the part read, with their grads after its backward
    grads: list[torch.Tensor | None]  # gradients later parts added to ``vals``
    main: torch.Tensor | None = None  # the part's loss without the auxiliary term, detached


@dataclass
class _RunResult:
    loss: torch.Tensor  # the main loss (no auxiliary term), detached
    logprobs: torch.Tensor  # [S]
    entropy: torch.Tensor | None  # [S], with outputs=("entropy",)
    router_stats: torch.Tensor | None  # [2E + 1] summed over parts, with a router auxiliary loss
    forward_rows: int


class _StreamedLoss(torch.autograd.Function):
    """The streamed loss value; its backward hands out the parameter gradients computed
    during the call, times the incoming gradient."""

    @staticmethod
    def forward(ctx, value, grads, *params):
        ctx.grads = grads
        return value.clone()

    @staticmethod
    def backward(ctx, g):
        return (None, None, *[None if x is None else x * g.to(x.dtype) for x in ctx.grads])


class StreamRunner:
    """Runs batches over the budget for a `TreeCompiledModel` (see the module docstring)."""

    def __init__(self, wrapper, options: StreamOptions) -> None:
        self.wrapper = wrapper
        self.options = options
        self.stats: StreamStats | None = None
        self._compiled = None
        self._shapes: KVLayout | None = None  # the stack's slots, learnt from the graph
        self._layout = None
        _check_streamable(wrapper)

    def wants(self, batch: TreeBatch) -> bool:
        """Whether ``batch`` is over the budget (and streams)."""
        return batch.num_tokens > self.options.budget_rows

    # ------------------------------------------------------------------ compile

    def _build(self, device: torch.device, shapes: KVLayout) -> None:
        w = self.wrapper
        state = StreamGraph()
        read, route, route_state = stream_passes(state)
        pipeline = w._passes if isinstance(w._passes, Pipeline) else Pipeline(tuple(w._passes))
        passes = []
        for p in pipeline.passes:
            passes.append(p)
            if p is inline_subgraphs_pass:
                passes.append(read)
            if p is rewrite_attention_pass:
                passes.append(route)
            if p is route_ssm_state_pass:
                passes.append(route_state)
        lowering = w._backend_name or ("inductor" if device.type == "cuda" else "aot_eager")
        backend = make_backend(mask="interval", layout_of=lambda: self._layout, chunks_of=lambda: 0,
                               lowering=lowering, records=w.compile_records,
                               passes=dataclasses.replace(pipeline, passes=tuple(passes)), scan_kernel=w.scan_kernel)
        inner, kwargs_of, router = w._inner, w._call_kwargs, w._router_aux
        want_entropy = "entropy" in w._outputs
        temperature = w.temperature
        from treecompile.capture import install_output_hooks
        from treecompile.reference import logits_of

        if router is not None:
            install_output_hooks(inner)

        def stream_forward(ids, positions, sub_local, block_tensors, rows, slot, target, dest, weight, path_count,
                           structure, prefix, conv, states, kv_meta):
            ids = torch.ops.treecompile.tree_inputs(ids, [positions, sub_local], list(block_tensors), list(structure))
            ids = torch.ops.treecompile.stream_inputs(ids, list(prefix), list(conv), list(states), list(kv_meta))
            out = inner(ids, **kwargs_of(positions))
            logits = logits_of(out)
            if temperature != 1.0:
                logits = logits / temperature
            logprobs = torch.ops.treecompile.tree_logprobs(logits, rows, slot, target, dest)
            loss = -(weight.to(logprobs.dtype) * logprobs).sum()
            # The part's router sums (added over parts by the runner; see RouterAux.tree_stats).
            stats = router.tree_stats(out.router_logits, path_count) if router is not None else None
            entropy = gathered_entropy(logits, rows, slot, dest, positions) if want_entropy else None
            kv = torch.ops.treecompile.stream_outputs(ids, list(prefix), list(conv), list(states), kv_meta[3])
            return loss, logprobs, kv, stats, entropy

        code = stream_forward.__code__.replace(co_name=f"stream_forward_{id(self):x}_{len(shapes.shapes)}")
        fn = types.FunctionType(code, stream_forward.__globals__, code.co_name, None, stream_forward.__closure__)
        self._compiled = torch.compile(fn, backend=backend, fullgraph=True)
        self._shapes = shapes

    def _call(self, args: tuple) -> tuple:
        from treecompile.call import DYNAMO_CONFIG as _DYNAMO_CONFIG
        from treecompile.capture import hf_interfaces, swapped_kernels

        w = self.wrapper
        hf = hf_interfaces(w._inner, w._routes_attention) if w._is_hf else contextlib.nullcontext()
        with hf, swapped_kernels(w._kernels + w._mask_swaps):
            with torch.fx.experimental._config.patch(use_duck_shape=False), torch._dynamo.config.patch(_DYNAMO_CONFIG):
                try:
                    return self._compiled(*args)
                except torch._dynamo.exc.BackendCompilerFailed as e:
                    if isinstance(e.inner_exception, (KVLayout, UnsupportedModelError)):
                        raise e.inner_exception from None
                    raise

    # ------------------------------------------------------------------ run

    def __call__(self, batch: TreeBatch):
        from treecompile.call import TreeOutput, device_of as _device_of

        w = self.wrapper
        device = _device_of(w._inner)
        batch = batch.to(device) if batch.device != device else batch
        plan = plan_stream(batch, self.options.budget_rows, self.options.cuts)
        grad = torch.is_grad_enabled()
        params = [p for p in w._inner.parameters() if p.requires_grad] if grad else []
        saved = [p.grad for p in params]
        for p in params:
            p.grad = None
        router = w._router_aux
        try:
            aux_grad, first_rows = None, 0
            if router is not None and grad:
                # The gradient of the auxiliary loss with respect to a part's router
                # probability sums is E * T / N^2 (`RouterAux.aux_from_stats` is linear in them),
                # with T and N over the whole tree: a first pass without a graph finds them.
                first = self._run(batch, plan, device, False)
                first_rows = first.forward_rows
                probs = first.router_stats.clone().requires_grad_(True)
                (aux_grad,) = torch.autograd.grad(router.aux_from_stats(probs), probs)
                aux_grad = router.coef * aux_grad
            result = self._run(batch, plan, device, grad, aux_grad)
            streamed = [p.grad for p in params]
        finally:
            for p, g in zip(params, saved):
                p.grad = g
        self.stats = StreamStats(parts=plan.num_parts, stack_depth=plan.stack_depth, max_prefix=plan.max_prefix,
                                 forward_rows=first_rows + result.forward_rows, rows=batch.num_tokens)
        loss, aux = result.loss, None
        if router is not None:
            aux = router.aux_from_stats(result.router_stats)
            loss = loss + router.coef * aux.to(loss.dtype)
        if grad:
            loss = _StreamedLoss.apply(loss, streamed, *params)
        return TreeOutput(loss=loss, logprobs=result.logprobs, aux_loss=aux, entropy=result.entropy)

    def _run(self, batch: TreeBatch, plan: StreamPlan, device, grad: bool,
             aux_grad: torch.Tensor | None = None) -> _RunResult:
        """Every part forward (and, with ``grad``, backward) in the plan's order.

        ``aux_grad``: ``[2E + 1]``, the gradient of ``coef * aux`` with respect to the
        router sums; each part's backward adds ``aux_grad . stats_j`` to its loss."""
        keep = self.options.mode == "keep"
        data = _BatchArrays(batch, plan, self.wrapper._structure)
        entries: dict[int, _Entry] = {}
        total = torch.zeros((), dtype=torch.float64, device=device)
        logprobs = torch.zeros(batch.num_tokens, dtype=torch.float64, device=device)
        entropy = torch.zeros_like(logprobs) if "entropy" in self.wrapper._outputs else None
        router_stats = None
        forward_rows = 0
        for j in range(plan.num_parts):
            # A part nothing later reads runs with grad and goes back at once; in recompute
            # mode, a part that later parts read runs without a graph first.
            backward_now = grad and int(plan.last_reader[j]) == j
            with_graph = grad and (keep or backward_now)
            entry, lp, dest, stats, ent = self._forward_part(data, plan, j, entries, device, with_graph, aux_grad)
            forward_rows += int(plan.starts[j + 1] - plan.starts[j])
            entries[j] = entry
            total = total + entry.main.to(total.dtype)
            logprobs[dest] = lp.detach().to(logprobs.dtype)
            if ent is not None:
                entropy[dest] = ent.detach().to(entropy.dtype)
            if stats is not None:
                stats = stats.detach().to(torch.float64)
                router_stats = stats if router_stats is None else router_stats + stats
            if not grad:
                for p in plan.release[j]:
                    entries.pop(p)
                continue
            for p in plan.release[j]:
                e = entries[p]
                if e.outs is None:  # recompute mode: run it again, now with its graph
                    redo = self._forward_part(data, plan, p, entries, device, True, aux_grad)[0]
                    forward_rows += int(plan.starts[p + 1] - plan.starts[p])
                    e.outs, e.loss, e.leaves = redo.outs, redo.loss, redo.leaves
                self._backward_part(plan, data, p, e, entries)
                del entries[p]
        return _RunResult(loss=total, logprobs=logprobs, entropy=entropy, router_stats=router_stats,
                          forward_rows=forward_rows)

    def _forward_part(self, data: _BatchArrays, plan: StreamPlan, j: int, entries: dict, device, with_graph: bool,
                      aux_grad: torch.Tensor | None = None):
        a, b = int(plan.starts[j]), int(plan.starts[j + 1])
        inputs, dest = data.part_inputs(a, b, plan.prefix[j])
        inputs = [x.to(device) for x in inputs]
        block_tensors, self._layout = split_block_mask(interval_block_mask(inputs[2], BLOCK_SIZE))
        if self._shapes is None:
            self._build(device, KVLayout([]))
            try:
                self._call(self._args(inputs, block_tensors, data.structure(j, 1, device), ([], [], [])))
            except KVLayout as e:
                self._build(device, e)
        dk = self._shapes.states[0][1] if self._shapes.states else 1
        structure = data.structure(j, dk, device)
        stack = self._prefix(plan, data, j, entries, device)
        leaves = [x.requires_grad_() for x in (*stack[0], *stack[1], *stack[2])] if with_graph else []
        with torch.set_grad_enabled(with_graph):
            loss, lp, kv, stats, ent = self._call(self._args(inputs, block_tensors, structure, stack))
            main = loss.detach()
            if aux_grad is not None and with_graph:
                # coef * aux is linear in the part's router sums with this gradient: the part's
                # share of the auxiliary loss's gradient (see StreamRunner.__call__).
                loss = loss + (aux_grad.to(stats.dtype) * stats).sum().to(loss.dtype)
        m = dest.shape[0]
        entry = _Entry(vals=[t.detach() for t in kv], outs=list(kv) if with_graph else None, loss=loss,
                       leaves=leaves, grads=[None] * len(kv), main=main)
        return entry, lp[:m], dest.to(device), stats, None if ent is None else ent[:m]

    @staticmethod
    def _args(inputs, block_tensors, structure, stack) -> tuple:
        ids, positions, sub_local, rows, slot, target, dest, weight, path_count, kv_end, kv_pos = inputs
        tables, conv_pred, readouts = structure
        prefix, conv, states = stack
        ids = ids[None]
        for t, d in [(ids, 1), (positions, 0), (sub_local, 0), (rows, 0), (slot, 0), (target, 0), (dest, 0),
                     (weight, 0), (path_count, 0), (kv_end, 0), (kv_pos, 0), (conv_pred, 0), (readouts, 0),
                     *[(t, 0) for t in tables], *[(p, 2) for p in prefix], *[(c, 2) for c in conv],
                     *[(x, 0) for x in states], *[(bt, d) for bt in block_tensors for d in range(2, bt.dim())]]:
            torch._dynamo.maybe_mark_dynamic(t, d)
        return (ids, positions, sub_local, block_tensors, rows, slot, target, dest, weight, path_count, tables,
                prefix, conv, states, [kv_end, kv_pos, conv_pred, readouts])

    def _prefix(self, plan: StreamPlan, data: _BatchArrays, j: int, entries: dict, device) -> tuple[list, list, list]:
        """What part ``j`` reads from the stack (detached copies), per slot:

        * keys and values ``[1, Hkv, PAD_PREFIX + P_j, D]`` and conv inputs ``[1, C,
          PAD_PREFIX + P_j]``: padding, then the prefix rows' ones, gathered from the parts
          that computed them;
        * recurrent states ``[PAD_STATES + E_j, H, Dk, Dv]``: zeros, then the states after
          the part's entry rows (`_BatchArrays._state_rows`), read out by the parts holding them.
        """
        rows = plan.prefix[j]
        owners = plan.part_of(rows)
        groups = [(int(p), torch.as_tensor(rows[owners == p] - plan.starts[p], device=device))
                  for p in np.unique(owners)]
        lay = self._shapes
        kv, conv, states = [], [], []
        for i, (h, d, dtype) in enumerate(lay.shapes):
            pieces = [torch.zeros(1, h, PAD_PREFIX, d, dtype=dtype, device=device)]
            pieces += [entries[p].vals[i].index_select(2, idx) for p, idx in groups]
            kv.append(torch.cat(pieces, dim=2))
        for i, (c, dtype) in enumerate(lay.conv, start=len(lay.shapes)):
            pieces = [torch.zeros(1, c, PAD_PREFIX, dtype=dtype, device=device)]
            pieces += [entries[p].vals[i].index_select(2, idx) for p, idx in groups]
            conv.append(torch.cat(pieces, dim=2))
        state_groups = ([(p, torch.as_tensor(idx, device=device)) for p, idx in data.entry_sources(j)]
                        if lay.states else [])
        for i, (h, dk, dv, dtype) in enumerate(lay.states, start=len(lay.shapes) + len(lay.conv)):
            pieces = [torch.zeros(PAD_STATES, h, dk, dv, dtype=dtype, device=device)]
            pieces += [entries[p].vals[i].index_select(0, idx) for p, idx in state_groups]
            states.append(torch.cat(pieces, dim=0))
        return kv, conv, states

    def _backward_part(self, plan: StreamPlan, data: _BatchArrays, p: int, e: _Entry, entries: dict) -> None:
        """Backward of part ``p`` with the gradients its readers added; then its prefix
        gradients go into the entries of the parts that computed those rows."""
        tensors, grads = [e.loss], [torch.ones_like(e.loss)]
        for out, g in zip(e.outs, e.grads):
            if g is not None:
                tensors.append(out)
                grads.append(g)
        torch.autograd.backward(tensors, grads)
        rows = plan.prefix[p]
        owners = plan.part_of(rows)
        n_seq = len(self._shapes.shapes) + len(self._shapes.conv)
        sources = data.entry_sources(p) if len(e.leaves) > n_seq else []
        for i, leaf in enumerate(e.leaves):
            if leaf.grad is None:
                continue
            if i < n_seq:  # keys, values, conv inputs: along the rows (dim 2)
                dim, g = 2, leaf.grad[:, :, PAD_PREFIX:]
                pieces = [(q, rows[owners == q] - plan.starts[q]) for q in np.unique(owners).tolist()]
            else:  # recurrent states: one per entry row (dim 0)
                dim, g, pieces = 0, leaf.grad[PAD_STATES:], sources
            offset = 0
            for q, idx in pieces:
                n = len(idx)
                owner = entries[q]
                if owner.grads[i] is None:
                    owner.grads[i] = torch.zeros_like(owner.vals[i])
                owner.grads[i].index_add_(dim, torch.as_tensor(idx, device=g.device), g.narrow(dim, offset, n))
                offset += n
        e.outs = e.loss = None
        e.leaves = []


class _BatchArrays:
    """The batch's per-row fields as numpy arrays, and each part's compiled-call inputs."""

    def __init__(self, batch: TreeBatch, plan: StreamPlan | None = None, structure: bool = False) -> None:
        self.ids = batch.input_ids.cpu().numpy()
        self.pos = batch.position_ids.cpu().numpy()
        self.sub = batch.subtree_end.cpu().numpy()
        self.weight = batch.target_weight.detach().cpu().numpy()
        self.path_count = batch.path_count.cpu().numpy()
        pred = batch.pred_index.cpu().numpy()
        targets = np.flatnonzero(pred >= 0)
        order = np.argsort(pred[targets], kind="stable")
        self.targets = targets[order]  # target rows, by their predicting row
        self.target_pred = pred[self.targets]
        self.plan = plan
        self.has_structure = structure
        if structure:
            self._state_rows(batch, pred)

    # ---- recurrent state and conv context (hybrid models)

    def _state_rows(self, batch: TreeBatch, pred: np.ndarray) -> None:
        """Per part, its *entry rows* (earlier parts' rows whose recurrent state a row of the
        part starts from: the predecessors of its rows that lie before it) and its *readout
        rows* (its rows that a later part's row starts from), each sorted.

        A readout row is always the last row of its node within the part (the next row on
        its path is a node start or the next part's first row), so the state after it is the
        final state of that node as the part runs it.
        """
        plan = self.plan
        self.pred = pred
        self.n_start, self.n_end, self.n_parent = (t.cpu().numpy() for t in
                                                   (batch.node_start, batch.node_end, batch.node_parent))
        rows = np.flatnonzero(pred >= 0)
        part = plan.part_of(rows)
        src = pred[rows]
        src_part = plan.part_of(src)
        cross = src_part != part
        n = plan.num_parts
        self.entry = [np.unique(src[cross & (part == j)]) for j in range(n)]
        self.readout = [np.unique(src[cross & (src_part == j)]) for j in range(n)]

    def entry_sources(self, j: int) -> list[tuple[int, np.ndarray]]:
        """``(part, readout indices)`` holding part ``j``'s entry rows' states, in entry order."""
        rows = self.entry[j]
        owners = self.plan.part_of(rows)
        out = []
        for q in np.unique(owners).tolist():
            sel = rows[owners == q]
            out.append((q, PAD_STATES + np.searchsorted(self.readout[q], sel)))
        return out

    def structure(self, j: int, dk: int, device) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
        """``(tree structure, conv_pred, readouts)`` for part ``j``'s call.

        * tree structure (hybrid models): ``[pred_index [S_run], node_table [N, 3]]``, the
          node table (on the CPU) over ``[injection rows ; the part's rows ; readout rows]``
          (see `treecompile.passes.stream.stream_scan_fn`): ``PAD_STATES + E_j`` injection
          nodes of ``dk`` rows (roots), the tree's nodes clipped to the part (a node that
          starts before the part hangs from the injection node of its previous row; one
          whose parent ended before the part, from that of the parent's last row), a root
          node for the padding rows, and ``PAD_STATES + R_j`` readout nodes of ``dk`` rows,
          each a child of the node whose last row it reads;
        * ``conv_pred`` ``[PAD_PREFIX + P_j + S_run]``: each row's predecessor in
          ``[padding ; prefix ; part]`` coordinates (-1 at a root and on padding rows);
        * ``readouts`` ``[PAD_STATES + R_j]``: a tensor whose length is the number of states
          read out.
        """
        plan = self.plan
        a, b = int(plan.starts[j]), int(plan.starts[j + 1])
        s = b - a
        s_run = self._s_run(a, b)
        prefix = plan.prefix[j]
        n_read = PAD_STATES + (len(self.readout[j]) if self.has_structure else 0)
        readouts = torch.zeros(n_read, dtype=torch.int64, device=device)
        pre = PAD_PREFIX + len(prefix)
        if not self.has_structure:
            return [], torch.full((pre + s_run,), -1, dtype=torch.int64, device=device), readouts
        pred = self.pred[a:b]
        # Predecessors inside the part, before it (on the prefix: index = path position), none.
        before = np.where(pred >= 0, PAD_PREFIX + self.pos[np.maximum(pred, 0)], -1)
        inside = np.where(pred >= a, pre + pred - a, before)
        conv_pred = np.concatenate([np.full(PAD_PREFIX, -1), np.arange(len(prefix)) + PAD_PREFIX - 1, inside,
                                    np.full(s_run - s, -1)])
        if len(prefix):
            conv_pred[PAD_PREFIX] = -1  # the root's first row
        pred_local = np.concatenate([np.where(pred >= a, pred - a, -1), np.full(s_run - s, -1)])
        entry = self.entry[j]
        inj = {int(r): PAD_STATES + i for i, r in enumerate(entry.tolist())}
        n_in = PAD_STATES + len(entry)
        table = [[i * dk, (i + 1) * dk, -1] for i in range(n_in)]
        off = n_in * dk
        v0 = int(np.searchsorted(self.n_start, a, side="right")) - 1
        v1 = int(np.searchsorted(self.n_start, b, side="left"))
        for v in range(v0, v1):
            st, en, par = int(self.n_start[v]), int(self.n_end[v]), int(self.n_parent[v])
            if st < a:
                parent = inj[a - 1]
            elif par < 0:
                parent = -1
            elif par >= v0:
                parent = n_in + par - v0
            else:
                parent = inj[int(self.pred[st])]
            table.append([max(st, a) - a + off, min(en, b) - a + off, parent])
        if s_run > s:
            table.append([off + s, off + s_run, -1])
        off += s_run
        for i in range(PAD_STATES):
            table.append([off + i * dk, off + (i + 1) * dk, 0])
        for i, r in enumerate(self.readout[j].tolist(), start=PAD_STATES):
            v = int(np.searchsorted(self.n_start, r, side="right")) - 1
            table.append([off + i * dk, off + (i + 1) * dk, n_in + v - v0])
        tensors = [torch.from_numpy(pred_local.astype(np.int64)).to(device),
                   torch.tensor(table, dtype=torch.int64)]
        return tensors, torch.from_numpy(conv_pred.astype(np.int64)).to(device), readouts

    def _s_run(self, a: int, b: int) -> int:
        lo, hi = np.searchsorted(self.target_pred, [a, b])
        return max(b - a, max(int(hi - lo), 2), 2)

    def part_inputs(self, a: int, b: int, prefix: np.ndarray) -> tuple[list[torch.Tensor], torch.Tensor]:
        """The compiled call's inputs for rows ``[a, b)``, and the global rows of its targets.

        The part's targets are those predicted by its rows (the loss needs the predicting
        row's output). A branch row predicts several; the call has ``S_run = max(b - a, M,
        2)`` rows (padding rows see only themselves, nothing sees them) so that the ``M``
        targets' log-probabilities fit in its ``[S_run]`` output, in slots ``0 .. M - 1``.
        """
        s = b - a
        lo, hi = np.searchsorted(self.target_pred, [a, b])
        t = self.targets[lo:hi]
        m = t.shape[0]
        m_run = max(m, 2)
        s_run = max(s, m_run, 2)
        pad = s_run - s
        ids = np.concatenate([self.ids[a:b], np.zeros(pad, np.int64)])
        pos = np.concatenate([self.pos[a:b], np.zeros(pad, np.int64)])
        sub_local = np.concatenate([np.minimum(self.sub[a:b], b) - a, np.arange(s + 1, s_run + 1)])
        rows, slot = np.unique(self.target_pred[lo:hi] - a, return_inverse=True)
        rows = np.concatenate([rows, np.zeros(max(0, 2 - rows.shape[0]), np.int64)])
        target = np.concatenate([self.ids[t], np.zeros(m_run - m, np.int64)])
        slot = np.concatenate([slot.reshape(-1), np.zeros(m_run - m, np.int64)])
        dest = np.arange(m_run)
        weight = np.zeros(s_run)
        weight[:m] = self.weight[t]
        path_count = np.concatenate([self.path_count[a:b], np.zeros(pad, np.int64)])
        p = PAD_PREFIX + prefix.shape[0]
        kv_end = np.concatenate([np.zeros(PAD_PREFIX, np.int64), p + np.minimum(self.sub[prefix], b) - a,
                                 p + sub_local])
        kv_pos = np.concatenate([np.zeros(PAD_PREFIX, np.int64), self.pos[prefix], pos])
        as_t = [torch.from_numpy(np.ascontiguousarray(x)) for x in
                (ids, pos, sub_local, rows, slot, target, dest, weight, path_count, kv_end, kv_pos)]
        as_t = [x.to(torch.int64) if x.dtype != torch.float64 else x for x in as_t]
        return as_t, torch.from_numpy(t.copy())


def stream_logprob_loss(
    compiled: TreeCompiledModel, batch: TreeBatch, loss_fn: Callable[[torch.Tensor], torch.Tensor]
) -> TreeOutput:
    """A loss that is any function of the per-row log-probabilities, streamed exactly.

    ``loss_fn(logprobs [S]) -> scalar`` (an RL objective, say) is evaluated on the
    log-probabilities of a no-grad streamed call; its gradient ``g = d loss / d logprobs``
    then becomes the batch's target weights (``-g``) for a streamed call with grad, whose
    parameter gradient is ``sum_t g_t d logprobs_t / d theta``, the chain rule for
    ``loss_fn``. Exact, for one more forward pass of the tree (without a graph).

    Args:
        compiled: a model from ``tree_compile(model, stream=...)``.
        batch: the packed batch (left unchanged).
        loss_fn: differentiable in its ``[S]`` argument (0 at rows without a predictor).

    Returns:
        A `TreeOutput` whose ``loss`` has ``loss_fn``'s value and, by ``backward()``, its
        gradients; ``logprobs`` the values it was evaluated at.
    """
    import dataclasses

    from treecompile.call import TreeOutput

    with torch.no_grad():
        lp = compiled(batch).logprobs.detach()
    lp.requires_grad_(True)
    value = loss_fn(lp)
    (g,) = torch.autograd.grad(value, lp)
    weight = torch.where(batch.pred_index.to(g.device) >= 0, -g, torch.zeros_like(g)).to(torch.float64)
    out = compiled(dataclasses.replace(batch, target_weight=weight.to(batch.target_weight.device)))
    return TreeOutput(loss=value.detach() + (out.loss - out.loss.detach()), logprobs=lp.detach())


def _check_streamable(wrapper) -> None:
    """Refuses, when the model is wrapped, what streaming cannot make exact yet."""
    if wrapper._router_aux is not None:
        wrapper._router_aux.check_stats_form()


def plan_stream_report(names: list[str], trees: list, header: dict, args, start: float) -> int:
    """``treecompile plan --stream MODE``: per tree, the streaming schedule at ``--capacity``
    rows: parts, stack depth, longest prefix, rows run forward, ERR and the predicted peak in
    rows (keep: the parts alive at once times the capacity; recompute: one part), plus the
    prefix rows every part reads."""
    import json
    import time

    from treecompile.batch import pack

    capacity = args.capacity or max(-(-max(t.num_tokens for t in trees) // 2), 1)
    out = []
    for name, tree in zip(names, trees):
        plan = plan_stream(pack(tree), capacity)
        stats = tree.stats()
        fwd = plan.forward_rows(args.stream)
        live = plan.stack_depth * capacity if args.stream == "keep" else capacity
        out.append({"name": name, "rows": tree.num_tokens, "path_tokens": stats.path_tokens, "parts": plan.num_parts,
                    "stack_depth": plan.stack_depth, "max_prefix": plan.max_prefix, "forward_rows": fwd,
                    "por": stats.por, "err": 1 - fwd / stats.path_tokens, "peak_activation_rows": live,
                    "schedule": [[int(x) for x in r] for r in plan.release]})
    if args.json:
        print(json.dumps({**header, "capacity": capacity, "mode": args.stream, "trees": out,
                          "seconds": round(time.perf_counter() - start, 3)}, indent=1))
        return 0
    print(f"treecompile plan --stream {args.stream} {header['file']}: parts of at most {capacity} rows")
    print(f"{'tree':<40} {'rows':>8} {'parts':>6} {'stack':>6} {'prefix':>7} {'fwd rows':>9} {'POR':>6} {'ERR':>6} "
          f"{'peak rows':>10}")
    for t in out[: max(args.rows, 0)]:
        print(f"{t['name'][:40]:<40} {t['rows']:>8} {t['parts']:>6} {t['stack_depth']:>6} {t['max_prefix']:>7} "
              f"{t['forward_rows']:>9} {t['por']:>6.3f} {t['err']:>6.3f} {t['peak_activation_rows']:>10}")
    print("stack: most parts alive at once; prefix: most rows of keys/values a part reads from the stack; "
          "peak rows: rows whose activations are held at once (plus the prefix keys/values)")
    return 0
