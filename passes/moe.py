"""check_moe_regions_pass: mixture-of-experts blocks and the router's auxiliary loss.

Two regions of a captured MoE model move rows around or reduce over them, and both are
exact on a tree for a reason the verify pass cannot see op by op. The wrapper brackets
each with marker ops (:mod:`treecompile.passes.markers`); this pass finds every region,
checks what can be checked, lets the verify pass trust its nodes, and removes the markers.

**Experts** (``experts_begin`` ... ``experts_end``, one region per MoE layer). HF's
``grouped_mm`` experts sort the ``T * k`` (token, expert) pairs by expert, run one
grouped matmul per projection and scatter the results back. The result is token-wise:
output row ``t`` is ``sum_j w[t, j] * expert[idx[t, j]](x[t])`` from row ``t``'s own hidden
state and routing (HF's experts have no capacity limit, so no token's routing can
displace another's). A token-wise function of rows that equal the per-path rows gives
rows that equal the per-path rows: exact on the tree as it stands. Checked: the region
reads no sequence tensor other than its three inputs.

**Router auxiliary loss** (``router_stats_begin`` ... ``router_aux_end``, one region). The
ground truth is per-path training: all ``P`` paths through the unmodified model in one
padded batch, and HF's ``load_balancing_loss_func(router_logits, num_experts, top_k,
attention_mask)`` over every real token of every path; the model's loss is the main loss
plus ``router_aux_loss_coef * aux``. The statistics it reduces over the tokens (the
fraction of top-k slots each expert receives, the mean router probability per expert)
are sums over tokens divided by the number of tokens. A tree row computes its token once
but per-path training computes it once per path through it, ``path_count`` times, with
identical router logits (everything up to the router is per-path exact). So the wrapper
calls the model's own function with ``attention_mask = path_count``: HF's function weights
each row's statistics by the mask (``sum(mask * stat) / sum(mask)``), which with these
weights is the sum over the per-path tokens, and ``sum(path_count)`` is their number.
Padding rows have ``path_count`` 0. Checked: every node in the region that reduces over
the rows (an input with a row dimension, ``S`` or ``S * k``, and an output without)
depends on the weights, so a function that ignores its mask is refused, not silently
unweighted.

Counters (``ctx.counters["check_moe_regions_pass"]``): ``experts`` (MoE layers),
``router_aux_loss`` (1 when the loss is computed) and ``router_layers`` (layers whose router
logits it reads).
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import fx

from treecompile.core.errors import UnsupportedModelError
from treecompile.passes._graph import PassContext, describe, is_row_size, source_of, value
from treecompile.passes.markers import is_marker

__all__ = ["check_moe_regions_pass"]


def check_moe_regions_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Checks and accepts the experts and router-loss regions; removes their markers.

    Counters (``ctx.counters["check_moe_regions_pass"]``): ``experts``, ``router_aux_loss``, ``router_layers``.
    """
    for begin in [n for n in gm.graph.nodes if is_marker(n, "experts_begin")]:
        region, end = _region(begin, "experts_end", ctx.seq_len)
        _check_reads(region, begin, ctx, "experts")
        ctx.created.update(region)
        _unwrap(gm, begin, list(begin.args), end)
        ctx.count("experts")
    for begin in [n for n in gm.graph.nodes if is_marker(n, "router_stats_begin")]:
        region, end = _region(begin, "router_aux_end", ctx.seq_len)
        _check_reads(region, begin, ctx, "router auxiliary loss")
        logits, weights = begin.args
        weight_uses = {u for u in begin.users if _getitem_index(u) == len(logits)}
        _check_weighted(region, weight_uses, ctx)
        ctx.created.update(region)
        _unwrap(gm, begin, [*logits, weights], end)
        ctx.count("router_aux_loss")
        ctx.count("router_layers", len(logits))
    return gm


#: Each region's begin marker and the end marker it leads to.
REGIONS = (("experts_begin", "experts_end"), ("router_stats_begin", "router_aux_end"))


def region_nodes(gm: fx.GraphModule, seq: Any) -> set[fx.Node]:
    """The nodes inside every experts and router-loss region (as `check_moe_regions_pass`
    finds them): what a rewrite before it must leave alone. An ``arange`` over the tokens
    there is a permutation of the region's tokens (grouping them by expert and back), not
    their positions."""
    inside: set[fx.Node] = set()
    for begin_name, end_name in REGIONS:
        for begin in [n for n in gm.graph.nodes if is_marker(n, begin_name)]:
            inside |= _region(begin, end_name, seq)[0]
    return inside


