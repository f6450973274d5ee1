"""State a model keeps after a call: computed as the unmodified model computes it, written
only once the call has succeeded.

Models keep things between calls: a rotary table cached on the module or in a dict shared
by the layers, a buffer extended when a longer sequence comes, a buffer written in place
and read back, a step counter, a power iteration's vector. Dynamo replays the Python-side
writes of a traced forward (an attribute or buffer set, a dict entry, a Python number
counted up) after the compiled graph has run, with values the graph returns beside the
call's own results; a write into a tensor the model holds (``cached[:T] = freqs``,
``steps.add_(1)``) is an op of the graph on one of its inputs. The passes rewrite the
graph for the tree: positions become tree positions, masks the tree mask, and the rows
follow the DFS order. Whatever of that reached the model's state would be, for instance,
a table over tree positions that the next call, or the user's own model run normally,
reads as a table over sequence positions: silently wrong, and the user's model changed.

`separate_state` splits the captured graph, before any pass, in two:

* the **state graph**: the slice of the captured graph, unmodified, that computes every
  state write. It may read the model's state (parameters, buffers, attributes, globals)
  and the batch's sizes (a table over ``arange(T)``), never a batch tensor: a value
  computed from the tokens (a running statistic of the activations, a KV cache filled in
  training, a loss kept on the module) has no per-path meaning, and the model is refused
  naming the attribute and the source line. What it computes is what the unmodified model
  computes for a sequence of the batch's length: a table of ``T`` sequence positions.
* the **main graph**: the call's own results, which the passes rewrite; its writes into
  the model's tensors are removed. Where it reads such a tensor after the model wrote it in
  place (a table written and read back), it is handed the written value; where it reads it
  before (a counter used, then advanced), the value from before the call. A read on both
  sides of the write is refused.

At each call (`StateWrites`), the state graph runs first, on copies of the tensors it
writes; then the main graph; then the call's checks (the first-call probe); only then are
the copies written back into the model's tensors and the Python-side values handed to
Dynamo to replay. A call that fails or is refused leaves the model as it was, and the
probe, which runs the main graph on batches of its own, never touches the model's state.

One kind of state computed from the tokens has a per-path meaning: a **counter**,
``buffer.add_(inc)`` where nothing else reads the buffer (torchtitan's MoE adds each call's
tokens per expert to ``tokens_per_expert``). Per-path training adds every path's increment,
a sum over the paths' tokens; on the tree each token is one row, counted once per path
through it. The increment stays in the main graph, which returns it as an extra result;
`treecompile.passes.counters` weights it by ``path_count`` (or refuses it), and the commit
adds it to the buffer.
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

from treecompile.core.errors import UnsupportedModelError
from treecompile.passes._graph import describe, location_of, mutated_args, op_name, source_of, storage_of, value
from treecompile.passes._mask_eval import shape_sources
from treecompile.passes.held_writes import (UNNAMED, at_length, holding, length_inputs, note_filled,
                                           repeated_idempotent, self_updates)
from treecompile.passes.markers import is_marker

__all__ = ["touches_state", "StateWrites", "is_batch", "separate_state", "state_name"]

#: Ops whose result is a view of their first argument (a read of it happens at their users).
_VIEW_OPS = {"view", "reshape", "transpose", "permute", "unsqueeze", "squeeze", "expand", "getitem", "__getitem__",
             "select", "narrow", "flatten", "unflatten", "movedim", "view_as", "expand_as", "t", "T", "mT",
             "contiguous", "detach", "alias", "split", "chunk", "unbind"}


@dataclass
class StateWrites:
    """The state one compiled graph writes, and how a call of it runs (see the module).

    Attributes:
        graph: the state graph: the captured graph's placeholders, returning the state
            values (`outputs` order) then the tensors written in place (`written` order).
        outputs: the positions, in the captured graph's output, of the values Dynamo writes
            back into the model after the call.
        size: the length of the captured graph's output.
        written: the positions of the graph inputs the model writes in place.
        read_after: of `written`, those the main graph reads after the write.
        names: for each of `outputs` and `written`, what it is in the model
            (``model.rope.cos_cached``), as far as it is known.
        refusal: why the state cannot be kept exactly (the backend raises it once the passes
            have found nothing more fundamental), or None.
        inputs: the captured graph's inputs (its placeholders).
    """

    graph: fx.GraphModule | None
    outputs: tuple[int, ...]
    size: int
    written: tuple[int, ...]
    read_after: frozenset[int]
    names: list[str] = field(default_factory=list)
    refusal: UnsupportedModelError | None = None
    inputs: int | None = None
    held: tuple[tuple[int, Any], ...] = ()  # (index, weak reference) of the model's tensors it does not write
    counters: tuple[int, ...] = ()  # graph inputs the main graph's last len(counters) results are added to
    counter_names: list[str] = field(default_factory=list)  # what each of `counters` is in the model
    refused_writes: dict = field(default_factory=dict)  # memory -> refusal of a write computed from the batch
    self_updates: list[str] = field(default_factory=list)  # what it writes from the value it replaces (held_writes)
    lengths: tuple = ()  # (input, its dims of the sequence's length, or None for the length itself) the state reads
    other_sizes: list[str] = field(default_factory=list)  # batch sizes besides the length the state reads

    def prepare(self, args: Sequence[Any], length: int | None = None) -> tuple[list, list, list]:
        """Runs the state graph on copies of the tensors it writes; with ``length``, as for a
        sequence of that length (`treecompile.passes.held_writes.at_length`).

        Returns:
            ``(main_args, values, written)``: the main graph's arguments (a tensor written in
            place and read after the write is its copy), the state values for Dynamo, and the
            written copies (`commit` writes them back).
        """
        if self.inputs is not None and len(args) > self.inputs and self.held \
                and all(args[i] is ref() for i, ref in self.held):
            # Dynamo passes a buffer the graph does not read after the graph's own inputs (seen
            # with a counter written in place beside an unused buffer): the model's tensors are
            # where the graph had them, so the graph's inputs are the first ones.
            args = args[:self.inputs]
        if self.inputs is not None and len(args) != self.inputs:
            # Seen with a buffer registered as None and registered again in forward beside
            # other buffers: Dynamo's call does not match the graph it captured, so which
            # input is which model tensor is not known; nothing has been written yet.
            names = ", ".join(self.names) or "state"
            raise UnsupportedModelError(
                f"treecompile cannot make this model exact on a tree: the captured call that writes {names} got "
                f"{len(args)} inputs for the {self.inputs} it was captured with, so the tensors it writes cannot be "
                "matched to the model's (a buffer registered as None in __init__ and registered again in forward "
                "does this: register it with a tensor in __init__, or keep it as a plain attribute).")
        fresh = list(args) if length is None else at_length(args, self.lengths, length)
        for i in self.written:
            fresh[i] = args[i].clone()
        out = self.graph(*fresh)
        values, new = list(out[:len(self.outputs)]), list(out[len(self.outputs):])
        main = list(args)
        for i, t in zip(self.written, new):
            if i in self.read_after:
                main[i] = t
        return main, values, new

    def written_name(self, index: int) -> str:
        """What the graph input at ``index`` (one of `written`) is in the model."""
        at = len(self.outputs) + self.written.index(index)
        return self.names[at] if at < len(self.names) and self.names[at] else "a tensor the model holds"

    def commit(self, args: Sequence[Any], new: Sequence[torch.Tensor], added: Sequence[torch.Tensor] = ()) -> None:
        """Writes the written copies back into the model's tensors, and adds each counter's increment."""
        with torch.no_grad():
            for i, t in zip(self.written, new):
                args[i].copy_(t)
                if i in self.read_after and self.lengths:  # filled for the sequence's length, read back
                    note_filled(args[i])
            for i, t in zip(self.counters, added):
                args[i].add_(t)

    def split(self, results: Sequence[Any]) -> tuple[Sequence[Any], Sequence[Any]]:
        """The main graph's results: ``(the call's own, the counters' increments)``."""
        n = len(self.counters)
        return (results[:-n], results[-n:]) if n else (results, ())

    def merge(self, results: Sequence[Any], values: Sequence[Any]) -> tuple:
        """The captured graph's output: the main graph's results and the state values, each
        at its place."""
        out: list[Any] = [None] * self.size
        state = dict(zip(self.outputs, values))
        it = iter(results)
        for i in range(self.size):
            out[i] = state[i] if i in state else next(it)
        return tuple(out)


