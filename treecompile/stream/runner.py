"""The runner of streamed batches: compiles the part graph, runs every part forward and
backward in the plan's order over the KV stack, and hands the parameter gradients to the
loss's backward (see `treecompile.stream.options`)."""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from treecompile.core.batch import TreeBatch, on_host, to_device
from treecompile.capture.call import CallSetup, argument_names, call_under_setup, compile_named, run_head
from treecompile.kernels.attention.flex import BLOCK_SIZE, interval_block_mask, split_block_mask
from treecompile.passes import markers
from treecompile.passes.held_writes import held_run, held_state_writes, holding
from treecompile.passes.pipeline import CallState, JudgedInputChanged, Pipeline, streamed
from treecompile.passes.stream import KVLayout, StreamGraph, stack_layout
from treecompile.stream.parts import BatchArrays
from treecompile.stream.plan import (StreamChoice, StreamOptions, StreamPlan, StreamStats, choose_stream, plan_stream,
                                     stream_cost_model)
from treecompile.distributed.unsharded import Unsharded
from treecompile.stream.stack import StackEntry, backward_part, gather_prefix

if TYPE_CHECKING:
    from treecompile import TreeCompiledModel
    from treecompile.capture.call import TreeOutput

__all__ = ["StreamRunner", "stream_logprob_loss"]


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
        return (None, None, *[None if x is None else _scaled(x, g) for x in ctx.grads])


