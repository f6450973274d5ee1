"""The pass pipeline and the Dynamo backend that runs it.

Order (each pass is a plain ``<verb>_<noun>_pass(gm, ctx) -> gm``; dead code is removed
after each, keeping every in-place op whose write is observable, see
:func:`treecompile.passes._graph.eliminate_dead_code`):

0. ``inline_subgraphs_pass``: activation-checkpoint bodies are inlined (tagged for
   recomputation), so that every later pass and the verification see their ops.
1. ``rewrite_attention_pass``: causal attention becomes tree FlexAttention. First, so
   that the model's own mask building (aranges compared with each other, tril buffers)
   is dead and removed before positions are looked for.
2. ``rewrite_positions_pass``: sequence-index positions become tree positions.
3. ``rewrite_conv_context_pass``: causal depthwise convs read their window along the path.
4. ``route_ssm_state_pass``: Gated DeltaNet and Mamba2 (SSD) layers start each node from
   its parent's state.
5. ``gather_logits_pass`` (``passes/lm_head.py``): only needed rows reach the vocabulary
   projection (``fuse_lm_head_pass`` in its place with ``tree_compile(lm_head="fused")``).
6. ``check_moe_regions_pass``: accepts the experts (token-wise) and the router auxiliary
   loss (rows weighted by ``path_count``) after checking them; removes their markers.
7. ``verify_graph_pass``: refuses any remaining sequence mixing. Always last.

A pass is known by its function name everywhere: its rewrite counters
(``ctx.counters[name]``), the DEBUG log of logger ``treecompile.passes``,
``tree_compile(disable_passes=...)`` and ``treecompile inspect``, which runs the pipeline
``tree_compile`` builds (:func:`passes_for`) with a :class:`Pipeline`'s before/after hooks.

The backend copies Dynamo's graph (editing it in place breaks Dynamo's bookkeeping),
finds the ``tree_inputs`` marker to learn which placeholders hold the tree tensors,
removes it, runs the passes, then lowers with the chosen backend.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import weakref
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import fx

from treecompile.kernels.attention.flex import BlockLayout
from treecompile.kernels.attention.masks import MASK_KINDS
from treecompile.core.errors import UnsupportedModelError, unknown_choice
from treecompile.passes._graph import (PassContext, describe, eliminate_dead_code, location_of, mutated_args, source_of,
                                      value, version_of)
from treecompile.passes.attention import rewrite_attention_pass
from treecompile.passes.cp import CPGraph, cp_passes
from treecompile.passes.conv_context import rewrite_conv_context_pass
from treecompile.passes.length_branches import BranchVerdicts, checked_lengths, length_branches
from treecompile.passes.lm_head import fuse_lm_head_pass, gather_logits_pass
from treecompile.passes.markers import is_marker
from treecompile.passes.moe import check_moe_regions_pass
from treecompile.passes.positions import rewrite_positions_pass
from treecompile.passes.ssm_state import route_ssm_state_pass
from treecompile.passes.state import (StateWrites, input_source, is_batch, run_with_state, separate_state, state_name,
                                      touches_state)
from treecompile.passes.stream import KVLayout, StreamGraph, stream_passes
from treecompile.passes.subgraphs import inline_subgraphs_pass
from treecompile.passes.verify import RowsMixed, verify_graph_pass

__all__ = [
    "streamed", "context_parallel", "streamed_context_parallel", "PASSES", "LM_HEAD_PASSES", "Pipeline", "passes_for", "LOWERINGS", "CompileRecord", "CallState", "make_backend", "run_passes",
    "JudgedInputChanged",
]

log = logging.getLogger("treecompile.passes")

Pass = Callable[[fx.GraphModule, PassContext], fx.GraphModule]
#: ``hook(pass_name, gm, ctx)``, called around each pass (see :func:`run_passes`).
PassHook = Callable[[str, fx.GraphModule, PassContext], None]

#: The passes in the order they run.
PASSES: tuple[Pass, ...] = (
    inline_subgraphs_pass,
    rewrite_attention_pass,
    rewrite_positions_pass,
    rewrite_conv_context_pass,
    route_ssm_state_pass,
    gather_logits_pass,
    check_moe_regions_pass,
    verify_graph_pass,
)

#: The LM head pass for each ``tree_compile(lm_head=...)`` choice.
LM_HEAD_PASSES: dict[str, Pass] = {"gather": gather_logits_pass, "fused": fuse_lm_head_pass}

#: Passes ``disable_passes`` may not name: without the verification a graph that is not
#: exact would train silently.
_REQUIRED = (verify_graph_pass,)


@dataclass(frozen=True)
class Pipeline:
    """The passes one compile runs, in order, and hooks around each (see :func:`run_passes`).

    Attributes:
        passes: the pass functions.
        before: ``before(pass_name, gm, ctx)``, before each pass.
        after: ``after(pass_name, gm, ctx)``, after each pass and its dead-code elimination
            (not called for a pass that raised).
    """

    passes: tuple[Pass, ...] = PASSES
    before: PassHook | None = None
    after: PassHook | None = None

    @property
    def names(self) -> tuple[str, ...]:
        """The passes' names, the keys of the rewrite counters and the log."""
        return tuple(p.__name__ for p in self.passes)


