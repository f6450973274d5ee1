"""The streamed-part variant of the graph: attention over the ancestors' keys and values.

A tree too large for one call is run in parts of consecutive rows (see
:mod:`treecompile.stream.options`). Each part's graph is the model's graph with two changes:

* every tree attention (after ``rewrite_attention_pass``) attends over ``[prefix ; own]``
  keys and values: the prefix rows are the part's ancestors' keys and values for that
  layer, graph inputs taken from the KV stack, and the mask is the interval rule in the
  concatenated coordinates (`treecompile.kernels.attention.prefix_attention`);
* the graph returns each attention's own keys and values, so that later parts can read
  them and their gradients can flow back.

The wrapper routes both through markers that are identities as far as Dynamo is concerned:

* ``treecompile::stream_inputs(ids, prefix, kv_meta)`` returns a copy of ``ids`` and makes
  ``prefix`` (``[k_0, v_0, k_1, v_1, ...]``, each ``[1, Hkv, L - S, D]``) and ``kv_meta``
  (``[kv_end [L], kv_pos [L]]``) graph inputs; `read_stream_inputs_pass` removes it first.
* ``treecompile::stream_outputs(ids, prefix)`` stands for the part's own keys and values,
  one ``[1, Hkv, S, D]`` tensor per prefix tensor; `route_prefix_kv_pass` replaces its
  items with the keys and values each attention call receives, in graph order.

Why it is exact: row ``q`` of a part attends, per path, to the rows on its root path up to
itself. Those before the part are on the root path of the part's first row (the prefix,
taken from earlier parts whose keys and values are the per-path ones by induction over
parts and layers); those inside follow the interval rule. The concatenated rule
``j <= c_q < kv_end[j]`` selects exactly them (`treecompile.kernels.attention.prefix_attention`).

The number of attention calls and their key/value shapes (and the conv contexts' and
recurrent states') are checked against the graph: a compile given another layout raises
`KVLayout` with the graph's, which the wrapper catches to call again with it. The wrapper
starts from a guess where it has one (`stack_layout` of the whole-tree graph, see
`treecompile.stream.runner`).
"""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import fx

from treecompile.core.errors import UnsupportedModelError
from treecompile.kernels.scans.table import SCANS, stream_selective_scan  # noqa: F401  (re-exported)
from treecompile.kernels.attention import prefix_attention  # noqa: F401  (registers treecompile::prefix_tree_attention)
from treecompile.kernels.attention import pair_sum  # noqa: F401  (registers treecompile::tree_pair_sum)
from treecompile.kernels.attention.masks import dense_tree_mask
from treecompile.kernels.attention.flex import AttentionSpec, _common_dtype, _with_sinks
from treecompile.kernels.attention.prefix_flex import prefix_flex_hop
from treecompile.passes._graph import PassContext, describe, is_op, location_of, source_of, value

__all__ = ["KVLayout", "StreamGraph", "stack_layout", "stream_passes", "refuse_pair_sums", "stream_attention_fn", "stream_causal_conv1d",
           "stream_scan_fn", "stream_selective_scan", "stream_inputs", "stream_outputs", "prefix_attention_calls"]


Tensor = torch.Tensor

#: Queries per block of the prefix attention kernel.
PREFIX_BLOCK = 128

#: The kernel of a part's attention over ``[prefix ; own]``, by device type: ``"flex"``, one
#: FlexAttention call (`treecompile.kernels.attention.prefix_flex.prefix_flex_hop`); ``"blocks"``, the
#: per-block op of `treecompile.kernels.attention.prefix_attention` (devices not named here). ALiBi
#: always takes the per-block op (its bias reads query and key positions of two tables).
PREFIX_KERNEL = {"cuda": "flex"}


@torch.library.custom_op("treecompile::stream_inputs", mutates_args=())
def stream_inputs(ids: Tensor, prefix: list[Tensor], conv: list[Tensor], states: list[Tensor],
                  kv_meta: list[Tensor]) -> Tensor:
    """Identity on ``ids`` ``[1, S]``; makes the stack's tensors and their index data graph inputs."""
    return ids.clone()


