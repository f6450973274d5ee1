"""gather_logits_pass: vocabulary logits only for the rows some target needs.

The wrapper asks for ``treecompile::tree_logprobs(logits, rows, slot, target, dest)``:
target ``m`` (at row ``dest[m]``, token ``target[m]``) is predicted by the output of row
``rows[slot[m]]`` (its ``pred_index``). HF's own loss is never used: it shifts labels by
one row, which at a branch point picks the wrong predictor (a node's first token is
predicted by its parent's last row, not by the row before it in the packed order).

The pass walks back from ``logits`` through row-wise ops (elementwise with scalars,
casts, full slices, soft-capping) to the vocabulary projection (a ``linear``), and
gathers the ``R`` needed rows of that projection's *input* instead. Exact: every op on the
way acts on each row independently, so computing it for the gathered rows gives the
gathered rows of its result. Rows no target needs (a leaf's last row) never reach the
projection; a row shared by several targets (a branch point) is projected once. If the
chain is not recognised, the logits are gathered after the projection (still exact).
"""

from __future__ import annotations

import operator

import torch
import torch.nn.functional as F
from torch import fx

from treecompile.kernels.logprobs.fused import fused_target_logprobs
from treecompile.passes._graph import PassContext, is_call, mutated_args, storage_of, value
from treecompile.passes.markers import is_marker, logprobs_at_rows, scatter_to_rows

__all__ = ["gather_logits_pass", "fuse_lm_head_pass", "gathered_logprobs", "fused_logprobs_at_rows"]

_LINEAR = {F.linear, torch.ops.aten.linear.default}
_UNARY = {torch.tanh, torch.ops.aten.tanh.default}
_UNARY_METHODS = {"tanh", "float", "double", "to", "contiguous", "type"}
_SCALAR_BINARY = {operator.mul, operator.truediv, operator.add, operator.sub, torch.mul, torch.div}
_SCALAR_BINARY_METHODS = {"mul", "div", "add", "sub"}


def gathered_logprobs(
    logits_rows: torch.Tensor, slot: torch.Tensor, target: torch.Tensor, dest: torch.Tensor, like: torch.Tensor
) -> torch.Tensor:
    """``[S]`` target log-probabilities from the logits of the needed rows only.

    Args:
        logits_rows: ``[1, R, V]`` logits of ``rows``.
        slot, target, dest: ``[M]`` (see :func:`treecompile.passes.markers.tree_logprobs`).
        like: any ``[S]`` tensor (gives S and the device).
    """
    return logprobs_at_rows(logits_rows[0], slot, target, dest, like.shape[0])


def fused_logprobs_at_rows(
    head_rows: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    slot: torch.Tensor,
    target: torch.Tensor,
    dest: torch.Tensor,
    like: torch.Tensor,
) -> torch.Tensor:
    """``[S]`` target log-probabilities from the LM head's inputs at the needed rows.

    Args:
        head_rows: ``[1, R, H]`` inputs of the vocabulary projection at ``rows``.
        weight, bias: the projection's ``[V, H]`` weight and ``[V]`` bias (or None).
        slot, target, dest, like: as in `gathered_logprobs`.
    """
    lp = fused_target_logprobs(head_rows[0], weight, bias, slot, target)
    return scatter_to_rows(lp, dest, like.shape[0])


def gather_logits_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Replaces ``tree_logprobs`` with a gather of the needed rows before the LM head.

    Counters (``ctx.counters["gather_logits_pass"]``): ``gather_before_lm_head`` or ``gather_logits``.
    """
    return _rewrite_logprobs(gm, ctx, fuse=False)


def fuse_lm_head_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Like `gather_logits_pass`, but a plain LM head (``linear`` then at most casts) becomes
    the fused chunked projection + log-softmax (`treecompile.kernels.logprobs.fused`): the
    ``[R, V]`` logits are never formed, forward or backward. Other heads are gathered as
    `gather_logits_pass` does.

    Counters (``ctx.counters["fuse_lm_head_pass"]``): ``fused_lm_head``, ``gather_before_lm_head`` or
    ``gather_logits``.
    """
    return _rewrite_logprobs(gm, ctx, fuse=True)