def passes_for(
    lm_head: str = "gather",
    *,
    disable_passes: Sequence[str] = (),
    before: PassHook | None = None,
    after: PassHook | None = None,
) -> Pipeline:
    """The pipeline ``tree_compile`` runs: `PASSES` with the LM head pass chosen by ``lm_head``
    (a key of `LM_HEAD_PASSES`), less the passes named in ``disable_passes``.

    Raises:
        ValueError: an unknown ``lm_head``; a name in ``disable_passes`` that is not a pass of
            this pipeline, or that names ``verify_graph_pass``. The message lists the valid ones.
    """
    if lm_head not in LM_HEAD_PASSES:
        raise ValueError(unknown_choice("lm_head", lm_head, LM_HEAD_PASSES, "choices"))
    if isinstance(disable_passes, str):
        raise ValueError(f"disable_passes takes a tuple of pass names, not the string {disable_passes!r}")
    passes = tuple(LM_HEAD_PASSES[lm_head] if p is gather_logits_pass else p for p in PASSES)
    optional = [p.__name__ for p in passes if p not in _REQUIRED]
    bad = [n for n in disable_passes if n not in optional]
    if bad:
        raise ValueError(
            f"cannot disable {', '.join(map(repr, bad))}; passes that can be disabled: {', '.join(optional)}"
            f" ({', '.join(p.__name__ for p in _REQUIRED)} always runs)"
        )
    return Pipeline(tuple(p for p in passes if p.__name__ not in disable_passes), before, after)


def streamed(pipeline: Pipeline, state: StreamGraph) -> Pipeline:
    """The pipeline of a streamed part's graph: ``pipeline`` with the stream passes
    (`treecompile.passes.stream`, sharing ``state``) each right after the pass it follows:
    the stream inputs are read after the subgraphs are inlined, the prefix K/V routed after
    the attention rewrite, the recurrent state and conv context after the SSM state pass."""
    read, route, route_state = stream_passes(state)
    return _with_after(pipeline, {inline_subgraphs_pass: read, rewrite_attention_pass: route,
                                  route_ssm_state_pass: route_state})


def context_parallel(pipeline: Pipeline, state: CPGraph) -> Pipeline:
    """The pipeline of a context-parallel rank's graph: ``pipeline`` with the CP passes
    (`treecompile.passes.cp`, sharing ``state``) each right after the pass it follows: the CP
    inputs are read after the subgraphs are inlined, the keys and values gathered after the
    attention rewrite, recurrent layers refused after the SSM state pass."""
    read, route, refuse = cp_passes(state)
    return _with_after(pipeline, {inline_subgraphs_pass: read, rewrite_attention_pass: route,
                                  route_ssm_state_pass: refuse})


