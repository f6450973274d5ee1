"""A fixed causal mixing matrix over the sequence becomes a path scan.

``M @ x`` where ``M`` is ``[.., S, S]`` built from sizes and constants only (no token, no
parameter), zero above the diagonal and, in each row, one value ``r(i)`` at and below it:
OpenNMT's Average Attention (``tril(ones(T, T)) / arange(1, T + 1)[:, None] @ x``, a running
mean), ``tril(ones(T, T)) @ x`` (a running sum). Per path, row ``i`` is ``r(i)`` times the sum
of the path's first ``i + 1`` rows. On the tree that is ``r`` at the row's position times the
running sum along its root path (``treecompile::path_scan``, O(S log depth)); the matrix
itself is no longer built.

The matrix must be built from sizes and constants alone (not from a buffer, whose values may
change between calls), and is judged as a structural mask is (`treecompile.passes._mask_eval`): evaluated at
the length the wrapper asks for (or the example length) and at half of it, it must be causal
with one value per row below the diagonal, the same at both lengths (``1 / T`` would differ:
per path ``T`` is the path's length). ``r`` is read from that evaluation, a constant table
that holds for paths up to the length it was judged at (`PassContext.max_rows`: a longer path
compiles again). A learned matrix (gMLP's ``W[:T, :T]``) reads a parameter and is left to the
verify pass.

Counter (``ctx.counters["rewrite_attention_pass"]``): ``mixing``.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import fx

from treecompile.kernels.scans import path_scan as _path_scan  # noqa: F401  (registers treecompile::path_scan)
from treecompile.passes._graph import MATMUL, PassContext, ancestors, describe, is_call, same_size, source_of, value
from treecompile.passes._mask_eval import depends_on_inputs, evaluate, judged_length

__all__ = ["rewrite_mixing"]


def rewrite_mixing(gm: fx.GraphModule, ctx: PassContext, node: fx.Node) -> bool | None:
    """Replaces ``M @ x`` with a fixed causal mixing matrix ``M`` (module docstring) by
    ``r[positions] * path_cumsum(x)``, or leaves a note where ``M`` is structural but not
    such a matrix; False (declined) where ``M`` reads a token or a parameter."""
    from treecompile.passes.conv_context import NeedsStructure

    if len(node.args) < 2:
        return False
    m, x = node.args[:2]
    if not (is_call(node, MATMUL, ("matmul", "bmm")) and _mixes_rows(ctx, m, x)) or depends_on_inputs(ctx, m):
        return False
    if any(n.op == "placeholder" and isinstance(value(n), torch.Tensor) for n in ancestors(m)):
        # Built from a buffer (or another tensor input): its values may change between calls,
        # and the table read from them would not.
        ctx.notes[node] = "a fixed [S, S] matrix times the rows whose matrix reads a buffer or another tensor input"
        return None
    judged = _judge(ctx, m)
    if isinstance(judged, str):
        ctx.notes[node] = f"a fixed [S, S] matrix times the rows whose matrix is {judged}"
        return None
    if ctx.pred_index is None:
        raise NeedsStructure(
            f"treecompile cannot make this model exact on a tree: {describe(node)} sums the rows before each row, "
            f"and this call has no path structure to sum them along (a streamed or context-parallel call).\n"
            f"  at {source_of(node)}")
    g = gm.graph
    xv, out = value(x), value(node)
    rates = judged.to(out.dtype)
    with g.inserting_before(node):
        table = ctx.mark(g.call_function(torch.tensor, (rates.tolist(),), {"dtype": out.dtype,
                                                                            "device": out.device}), like=node)
        table.meta["example_value"] = rates
        rate = ctx.mark(g.call_function(torch.index_select, (table, -1, ctx.positions)), like=node)
        rate = ctx.mark(g.call_method("unsqueeze", (rate, -1)), like=node)
        scan = ctx.mark(g.call_function(torch.ops.treecompile.path_scan.default,
                                        (x, xv.dim() - 2, ctx.pred_index, ctx.node_table, "cumsum")), like=node)
        sums = ctx.mark(g.call_function(operator.getitem, (scan, 0)), like=node)
        sums.meta["example_value"] = xv
        new = ctx.mark(g.call_function(operator.mul, (rate, sums)), like=node)
        if xv.dtype != out.dtype:
            new = ctx.mark(g.call_method("to", (new, out.dtype)), like=node)
    new.meta["example_value"] = out
    node.replace_all_uses_with(new)
    gm.graph.erase_node(node)
    ctx.count("mixing")
    return None


def _mixes_rows(ctx: PassContext, m: Any, x: Any) -> bool:
    """``m`` is ``[.., S, S]`` and ``x`` has its rows at dim -2 (``m @ x`` sums over the rows)."""
    mv, xv = value(m) if isinstance(m, fx.Node) else None, value(x) if isinstance(x, fx.Node) else None
    if not (isinstance(mv, torch.Tensor) and isinstance(xv, torch.Tensor) and mv.dim() >= 2 and xv.dim() >= 2):
        return False
    return all(same_size(d, ctx.seq_len) for d in (mv.shape[-1], mv.shape[-2], xv.shape[-2])) and \
        mv.is_floating_point()


def _judge(ctx: PassContext, m: fx.Node) -> torch.Tensor | str:
    """``r``, ``[.., L]`` (``M``'s key column 0 evaluated at length ``L``), if ``m`` is a fixed
    causal matrix with one value per row below the diagonal whose rows do not change with the
    length; else why not."""
    if not isinstance(ctx.seq_len, torch.SymInt) or ctx.seq_len.node.hint is None:
        return "judged at one length only (the sequence length is a constant)"
    rows = int(judged_length(ctx) or ctx.seq_len.node.hint)
    try:
        long = evaluate(ctx, m, rows=rows)
        short = evaluate(ctx, m, rows=max(2, rows // 2))
    except Exception as e:  # a matrix that cannot be built alone, or at another length
        return f"not evaluated alone ({type(e).__name__})"
    for ev in (long, short):
        if ev.dim() < 2 or ev.shape[-1] != ev.shape[-2]:
            return f"of shape {tuple(ev.shape)}, not [.., S, S]"
        s = ev.shape[-1]
        above = torch.ones(s, s, dtype=torch.bool, device=ev.device).triu(1)
        if torch.any(ev.masked_fill(~above, 0) != 0):
            return "not zero above the diagonal (it reads later rows)"
        if not torch.equal(ev.masked_fill(above, 0), ev[..., :, :1].expand_as(ev).masked_fill(above, 0)):
            return "not one value per row below the diagonal"
    n = short.shape[-1]
    if not torch.equal(short[..., :, 0], long[..., :n, 0]):
        return "different at another length (computed from the sequence length, as 1 / T)"
    ctx.max_rows = rows if ctx.max_rows is None else min(ctx.max_rows, rows)
    return long[..., :, 0]
