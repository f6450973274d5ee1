"""The context-parallel variant of the graph: a rank's rows attend over the keys and values
the other ranks hold.

Under context parallelism (`treecompile.distributed.context_parallel`) each rank of a group runs
one graph over its own consecutive rows of the packed row, as a streamed part does
(`treecompile.passes.stream`), with one difference: the prefix keys and values (the root
path of the rank's first row, held by earlier ranks) are not graph inputs computed before
the call but gathered inside it, layer by layer, from the keys and values the other ranks
compute in the same layer (``treecompile::cp_gather_rows``, an all-to-all of the rows each
rank reads whose backward sends the gradients back, `treecompile.kernels.collectives.cp_gather`). Each attention then runs
over ``[prefix ; own]`` with the concatenated interval rule of
`treecompile.kernels.attention.prefix_attention`, exactly as a streamed part's.

The wrapper routes the gather's index data through one marker:
``treecompile::cp_inputs(ids, [kv_end, kv_pos, gather_index, send_rows, counts])`` returns a
copy of ``ids`` and makes the five tensors graph inputs; `read_cp_inputs_pass` removes it
first.

Why it is exact: as for streamed parts (see `treecompile.passes.stream`), with the earlier
parts' keys and values of a layer being the other ranks' keys and values of that layer,
which are the per-path ones by induction over layers.

Recurrent layers and causal convolutions (Gated DeltaNet, Mamba) would need the state at a
rank's first row from the rank before it, layer by layer: not done, and refused by name
(`refuse_cp_state_pass`).

A streamed part split over the group (`treecompile.distributed.stream_cp`) runs the streamed
part's graph with ``extend_prefix_kv_pass`` after its ``route_prefix_kv_pass``: each
attention's prefix becomes ``[the stack's rows ; the gathered rows]``, the first from the
stream inputs (earlier parts), the second gathered as above (the part's earlier ranks).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import fx

from treecompile.core.errors import UnsupportedModelError
from treecompile.kernels.collectives import cp_gather  # noqa: F401  (registers treecompile::cp_gather_rows)
from treecompile.passes._graph import PassContext, describe, is_op, source_of, value
from treecompile.passes.stream import (_attention_calls, _conv_calls, _scan_calls, prefix_attention_calls,
                                       refuse_own_mods, refuse_pair_sums, stream_attention_fn)

__all__ = ["CPGraph", "cp_inputs", "cp_passes"]

Tensor = torch.Tensor


@torch.library.custom_op("treecompile::cp_inputs", mutates_args=())
def cp_inputs(ids: Tensor, meta: list[Tensor]) -> Tensor:
    """Identity on ``ids`` ``[1, S]``; makes ``meta`` (``[kv_end, kv_pos, gather_index,
    send_rows, counts]``) graph inputs."""
    return ids.clone()


@cp_inputs.register_fake
def _cp_inputs_fake(ids, meta):
    return torch.empty_like(ids)


@dataclass
class CPGraph:
    """The group the gathers run over, and the placeholders `read_cp_inputs_pass` found."""

    group: str
    kv_end: fx.Node | None = None
    kv_pos: fx.Node | None = None
    gather_index: fx.Node | None = None
    send_rows: fx.Node | None = None
    counts: fx.Node | None = None


def cp_passes(state: CPGraph, streamed: bool = False) -> tuple[Callable, Callable, Callable]:
    """``(read_cp_inputs_pass, route_cp_kv_pass, refuse_cp_state_pass)`` sharing ``state``:
    the first runs before every other pass, the second right after ``rewrite_attention_pass``,
    the third after ``route_ssm_state_pass``.

    ``streamed``: for a streamed part split over the group (`treecompile.distributed.stream_cp`),
    whose attention calls already read a prefix from the KV stack: the second is
    ``extend_prefix_kv_pass`` instead, which runs right after the stream passes'
    ``route_prefix_kv_pass`` and appends the gathered rows to each call's prefix (the stack's
    rows come before the part, the gathered ones inside it, so the concatenation keeps row
    order); the third must run before ``route_stream_state_pass``.
    """

    def read_cp_inputs_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
        found = [n for n in gm.graph.nodes if is_op(n, torch.ops.treecompile.cp_inputs)]
        if len(found) != 1:
            raise RuntimeError(f"treecompile: expected one cp_inputs marker, found {len(found)}")
        node = found[0]
        ids, meta = node.args
        state.kv_end, state.kv_pos, state.gather_index, state.send_rows, state.counts = meta
        node.replace_all_uses_with(ids)
        gm.graph.erase_node(node)
        return gm

    def route_cp_kv_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
        gather = torch.ops.treecompile.cp_gather_rows.default
        n_keys = value(state.gather_index).shape[0]
        calls = _attention_calls(gm)
        refuse_own_mods(calls, "run this model under context parallelism", "a rank's attention to the gathered rows",
                        "train it without cp=")
        for node in calls:
            q, k, v = node.args[:3]
            with gm.graph.inserting_before(node):
                prefix = []
                for x in (k, v):
                    args = (x, state.gather_index, state.send_rows, state.counts, state.group)
                    got = ctx.mark(gm.graph.call_function(gather, args), like=node)
                    t = value(x)
                    got.meta["example_value"] = t.new_empty(1, t.shape[1], n_keys, t.shape[3])
                    prefix.append(got)
                new = ctx.mark(gm.graph.call_function(
                    stream_attention_fn(node.target.spec),
                    (q, k, v, *prefix, state.kv_end, state.kv_pos, ctx.positions), dict(node.kwargs)), like=node)
            new.meta["example_value"] = value(node)
            node.replace_all_uses_with(new)
            gm.graph.erase_node(node)
            ctx.count("cp_attention")
        return gm

    def extend_prefix_kv_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
        gather = torch.ops.treecompile.cp_gather_rows.default
        n_keys = value(state.gather_index).shape[0]
        for node in prefix_attention_calls(gm):
            q, k, v, pk, pv = node.args[:5]
            with gm.graph.inserting_before(node):
                joined = []
                for x, p in ((k, pk), (v, pv)):
                    args = (x, state.gather_index, state.send_rows, state.counts, state.group)
                    got = ctx.mark(gm.graph.call_function(gather, args), like=node)
                    t, before = value(x), value(p)
                    got.meta["example_value"] = t.new_empty(1, t.shape[1], n_keys, t.shape[3])
                    cat = ctx.mark(gm.graph.call_function(torch.cat, ([p, got], 2)), like=node)
                    cat.meta["example_value"] = before.new_empty(1, before.shape[1], before.shape[2] + n_keys,
                                                                 before.shape[3])
                    joined.append(cat)
            node.args = (q, k, v, *joined, *node.args[5:])
            ctx.count("cp_attention")
        return gm

    def refuse_cp_state_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
        refuse_pair_sums(gm, "the ranks of context parallelism", "train this model without cp=")
        held = _conv_calls(gm) + [n for n, _ in _scan_calls(gm)]
        if held:
            n = held[0]
            raise UnsupportedModelError(
                f"treecompile: {describe(n)} carries state along the sequence, which context parallelism does not "
                "hand across ranks (a rank would need the state at its first row from the rank before it, layer by "
                "layer): train this model without cp=, or stream it (tree_compile(stream=...)) to bound its memory."
                f"\n  at {source_of(n)}")
        return gm

    return read_cp_inputs_pass, extend_prefix_kv_pass if streamed else route_cp_kv_pass, refuse_cp_state_pass