def streamed_context_parallel(pipeline: Pipeline, stream: StreamGraph, cp: CPGraph) -> Pipeline:
    """The pipeline of a streamed part split over a CP group (`treecompile.distributed.stream_cp`):
    the stream passes and the CP passes (``streamed=True``), each right after the pass it
    follows: the inputs read after the subgraphs are inlined; the stack's keys and values
    routed, then the gathered ones appended, after the attention rewrite; recurrent layers
    refused after the SSM state pass, before the stream state would be routed."""
    read, route, route_state = stream_passes(stream)
    read_cp, extend, refuse = cp_passes(cp, streamed=True)
    return _with_after(pipeline, {inline_subgraphs_pass: (read, read_cp), rewrite_attention_pass: (route, extend),
                                  route_ssm_state_pass: (refuse, route_state)})


def _with_after(pipeline: Pipeline, after: dict[Pass, Pass | tuple[Pass, ...]]) -> Pipeline:
    """``pipeline`` with ``after[p]`` (a pass or several, in order) inserted right after each
    pass ``p`` it names."""
    passes = []
    for p in pipeline.passes:
        passes.append(p)
        if p in after:
            passes.extend(after[p] if isinstance(after[p], tuple) else (after[p],))
    return dataclasses.replace(pipeline, passes=tuple(passes))


def _lower_eager(gm: fx.GraphModule, example_inputs):
    return gm.forward


def _lower_aot_eager(gm: fx.GraphModule, example_inputs):
    from torch._dynamo.backends.registry import lookup_backend

    return lookup_backend("aot_eager")(gm, example_inputs)


def _lower_inductor(gm: fx.GraphModule, example_inputs):
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(gm, example_inputs)


#: Lowerings after the passes, by the name ``tree_compile(backend=...)`` takes.
LOWERINGS: dict[str, Callable] = {
    "eager": _lower_eager,
    "aot_eager": _lower_aot_eager,
    "inductor": _lower_inductor,
}


@dataclass
class CompileRecord:
    """What one backend invocation (one compile of one graph) did.

    Attributes:
        counters: per pass function name, a Counter of rewrites by kind.
        graph_module: the rewritten graph (before lowering), for inspection.
        seq_len: S as the graph saw it (an int, or a symbol when dynamic).
        in_place_ops: the number of in-place ops (``add_``, ``copy_``, ``out=`` ...) in the
            captured graph, before the passes.
        max_rows: the longest path this graph is proven exact for (see
            ``PassContext.max_rows``), or None for any length.
        sources: with ``keep_inputs``, Dynamo's source of each graph input (``L['ids']``,
            ``L['inner']._modules[...]``), for the first-call probe.
        last_args: with ``keep_inputs``, the inputs of the graph's latest call (cleared by
            the probe).
        probe_graph: with ``keep_inputs``, a copy of the rewritten graph the probe runs.
        row_states: where each node's rows are, as the verify pass proved them.
        created: the names of the nodes the passes inserted.
        state: the state the graph writes (`treecompile.passes.state`), or None.
        length_branches: the model's Python branches on the row count the graph holds
            (`treecompile.passes.length_branches`), evaluated at every call's path lengths.
        branch_verdicts: what is known of each of them (`BranchVerdicts`).
    """

    counters: dict[str, Counter] = field(default_factory=dict)
    graph_module: fx.GraphModule | None = None
    seq_len: str = ""
    in_place_ops: int = 0
    max_rows: int | None = None
    sources: list[str] | None = None
    last_args: list | None = None
    probe_graph: fx.GraphModule | None = None
    row_states: dict | None = None
    created: frozenset = frozenset()
    state: StateWrites | None = None
    length_branches: list = field(default_factory=list)
    branch_verdicts: BranchVerdicts = field(default_factory=BranchVerdicts)