def _scaled(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """``x * g``; for a DTensor gradient (an FSDP2 parameter's shard), its local part scaled."""
    if hasattr(x, "to_local"):
        return type(x).from_local(x.to_local() * g.to(x.dtype), x.device_mesh, x.placements, shape=x.shape,
                                  stride=x.stride())
    return x * g.to(x.dtype)


class StreamRunner:
    """Runs batches over the budget for a `TreeCompiledModel` (see the module docstring)."""

    def __init__(self, setup: CallSetup, options: StreamOptions) -> None:
        self.setup = setup
        self.options = options
        self.stats: StreamStats | None = None
        self._compiled = None
        self._rejudging = False  # compiling again after `JudgedInputChanged`, once per part
        self._shapes: KVLayout | None = None  # the stack's slots, learnt from the graph
        self._remembered = False  # whether `_shapes` went into `_LEARNT` (once checked by a call)
        self._state = CallState()  # the part's layout, read when its graph compiles
        self._resolved: tuple | None = None  # (options, cost model, rows) for a budget in bytes
        _check_streamable(setup)
        self.budget_rows  # noqa: B018  (a budget in bytes is resolved, or refused, here)

    @property
    def budget_rows(self) -> int:
        """The most rows a batch may have to run as one call: ``options.budget_rows``, or
        the largest S whose whole step `treecompile.planning.budget.CostModel` predicts within
        ``options.budget_bytes``. Over it, a batch streams; with ``budget_bytes`` its parts
        are chosen per batch (`treecompile.stream.plan.choose_stream`).

        Raises:
            BudgetError: the budget does not hold one row besides the parameters, gradients
                and optimizer state; or the cost model cannot describe the model.
        """
        o = self.options
        if o.budget_rows is not None:
            return o.budget_rows
        return self._cost_model()[1]

    def _cost_model(self):
        """``(CostModel, whole-step capacity in rows)`` for ``options.budget_bytes``, resolved
        once per options."""
        o = self.options
        if self._resolved is None or self._resolved[0] is not o:
            from treecompile.planning.budget import BudgetError

            w = self.setup
            if w.structure:
                raise BudgetError(
                    f"StreamOptions(budget_bytes=...): {type(w.model).__name__} has recurrent or convolution layers, "
                    "which the cost model (treecompile.planning.budget) does not describe: give budget_rows")
            try:
                cost = stream_cost_model(w.model, o)
                rows = cost.capacity(o.budget_bytes)
            except BudgetError as e:
                raise BudgetError(f"StreamOptions(budget_bytes={o.budget_bytes}): {e}") from None
            self._resolved = (o, cost, rows)
        return self._resolved[1:]

    def wants(self, batch: TreeBatch) -> bool:
        """Whether ``batch`` is over the budget (and streams)."""
        return batch.num_tokens > self.budget_rows

    def choose(self, batch: TreeBatch) -> StreamChoice:
        """The parts, mode and predicted peak that stream ``batch`` under the options (for a
        row budget: its plan, no prediction)."""
        o = self.options
        if o.budget_bytes is None:
            plan = plan_stream(batch, o.budget_rows, o.cuts)
            return StreamChoice(rows=o.budget_rows, mode=o.mode, peak_bytes=None, plan=plan,
                                why=f"{o.mode} mode: parts of at most {o.budget_rows} rows (budget_rows)")
        from treecompile.planning.budget import BudgetError

        cost, _ = self._cost_model()
        try:
            return choose_stream(batch, cost, o.budget_bytes, o.mode, o.cuts)
        except BudgetError as e:
            raise BudgetError(f"StreamOptions(budget_bytes={o.budget_bytes}): {e}") from None

    # ------------------------------------------------------------------ compile

    def _build(self, device: torch.device, shapes: KVLayout) -> None:
        w = self.setup
        pipeline = w.passes if isinstance(w.passes, Pipeline) else Pipeline(tuple(w.passes))
        inner, kwargs_of, router, want_entropy, temperature = w.graph_parts()

        def stream_forward(ids, positions, sub_local, block_tensors, rows, slot, target, dest, weight, path_count,
                           structure, prefix, conv, states, kv_meta, cp_meta):
            ids = torch.ops.treecompile.tree_inputs(ids, [positions, sub_local], list(block_tensors), list(structure),
                                                    path_count)
            ids = torch.ops.treecompile.stream_inputs(ids, list(prefix), list(conv), list(states), list(kv_meta))
            if cp_meta:  # a part split over a CP group (`treecompile.distributed.stream_cp`): the exchange's data
                ids = torch.ops.treecompile.cp_inputs(ids, list(cp_meta))
            out, loss, logprobs, entropy = run_head(inner, kwargs_of(positions), ids, positions, rows, slot, target,
                                                    dest, weight, temperature, want_entropy)
            # The part's router sums (added over parts by the runner; see RouterAux.tree_stats).
            stats = router.tree_stats(out.router_logits, path_count) if router is not None else None
            kv = torch.ops.treecompile.stream_outputs(ids, list(prefix), list(conv), list(states), kv_meta[3])
            return markers.returned((loss, logprobs, kv, stats, entropy))

        backend = w.backend(device, mask="interval", state=self._state, passes=self._pipeline(pipeline),
                            arguments=argument_names(stream_forward))
        self._compiled = compile_named(stream_forward, f"{self._GRAPH}_{len(shapes.shapes)}", backend)
        self._shapes = shapes
        self._remembered = False

    #: The part graph's name (with its attention calls' count).
    _GRAPH = "stream_forward"

    def _pipeline(self, pipeline: Pipeline) -> Pipeline:
        """The part graph's passes: ``pipeline`` with the stream passes."""
        return streamed(pipeline, StreamGraph())

    def _call(self, args: tuple) -> tuple:
        with held_run():  # what Dynamo sets on the model after the run waits for the call's end
            return call_under_setup(self.setup, self._compiled, args, passing=(KVLayout,))

    # ------------------------------------------------------------------ run

    def __call__(self, batch: TreeBatch):
        from treecompile.capture.call import TreeOutput, device_of as _device_of

        w = self.setup
        device = _device_of(w.model)
        batch = on_host(batch)
        self._state.path_lengths = functools.cache(batch.path_lengths)  # every part judged at every path
        choice = self.choose(batch)
        plan, mode = choice.plan, choice.mode
        grad = torch.is_grad_enabled()
        # An FSDP2 model runs unsharded (treecompile.distributed.unsharded); the state the part
        # graphs write reaches the model once, when every part has run (passes/held_writes.py).
        with Unsharded(w.model) as unsharded, held_state_writes(w.model, batch.num_tokens):
            result, first_rows, names, streamed = self._step(batch, plan, mode, device, grad)
        wanted = set(names)
        params = [p for n, p in w.model.named_parameters() if n in wanted]
        if unsharded.units and grad:  # each gradient into its shard, as FSDP2 would
            held = [i for i, g in enumerate(streamed) if g is not None]
            _, grads = unsharded.shard_grads([names[i] for i in held], [streamed[i] for i in held])
            params, streamed = [unsharded.sharded[n] for n in names], [None] * len(names)
            for i, g in zip(held, grads):
                streamed[i] = g
        router = w.router_aux
        self.stats = StreamStats(parts=plan.num_parts, stack_depth=plan.stack_depth, max_prefix=plan.max_prefix,
                                 forward_rows=first_rows + result.forward_rows, rows=batch.num_tokens,
                                 budget_rows=choice.rows, mode=mode, peak_bytes=choice.peak_bytes, why=choice.why)
        loss, aux = result.loss, None
        if router is not None:
            aux = router.aux_from_stats(result.router_stats)
            loss = loss + router.coef * aux.to(loss.dtype)
        if grad:
            loss = _StreamedLoss.apply(loss, streamed, *params)
        return TreeOutput(loss=loss, logprobs=result.logprobs, aux_loss=aux, entropy=result.entropy)

    def _step(self, batch: TreeBatch, plan: StreamPlan, mode: str, device, grad: bool) -> tuple:
        """``(result, rows of the aux loss's first pass, parameter names, their gradients)`` of
        one streamed call; the parameters' own gradients are left as they were."""
        w = self.setup
        named = [(n, p) for n, p in w.model.named_parameters() if p.requires_grad] if grad else []
        params = [p for _, p in named]
        saved = [p.grad for p in params]
        for p in params:
            p.grad = None
        router = w.router_aux
        try:
            aux_grad, first_rows = None, 0
            if router is not None and grad:
                # The gradient of the auxiliary loss with respect to a part's router
                # probability sums is E * T / N^2 (`RouterAux.aux_from_stats` is linear in them),
                # with T and N over the whole tree: a first pass without a graph finds them.
                first = self._run(batch, plan, mode, device, False)
                first_rows = first.forward_rows
                probs = first.router_stats.clone().requires_grad_(True)
                (aux_grad,) = torch.autograd.grad(router.aux_from_stats(probs), probs)
                aux_grad = router.coef * aux_grad
            result = self._run(batch, plan, mode, device, grad, aux_grad)
            streamed = self._reduce_grads(params, [p.grad for p in params])
        finally:
            for p, g in zip(params, saved):
                p.grad = g
        return result, first_rows, [n for n, _ in named], streamed

    def _run(self, batch: TreeBatch, plan: StreamPlan, mode: str, device, grad: bool,
             aux_grad: torch.Tensor | None = None) -> _RunResult:
        """Every part forward (and, with ``grad``, backward) in the plan's order.

        ``aux_grad``: ``[2E + 1]``, the gradient of ``coef * aux`` with respect to the
        router sums; each part's backward adds ``aux_grad . stats_j`` to its loss."""
        keep = mode == "keep"
        data = BatchArrays(batch, plan, self.setup.structure)
        entries: dict[int, StackEntry] = {}
        total = torch.zeros((), dtype=torch.float64, device=device)
        logprobs = torch.zeros(batch.num_tokens, dtype=torch.float64, device=device)
        entropy = torch.zeros_like(logprobs) if "entropy" in self.setup.outputs else None
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
                    redo = self._forward_part(data, plan, p, entries, device, True, aux_grad, keep=False)[0]
                    forward_rows += int(plan.starts[p + 1] - plan.starts[p])
                    e.outs, e.loss, e.leaves = redo.outs, redo.loss, redo.leaves
                self._backward_part(plan, data, p, e, entries)
                del entries[p]
        return self._finish(_RunResult(loss=total, logprobs=logprobs, entropy=entropy, router_stats=router_stats,
                                       forward_rows=forward_rows))

    # ------------------------------------------------------------------ what a part reads and keeps
    # (`treecompile.distributed.stream_cp` overrides these to split each part over a CP group)

    def _part_inputs(self, data: BatchArrays, plan: StreamPlan, j: int) -> tuple[list, torch.Tensor, list]:
        """``(compiled-call inputs, global rows of its targets, extra graph inputs)`` of part ``j``."""
        a, b = int(plan.starts[j]), int(plan.starts[j + 1])
        inputs, dest = data.part_inputs(a, b, plan.prefix[j])
        return inputs, dest, []

    def _structure(self, data: BatchArrays, plan: StreamPlan, j: int, dk: int, device) -> tuple:
        return data.structure(j, dk, device)

    def _stack(self, plan: StreamPlan, data: BatchArrays, j: int, entries: dict, device) -> tuple[list, list, list]:
        return gather_prefix(plan, data, j, entries, self._shapes, device)

    def _kept(self, plan: StreamPlan, j: int, kv: list[torch.Tensor]) -> list[torch.Tensor]:
        """What part ``j`` keeps on the stack of its outputs ``kv`` (detached)."""
        return [t.detach() for t in kv]

    def _backward_part(self, plan: StreamPlan, data: BatchArrays, p: int, e: StackEntry, entries: dict) -> None:
        backward_part(plan, data, p, e, entries, self._shapes)

    def _finish(self, result: _RunResult) -> _RunResult:
        """The result of a pass over every part (summed over a CP group by `stream_cp`)."""
        return result

    def _reduce_grads(self, params: list, grads: list) -> list:
        """The parameter gradients of the call (summed over a CP group by `stream_cp`)."""
        return grads

    def _forward_part(self, data: BatchArrays, plan: StreamPlan, j: int, entries: dict, device, with_graph: bool,
                      aux_grad: torch.Tensor | None = None, keep: bool = True):
        """``(entry, log-probs, their rows, router sums, entropies)`` of part ``j``; ``keep``:
        the entry's ``vals`` hold what it keeps for later parts (else empty: a part run again
        for its backward, whose kept values are on the stack already)."""
        inputs, dest, extra = self._part_inputs(data, plan, j)
        inputs = [to_device(x, device) for x in inputs]
        held = holding()
        if held is not None:  # the part's first run adds its rows to the counters
            held.part(j)
        block_tensors, self._state.layout = split_block_mask(interval_block_mask(inputs[2], BLOCK_SIZE, min_blocks=2))
        guessed = False
        if self._shapes is None:
            guess = _known_layout(self.setup) or _layout_guess(self.setup)
            if guess is not None:
                self._build(device, guess)
                guessed = True
            else:
                self._build(device, KVLayout([]))
                try:
                    self._call(self._args(inputs, block_tensors, self._structure(data, plan, j, 1, device),
                                          ([], [], []), extra))
                except KVLayout as e:
                    self._build(device, e)
        dk = self._shapes.states[0][1] if self._shapes.states else 1
        structure = self._structure(data, plan, j, dk, device)
        stack = self._stack(plan, data, j, entries, device)
        leaves = [x.requires_grad_() for x in (*stack[0], *stack[1], *stack[2])] if with_graph else []
        with torch.set_grad_enabled(with_graph):
            try:
                loss, lp, kv, stats, ent = self._call(self._args(inputs, block_tensors, structure, stack, extra))
            except KVLayout as e:
                if not guessed:
                    raise
                # The graph's layers are not the guessed ones: build with what it reported.
                self._build(device, e)
                return self._forward_part(data, plan, j, entries, device, with_graph, aux_grad, keep)
            except JudgedInputChanged:
                if self._rejudging:
                    raise
                # A tensor whose values the passes judged changed (a window set between steps): judge anew.
                self._rejudging = True
                try:
                    self._build(device, self._shapes)
                    return self._forward_part(data, plan, j, entries, device, with_graph, aux_grad, keep)
                finally:
                    self._rejudging = False
            if not self._remembered:
                _remember_layout(self.setup.model, self._shapes)
                self._remembered = True
            main = loss.detach()
            if aux_grad is not None and with_graph:
                # coef * aux is linear in the part's router sums with this gradient: the part's
                # share of the auxiliary loss's gradient (see StreamRunner.__call__).
                loss = loss + (aux_grad.to(stats.dtype) * stats).sum().to(loss.dtype)
        m = dest.shape[0]
        entry = StackEntry(vals=self._kept(plan, j, kv) if keep else [], outs=list(kv) if with_graph else None, loss=loss,
                       leaves=leaves, grads=[None] * len(kv), main=main)
        return entry, lp[:m], to_device(dest, device), stats, None if ent is None else ent[:m]

    @staticmethod
    def _args(inputs, block_tensors, structure, stack, extra=()) -> tuple:
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
                prefix, conv, states, [kv_end, kv_pos, conv_pred, readouts], list(extra))


