"""The ``treecompile inspect`` command: what the passes do to one model, step by step.

Example::

    treecompile inspect ./qwen3-tiny                  # a directory with a HF config.json
    treecompile inspect config.json --json            # a HF config file, machine-readable
    treecompile inspect mypkg.models:make_lm --full   # any callable returning an nn.Module
    treecompile inspect ./qwen3-tiny --mask bitmask --png mask.png
    treecompile inspect ./qwen3-tiny --stream-rows 8  # the streamed part's graph

The model is built (a Hugging Face config with small random weights; a ``module:factory``
by calling it), compiled with :func:`treecompile.tree_compile` on a small example forest
and run once, through the pipeline ``tree_compile`` builds
(:func:`treecompile.passes.pipeline.passes_for`, so ``--lm-head fused`` shows the fused
head), with before/after hooks that record the graph each pass receives, the graph after
it and the pipeline's dead-code elimination, and the rewrites it counted. The
command prints, per pass, a unified diff of the graph code and the rewrite counts, then
the tree attention mask of the example as a grid of ``█``/``·`` (and as a PNG with
``--png``). A refused model prints the refusal and exits with status 1.

With ``--stream-rows C`` the example streams in parts of at most C rows
(:mod:`treecompile.stream.options`) and the report shows the part graph instead: the pipeline
with the streaming passes, the stack's inputs (prefix keys and values, conv contexts,
recurrent states) and what the graph returns for later parts.

:func:`inspect_model` is the work as a function and :func:`render_text` / :func:`as_json`
the reports; the model is built by :func:`load_model` (:mod:`treecompile.capture.model_loader`), and
the subcommand's arguments live in :mod:`treecompile.cli.inspect_cmd`. Nothing heavy is imported
until a model is inspected.
"""

from __future__ import annotations

import difflib
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from treecompile.compile.maskview import MASK_RULES, mask_matrix, mask_picture
from treecompile.capture.model_loader import load_model  # re-exported: `inspect`'s MODEL argument

__all__ = [
    "EXAMPLE_SEQUENCES",
    "Inspection",
    "PassStep",
    "as_json",
    "example_trees",
    "inspect_model",
    "load_model",
    "render_text",
]

#: The example forest, as token sequences per tree: a 13-token tree that branches at three
#: depths (with 1-token nodes and a path ending where another continues) beside a 6-token
#: tree, 19 rows in all. Small enough to read its mask, awkward enough to show every rule.
EXAMPLE_SEQUENCES: tuple[tuple[tuple[int, ...], ...], ...] = (
    ((1, 2, 3, 4, 5, 6, 7), (1, 2, 3, 4, 8, 9), (1, 2, 3, 4, 8, 10, 11), (1, 2, 12, 13)),
    ((14, 15, 16, 17, 18), (14, 15, 16, 19)),
)

#: Backends :func:`inspect_model` accepts; ``eager`` skips AOTAutograd, which the passes do not need.
BACKENDS = ("eager", "aot_eager", "inductor")


# --------------------------------------------------------------------------- records


@dataclass
class PassStep:
    """One pass as it ran on the captured graph.

    Attributes:
        name: the pass function's name (``rewrite_attention_pass`` ...), the key of its
            rewrite counters.
        counts: rewrites by kind that this pass counted.
        before: graph code the pass received.
        after: graph code after the pass and dead-code elimination; None if it refused.
        nodes_before, nodes_after: graph node counts (``nodes_after`` None if refused).
    """

    name: str
    counts: dict[str, int] = field(default_factory=dict)
    before: str = ""
    after: str | None = None
    nodes_before: int = 0
    nodes_after: int | None = None

    @property
    def changed(self) -> bool:
        """Whether the pass changed the graph code."""
        return self.after is not None and self.after != self.before

    def diff(self, context: int = 2) -> str:
        """Unified diff of the graph code, before -> after (empty if unchanged or refused)."""
        if self.after is None:
            return ""
        lines = difflib.unified_diff(
            self.before.splitlines(), self.after.splitlines(),
            fromfile=f"before {self.name}", tofile=f"after {self.name}", n=context, lineterm="",
        )
        return "\n".join(lines)