def run_with_state(fn: Callable, state: StateWrites | None, before_commit: Callable[[], None] | None = None
                   ) -> Callable:
    """The captured graph's callable from ``fn``, the lowered main graph: the state graph,
    then ``fn``, then ``before_commit()`` (the call's checks; it raises to refuse), then the
    state written back (see the module), or held back until the call of several graphs that
    runs it has succeeded (`treecompile.passes.held_writes`)."""
    if state is None:
        def run_plain(*args):
            held = holding()
            if held is not None:
                held.check_reads(args)
            out = fn(*args)
            if before_commit is not None:
                before_commit()
            return out

        return run_plain

    def run(*args):
        held = holding()  # a streamed call writes once, when it has succeeded
        if held is not None:
            held.check(state)
            held.check_reads([a for i, a in enumerate(args) if i not in state.written])
        main, values, new = state.prepare(args, None if held is None else held.length)
        results, added = state.split(fn(*main))
        if before_commit is not None:
            before_commit()
        if held is None:
            state.commit(args, new, added)
        else:
            held.hold(state, args, new, added)
        return state.merge(results, values)

    return run


def separate_state(gm: fx.GraphModule, example_inputs: Sequence[Any], sources: Sequence[str],
                   arguments: Sequence[str]) -> tuple[fx.GraphModule, StateWrites | None]:
    """Splits the state writes off ``gm`` (a copy of Dynamo's graph, before any pass), in place.

    Args:
        gm: the captured graph; its ``treecompile::call_output`` markers are removed.
        example_inputs: the graph inputs, aligned with its placeholders.
        sources: Dynamo's source of each placeholder (``L['ids']``, ``L['inner']._modules[...]``).
        arguments: the names of the compiled function's arguments: placeholders from them are
            the batch, every other one the model's state.

    Returns:
        ``(main graph, StateWrites)``, or ``(gm, None)`` when the graph writes no state.

    A state write computed from a batch tensor, or a tensor the model reads both before and
    after writing it in place, gives ``StateWrites.refusal``.
    """
    graph = gm.graph
    returned = _unmark_returns(graph)
    nodes = list(graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    placeholders = [n for n in nodes if n.op == "placeholder"]
    batch = {p for p, s in zip(placeholders, sources) if is_batch(s, arguments)}
    batch_tensors = {p for p, x in zip(placeholders, example_inputs) if p in batch and isinstance(x, torch.Tensor)}
    held = {storage_of(p): p for p in placeholders if p not in batch and storage_of(p) is not None}
    output = graph.output_node()
    outs = list(output.args[0]) if isinstance(output.args[0], (list, tuple)) else [output.args[0]]
    kept = [i for i, a in enumerate(outs) if not (isinstance(a, fx.Node) and a in returned)]
    writes = [n for n in nodes if any(storage_of(t) in held for t in mutated_args(n))]
    if not kept and not writes:
        return gm, None
    counters = [w for w in writes if _counter(w, held, nodes, batch_tensors)]
    counted = tuple(placeholders.index(w.args[0]) for w in counters)
    writes = [w for w in writes if w not in counters]
    names = _side_effect_names()
    written = sorted({held[storage_of(t)] for n in writes for t in mutated_args(n) if storage_of(t) in held},
                     key=order.__getitem__)
    sinks = [outs[i] for i in kept if isinstance(outs[i], fx.Node)] + writes
    state_nodes = _slice(nodes, sinks, exclude=set())
    refused = _batch_read_refusals(state_nodes, sinks, batch_tensors, writes, held, names, sources, placeholders)
    refusal = next(iter(refused.values()), None)

    # The main graph's reads of each written tensor: all after its writes, or all before.
    main_nodes = _slice(nodes, [n for n in nodes if n in returned], exclude=set(writes))
    read_after = set()
    for p in written:
        s = storage_of(p)
        own = [w for w in writes if any(storage_of(t) == s for t in mutated_args(w))]
        readers = [n for n in main_nodes if n not in own and op_name(n) not in _VIEW_OPS and n.op != "placeholder"
                   and any(storage_of(i) == s for i in n.all_input_nodes)]
        first, last = min(order[w] for w in own), max(order[w] for w in own)
        if readers and all(order[r] > last for r in readers):
            read_after.add(placeholders.index(p))
        elif readers and all(order[r] > first for r in readers) and repeated_idempotent(own, p):
            read_after.add(placeholders.index(p))  # each write leaves the value the last one leaves
        elif not all(order[r] < first for r in readers) and refusal is None:
            r = next(r for r in readers if order[r] > first)
            refusal = UnsupportedModelError(
                f"treecompile cannot make this model exact on a tree: {describe(r)} at {location_of(r)} reads "
                f"{_pretty(sources[placeholders.index(p)])} after the model began writing it in place, and another "
                "op reads it before the write is done: treecompile hands a call either the tensor's old value or "
                f"its new one.\n  at {source_of(r)}"
            )

    try:
        state_gm = _state_graph(gm, nodes, state_nodes, [outs[i] for i in kept], written)
    except UnsupportedModelError as e:
        state_gm, refusal = None, refusal or e
    labels = [names.get(getattr(outs[i], "name", "")) or names.get(_symbol_key(outs[i]) or "")
              or f"{UNNAMED} (output {i})" for i in kept]
    labels += [_pretty(sources[placeholders.index(p)]) for p in written]
    updates = self_updates(placeholders, [_pretty(s) for s in sources], [outs[i] for i in kept], labels)
    # The main graph: the call's results only, without the writes into the model's tensors;
    # then each counter's increment (added to the model's tensor at the commit).
    increments = tuple(w.args[1] for w in counters)
    for w in reversed(sorted([*writes, *counters], key=order.__getitem__)):
        w.replace_all_uses_with(mutated_args(w)[0])
        graph.erase_node(w)
    graph.erase_node(output)
    rest = tuple(a for i, a in enumerate(outs) if i not in kept)
    graph.output(rest + increments)
    gm.recompile()
    state = StateWrites(graph=state_gm, outputs=tuple(kept), size=len(outs),
                        written=tuple(placeholders.index(p) for p in written), read_after=frozenset(read_after),
                        names=labels, refusal=refusal, inputs=len(placeholders),
                        held=tuple((i, weakref.ref(x)) for i, (p, x) in enumerate(zip(placeholders, example_inputs))
                                   if p not in batch and p not in written and isinstance(x, torch.Tensor)),
                        counters=counted, refused_writes=refused)
    state.counter_names = [_pretty(sources[i]) for i in state.counters]
    state.self_updates = updates
    state.lengths, state.other_sizes = length_inputs(placeholders, sources, batch, state_nodes)
    return gm, state


def _counter(w: fx.Node, held: dict, nodes: list[fx.Node], batch_tensors: set[fx.Node]) -> bool:
    """Whether ``w`` is ``buffer.add_(inc)`` into a model tensor that nothing else reads or
    writes, of an increment of the buffer's shape computed from the batch (a counter)."""
    if op_name(w) not in ("add_", "iadd") or len(w.args) != 2 or w.kwargs:
        return False
    target, inc = w.args
    if not isinstance(target, fx.Node) or target.op != "placeholder" or held.get(storage_of(target)) is not target:
        return False
    tv, iv = value(target), value(inc) if isinstance(inc, fx.Node) else None
    if not isinstance(iv, torch.Tensor) or iv.shape != tv.shape or iv.requires_grad:
        return False
    s = storage_of(target)
    if any(n is not w and (any(storage_of(i) == s for i in n.all_input_nodes) or
                           any(storage_of(t) == s for t in mutated_args(n))) for n in nodes):
        return False
    return bool(_slice(nodes, [inc], exclude=set()) & batch_tensors)


def state_name(source: str) -> str:
    """A placeholder's source as the user reads it: ``model.blocks.0.rope.cos_cached``."""
    return _pretty(source)


# ----------------------------------------------------------------------------- helpers


def _unmark_returns(graph: fx.Graph) -> set[fx.Node]:
    """Removes the ``call_output`` markers; returns the nodes they marked."""
    returned = set()
    for n in list(graph.nodes):
        if is_marker(n, "call_output"):
            x = n.args[0]
            n.replace_all_uses_with(x)
            graph.erase_node(n)
            returned.add(x)
    return returned


def is_batch(source: str, arguments: Sequence[str]) -> bool:
    """Whether a graph input with Dynamo's ``source`` comes from the compiled function's
    ``arguments`` (the batch, new at every call), not from the model's state."""
    return _root(source) in arguments or not source


def input_source(node: fx.Node) -> str:
    """Dynamo's name for where a graph input comes from (``L['ids'].size()[1]``,
    ``L['inner']._modules['rotary'].cos_cached``), or ``""``."""
    arg = node.meta.get("grapharg")
    source = getattr(arg, "source", None)
    if source is None:
        return ""
    name = source.name
    return name() if callable(name) else name  # a method before torch 2.12


def is_held_source(source: str) -> bool:
    """Whether a graph input with Dynamo's ``source`` is a tensor an object holds (a module's
    attribute or buffer, an entry of a dict it keeps, a global), not a local of the frame."""
    return (source or "").startswith("G[") or bool(re.match(r"L\['[^']+'\]\.", source or ""))


def _root(source: str) -> str:
    m = re.match(r"L\['([^']+)'\]", source or "")
    return m.group(1) if m else ""


def _value_inputs(n: fx.Node) -> list[fx.Node]:
    """The inputs of ``n`` whose values it reads (not those it takes only the dtype, device or
    shape of, ``x.to(other)``, ``other.new_zeros(n)``)."""
    meta = shape_sources(n)
    return [i for i in n.all_input_nodes if i not in meta]


def _slice(nodes: list[fx.Node], sinks: Sequence[Any], exclude: set[fx.Node]) -> set[fx.Node]:
    """The nodes that compute ``sinks``: their ancestors through the inputs whose values they
    read, with every in-place write (not in ``exclude``) into memory one of them reads, to a
    fixed point; and the global switches (grad mode, autocast) whose arguments are constants."""
    live: set[fx.Node] = set()

    def add(ns):
        stack = [n for n in ns if isinstance(n, fx.Node)]
        while stack:
            n = stack.pop()
            if n not in live:
                live.add(n)
                stack.extend(_value_inputs(n))

    add(sinks)
    add(n for n in nodes if n.op == "call_function" and n.is_impure() and not n.all_input_nodes
        and not mutated_args(n))
    writes = {n: {storage_of(t) for t in mutated_args(n)} - {None} for n in nodes if n not in exclude}
    writes = {n: s for n, s in writes.items() if s}
    changed = True
    while changed:
        changed = False
        read = {storage_of(m) for m in live} | {storage_of(i) for m in live for i in _value_inputs(m)}
        for n, storages in writes.items():
            if n not in live and storages & read:
                add([n])
                changed = True
    return live


def _batch_read_refusals(state_nodes: set[fx.Node], sinks: list, batch_tensors: set[fx.Node], writes: list,
                         held: dict, names: dict[str, str], sources: Sequence[str], placeholders: list
                         ) -> dict[int, UnsupportedModelError]:
    """The refusal of each state write computed from a batch tensor, naming what is written and
    where, by the memory it writes (the first sink's first); empty if every state write reads the
    model's state and the batch's sizes only."""
    if not state_nodes & batch_tensors:
        return {}
    out: dict[int, UnsupportedModelError] = {}
    for sink in sinks:
        if _slice(list(state_nodes), [sink], exclude=set()) & batch_tensors:
            err, memory = _sink_refusal(sink, state_nodes, batch_tensors, writes, held, names, sources, placeholders)
            for m in memory:
                out.setdefault(m, err)
    return out


def _sink_refusal(sink: fx.Node, state_nodes: set[fx.Node], batch_tensors: set[fx.Node], writes: list, held: dict,
                  names: dict[str, str], sources: Sequence[str], placeholders: list
                  ) -> tuple[UnsupportedModelError, frozenset]:
    """The refusal of one state write computed from the batch, and the memory it writes."""
    if sink in writes:
        target = next(t for t in mutated_args(sink) if storage_of(t) in held)
        what = _pretty(sources[placeholders.index(held[storage_of(target)])])
        how = f"writes {what} in place ({describe(sink)}) at {location_of(sink)}"
        node = sink
    else:
        what = names.get(sink.name, "an attribute, dict entry or global")
        # A kept tensor the call writes in place (a KV cache: `cache[:, :T] = k`) is named where it is written.
        into = next((n for n in sink.graph.nodes if n in state_nodes and n is not sink
                     and any(storage_of(t) == storage_of(sink) is not None for t in mutated_args(n))
                     and _slice(list(state_nodes), [n], exclude=set()) & batch_tensors), None)
        node = into or sink
        how = (f"keeps {what} after the call, written in place by {describe(into)} at {location_of(into)}"
               if into is not None else f"keeps {what} after the call, set from {describe(sink)} at {location_of(sink)}")
    err = UnsupportedModelError(
        f"treecompile cannot make this model exact on a tree: the model {how}, a value computed from the batch's "
        "tokens: on a tree it would hold values of the packed tree (rows of several paths), not what per-path "
        f"training stores, and the next call or the model run on its own would read them.\n  at {source_of(node)}\n"
        "State a model keeps between calls may depend on its parameters, buffers and the sequence length only "
        "(a rotary table, a step counter); in training, leave a KV cache out (write keys and values to it only "
        "when generating) and keep statistics of the activations out of the forward."
    )
    return err, frozenset({storage_of(sink), *(storage_of(t) for t in mutated_args(sink))} - {None})


def touches_state(node: fx.Node, state: StateWrites) -> UnsupportedModelError | None:
    """The refusal of the state ``node`` (an op the main graph's checks refused) writes into, when
    that state is refused (`StateWrites.refused_writes`); else None (an op that only reads such
    state is refused for what it does with it: a mask over document ids the model also keeps)."""
    by = state.refused_writes
    return next((by[storage_of(t)] for t in mutated_args(node) if storage_of(t) in by), None)


def _state_graph(gm: fx.GraphModule, nodes: list[fx.Node], state_nodes: set[fx.Node], values: list,
                 written: list[fx.Node]) -> fx.GraphModule:
    """The state graph: every placeholder, the state nodes in graph order, returning
    ``(*values, *written)``. An input a node reads only the dtype, device or shape of, and
    that the state graph does not compute, is replaced by a tensor of that dtype, device and
    shape (the capture guards on them)."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in nodes:
        if n.op == "placeholder" or (n in state_nodes and n.op != "output"):
            for meta in shape_sources(n):
                if meta not in env:
                    env[meta] = _like(graph, meta)
            env[n] = graph.node_copy(n, lambda x: env[x])
    graph.output(tuple(env[v] if isinstance(v, fx.Node) else v for v in values) + tuple(env[p] for p in written))
    return fx.GraphModule(gm, graph, class_name="StateGraph")


def _like(graph: fx.Graph, node: fx.Node) -> fx.Node:
    """A node of ``graph`` creating an empty tensor like ``node``'s example value (its
    symbolic sizes become the placeholders that hold them)."""
    v = node.meta["example_value"]
    sizes = {str(p.meta["example_value"].node.expr): p for p in graph.nodes if p.op == "placeholder"
             and isinstance(p.meta.get("example_value"), torch.SymInt)}
    shape = []
    for d in v.shape:
        if isinstance(d, torch.SymInt):
            d = sizes.get(str(d.node.expr))
            if d is None:
                raise UnsupportedModelError(
                    f"treecompile cannot make this model exact on a tree: {describe(node)} at {location_of(node)} "
                    "gives the shape of a value the model keeps after the call, from a size the capture does not "
                    f"hold as an input.\n  at {source_of(node)}")
        shape.append(d)
    new = graph.call_function(torch.empty, (tuple(shape),), {"dtype": v.dtype, "device": v.device})
    new.meta["example_value"] = v
    return new


_SOURCE_STEPS = [
    (re.compile(r"^L\['inner'\]"), "model"),
    (re.compile(r"^L\['self'\]"), "model"),
    (re.compile(r"^G\['([^']+)'\]"), r"\1"),
    (re.compile(r"\.__dict__\['_(?:buffers|parameters|modules)'\]\['([^']+)'\]"), r".\1"),
    (re.compile(r"\._(?:buffers|parameters|modules)\['([^']+)'\]"), r".\1"),
]


def _pretty(source: str) -> str:
    out = source or "a tensor of the model"
    for pattern, repl in _SOURCE_STEPS:
        out = pattern.sub(repl, out)
    return out


def _name(source: Any) -> str:
    name = getattr(source, "name", "")
    return name() if callable(name) else name  # a method before torch 2.12


def _symbol_key(node: Any) -> str | None:
    """``"sym:<expression>"`` for a node whose value is a symbolic Python number, else None."""
    v = node.meta.get("example_value") if isinstance(node, fx.Node) else None
    if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return f"sym:{v.node.expr}"
    return None


def _side_effect_names() -> dict[str, str]:
    """``{node name: "model.rope.cos_cached"}`` for the values Dynamo writes back after the
    call, read from the trace being compiled; empty where this torch does not show them (the
    messages then say less)."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
        effects = tx.output.side_effects
    except Exception:  # another torch's internals: names are a courtesy
        return {}
    found: dict[str, str] = {}

    def note(value: Any, where: str) -> None:
        try:
            node = getattr(value.as_proxy(), "node", None)
        except Exception:  # not a graph value
            node = None
        if isinstance(node, fx.Node):
            found.setdefault(node.name, where)
            sym = _symbol_key(node)
            if sym is not None:  # a size may reach the output as another node of the same symbol
                found.setdefault(sym, where)
            return
        items = value.__dict__.get("items") if hasattr(value, "__dict__") else None
        if isinstance(items, (list, tuple)):  # a tuple or list of values
            for i, v in enumerate(items):
                note(v, f"{where}[{i}]")

    try:
        for var, attrs in effects.store_attr_mutations.items():
            base = _pretty(_name(getattr(var, "source", None)))
            for attr, value in attrs.items():
                note(value, f"{base}.{attr}")
        for var in effects._get_modified_vars():
            source = getattr(var, "source", None)
            items = getattr(var, "items", None)
            if source is None or not isinstance(items, dict):
                continue
            base = _pretty(_name(source))
            for key, value in items.items():
                k = getattr(getattr(key, "vt", None), "value", key)
                if base.endswith((".__dict__['_buffers']", "._buffers")):
                    note(value, f"{base.rsplit('.', 1)[0]}.{k}")
                else:
                    note(value, f"{base}[{k!r}]")
    except Exception:
        return found
    return found
