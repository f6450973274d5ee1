"""rewrite_positions_pass: positions derived from the sequence index become tree positions.

Per-path training gives the token at path offset ``p`` the position ``p``. In the packed
row, row ``j`` holds a token at path offset ``positions[j]`` (siblings repeat offsets),
so every place where a model derives a position from the row index must read
``positions`` instead:

* ``torch.arange(c, S + c)`` (step 1): RoPE angles, learned absolute embeddings
  ``wpe(arange(T))``, 1-based counts. Replaced by ``positions + c`` (in the arange's
  dtype). Exact: entry ``j`` of the arange was used as row ``j``'s position plus ``c``.
* ``table[:S]`` on one dim of a constant table (cached cos/sin, position embedding
  weights): row ``j`` of the slice was used for row ``j``, so it becomes
  ``table.index_select(dim, positions)``.
* ``position_ids`` given to a model (Hugging Face) already are the tree positions; they
  are only counted.

Aranges that feed mask building (a comparison) are left alone: a mask built from the
sequence index is not a position, and if it survived the attention pass the verify pass
refuses it.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from treecompile.passes._graph import ARANGE, PassContext, bind, is_call, row_indices, same_size, value

__all__ = ["rewrite_positions_pass"]

_COMPARISONS = {operator.lt, operator.le, operator.gt, operator.ge, operator.eq, operator.ne,
                torch.lt, torch.le, torch.gt, torch.ge, torch.eq, torch.ne, torch.tril, torch.triu}
_COMPARISON_METHODS = {"lt", "le", "gt", "ge", "eq", "ne", "tril", "triu", "masked_fill"}
# Ops through which an index keeps being an index (views, broadcasting, offsets).
_PASS_THROUGH = {operator.getitem, operator.add, operator.sub, torch.add, torch.sub}
_PASS_THROUGH_METHODS = {"view", "reshape", "unsqueeze", "expand", "to", "long", "int", "__getitem__", "add", "sub"}


def rewrite_positions_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Replaces sequence-index positions with tree positions.

    Counters (``ctx.counters["rewrite_positions_pass"]``): ``arange``, ``table_slice``,
    ``position_ids_input``.
    """
    external = [u for u in ctx.positions.users if u not in ctx.created]
    if external:
        ctx.count("position_ids_input", len(external))
    for node in list(gm.graph.nodes):
        if node in ctx.created:
            continue
        offset = _row_index_offset(node, ctx) if is_call(node, ARANGE) else None
        # An arange used as an index along the rows is a row index, not a position (the
        # verify pass accepts it only as the identity).
        as_row_index = any(any(i is node for i, _ in row_indices(u, ctx.seq_len)) for u in node.users)
        if offset is not None and not _feeds_comparison(node) and not as_row_index:
            dtype = value(node).dtype
            with gm.graph.inserting_before(node):
                new = gm.graph.call_method("to", (ctx.positions,), {"dtype": dtype})
                if offset:
                    new = ctx.mark(gm.graph.call_function(operator.add, (new, offset)), like=node)
            new.meta["example_value"] = value(node)
            ctx.mark(new, like=node)
            node.replace_all_uses_with(new)
            ctx.count("arange")
        elif node.op == "call_function" and node.target is operator.getitem:
            dim = _table_slice_dim(node, ctx)
            if dim is not None:
                with gm.graph.inserting_before(node):
                    new = gm.graph.call_function(torch.index_select, (node.args[0], dim, ctx.positions))
                new.meta["example_value"] = value(node)
                ctx.mark(new, like=node)
                node.replace_all_uses_with(new)
                ctx.count("table_slice")
    return gm


def _row_index_offset(node: fx.Node, ctx: PassContext) -> int | None:
    """``c`` if ``node`` is ``arange(c, S + c)`` (step 1) with S the sequence length, else None."""
    args = list(node.args)
    if len(args) == 1:
        start, end, step = 0, args[0], 1
    else:
        a = bind(node, ["start", "end", "step"], {"start": 0, "step": 1})
        start, end, step = a["start"], a.get("end"), a["step"]
    if "end" in node.kwargs and len(args) == 0:
        start, end = node.kwargs.get("start", 0), node.kwargs["end"]
    v = value(node)
    if not isinstance(v, torch.Tensor) or v.dim() != 1 or _const(step) != 1 or not isinstance(_const(start), int):
        return None
    offset = _const(start)
    end = value(end) if isinstance(end, fx.Node) else end
    return offset if same_size(end - offset, ctx.seq_len) else None


def _const(x):
    v = value(x) if isinstance(x, fx.Node) else x
    return v if isinstance(v, (int, float)) else None


def _feeds_comparison(node: fx.Node) -> bool:
    """Whether the index reaches a comparison (mask building) through views and offsets."""
    stack, seen = [node], set()
    while stack:
        n = stack.pop()
        for u in n.users:
            if u in seen:
                continue
            seen.add(u)
            if is_call(u, _COMPARISONS, _COMPARISON_METHODS):
                return True
            if is_call(u, _PASS_THROUGH, _PASS_THROUGH_METHODS):
                stack.append(u)
    return False


def _table_slice_dim(node: fx.Node, ctx: PassContext) -> int | None:
    """The dim ``d`` if ``node`` is ``table[..., :S, ...]`` on a constant table, else None."""
    table, index = node.args
    if not isinstance(table, fx.Node) or table.op != "placeholder" or table in (ctx.input_ids, ctx.positions):
        return None
    tv = value(table)
    if not isinstance(tv, torch.Tensor):
        return None
    index = index if isinstance(index, tuple) else (index,)
    if any(i is Ellipsis for i in index) or len(index) > tv.dim():
        return None
    sliced = []
    for d, i in enumerate(index):
        if not isinstance(i, slice):
            return None
        if i == slice(None):
            continue
        if i.start not in (None, 0) or i.step not in (None, 1) or not same_size(i.stop, ctx.seq_len):
            return None
        sliced.append(d)
    # Exactly one dim cut to S: a [:S, :S] cut is a mask, not a position table.
    if len(sliced) != 1 or same_size(tv.shape[sliced[0]], ctx.seq_len):
        return None
    return sliced[0]