def _rewrite_logprobs(gm: fx.GraphModule, ctx: PassContext, *, fuse: bool) -> fx.GraphModule:
    for node in list(gm.graph.nodes):
        if not is_marker(node, "tree_logprobs"):
            continue
        logits, rows, slot, target, dest = node.args
        chain = _rowwise_chain(logits)
        if chain is not None and _written(gm, [chain[0].args[0], *chain]):
            # An op writes into the logits or the head's input in place (``logits.mul_``): the
            # chain recomputed on the gathered rows would read them from before that write.
            chain = None
        with gm.graph.inserting_before(node):
            if fuse and chain is not None and all(_is_cast(n) for n in chain[1:]):
                head = chain[0]
                head_input = head.args[0]
                weight = head.args[1] if len(head.args) > 1 else head.kwargs.get("weight")
                bias = head.args[2] if len(head.args) > 2 else head.kwargs.get("bias")
                sel = ctx.mark(gm.graph.call_function(torch.index_select, (head_input, 1, rows)), like=node)
                new = ctx.mark(
                    gm.graph.call_function(
                        fused_logprobs_at_rows, (sel, weight, bias, slot, target, dest, ctx.positions)
                    ),
                    like=node,
                )
                new.meta["example_value"] = value(node)
                node.replace_all_uses_with(new)
                gm.graph.erase_node(node)
                ctx.count("fused_lm_head")
                continue
            if chain is not None:
                head_input = chain[0].args[0]
                sel = ctx.mark(gm.graph.call_function(torch.index_select, (head_input, 1, rows)), like=node)
                remap = {head_input: sel}
                for n in chain:
                    remap[n] = ctx.mark(gm.graph.node_copy(n, lambda x: remap.get(x, x)), like=n)
                    remap[n].meta.pop("example_value", None)
                logits_rows = remap[chain[-1]]
                ctx.count("gather_before_lm_head")
            else:
                logits_rows = ctx.mark(gm.graph.call_function(torch.index_select, (logits, 1, rows)), like=node)
                ctx.count("gather_logits")
            new = ctx.mark(
                gm.graph.call_function(gathered_logprobs, (logits_rows, slot, target, dest, ctx.positions)),
                like=node,
            )
        new.meta["example_value"] = value(node)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
    return gm


def _rowwise_chain(logits: fx.Node) -> list[fx.Node] | None:
    """Nodes from the LM head ``linear`` to ``logits``, if every one acts row by row."""
    chain: list[fx.Node] = []
    cur = logits
    while isinstance(cur, fx.Node):
        chain.append(cur)
        if is_call(cur, _LINEAR):
            weight = cur.args[1] if len(cur.args) > 1 else cur.kwargs.get("weight")
            if not isinstance(weight, fx.Node) or weight.op != "placeholder":
                return None
            return chain[::-1]
        if is_call(cur, _UNARY, _UNARY_METHODS):
            cur = cur.args[0]
        elif is_call(cur, _SCALAR_BINARY, _SCALAR_BINARY_METHODS):
            a, b = cur.args[:2]
            if isinstance(a, fx.Node) and not isinstance(b, fx.Node):
                cur = a
            elif isinstance(b, fx.Node) and not isinstance(a, fx.Node):
                cur = b
            else:
                return None
        elif cur.op == "call_function" and cur.target is operator.getitem and _full_slices(cur.args[1]):
            cur = cur.args[0]
        else:
            return None
    return None


def _written(gm: fx.GraphModule, nodes: list[fx.Node]) -> bool:
    """Whether some op of the graph writes in place into the memory of one of ``nodes`` (or
    of a view of it); also when the memory of one, or of a write's target, is not known."""
    stores = {storage_of(n) for n in nodes}
    if None in stores:
        return True
    return any(storage_of(a) is None or storage_of(a) in stores for m in gm.graph.nodes for a in mutated_args(m))


def _is_cast(node: fx.Node) -> bool:
    """An op that changes only the dtype or layout (the fused op computes in float32 anyway)."""
    if node.op == "call_method" and node.target in ("float", "double", "contiguous"):
        return True
    return node.op == "call_function" and node.target is operator.getitem and _full_slices(node.args[1])


def _full_slices(index) -> bool:
    index = index if isinstance(index, tuple) else (index,)
    return all(
        isinstance(i, slice) and i.start in (None, 0) and i.stop is None and i.step in (None, 1) for i in index
    )