#: Stack layouts checked by a streamed call in this process, per model architecture
#: (`_architecture`), with the parameters' dtype they were learnt at: a model of a known
#: architecture (the float64 copy `verify` checks, a model wrapped again) starts from its layout
#: rather than from a capture that only learns it. A stale entry costs what a wrong guess costs.
_LEARNT: OrderedDict[tuple, tuple[KVLayout, torch.dtype | None]] = OrderedDict()
_LEARNT_MAX = 32
#: The passes only a part graph runs (`treecompile.passes.stream.stream_passes`).
_PART_PASSES = frozenset({"read_stream_inputs_pass", "route_prefix_kv_pass", "route_stream_state_pass",
                          "read_cp_inputs_pass"})


def _architecture(model: torch.nn.Module) -> tuple:
    return (type(model).__module__, type(model).__qualname__,
            tuple((n, tuple(p.shape)) for n, p in model.named_parameters()))


def _dtype_of(model: torch.nn.Module) -> torch.dtype | None:
    return next((p.dtype for p in model.parameters()), None)


def _remember_layout(model: torch.nn.Module, layout: KVLayout) -> None:
    key = _architecture(model)
    # A copy: the layout may be the `KVLayout` a capture raised, whose traceback holds the
    # capture's frames, and through them the model.
    _LEARNT[key] = (KVLayout(list(layout.shapes), list(layout.conv), list(layout.states)), _dtype_of(model))
    _LEARNT.move_to_end(key)
    while len(_LEARNT) > _LEARNT_MAX:
        _LEARNT.popitem(last=False)


