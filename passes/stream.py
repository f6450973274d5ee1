"""The streamed-part variant of the graph: attention over the ancestors' keys and values.

A tree too large for one call is run in parts of consecutive rows (see
:mod:`treecompile.stream`). Each part's graph is the model's graph with two changes:

* every tree attention (after ``rewrite_attention_pass``) attends over ``[prefix ; own]``
  keys and values: the prefix rows are the part's ancestors' keys and values for that
  layer, graph inputs taken from the KV stack, and the mask is the interval rule in the
  concatenated coordinates (`treecompile.kernels.prefix_attention`);
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
``j <= c_q < kv_end[j]`` selects exactly them (`treecompile.kernels.prefix_attention`).

The number of attention calls and their key/value shapes are learnt from the graph: a
first compile with the wrong count raises `KVLayout`, which the wrapper catches to call
again with the right prefix shapes.
"""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import fx

from treecompile.errors import UnsupportedModelError
from treecompile.kernels import prefix_attention  # noqa: F401  (registers treecompile::prefix_tree_attention)
from treecompile.kernels.flex import AttentionSpec, _common_dtype, _with_sinks
from treecompile.passes._graph import PassContext, is_op, value

__all__ = ["KVLayout", "StreamGraph", "stream_passes", "stream_attention_fn", "stream_inputs", "stream_outputs"]


Tensor = torch.Tensor

#: Queries per block of the prefix attention kernel.
PREFIX_BLOCK = 128


@torch.library.custom_op("treecompile::stream_inputs", mutates_args=())
def stream_inputs(ids: Tensor, prefix: list[Tensor], kv_meta: list[Tensor]) -> Tensor:
    """Identity on ``ids`` ``[1, S]``; makes the prefix keys/values and their mask data graph inputs."""
    return ids.clone()


@stream_inputs.register_fake
def _stream_inputs_fake(ids, prefix, kv_meta):
    return torch.empty_like(ids)


@torch.library.custom_op("treecompile::stream_outputs", mutates_args=())
def stream_outputs(ids: Tensor, prefix: list[Tensor]) -> list[Tensor]:
    """Placeholders ``[1, Hkv, S, D]`` for the part's own keys and values (one per prefix tensor).

    Its eager body cannot know them: the streaming pass must replace it.
    """
    raise RuntimeError("treecompile::stream_outputs ran uncompiled: the streaming pass did not replace it")


@stream_outputs.register_fake
def _stream_outputs_fake(ids, prefix):
    s = ids.shape[-1]
    return [p.new_empty(*p.shape[:-2], s, p.shape[-1]) for p in prefix]


class KVLayout(Exception):
    """Raised by `route_prefix_kv_pass` when the prefix given does not match the graph's
    attention calls; ``shapes`` lists ``(Hkv, D, dtype)`` of each prefix tensor to pass."""

    def __init__(self, shapes: list[tuple[int, int, torch.dtype]]):
        super().__init__(f"the graph has {len(shapes) // 2} attention calls")
        self.shapes = shapes


@dataclass
class StreamGraph:
    """The placeholders `read_stream_inputs_pass` found, for `route_prefix_kv_pass`."""

    prefix: list[fx.Node] | None = None
    kv_end: fx.Node | None = None
    kv_pos: fx.Node | None = None


@functools.cache
def stream_attention_fn(spec: AttentionSpec) -> Callable:
    """``fn(q, k, v, prefix_k, prefix_v, kv_end, kv_pos, q_pos, sinks=None) -> [1, Hq, S, Dv]``."""
    if spec.kind != "interval":
        raise ValueError("streamed parts use the interval rule")

    def stream_tree_attention(q, k, v, pk, pv, kv_end, kv_pos, q_pos, sinks=None):
        q, k, v = _common_dtype(q, torch.cat([pk, k], dim=2), torch.cat([pv, v], dim=2))
        scale = spec.scale if spec.scale is not None else 1.0 / math.sqrt(q.shape[-1])
        out, lse = torch.ops.treecompile.prefix_tree_attention(
            q, k, v, kv_end, kv_pos, q_pos, PREFIX_BLOCK, float(scale), float(spec.softcap or 0.0),
            int(spec.window or 0), list(spec.alibi) if spec.alibi else None,
        )
        return out if sinks is None else _with_sinks(out, lse, sinks)

    parts = [f"w{spec.window}" if spec.window else "", "softcap" if spec.softcap else "",
             "alibi" if spec.alibi else "", "sinks" if spec.sinks else ""]
    stream_tree_attention.__name__ = "stream_tree_attention" + "".join("_" + p for p in parts if p)
    return stream_tree_attention


def stream_passes(state: StreamGraph) -> tuple[Callable, Callable]:
    """``(read_stream_inputs_pass, route_prefix_kv_pass)`` sharing ``state``: the first runs
    before every other pass, the second right after ``rewrite_attention_pass``."""

    def read_stream_inputs_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
        found = [n for n in gm.graph.nodes if is_op(n, torch.ops.treecompile.stream_inputs)]
        if len(found) != 1:
            raise RuntimeError(f"treecompile: expected one stream_inputs marker, found {len(found)}")
        node = found[0]
        ids, prefix, kv_meta = node.args
        state.prefix, (state.kv_end, state.kv_pos) = list(prefix), kv_meta
        node.replace_all_uses_with(ids)
        gm.graph.erase_node(node)
        return gm

    def route_prefix_kv_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
        calls = [n for n in gm.graph.nodes if n.op == "call_function" and hasattr(n.target, "spec")
                 and isinstance(n.target.spec, AttentionSpec)]
        kv = [(n.args[1], n.args[2]) for n in calls]
        shapes = []
        for k, v in kv:
            for t in (value(k), value(v)):
                if not (isinstance(t.shape[1], int) and isinstance(t.shape[3], int)):
                    raise UnsupportedModelError(
                        f"{calls[0].name}: keys/values with a symbolic head count or head dim {tuple(t.shape)} cannot "
                        "be kept on the streaming KV stack"
                    )
                shapes.append((int(t.shape[1]), int(t.shape[3]), t.dtype))
        given = [(int(value(p).shape[1]), int(value(p).shape[3]), value(p).dtype) for p in state.prefix]
        if given != shapes:
            raise KVLayout(shapes)
        outputs = [n for n in gm.graph.nodes if is_op(n, torch.ops.treecompile.stream_outputs)]
        if len(outputs) != 1:
            raise RuntimeError(f"treecompile: expected one stream_outputs marker, found {len(outputs)}")
        flat = [x for pair in kv for x in pair]
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
        marker = outputs[0]
        for user in list(marker.users):
            if not (user.op == "call_function" and user.target is operator.getitem):
                raise RuntimeError(f"treecompile: stream_outputs used by {user.format_node()}")
            user.replace_all_uses_with(flat[user.args[1]])
            gm.graph.erase_node(user)
        gm.graph.erase_node(marker)
        ctx.count("kv_outputs", len(flat))
        return gm

    return read_stream_inputs_pass, route_prefix_kv_pass