def run_passes(
    gm: fx.GraphModule, ctx: PassContext, passes: Sequence[Pass] | Pipeline = PASSES
) -> fx.GraphModule:
    """Runs ``passes`` in order with mutation-safe dead-code elimination after each.

    Each pass's rewrites are counted under its function name (``ctx.counters[name]``) and
    logged under it (logger ``treecompile.passes``, level DEBUG). A :class:`Pipeline`'s
    hooks run before each pass and after its dead-code elimination.

    Every in-place op (``add_``, ``copy_``, ``index_put_``, ``out=`` ...) must survive every
    pass unless the dead-code elimination proved its write unobservable: a pass that drops
    one would silently change what the model computes, so that raises.
    """
    pipeline = passes if isinstance(passes, Pipeline) else Pipeline(tuple(passes))
    for p in pipeline.passes:
        name = p.__name__
        if pipeline.before is not None:
            pipeline.before(name, gm, ctx)
        ctx.pass_name = name
        in_place = {n for n in gm.graph.nodes if mutated_args(n)}
        try:
            gm = p(gm, ctx)
        except (UnsupportedModelError, KVLayout):  # a refusal; the stack layout a streamed part learns
            raise
        except Exception as e:
            raise _pass_failure(name, e) from e
        finally:
            ctx.pass_name = ""
        after = set(gm.graph.nodes)
        lost = [n for n in in_place if n not in after]
        if lost:
            raise UnsupportedModelError(
                f"treecompile internal error: {name} removed the in-place op {describe(lost[0])}\n"
                f"  at {source_of(lost[0])}"
            )
        removed = eliminate_dead_code(gm)
        gm.graph.lint()
        log.debug("%s: %s; %d dead nodes removed", name, dict(ctx.counters.get(name, {})), removed)
        if pipeline.after is not None:
            pipeline.after(name, gm, ctx)
    gm.recompile()  # once: the passes and the hooks read the graph, not the generated code
    return gm


def _pass_failure(name: str, exc: Exception) -> UnsupportedModelError:
    """The refusal for an error inside pass ``name``: an internal error of treecompile, named
    with the node the pass was at (the innermost ``fx.Node`` local of its frames) and that
    node's source line; the model is refused, not trained unchecked."""
    node = None
    tb = exc.__traceback__
    while tb is not None:
        for local in ("node", "n"):
            v = tb.tb_frame.f_locals.get(local)
            if isinstance(v, fx.Node):
                node = v
        tb = tb.tb_next
    first = (str(exc).strip().splitlines() or [""])[0]
    at = f" at {describe(node)} ({location_of(node)})" if node is not None else ""
    src = f"\n  at {source_of(node)}" if node is not None else ""
    return UnsupportedModelError(
        f"treecompile cannot make this model exact on a tree: {name} failed{at} ({type(exc).__name__}: {first}).{src}\n"
        "This is an internal error of treecompile, please report it: the model is refused rather than trained with "
        "a graph the passes did not finish."
    )


@dataclasses.dataclass
class CallState:
    """What a backend reads about the batch of the call it compiles for, set by whoever makes the
    call (the wrapper, the stream runner, the CP runner) before each compiled call, and read only
    when Dynamo compiles a graph.

    Attributes:
        layout: the batch's BlockMask layout (static per compiled graph: Dynamo guards on the
            shapes that determine it).
        chunks: the path-bit chunks of ``mask="bitmask"`` (0 otherwise).
        probe_rows: the length at which to judge structural masks (``PassContext.probe_rows``).
        judge_cap: see ``PassContext.judge_cap``.
        path_lengths: ``() -> `` the distinct path lengths of the call's batch
            (`TreeBatch.path_lengths`), read before a compiled run of a graph that holds a
            Python branch of the model on its row count (`treecompile.passes.length_branches`).
    """

    layout: BlockLayout | None = None
    chunks: int = 0
    probe_rows: int = 0
    judge_cap: int = 0
    path_lengths: Callable[[], tuple[int, ...]] = tuple

    @contextlib.contextmanager
    def kept(self) -> Iterator[CallState]:
        """Within the block the fields may change (a probe's own calls); restored on exit."""
        saved = dataclasses.replace(self)
        try:
            yield self
        finally:
            for f in dataclasses.fields(self):
                setattr(self, f.name, getattr(saved, f.name))