@dataclass
class Inspection:
    """What :func:`inspect_model` found.

    Attributes:
        model: a one-line description (class, parameters, dtype).
        source: ``"hf-config"``, ``"factory"`` or ``"module"`` (given as an object).
        mask: ``"interval"`` or ``"bitmask"``.
        backend: the lowering after the passes.
        lm_head: ``"gather"`` or ``"fused"``, as ``tree_compile(lm_head=...)``.
        steps: one :class:`PassStep` per pass that ran, in order.
        batch: the packed example forest (a :class:`~treecompile.TreeBatch` with path bits).
        trees: the example trees.
        seq_len: S as the graph saw it (a symbol when dynamic).
        refusal: the :class:`~treecompile.UnsupportedModelError` message, or None.
        loss: the loss on the example, when the model was not refused.
        parameters: parameter count.
        stream: with ``stream_rows``, the streamed part graph's schedule and stack
            interface: ``rows`` (C), ``parts``, ``stack_depth``, ``max_prefix``, the names of
            its ``prefix_kv_inputs``, ``conv_inputs``, ``state_inputs`` and ``index_inputs``
            placeholders, and ``outputs``, the nodes it returns for later parts.
    """

    model: str
    source: str
    mask: str
    backend: str
    steps: list[PassStep]
    batch: Any
    trees: list[Any]
    seq_len: str = ""
    refusal: str | None = None
    loss: float | None = None
    parameters: int = 0
    lm_head: str = "gather"
    stream: dict[str, Any] | None = None

    @property
    def counters(self) -> dict[str, dict[str, int]]:
        """Rewrite counts per pass name, for the passes that counted any."""
        return {s.name: dict(sorted(s.counts.items())) for s in self.steps if s.counts}

    @property
    def refused_at(self) -> str | None:
        """The pass that refused the model (None if not refused, or refused before the passes)."""
        if self.refusal is None or not self.steps or self.steps[-1].after is not None:
            return None
        return self.steps[-1].name


# --------------------------------------------------------------------------- example


def example_trees(vocab_size: int | None = None) -> list[Any]:
    """The example forest of :data:`EXAMPLE_SEQUENCES` as trees.

    Args:
        vocab_size: token ids are taken modulo this if it is smaller than the example's ids
            (the shape may then merge; it stays a valid tree).
    """
    from treecompile.core.tree import TrajectoryTree

    def ids(seq: tuple[int, ...]) -> list[int]:
        return [t % vocab_size for t in seq] if vocab_size else list(seq)

    # Insertion order: the rows stay in the order the sequences list them (the docs describe them).
    return [TrajectoryTree.from_sequences([ids(s) for s in tree], child_order="insertion")
            for tree in EXAMPLE_SEQUENCES]


# --------------------------------------------------------------------------- inspection


# FX code ends a line with ``;  a = b = None`` where values die; a rewrite moves those
# deaths around, which would fill every diff with noise. They are left out of the report.
_FREES = re.compile(r";  (?:\w+ = )+None$")


def _code(gm: Any) -> str:
    """The graph's Python code, without the lines' trailing frees of dead values."""
    # From the graph, not gm.code: the pipeline edits the graph before the first pass
    # (the input marker is removed) without regenerating the module's code.
    src = gm.graph.python_code(root_module="self").src
    return "\n".join(_FREES.sub("", line).rstrip() for line in src.strip("\n").splitlines())


def _recording_hooks(steps: list[PassStep]) -> tuple[Any, Any]:
    """Pipeline hooks ``(before, after)`` that append one :class:`PassStep` per pass to ``steps``."""
    seen: dict[str, Counter] = {}

    def before(name, gm, ctx):
        steps.append(PassStep(name=name, before=_code(gm), nodes_before=len(gm.graph.nodes)))
        seen[name] = Counter(ctx.counters.get(name, Counter()))

    def after(name, gm, ctx):
        step = steps[-1]
        step.after, step.nodes_after = _code(gm), len(gm.graph.nodes)
        now = ctx.counters.get(name, Counter())
        step.counts = {k: now[k] - seen[name][k] for k in now if now[k] != seen[name][k]}

    return before, after


