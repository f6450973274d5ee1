"""Tables over the rows, judged by building them at two lengths.

A model may build a per-token table from the row index by a spelling no other rule names:
RWKV-5's matrix form raises a decay to ``arange(T - 1, -1, -1)`` and flips the result along
time (``w ** t``, the decay of the initial state at token ``t``); others count positions
backwards, or through ``repeat``, ``pow`` and ``reshape``. What such a table means per path
depends on whether its entry ``t`` depends on the length: ``w ** t`` does not, ``w ** (T - 1 - t)``
(the decay to the end) and centred positions (``arange(-T // 2, T - T // 2)``) do.

**The rule.** A tensor that reads no token (built from sizes, constants, buffers and
parameters), has one dim over the rows, is built from an ``arange`` over the rows or a count
along them (``ones(T).cumsum(0)``), and is read by token ops element-wise, is built again (the
model's own ops, on the pass's nodes) at the judged length and at half of it, with the example
parameters and with every parameter moved (`treecompile.passes._mask_eval.moved_parameters`).
Where the short table is the first half of the long one at both, entry ``t`` is a function of
``t`` alone: each token reads the entry at its path position, ``table.index_select(dim,
positions)``, which is what its path computes. A table that changes with the length is left
alone (the verify pass refuses its ``arange``, naming the table); so is one read other than
element-wise (as an index, or reduced over the rows).
Counter ``row_table`` of ``rewrite_positions_pass``; the graph is compiled again for paths
longer than the judged length (`PassContext.max_rows`).
"""

from __future__ import annotations

import torch
from torch import fx

from treecompile.passes._graph import ARANGE, PassContext, describe, is_call, mutated_args, same_size, value
from treecompile.passes._mask_eval import (copy_values, depends_on_inputs, evaluate, judged_length,
                                          moved_parameters, token_readers, value_ancestors)
from treecompile.passes._subgraph_run import equal_with_nans
from treecompile.passes.rows.domain import op_key, split_inplace
from treecompile.passes.rows.elementwise import POINTWISE

__all__ = ["changes_with_length", "rewrite_row_tables"]

#: Ops through which a token reads a table entry by entry (the table broadcast against the rows).
_ELEMENTWISE = POINTWISE | {"add", "sub", "mul", "neg", "pow", "where", "masked_fill", "iadd", "isub", "imul",
                            "itruediv"}
#: Ops that count along the rows (a table built from them reads the row index).
_COUNTS = {"arange", "linspace", "logspace", "cumsum", "cumprod"}


def rewrite_row_tables(gm: fx.GraphModule, ctx: PassContext) -> None:
    """Reads each table over the rows that does not change with the length at path positions."""
    if not (isinstance(ctx.seq_len, torch.SymInt) and ctx.seq_len.node.hint is not None):
        return
    tokens = token_readers(ctx, gm.graph)
    for node in list(gm.graph.nodes):
        dim = _candidate(node, ctx, tokens)
        if dim is None:
            continue
        why = changes_with_length(ctx, node, dim)
        if why is not None:
            said = f"builds {describe(node)}, a table over the rows {why}"
            for n in value_ancestors(node):
                if _row_index(n, ctx) and n not in ctx.notes:
                    ctx.notes[n] = said
            continue
        g = gm.graph
        readers = [u for u in node.users if u not in ctx.created and u in tokens]
        order = {n: i for i, n in enumerate(g.nodes)}
        with g.inserting_before(min(readers, key=order.get)):
            built = copy_values(ctx, g, node)
            read = ctx.mark(g.call_function(torch.index_select, (built, dim, ctx.positions)), like=node)
        read.meta["example_value"] = value(node)
        for u in readers:
            u.replace_input_with(node, read)
        ctx.count("row_table")


def _candidate(node: fx.Node, ctx: PassContext, tokens: set[fx.Node]) -> int | None:
    """The rows' dim of ``node`` if it is a table over the rows built from the row index and
    read by token ops element-wise only (``tokens``: the nodes that read the tokens), else None."""
    if node.op not in ("call_function", "call_method") or node in ctx.created or mutated_args(node):
        return None
    v = value(node)
    if not isinstance(v, torch.Tensor):
        return None
    dims = [d for d in range(v.dim()) if same_size(v.shape[d], ctx.seq_len)]
    if len(dims) != 1 or node in tokens:
        return None
    readers = [u for u in node.users if u not in ctx.created and u in tokens]
    if not readers or any(split_inplace(op_key(u))[0] not in _ELEMENTWISE or node in mutated_args(u)
                          for u in readers):
        return None
    built_from = value_ancestors(node) | {node}
    if not any(_row_index(n, ctx) for n in built_from):
        return None
    return dims[0]


def _row_index(n: fx.Node, ctx: PassContext) -> bool:
    """An ``arange`` over the rows, or a count along them (``ones(T).cumsum(0)``): what a table
    over the rows is built from."""
    v = value(n)
    return n not in ctx.created and isinstance(v, torch.Tensor) and \
        any(same_size(d, ctx.seq_len) for d in v.shape) and \
        (is_call(n, ARANGE) or split_inplace(op_key(n))[0] in _COUNTS)


def changes_with_length(ctx: PassContext, node: fx.Node, dim: int) -> str | None:
    """None where ``node`` built at half the judged length is the first half of it built at the
    judged length, with the example parameters and with them moved; else why it is not read as a
    table of positions."""
    long = judged_length(ctx) or int(ctx.seq_len.node.hint)
    short = max(2, long // 2)
    if short >= long:
        return "that cannot be judged at this length (too short to build at half of it)"

    def disagree() -> str | None:
        try:
            a, b = (evaluate(ctx, node, rows=r) for r in (long, short))
        except Exception as e:  # not buildable at another length (a tensor input of the row count)
            return f"that cannot be built at another length ({type(e).__name__})"
        if a.shape[dim] != long or b.shape[dim] != short or a.dim() != b.dim() or \
                any(x != y for i, (x, y) in enumerate(zip(a.shape, b.shape)) if i != dim):
            return "whose other dims change with the sequence length"
        if not equal_with_nans(a.narrow(dim, 0, short), b):
            return ("whose entries change with the sequence length (built at half the length it is not the first "
                    "half), so a token's entry depends on its path's length")
        return None

    why = disagree()
    if why is None and depends_on_inputs(ctx, node):
        with moved_parameters(ctx):
            why = disagree()
    if why is None:
        ctx.max_rows = long if ctx.max_rows is None else min(ctx.max_rows, long)
    return why