@stream_inputs.register_fake
def _stream_inputs_fake(ids, prefix, conv, states, kv_meta):
    return torch.empty_like(ids)


@torch.library.custom_op("treecompile::stream_outputs", mutates_args=())
def stream_outputs(ids: Tensor, prefix: list[Tensor], conv: list[Tensor], states: list[Tensor],
                   readouts: Tensor) -> list[Tensor]:
    """Placeholders for what the part puts on the stack, in order: ``[1, Hkv, S, D]`` keys and
    values (one per prefix tensor), ``[1, C, S]`` conv inputs (one per conv context) and
    ``[R, H, Dk, Dv]`` recurrent states (one per state input; ``R = readouts.shape[0]``).

    Its eager body cannot know them: the streaming passes must replace it.
    """
    raise RuntimeError("treecompile::stream_outputs ran uncompiled: the streaming pass did not replace it")


@stream_outputs.register_fake
def _stream_outputs_fake(ids, prefix, conv, states, readouts):
    s = ids.shape[-1]
    return ([p.new_empty(*p.shape[:-2], s, p.shape[-1]) for p in prefix] + [c.new_empty(*c.shape[:-1], s) for c in conv]
            + [t.new_empty(readouts.shape[0], *t.shape[1:]) for t in states])


class KVLayout(Exception):
    """Raised by `route_stream_state_pass` when the stack tensors given do not match the
    graph's layers; ``shapes`` lists ``(Hkv, D, dtype)`` of each prefix key/value tensor to
    pass, ``conv`` ``(C, dtype)`` of each conv context and ``states`` ``(H, Dk, Dv, dtype)``
    of each recurrent state."""

    def __init__(self, shapes: list[tuple[int, int, torch.dtype]], conv: list | None = None,
                 states: list | None = None):
        super().__init__(f"the graph has {len(shapes) // 2} attention calls, {len(conv or [])} conv contexts and "
                         f"{len(states or [])} recurrent states")
        self.shapes = shapes
        self.conv = conv or []
        self.states = states or []


@dataclass
class StreamGraph:
    """The placeholders `read_stream_inputs_pass` found, and what `route_prefix_kv_pass`
    learnt, for `route_stream_state_pass`."""

    prefix: list[fx.Node] | None = None
    conv: list[fx.Node] | None = None
    states: list[fx.Node] | None = None
    kv_end: fx.Node | None = None
    kv_pos: fx.Node | None = None
    conv_pred: fx.Node | None = None
    readouts: fx.Node | None = None
    kv_shapes: list | None = None
    kv_flat: list | None = None
    layout_ok: bool = True


@functools.cache
def stream_attention_fn(spec: AttentionSpec) -> Callable:
    """``fn(q, k, v, prefix_k, prefix_v, kv_end, kv_pos, q_pos, sinks=None, sink_values=None) -> [1, Hq, S, Dv]``."""
    if spec.kind != "interval":
        raise ValueError("streamed parts use the interval rule")

    def stream_tree_attention(q, k, v, pk, pv, kv_end, kv_pos, q_pos, sinks=None, sink_values=None):
        q, k, v = _common_dtype(q, torch.cat([pk, k], dim=2), torch.cat([pv, v], dim=2))
        scale = spec.scale if spec.scale is not None else 1.0 / math.sqrt(q.shape[-1])
        if PREFIX_KERNEL.get(q.device.type, "blocks") == "flex" and not spec.alibi:
            out, lse = prefix_flex_hop(q, k, v, kv_end, kv_pos, q_pos, scale=float(scale),
                                       softcap=float(spec.softcap or 0.0), window=int(spec.window or 0))
            return out if sinks is None else _with_sinks(out, lse, sinks, sink_values)
        out, lse = torch.ops.treecompile.prefix_tree_attention(
            q, k, v, kv_end, kv_pos, q_pos, PREFIX_BLOCK, float(scale), float(spec.softcap or 0.0),
            int(spec.window or 0), list(spec.alibi) if spec.alibi else None,
        )
        return out if sinks is None else _with_sinks(out, lse, sinks, sink_values)

    parts = [f"w{spec.window}" if spec.window else "", "softcap" if spec.softcap else "",
             "alibi" if spec.alibi else "", "sinks" if spec.sinks else ""]
    stream_tree_attention.__name__ = "stream_tree_attention" + "".join("_" + p for p in parts if p)
    stream_tree_attention.prefix_spec = spec  # how the passes after `route_prefix_kv_pass` know it
    return stream_tree_attention