def make_backend(
    *,
    mask: str,
    call_state: CallState,
    lowering: str,
    records: list[CompileRecord],
    passes: Sequence[Pass] | Pipeline = PASSES,
    scan_kernel: str = "auto",
    dropout: str = "refuse",
    keep_inputs: bool = False,
    arguments: Sequence[str] = (),
    before_commit: Callable[[CompileRecord], None] | None = None,
) -> Callable:
    """A Dynamo backend that rewrites the captured graph for the tree and lowers it.

    Args:
        mask: a key of :data:`treecompile.kernels.attention.masks.MASK_KINDS`.
        call_state: the batch's layout, chunks and judging lengths, read when a graph compiles.
        lowering: a key of :data:`LOWERINGS`.
        records: each compile appends its :class:`CompileRecord` here.
        passes: the passes to run, or a :class:`Pipeline` (passes and hooks).
        scan_kernel: the scan kernel of recurrent layers' tree forms (see
            ``PassContext.scan_kernel``).
        dropout: see ``PassContext.dropout``.
        keep_inputs: record what the first-call probe needs (`CompileRecord.sources`,
            ``last_args``, ``probe_graph``).
        arguments: the names of the compiled function's arguments (the batch); every other
            graph input is the model's state (see :mod:`treecompile.passes.state`).
        before_commit: with ``keep_inputs``, ``before_commit(record)`` runs at the first call
            of each graph after the graph and before the state it writes is written back
            (the first-call probe, which raises to refuse).
    """
    if lowering not in LOWERINGS:
        raise ValueError(unknown_choice("backend", lowering, LOWERINGS, "backends"))
    lower = LOWERINGS[lowering]

    def treecompile_backend(gm: fx.GraphModule, example_inputs):
        gm = _copy(gm)
        sources = [input_source(n) for n in gm.graph.nodes if n.op == "placeholder"]
        # State the model keeps after the call is computed apart, before any pass rewrites it.
        try:
            gm, state = separate_state(gm, example_inputs, sources, arguments)
        except UnsupportedModelError:
            raise
        except Exception as e:
            raise _pass_failure("separate_state", e) from e
        ctx = _context(gm, example_inputs, mask, call_state.layout, call_state.chunks)
        ctx.state = state
        ctx.probe_rows = call_state.probe_rows
        ctx.judge_cap = call_state.judge_cap
        ctx.scan_kernel = scan_kernel
        ctx.dropout = dropout
        in_place = sum(1 for n in gm.graph.nodes if mutated_args(n))
        try:
            gm = run_passes(gm, ctx, passes)
        except UnsupportedModelError as e:
            # An op refused in the main graph that writes into the state the call keeps (a KV
            # cache written by slices of the length and read back) is refused naming that state.
            named = touches_state(e.node, state) if state is not None and isinstance(e, RowsMixed) else None
            if named is not None:
                raise named from None
            raise
        if state is not None and state.refusal is not None:
            raise state.refusal
        record = CompileRecord(ctx.counters, gm, str(ctx.seq_len), in_place, ctx.max_rows, row_states=ctx.row_states,
                               created=frozenset(n.name for n in ctx.created), state=state)
        records.append(record)
        guards = _judged_guards(ctx, example_inputs, sources, arguments, state)
        # A graph that writes state may hold a cache rebuilt for its length (`seq_len !=
        # self.seq_len_cached`), whose two sides compute the same table: not judged (the state
        # is computed for the batch's length, `treecompile.passes.held_writes`).
        record.length_branches = length_branches(example_inputs, ctx.seq_len) if state is None else []

        def path_lengths():
            return call_state.path_lengths()

        if not keep_inputs:
            return checked_lengths(run_with_state(_guarded(lower(gm, example_inputs), guards), state),
                                   record.length_branches, path_lengths, record.branch_verdicts)
        record.sources, record.probe_graph = sources, _copy(gm)
        return checked_lengths(_recording(_guarded(lower(gm, example_inputs), guards), record, state, before_commit),
                               record.length_branches, path_lengths, record.branch_verdicts)

    return treecompile_backend


class JudgedInputChanged(UnsupportedModelError):
    """A tensor of the model whose values the passes judged (a mask buffer, ALiBi slopes, a
    window kept as a tensor) is another tensor, or was written in place, since the graph was
    compiled: what was judged may not hold. The whole-tree wrapper and the streamed runner
    compile again and judge anew; elsewhere the call is refused with this message."""


#: ``(index, name, the tensor, its version, its data pointer)`` of a judged graph input.
_Guard = tuple[int, str, "weakref.ref", "int | None", int]


