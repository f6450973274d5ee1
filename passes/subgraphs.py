"""inline_subgraphs_pass: bring checkpointed regions into the graph the other passes see.

Dynamo records code under ``torch.utils.checkpoint`` (Hugging Face's
``gradient_checkpointing_enable()``, torchtitan's activation checkpointing) as one
``tag_activation_checkpoint`` higher-order op whose body is a separate graph. The passes
and the verify pass look at the top-level graph only, so attention inside a body would stay
plain causal attention over the whole packed row: silently wrong. This pass inlines every
such body in place and tags the inlined nodes as the checkpoint would
(``meta["recompute"]``, ``meta["ac_graph_id"]``, which AOTAutograd carries to the joint
graph), so the rewrites and the verification see every op while the partitioner may still
recompute the region in the backward.

Other higher-order ops that carry a subgraph (``torch.cond``, ``torch.autograd.Function``
bodies, ``while_loop`` ...) are left alone; the verify pass refuses them by name.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from treecompile.core.errors import UnsupportedModelError
from treecompile.passes._graph import PassContext

__all__ = ["inline_subgraphs_pass", "CHECKPOINT_OPS"]

#: Higher-order ops whose body is inlined (activation checkpointing only: same values,
#: recomputed or stored).
CHECKPOINT_OPS = tuple(
    op for op in (getattr(torch.ops.higher_order, "tag_activation_checkpoint", None),) if op is not None
)


def inline_subgraphs_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Inlines every activation-checkpoint body.

    Counters (``ctx.counters["inline_subgraphs_pass"]``): ``checkpoint`` per region inlined.
    """
    from torch.utils.checkpoint import CheckpointPolicy

    graph = gm.graph
    region_id = 0
    while True:  # nested checkpoints surface as new regions once their parent is inlined
        regions = [n for n in graph.nodes if n.op == "call_function" and n.target in CHECKPOINT_OPS]
        if not regions:
            return gm
        for node in regions:
            _inline(gm, node, region_id, CheckpointPolicy.PREFER_RECOMPUTE)
            ctx.count("checkpoint")
            region_id += 1


def _inline(gm: fx.GraphModule, node: fx.Node, region_id: int, policy) -> None:
    """Replaces one checkpoint op by its body's nodes, tagged with ``policy`` and ``region_id``."""
    graph = gm.graph
    body_ref, *operands = node.args
    body = getattr(gm, body_ref.target)
    env: dict[fx.Node, fx.Node] = {}
    placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
    for ph, arg in zip(placeholders, operands):
        env[ph] = arg
    outputs = None
    with graph.inserting_before(node):
        for inner in body.graph.nodes:
            if inner.op == "placeholder":
                continue
            if inner.op == "output":
                outputs = inner.args[0]
                continue
            if inner.op == "get_attr":  # a nested region's body: move it to the outer module
                name = f"{body_ref.target}_{inner.target}"
                setattr(gm, name, getattr(body, inner.target))
                env[inner] = graph.get_attr(name)
                continue
            new = graph.node_copy(inner, lambda x: env[x])
            new.meta["recompute"] = policy
            new.meta["ac_graph_id"] = region_id
            env[inner] = new
    results = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
    for user in list(node.users):
        if not (user.op == "call_function" and user.target is operator.getitem):
            raise UnsupportedModelError(
                f"treecompile cannot inline the activation-checkpoint region {node.name!r}: its result is "
                f"used as a whole by {user.format_node()}"
            )
        user.replace_all_uses_with(env.get(results[user.args[1]], results[user.args[1]]))
        graph.erase_node(user)
    graph.erase_node(node)
    if not body_ref.users:
        graph.erase_node(body_ref)
        delattr(gm, body_ref.target)