def stream_causal_conv1d(x: Tensor, weight: Tensor, bias: Tensor | None, context: Tensor, pred: Tensor) -> Tensor:
    """The tree causal conv of a part whose rows may read earlier parts' conv inputs.

    Args:
        x: ``[1, C, S]`` the part's conv inputs.
        weight, bias: as for ``treecompile::tree_causal_conv1d``.
        context: ``[1, C, L - S]`` the conv inputs of the part's prefix rows (after padding rows).
        pred: ``[L]`` each row's predecessor on its path in ``[context ; x]`` coordinates (-1 at a
            root or where the predecessor is not held).

    Returns:
        ``[1, C, S]``: the conv of ``[context ; x]`` along each row's path, the part's rows.
    """
    kk = weight.shape[1]
    cols = [pred]
    for _ in range(kk - 2):
        last = cols[-1]
        cols.append(pred.index_select(0, last.clamp(min=0)).masked_fill(last < 0, -1))
    ancestors = torch.stack(cols, dim=1) if kk > 1 else pred.new_zeros(pred.shape[0], 0)
    full = torch.cat([context.to(x.dtype), x], dim=2)
    out = torch.ops.treecompile.tree_causal_conv1d(full, weight, bias, ancestors)
    return out[:, :, context.shape[2]:]


@functools.cache
def stream_scan_fn(kind: str) -> Callable:
    """``fn(q, k, v, g, beta, states, node_table, readouts, kernel) -> (out [1, S, H, Dv], [R, H, Dk, Dv])``
    (a scan whose `treecompile.kernels.scans.table.ScanKind` has its own ``stream``: that one):
    the tree recurrence of a part, started from states of earlier parts, reading out states
    for later parts, through the unchanged ``treecompile::tree_{kind}`` op.

    Both ends are rows of the scan itself, placed around the part's rows (the node table,
    built by the runner, says which node each belongs to):

    * an *injection node* of ``Dk`` rows per given state ``S`` ``[H, Dk, Dv]``: row ``t`` has
      ``k = e_t``, ``v = S[:, t]``, ``g = 0``, ``beta = 1``, ``q = 0``, run from the zero state.
      Row ``t`` writes ``e_t (v_t - S_cur^T e_t)^T`` where row ``t`` of ``S_cur`` is still zero,
      so after the node the state is ``S`` exactly (products with 0 and 1 only, in either
      form of the rule); the part's nodes whose parent lies before the part hang from it.
    * a *readout node* of ``Dk`` rows per state to return, a child of the node whose final
      state it reads: ``q = e_t``, ``k = v = g = beta = 0`` (no decay, no write), so row ``t``
      outputs ``S^T e_t``, row ``t`` of the parent's final state, exactly.

    The gradients flow through the same rows: into the injected states, and from the
    read-out states into the part's rows.
    """
    if SCANS[kind].stream is not None:  # a scan with its own injection form (kernels/scans/table.py)
        return SCANS[kind].stream
    op = getattr(torch.ops.treecompile, f"tree_{kind}")

    def stream_scan(q, k, v, g, beta, states, node_table, readouts, kernel="auto"):
        n_in, h, dk, dv = states.shape
        n_out = readouts.shape[0]
        s = q.shape[1]
        eye = torch.eye(dk, dtype=q.dtype, device=q.device)[:, None, :].expand(dk, h, dk)
        ins = (q.new_zeros(n_in * dk, h, dk), eye.repeat(n_in, 1, 1),
               states.to(v.dtype).permute(0, 2, 1, 3).reshape(n_in * dk, h, dv),
               g.new_zeros(n_in * dk, *g.shape[2:]), beta.new_ones(n_in * dk, h))  # (a gate per head or channel)
        outs = (eye.repeat(n_out, 1, 1), k.new_zeros(n_out * dk, h, dk), v.new_zeros(n_out * dk, h, dv),
                g.new_zeros(n_out * dk, *g.shape[2:]), beta.new_zeros(n_out * dk, h))
        full = [torch.cat([a, x[0], b])[None] for a, x, b in zip(ins, (q, k, v, g, beta), outs)]
        out = op(*full, None, node_table, kernel)
        own = out[:, n_in * dk:n_in * dk + s]
        read = out[0, n_in * dk + s:].reshape(n_out, dk, h, dv).permute(0, 2, 1, 3)
        return own, read

    stream_scan.__name__ = f"stream_tree_{kind}"
    return stream_scan