def _known_layout(setup: CallSetup) -> KVLayout | None:
    """A guess at the stack layout from what this process has seen of the model: its
    whole-tree graph, if the wrapper compiled one (`treecompile.passes.stream.stack_layout`),
    else the layout a streamed call of its architecture checked (`_LEARNT`), its dtypes moved
    to the model's. None when neither is known (a first capture then learns it)."""
    for record in reversed(setup.compile_records):
        # A part graph counts its stack inputs or routes (one without any has an empty layout,
        # which is what reading it as a whole-tree graph gives).
        if record.graph_module is not None and not _PART_PASSES & record.counters.keys():
            return stack_layout(record.graph_module)
    known = _LEARNT.get(_architecture(setup.model))
    if known is None:
        return None
    layout, was = known
    now = _dtype_of(setup.model)

    def moved(entries: list[tuple]) -> list[tuple]:
        return [(*e[:-1], now if e[-1] == was else e[-1]) for e in entries]

    return KVLayout(moved(layout.shapes), moved(layout.conv), moved(layout.states))


#: A Hugging Face mixer's conv channels and recurrent state ``(H, Dk, Dv)``, by attribute
#: name (or a number): Gated DeltaNet, Mamba2, then Mamba's selective scan (one head per
#: channel, ``Dk`` the state size, ``Dv = 1``; see `treecompile.passes.stream.stream_selective_scan`).
_MIXER_ATTRIBUTES = (("conv_dim", "num_v_heads", "head_k_dim", "head_v_dim"),
                     ("conv_dim", "num_heads", "ssm_state_size", "head_dim"),
                     ("intermediate_size", "intermediate_size", "ssm_state_size", 1))