def _stream_hooks(before: Any, after: Any, io: dict[str, Any]) -> tuple[Any, Any]:
    """``before``/``after`` that also record, into ``io``, the streaming passes' view of the
    graph: the stack's placeholders (from the ``stream_inputs`` marker) and the nodes that
    take the ``stream_outputs`` marker's place in the graph's output."""
    import torch
    from torch.utils._pytree import tree_leaves

    from treecompile.passes._graph import is_op

    def outputs(gm):
        node = next(n for n in gm.graph.nodes if n.op == "output")
        return [getattr(x, "name", str(x)) for x in tree_leaves(node.args[0])]

    def hook_before(name, gm, ctx):
        if name == "read_stream_inputs_pass":
            for n in gm.graph.nodes:
                if is_op(n, torch.ops.treecompile.stream_inputs):
                    _, prefix, conv, states, meta = n.args
                    io.update({k: [x.name for x in v] for k, v in (
                        ("prefix_kv_inputs", prefix), ("conv_inputs", conv), ("state_inputs", states),
                        ("index_inputs", meta))})
        if name == "route_stream_state_pass":
            marker = [n for n in gm.graph.nodes if is_op(n, torch.ops.treecompile.stream_outputs)]
            io["_items"] = {u.name for m in marker for u in m.users}
            io["_before"] = outputs(gm)
        before(name, gm, ctx)

    def hook_after(name, gm, ctx):
        after(name, gm, ctx)
        if name == "route_stream_state_pass":
            io["outputs"] = [new for old, new in zip(io["_before"], outputs(gm)) if old in io["_items"]]

    return hook_before, hook_after


def inspect_model(
    model: Any,
    *,
    mask: str = "interval",
    backend: str = "eager",
    trees: list[Any] | None = None,
    source: str = "module",
    lm_head: str = "gather",
    stream_rows: int | None = None,
) -> Inspection:
    """Compiles ``model`` for one example batch and records every pass.

    Args:
        model: a causal LM (see :func:`treecompile.tree_compile`); left unchanged.
        mask: ``"interval"`` or ``"bitmask"``.
        backend: lowering after the passes (``"eager"`` is enough to see the rewrites).
        trees: the example trees (default :func:`example_trees`).
        source: how the model was given, for the report.
        lm_head: ``"gather"`` or ``"fused"``, as ``tree_compile(lm_head=...)``.
        stream_rows: stream the example in parts of at most this many rows
            (``tree_compile(stream=StreamOptions(budget_rows=...))``, fewer than the
            example's rows) and record the part graph's passes instead.

    Returns:
        An :class:`Inspection`; ``refusal`` holds the message if the model was refused.
    """
    import torch

    from treecompile.core.batch import pack
    from treecompile.capture.dynamo import is_hf_model, model_vocab_size
    from treecompile.compile.wrapper import MASKS, TreeCompiledModel
    from treecompile.core.errors import UnsupportedModelError
    from treecompile.passes.pipeline import passes_for

    if mask not in MASKS:
        raise ValueError(unknown_choice("mask", mask, MASKS, "masks"))
    if backend not in BACKENDS:
        raise ValueError(unknown_choice("backend", backend, BACKENDS, "backends"))
    trees = trees if trees is not None else example_trees(model_vocab_size(model, is_hf_model(model)))
    batch = pack(trees, path_bits=True, warn_por=False)
    if stream_rows is not None:
        if isinstance(stream_rows, bool) or not isinstance(stream_rows, int) or stream_rows < 1:
            raise ValueError(f"stream_rows must be a positive int, got {stream_rows!r}")
        if mask != "interval":
            raise ValueError(f"streamed parts use the interval mask; stream_rows needs mask='interval', not {mask!r}")
        if stream_rows >= batch.num_tokens:
            raise ValueError(f"stream_rows={stream_rows} holds the whole example ({batch.num_tokens} rows), which "
                             f"would run as one call: give fewer than {batch.num_tokens}")
    params = list(model.parameters())
    dtype = str(params[0].dtype).removeprefix("torch.") if params else "-"
    n_params = sum(p.numel() for p in params)
    description = f"{type(model).__name__} ({n_params:,} parameters, {dtype})"

    steps: list[PassStep] = []
    before, after = _recording_hooks(steps)
    io: dict[str, Any] = {}
    if stream_rows is not None:
        before, after = _stream_hooks(before, after, io)
    pipeline = passes_for(lm_head, before=before, after=after)
    stream = None
    if stream_rows is not None:
        from treecompile.stream.options import StreamOptions

        stream = StreamOptions(budget_rows=stream_rows)
    compiled = TreeCompiledModel(model, mask=mask, backend=backend, verify=False, passes=pipeline, stream=stream)
    out = Inspection(description, source, mask, backend, steps, batch, trees, parameters=n_params, lm_head=lm_head)
    device = next(iter(params)).device if params else torch.device("cpu")
    try:
        result = compiled(batch.to(device))
    except UnsupportedModelError as exc:
        out.refusal = str(exc)
        return out
    except torch._dynamo.exc.UserError as exc:
        # Data-dependent control flow: Dynamo cannot capture the model as one graph, which
        # tree_compile needs, so this is a refusal too (tree_compile itself lets it through
        # as Dynamo's error). Keep the first line and the user's source line.
        lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
        where = next((ln for ln in lines if ln.startswith("Caused by:")), "")
        out.refusal = (
            "treecompile needs the model as one graph, but Dynamo cannot capture part of it: "
            + "; ".join(x for x in (lines[0] if lines else "", where) if x)
        )
        return out
    record = compiled.compile_records[-1]
    out.seq_len = record.seq_len
    out.loss = float(result.loss.detach())
    if stream_rows is not None:
        # The part graph is compiled once to learn the stack's layout, then again with it:
        # keep the passes of the last compile.
        last = max(i for i, s in enumerate(steps) if s.name == steps[0].name)
        del steps[:last]
        stats = compiled._stream.stats
        out.stream = {"rows": stream_rows, "parts": stats.parts, "stack_depth": stats.stack_depth,
                      "max_prefix": stats.max_prefix, **{k: v for k, v in io.items() if not k.startswith("_")}}
    return out