def prefix_attention_calls(gm: fx.GraphModule) -> list[fx.Node]:
    """The attention calls over ``[prefix ; own]`` (after `route_prefix_kv_pass`), in graph order."""
    return [n for n in gm.graph.nodes
            if n.op == "call_function" and isinstance(getattr(n.target, "prefix_spec", None), AttentionSpec)]


def refuse_pair_sums(gm: fx.GraphModule, where: str, advice: str) -> None:
    """Refuses attention without a softmax (`treecompile.kernels.attention.pair_sum`) and attention
    kept on dense ``[S, S]`` tensors (`treecompile.passes.attention.dense_pairs`), whose sums over a
    query's ancestors are not split over ``where``."""
    for n in gm.graph.nodes:
        if is_op(n, torch.ops.treecompile.tree_pair_sum):
            raise UnsupportedModelError(
                f"treecompile: attention without a softmax at {location_of(n)} is not run over {where} (its sum over "
                f"a query's ancestors would miss those held elsewhere): {advice}.\n  at {source_of(n)}")
        if n.op == "call_function" and n.target is dense_tree_mask:
            raise UnsupportedModelError(
                f"treecompile: attention computed on [S, S] tensors at {location_of(n)} is not run over {where} (its "
                f"sums over a query's ancestors would miss those held elsewhere): {advice}.\n  at {source_of(n)}")


def refuse_own_mods(calls: list[fx.Node], doing: str, kernel: str, advice: str) -> None:
    """Refuses the first attention call that runs a score_mod or mask_mod of the model's own:
    ``kernel`` (the prefix attention of streamed parts and of context-parallel ranks) takes none."""
    own = next((n for n in calls if n.target.spec.mods), None)
    if own is not None:
        raise UnsupportedModelError(
            f"treecompile cannot {doing}: {describe(own)} at {location_of(own)} runs a score_mod or "
            f"mask_mod of the model's own (its FlexAttention mods, a learned pair bias or chunked attention), "
            f"which {kernel} does not take; {advice}.\n  at {source_of(own)}")


def _attention_calls(gm: fx.GraphModule) -> list[fx.Node]:
    """The tree attention calls (after ``rewrite_attention_pass``), in graph order."""
    return [n for n in gm.graph.nodes
            if n.op == "call_function" and isinstance(getattr(n.target, "spec", None), AttentionSpec)]


def _conv_calls(gm: fx.GraphModule) -> list[fx.Node]:
    """The tree causal convs (after ``rewrite_conv_context_pass``), in graph order."""
    return [n for n in gm.graph.nodes if is_op(n, torch.ops.treecompile.tree_causal_conv1d)]