def _layout_guess(setup: CallSetup) -> KVLayout | None:
    """The stack layout of a Hugging Face model read from its modules, in order: each attention
    module's key and value heads and head dim; each Gated DeltaNet's conv channels and
    ``(value heads, key dim, value dim)`` state; each Mamba2 mixer's conv channels and
    ``(heads, state size, head dim)`` state; each Mamba mixer's conv channels and
    ``(channels, state size, 1)`` state; the parameters' dtype. None for any other model.
    The layout is otherwise learnt by a first capture that only reports it (`KVLayout`), so a
    right guess saves one Dynamo capture of the whole model; a wrong one (a sequence mixer of
    another kind, a state kept in another dtype) is reported by the first capture as before."""
    from treecompile.capture.hf_interfaces import _calls_attention_interface

    if not setup.is_hf or not setup.route.routes:
        return None
    shapes, conv, states = [], [], []

    def ints(m, *names):
        values = [getattr(m, n, None) if isinstance(n, str) else n for n in names]
        return values if all(isinstance(v, int) and not isinstance(v, bool) for v in values) else None

    for m in setup.model.modules():
        dtype = _dtype_of(m)
        if _calls_attention_interface(type(m)):
            heads = getattr(getattr(m, "config", None), "num_key_value_heads", None)
            head_dim = getattr(m, "head_dim", None)
            if not (isinstance(heads, int) and isinstance(head_dim, int) and dtype is not None):
                return None
            shapes += [(heads, head_dim, dtype)] * 2
        elif setup.structure and dtype is not None:
            mixer = next(filter(None, (ints(m, *names) for names in _MIXER_ATTRIBUTES)), None)
            if mixer is not None:
                conv.append((mixer[0], dtype))
                states.append((*mixer[1:], dtype))
    if setup.structure and not states:
        return None  # recurrent or conv layers of a kind not read here: learnt by a capture
    return KVLayout(shapes, conv, states) if shapes or states else None


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

    from treecompile.capture.call import TreeOutput

    # Two calls, one training step: the second reads the state the model had before the first,
    # and the model's state advances once (passes/held_writes.py).
    with held_state_writes(compiled._inner, batch.num_tokens):
        with torch.no_grad():
            lp = compiled(batch).logprobs.detach()
        lp.requires_grad_(True)
        value = loss_fn(lp)
        (g,) = torch.autograd.grad(value, lp)
        weight = torch.where(batch.pred_index.to(g.device) >= 0, -g, torch.zeros_like(g)).to(torch.float64)
        out = compiled(dataclasses.replace(batch, target_weight=weight.to(batch.target_weight.device)))
    return TreeOutput(loss=value.detach() + (out.loss - out.loss.detach()), logprobs=lp.detach())


def _check_streamable(setup: CallSetup) -> None:
    """Refuses, when the model is wrapped, what streaming cannot make exact yet."""
    if setup.router_aux is not None:
        setup.router_aux.check_stats_form()