# --------------------------------------------------------------------------- rendering


def _counts_text(counts: dict[str, int]) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(counts.items())) or "-"


def render_text(
    insp: Inspection, *, full: bool = False, context: int = 2, show_mask: bool = True
) -> str:
    """The human-readable report: per pass a diff (or whole graphs), counts, the mask picture."""
    b = insp.batch
    path_tokens = sum(t.stats().path_tokens for t in insp.trees)
    out = [
        f"model: {insp.model}, mask={insp.mask}, backend={insp.backend}"
        + (f", lm_head={insp.lm_head}" if insp.lm_head != "gather" else "")
        + (f", stream_rows={insp.stream['rows']}" if insp.stream else ""),
        f"example: {b.num_trees} trees, {b.num_paths} paths, {b.num_nodes} nodes, S={b.num_tokens} rows "
        f"(from {path_tokens} path tokens)",
    ]
    if insp.steps:
        first = insp.steps[0]
        out.append(f"captured graph: {first.nodes_before} nodes, {len(first.before.splitlines())} lines of code")
        if full:
            out += ["", "== captured graph", first.before]
    for i, s in enumerate(insp.steps, 1):
        out.append("")
        if s.after is None:
            out.append(f"== pass {i}/{len(insp.steps)} {s.name} [{_counts_text(s.counts)}]: REFUSED")
            continue
        delta = s.nodes_after - s.nodes_before
        change = f"nodes {s.nodes_before} -> {s.nodes_after} ({delta:+d})" if s.changed else "graph unchanged"
        out.append(f"== pass {i}/{len(insp.steps)} {s.name} [{_counts_text(s.counts)}]; {change}")
        if s.changed:
            out.append(s.after if full else s.diff(context))
    out += ["", "rewrites per pass:"]
    width = max((len(s.name) for s in insp.steps), default=4)
    for s in insp.steps:
        nodes = f"{s.nodes_before} -> {s.nodes_after}" if s.after is not None else f"{s.nodes_before} -> refused"
        out.append(f"  {s.name:<{width}}  {nodes:<16} {_counts_text(s.counts)}")
    if insp.refusal is None:
        out.append(f"S in the graph: {insp.seq_len}; loss on the example: {insp.loss:.6g}")
    if insp.stream:
        st = insp.stream
        out += [
            "",
            f"stream variant: parts of at most {st['rows']} rows: {st['parts']} parts, stack depth "
            f"{st['stack_depth']}, longest prefix {st['max_prefix']} rows",
            "  stack inputs: prefix keys/values " + (", ".join(st.get("prefix_kv_inputs", [])) or "-")
            + "; conv contexts " + (", ".join(st.get("conv_inputs", [])) or "-")
            + "; recurrent states " + (", ".join(st.get("state_inputs", [])) or "-"),
            "  index inputs: " + (", ".join(st.get("index_inputs", [])) or "-")
            + " (key ends and positions, conv predecessors, state read-outs)",
            "  returned for later parts: " + (", ".join(st.get("outputs", [])) or "-"),
        ]
    if show_mask:
        out += ["", mask_picture(b, insp.mask)]
    if insp.refusal is not None:
        where = f" in {insp.refused_at}" if insp.refused_at else ""
        out += ["", f"REFUSED{where}: {insp.refusal}"]
    return "\n".join(out)