def _scan_calls(gm: fx.GraphModule) -> list[tuple[fx.Node, str]]:
    """``(node, kind)`` of the tree recurrent scans (after ``route_ssm_state_pass``), in graph order."""
    return [(n, kind) for n in gm.graph.nodes for kind in SCANS
            if is_op(n, getattr(torch.ops.treecompile, f"tree_{kind}"))]


def _kv_shapes(calls: list[fx.Node]) -> list[tuple[int, int, torch.dtype]]:
    """``(Hkv, D, dtype)`` of each attention call's key, then value; refused where symbolic."""
    shapes = []
    for n in calls:
        for t in (value(n.args[1]), value(n.args[2])):
            if not (isinstance(t.shape[1], int) and isinstance(t.shape[3], int)):
                raise UnsupportedModelError(
                    f"{calls[0].name}: keys/values with a symbolic head count or head dim {tuple(t.shape)} cannot "
                    "be kept on the streaming KV stack"
                )
            shapes.append((int(t.shape[1]), int(t.shape[3]), t.dtype))
    return shapes


def _conv_shapes(convs: list[fx.Node]) -> list[tuple[int, torch.dtype]]:
    """``(C, dtype)`` of each causal conv's input; refused where it is not one row of C channels."""
    shapes = []
    for n in convs:
        x = value(n.args[0])
        if x.shape[0] != 1 or not isinstance(x.shape[1], int):
            raise UnsupportedModelError(
                f"treecompile: {describe(n)} is a causal conv of input {tuple(x.shape)}: a streamed part keeps the "
                f"conv context of one packed row with a fixed channel count.\n  at {source_of(n)}")
        shapes.append((int(x.shape[1]), x.dtype))
    return shapes


def _state_of(n: fx.Node, kind: str) -> tuple[int, int, int, torch.dtype]:
    """``(H, Dk, Dv, dtype)`` of a tree scan's state (`treecompile.kernels.scans.table.ScanKind.state_of`);
    refused with an initial state or a symbolic size."""
    if n.args[5] is not None:
        raise UnsupportedModelError(
            f"treecompile: {describe(n)} is a recurrent scan with an initial state: a streamed part starts "
            f"its roots from the zero state.\n  at {source_of(n)}")
    dims, dtype = SCANS[kind].state_of(*(value(a) for a in n.args[:5]))
    if not all(isinstance(d, int) for d in dims):
        raise UnsupportedModelError(
            f"treecompile: {describe(n)} has a symbolic head count or state size {dims}: its state "
            f"cannot be kept on the streaming stack.\n  at {source_of(n)}")
    return (*(int(d) for d in dims), dtype)


def _state_shapes(scans: list[tuple[fx.Node, str]]) -> list[tuple[int, int, int, torch.dtype]]:
    """``(H, Dk, Dv, dtype)`` of each recurrent scan's state (`_state_of`); refused where key
    sizes differ between layers."""
    shapes = [_state_of(n, kind) for n, kind in scans]
    if len({sh[1] for sh in shapes}) > 1:
        raise UnsupportedModelError(
            f"treecompile: {describe(scans[0][0])}: recurrent layers of different key sizes "
            f"{sorted({sh[1] for sh in shapes})} cannot share one streamed node table.\n"
            f"  at {source_of(scans[0][0])}")
    return shapes


def stack_layout(gm: fx.GraphModule) -> KVLayout | None:
    """The KV stack layout of a streamed part graph of the model whose whole-tree graph
    (after the tree passes) is ``gm``: both graphs trace the same model code, so they hold
    the same attention calls, convs and scans. None where the part graph's passes would
    refuse one. A guess for `treecompile.stream.runner`, which the part graph's passes check
    (`KVLayout` on a mismatch)."""
    try:
        return KVLayout(_kv_shapes(_attention_calls(gm)), _conv_shapes(_conv_calls(gm)),
                        _state_shapes(_scan_calls(gm)))
    except UnsupportedModelError:
        return None