def _judged_guards(ctx: PassContext, example_inputs, sources, arguments, state: StateWrites | None) -> list[_Guard]:
    """The model's tensors among the graph inputs an evaluation read (`PassContext.judged`): not
    the batch (new at every call), not parameters (a judgement must hold for any of their values),
    not tensors the graph writes (judged on what the call writes, `_mask_eval.evaluate`)."""
    written = set(state.written) if state is not None else set()
    out = []
    for i in sorted(ctx.judged):
        x = example_inputs[i] if i < len(example_inputs) else None
        if isinstance(x, torch.Tensor) and not x.requires_grad and i not in written and i < len(sources) \
                and not is_batch(sources[i], arguments):
            out.append((i, state_name(sources[i]), weakref.ref(x), version_of(x), x.data_ptr()))
    return out


def _guarded(fn: Callable, guards: list[_Guard]) -> Callable:
    """``fn``, raising `JudgedInputChanged` before it runs if a judged input is not the tensor,
    or not at the version, it was at the compile."""
    if not guards:
        return fn

    def run(*args):
        for i, name, ref, version, ptr in guards:
            x = args[i]
            if x is not ref() or version_of(x) != version or x.data_ptr() != ptr:
                raise JudgedInputChanged(
                    f"treecompile: {name} changed since the graph that reads it was compiled, and the passes judged "
                    "its values (a mask, a bias, a table built from it): the graph must be compiled again.")
        return fn(*args)

    return run


def _recording(fn: Callable, record: CompileRecord, state: StateWrites | None,
               before_commit: Callable[[CompileRecord], None] | None) -> Callable:
    """``fn`` with the state it writes (`run_with_state`), keeping the inputs of its latest
    call in ``record.last_args`` until the probe has run, and running ``before_commit(record)``
    at the first call, before the state is written back."""

    def check() -> None:
        if before_commit is not None and record.probe_graph is not None:
            before_commit(record)

    run_state = run_with_state(fn, state, check)

    def run(*args):
        if record.probe_graph is not None:  # until the probe has run
            record.last_args = list(args)
        return run_state(*args)

    return run


def _copy(gm: fx.GraphModule) -> fx.GraphModule:
    graph = fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    return fx.GraphModule(gm, graph)


def _context(gm: fx.GraphModule, example_inputs, mask: str, layout: BlockLayout, chunks: int) -> PassContext:
    markers = [n for n in gm.graph.nodes if is_marker(n, "tree_inputs")]
    if len(markers) != 1:
        raise RuntimeError(
            f"treecompile: expected one tree_inputs marker in the captured graph, found {len(markers)}; "
            "the model was probably split by a graph break"
        )
    marker = markers[0]
    ids, seq_tensors, other, structure, path_count = marker.args
    positions, *mask_buffers = seq_tensors
    if len(mask_buffers) != len(MASK_KINDS[mask]):
        raise RuntimeError(f"treecompile: the marker carries {len(mask_buffers)} mask tensors for mask={mask!r}")
    # The marker is an identity on the ids: its users read the ids directly.
    marker.replace_all_uses_with(ids)
    gm.graph.erase_node(marker)
    seq_len = value(ids).shape[-1]
    # The wrapper's own loss arithmetic after tree_logprobs sums over targets by design, and
    # what reads the targets' tensors (the predicting rows, slots, targets, destinations:
    # inputs the model never sees) is the wrapper's too (the entropy of the predicting rows).
    wrapper_nodes: set[fx.Node] = set()
    stack = [n for n in gm.graph.nodes if is_marker(n, "tree_logprobs")]
    stack += [u for n in stack[:1] for a in n.args[1:] if isinstance(a, fx.Node) for u in a.users]
    while stack:
        n = stack.pop()
        if n not in wrapper_nodes:
            wrapper_nodes.add(n)
            stack.extend(n.users)
    return PassContext(
        mask=mask,
        input_ids=ids,
        positions=positions,
        mask_buffers=list(mask_buffers),
        block_tensors=list(other),
        layout=layout,
        chunks=chunks,
        seq_len=seq_len,
        example_inputs=list(example_inputs),
        created=wrapper_nodes,
        pred_index=structure[0] if structure else None,
        node_table=structure[1] if structure else None,
        path_count=path_count,
    )