def as_json(insp: Inspection, *, full: bool = False) -> dict[str, Any]:
    """The report as JSON-ready data: counts per pass, node counts, graph sizes, the mask."""
    b = insp.batch
    passes = []
    for s in insp.steps:
        entry: dict[str, Any] = {
            "name": s.name,
            "counts": dict(sorted(s.counts.items())),
            "nodes_before": s.nodes_before,
            "nodes_after": s.nodes_after,
            "lines_before": len(s.before.splitlines()),
            "lines_after": None if s.after is None else len(s.after.splitlines()),
            "changed": s.changed,
            "refused": s.after is None,
        }
        if full:
            entry["code_before"], entry["code_after"] = s.before, s.after
        passes.append(entry)
    out: dict[str, Any] = {
        "model": insp.model,
        "parameters": insp.parameters,
        "source": insp.source,
        "mask": insp.mask,
        "backend": insp.backend,
        "lm_head": insp.lm_head,
        "stream": insp.stream,
        "refused": insp.refusal is not None,
        "refusal": insp.refusal,
        "refused_at": insp.refused_at,
        "seq_len": insp.seq_len,
        "loss": insp.loss,
        "captured": (
            {"nodes": insp.steps[0].nodes_before, "lines": len(insp.steps[0].before.splitlines())}
            if insp.steps else None
        ),
        "rewritten": (
            {"nodes": insp.steps[-1].nodes_after, "lines": len(insp.steps[-1].after.splitlines())}
            if insp.steps and insp.steps[-1].after is not None else None
        ),
        "passes": passes,
        "counters": insp.counters,
        "example": {
            "trees": b.num_trees,
            "paths": b.num_paths,
            "nodes": b.num_nodes,
            "tokens": b.num_tokens,
            "path_tokens": sum(t.stats().path_tokens for t in insp.trees),
            "sequences": [t.sequences() for t in insp.trees],
            "input_ids": b.input_ids.tolist(),
            "position_ids": b.position_ids.tolist(),
            "subtree_end": b.subtree_end.tolist(),
            "tree_ids": b.tree_ids.tolist(),
            "node_start": b.node_start.tolist(),
            "tree_offsets": b.tree_offsets.tolist(),
        },
        "attention_mask": {
            "kind": insp.mask,
            "rule": MASK_RULES[insp.mask],
            "rows": [[int(x) for x in row] for row in mask_matrix(b, insp.mask).tolist()],
        },
    }
    if insp.mask == "bitmask":
        out["example"]["path_bits"] = b.path_bits.tolist()
    return out