def stream_passes(state: StreamGraph) -> tuple[Callable, Callable, Callable]:
    """``(read_stream_inputs_pass, route_prefix_kv_pass, route_stream_state_pass)`` sharing
    ``state``: the first runs before every other pass, the second right after
    ``rewrite_attention_pass``, the third after ``route_ssm_state_pass``."""
    return tuple(_bound(fn, state) for fn in (read_stream_inputs_pass, route_prefix_kv_pass, route_stream_state_pass))


def _bound(fn: Callable, state: StreamGraph) -> Callable:
    """``fn`` with ``state`` bound, under ``fn``'s name (the pipeline names passes by it)."""
    bound = functools.partial(fn, state)
    bound.__name__ = fn.__name__
    return bound


def read_stream_inputs_pass(state: StreamGraph, gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Reads the part's stack inputs off the ``stream_inputs`` marker into ``state``; the marker goes."""
    found = [n for n in gm.graph.nodes if is_op(n, torch.ops.treecompile.stream_inputs)]
    if len(found) != 1:
        raise RuntimeError(f"treecompile: expected one stream_inputs marker, found {len(found)}")
    node = found[0]
    ids, prefix, conv, states, kv_meta = node.args
    state.prefix, state.conv, state.states = list(prefix), list(conv), list(states)
    state.kv_end, state.kv_pos, state.conv_pred, state.readouts = kv_meta
    for kind, inputs in (("prefix_kv_inputs", prefix), ("conv_inputs", conv), ("state_inputs", states)):
        if inputs:
            ctx.count(kind, len(inputs))
    node.replace_all_uses_with(ids)
    gm.graph.erase_node(node)
    return gm


def route_prefix_kv_pass(state: StreamGraph, gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Each attention call also attends to its layer's prefix K/V from the stack (or the model's
    own mods are refused); a layout that differs from the stack's is left to the next pass."""
    calls = _attention_calls(gm)
    refuse_own_mods(calls, "stream this model", "the streamed parts' prefix attention",
                    "run it whole (no stream=) or under a larger budget")
    refuse_pair_sums(gm, "streamed parts", "run it whole (no stream=)")
    kv = [(n.args[1], n.args[2]) for n in calls]
    shapes = _kv_shapes(calls)
    given = [(int(value(p).shape[1]), int(value(p).shape[3]), value(p).dtype) for p in state.prefix]
    state.kv_shapes = shapes
    if given != shapes:
        state.layout_ok = False  # route_stream_state_pass raises KVLayout with every layer's shapes
        return gm
    state.kv_flat = [x for pair in kv for x in pair]
    for i, node in enumerate(calls):
        q, k, v = node.args[:3]
        fn = stream_attention_fn(node.target.spec)
        with gm.graph.inserting_before(node):
            new = ctx.mark(gm.graph.call_function(
                fn, (q, k, v, state.prefix[2 * i], state.prefix[2 * i + 1], state.kv_end, state.kv_pos,
                     ctx.positions), dict(node.kwargs)), like=node)
        new.meta["example_value"] = value(node)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        ctx.count("prefix_attention")
    return gm


#: What `rewrite_conv_context_pass` counts for a rewrite that reads rows' ancestors through the
#: call's ``pred_index`` (shifts, windows, tap convs, first rows, rooted and path scans, pointer
#: jumps, gathers at positions): a part's ``pred_index`` stops at the part (-1 where the predecessor
#: is in an earlier part), so such a rewrite would read past the root there.
ANCESTOR_READS = ("shift", "window", "tap_conv", "first_row", "rooted_scan", "path_jump", "offset_window", "path_scan",
                  "position_gather")


def refuse_ancestor_reads(ctx: PassContext) -> None:
    """Refuses a part graph holding a rewrite of `ANCESTOR_READS`, naming the first model op
    whose rewrite reads ``pred_index``."""
    done = ctx.counters.get("rewrite_conv_context_pass", {})
    found = [k for k in ANCESTOR_READS if done.get(k)]
    if not found or ctx.pred_index is None:
        return
    seen, queue, at = set(), list(ctx.pred_index.users), None
    while queue and at is None:
        n = queue.pop(0)
        if n not in seen:
            seen.add(n)
            at = n if "stack_trace" in n.meta else None
            queue.extend(n.users)
    where = f" at {location_of(at)}" if at is not None else ""
    raise UnsupportedModelError(
        f"treecompile cannot stream this model: an op{where} reads earlier rows of each path ({', '.join(found)}), "
        "which a streamed part holds only from its own first row (the earlier rows are in earlier parts); run it as "
        "one call (no stream=, or a budget that holds the batch)." + (f"\n  at {source_of(at)}" if at is not None else ""))


def route_stream_state_pass(state: StreamGraph, gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Conv context and scan states come from the stack; the part's K/V, conv inputs and state
    readouts become the ``stream_outputs`` marker's values (or `KVLayout` names every layer's shapes)."""
    refuse_ancestor_reads(ctx)
    convs, scans = _conv_calls(gm), _scan_calls(gm)
    conv_shapes, state_shapes = _conv_shapes(convs), _state_shapes(scans)
    given_conv = [(int(value(c).shape[1]), value(c).dtype) for c in state.conv]
    given_states = [(*(int(d) for d in value(t).shape[1:]), value(t).dtype) for t in state.states]
    if not state.layout_ok or given_conv != conv_shapes or given_states != state_shapes:
        raise KVLayout(state.kv_shapes, conv_shapes, state_shapes)
    flat = list(state.kv_flat)
    for i, node in enumerate(convs):
        x, weight, bias, _ = node.args
        with gm.graph.inserting_before(node):
            new = ctx.mark(gm.graph.call_function(
                stream_causal_conv1d, (x, weight, bias, state.conv[i], state.conv_pred)), like=node)
        new.meta["example_value"] = value(node)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        flat.append(x)
        ctx.count("conv_context")
    for i, (node, kind) in enumerate(scans):
        # (q, k, v, g, beta, initial state, node table, kernel name): see kernels/scans/recurrence.py;
        # (u, dt, A, B, C, ...) for the selective scan: see kernels/scans/selective_scan.py.
        *inputs, _, table, kernel = node.args
        with gm.graph.inserting_before(node):
            new = ctx.mark(gm.graph.call_function(
                stream_scan_fn(kind), (*inputs, state.states[i], table, state.readouts, kernel)),
                like=node)
            own = ctx.mark(gm.graph.call_function(operator.getitem, (new, 0)), like=node)
            read = ctx.mark(gm.graph.call_function(operator.getitem, (new, 1)), like=node)
        own.meta["example_value"] = value(node)
        sv = value(state.states[i])
        read.meta["example_value"] = sv.new_empty(value(state.readouts).shape[0], *sv.shape[1:]).to(
            state_shapes[i][3])
        new.meta["example_value"] = (own.meta["example_value"], read.meta["example_value"])
        node.replace_all_uses_with(own)
        gm.graph.erase_node(node)
        flat.append(read)
        ctx.count("recurrent_state")
    outputs = [n for n in gm.graph.nodes if is_op(n, torch.ops.treecompile.stream_outputs)]
    if len(outputs) != 1:
        raise RuntimeError(f"treecompile: expected one stream_outputs marker, found {len(outputs)}")
    marker = outputs[0]
    for user in list(marker.users):
        if not (user.op == "call_function" and user.target is operator.getitem):
            raise RuntimeError(f"treecompile: stream_outputs used by {user.format_node()}")
        user.replace_all_uses_with(flat[user.args[1]])
        gm.graph.erase_node(user)
    gm.graph.erase_node(marker)
    ctx.count("kv_outputs", len(state.kv_flat))
    return gm