def _region(begin: fx.Node, end_name: str, seq: Any) -> tuple[set[fx.Node], fx.Node]:
    """The nodes between ``begin`` and its end marker, and the end marker.

    Everything computed from ``begin``'s outputs up to the end marker, plus the helpers
    (sizes, ``arange``, empty buffers) used only inside the region that read no tensor with
    a row dimension from outside it.
    """
    region: set[fx.Node] = set()
    ends: set[fx.Node] = set()
    stack = list(begin.users)
    while stack:
        n = stack.pop()
        if n in region or n in ends:
            continue
        if is_marker(n, end_name):
            ends.add(n)
            continue
        region.add(n)
        stack.extend(n.users)
    if len(ends) != 1:
        raise UnsupportedModelError(
            f"treecompile: {describe(begin)} should lead to one {end_name} marker, found {len(ends)}"
        )
    # Helpers: candidates are the inputs of region nodes; adding one makes its inputs candidates.
    candidates = [m for n in region for m in n.all_input_nodes]
    while candidates:
        n = candidates.pop()
        if n in region or n is begin or n.op in ("placeholder", "output", "get_attr"):
            continue
        if all(u in region for u in n.users) and not any(
            m not in region and _row_dims(m, seq) for m in n.all_input_nodes
        ):
            region.add(n)
            candidates.extend(n.all_input_nodes)
    return region, ends.pop()


def _check_reads(region: set[fx.Node], begin: fx.Node, ctx: PassContext, what: str) -> None:
    """Refuses a region that reads a tensor with a row dimension other than through ``begin``."""
    seq = ctx.seq_len
    for n in region:
        for m in n.all_input_nodes:
            if m in region or m is begin:
                continue
            v = value(m)
            if isinstance(v, torch.Tensor) and any(is_row_size(s, seq, "derived") for s in v.shape):
                raise UnsupportedModelError(
                    f"treecompile cannot make this model exact on a tree: the {what} region reads "
                    f"{describe(m)}, a sequence tensor that is not one of its inputs.\n  at {source_of(n)}"
                )


def _check_weighted(region: set[fx.Node], weights: set[fx.Node], ctx: PassContext) -> None:
    """Refuses a reduction over the rows in the router-loss region that ignores the weights."""
    seq = ctx.seq_len
    weighted: set[fx.Node] = set()
    for n in _topo(region):
        if n in weights or any(m in weights or m in weighted for m in n.all_input_nodes):
            weighted.add(n)
            continue
        if n.op not in ("call_function", "call_method"):
            continue
        reads_rows = any(_row_dims(m, seq) for m in n.all_input_nodes)
        if reads_rows and not _row_dims(n, seq):
            raise UnsupportedModelError(
                f"treecompile cannot count the router auxiliary loss per path: {describe(n)} reduces over the "
                "tokens without the row weights (the model's load_balancing_loss_func does not weight its "
                "statistics by attention_mask), so shared tokens would count once instead of once per path. "
                f"Set config.output_router_logits = False to train without it.\n  at {source_of(n)}"
            )


def _topo(nodes: set[fx.Node]) -> list[fx.Node]:
    if not nodes:
        return []
    graph = next(iter(nodes)).graph
    return [n for n in graph.nodes if n in nodes]


def _row_dims(node: fx.Node, seq: Any) -> bool:
    """Whether the node's value is a tensor (or tuple of tensors) with a dim derived from the rows."""
    v = value(node)
    vals = v if isinstance(v, (tuple, list)) else [v]
    return any(isinstance(t, torch.Tensor) and any(is_row_size(s, seq, "derived") for s in t.shape) for t in vals)


def _getitem_index(node: fx.Node) -> int | None:
    if node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[1], int):
        return node.args[1]
    return None


def _unwrap(gm: fx.GraphModule, begin: fx.Node, inputs: list[Any], end: fx.Node) -> None:
    """Removes a region's markers: their users read the marked tensors directly."""
    for user in list(begin.users):
        i = _getitem_index(user)
        if i is None:
            raise UnsupportedModelError(f"treecompile: {describe(user)} uses {describe(begin)} as a whole")
        user.replace_all_uses_with(inputs[i])
        gm.graph.erase_node(user)
    gm.graph.erase_node(begin)
    end.replace_all_uses_with(end.args[0])
    gm.graph.erase_node(end)
