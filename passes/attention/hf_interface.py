"""A Hugging Face attention-interface call: ``treecompile::causal_attention``.

The wrapper routes HF's attention interface to this marker, whatever kernel the model was
configured with; it carries the call's scale, sliding window, soft-cap, sinks (gpt-oss) and
chunk (Llama 4's chunked attention: the model's own mask on path positions).
"""

from __future__ import annotations

from torch import fx

from treecompile.kernels.attention.flex_mods import chunk_mods
from treecompile.passes._graph import PassContext
from treecompile.passes.attention.replace import replace

__all__ = ["rewrite_hf_interface"]


def rewrite_hf_interface(gm: fx.GraphModule, ctx: PassContext, node: fx.Node) -> None:
    q, k, v, scale, window, softcap, *rest = node.args
    sinks = rest[0] if rest else node.kwargs.get("sinks")
    chunk = rest[1] if len(rest) > 1 else node.kwargs.get("chunk")
    if sinks is not None:
        with gm.graph.inserting_before(node):  # [Hq] -> [1, Hq, 1], broadcast over the rows
            sinks = ctx.mark(gm.graph.call_method("view", (sinks, 1, -1, 1)), like=node)
    mods = chunk_mods(int(chunk)) if chunk is not None else None
    if replace(gm, ctx, node, q, k, v, scale=scale, window=window, softcap=softcap, sinks=sinks, mods=mods):
        ctx.count("hf_interface")
