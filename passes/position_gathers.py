"""A gather along the sequence at computed indices becomes a gather of ancestors on the path.

Per path, an index ``v`` along the sequence is a position: ``x.gather(1, v)`` gives row ``t`` the
path's row at position ``v[t]`` (the last separator's state, ``cummax`` of the separators'
positions; a token shift ``x[:, (arange(T) - 1).clamp(min=0)]``). Where ``v[t] <= position[t]`` that
row is ``t``'s own ancestor at depth ``v[t]``, one row of the packed row on the tree:
``treecompile::ancestor_rows`` finds it by binary lifting over ``pred_index`` (the ``2**k``-th
ancestors, O(S log S) work and memory, no ``[S, S]``), and the gather reads it. A later position
(``v[t] > position[t]``) is a row after ``t`` on the path, which the tree does not have once the
path branches: the batch is refused (`BatchRefused`), as is a negative index.

The rule takes ``gather``, ``take_along_dim``, ``index_select`` and ``x[:, idx]`` along the rows with
one index per row (the index's own rows at the same dim, of the row count); the index's values are judged by
the row rules as any other row value (the positions it is built from are the tree's, after the
positions pass; a scan along the rows is a path scan). An index that reads an ``arange`` over the
rows left as a row index (the identity gather, ``x[:, arange(T)]``) is not a position, nor are the
indices of a mixture of experts' dispatch (`treecompile.passes.moe.region_nodes`): left to the row
and expert rules; so are tables over positions the positions pass keeps (``ctx.off_rows``), whose
entries are positions, not rows. Needs the path structure (not streamed or context-parallel: `NeedsStructure`).
Counter ``position_gather`` of ``rewrite_conv_context_pass``.
"""

from __future__ import annotations

import operator
from typing import Callable

import torch
from torch import Tensor, fx

from treecompile.core.errors import BatchRefused
from treecompile.passes._graph import ARANGE, PassContext, ancestors, is_call, location_of, same_size, value

__all__ = ["rewrite_position_gathers", "ancestor_rows"]


@torch.library.custom_op("treecompile::ancestor_rows", mutates_args=())
def ancestor_rows(index: Tensor, dim: int, positions: Tensor, pred_index: Tensor, path_count: Tensor,
                  where: str) -> Tensor:
    """For each entry of ``index`` (an ``[.., S, ..]`` integer tensor, its rows at ``dim``): the
    row of the packed row that is the entry's row's ancestor (or itself) at path position
    ``index``. Raises `BatchRefused` naming ``where`` if an index is negative or after its row's
    own position on a row some path goes through (``path_count``; a padding row reads itself)."""
    nd = index.dim()
    d = dim % nd
    rows = torch.arange(index.shape[d], device=index.device).view([-1 if k == d else 1 for k in range(nd)])
    rows = rows.expand(index.shape)
    want = index.to(torch.int64)
    own = positions.to(torch.int64)[rows]
    trained = path_count[rows] > 0
    want = torch.where(trained, want, own)
    bad = (want < 0) | (want > own)
    if bool(bad.any()):
        raise BatchRefused(
            f"treecompile cannot run this batch exactly: the gather at {where} reads, for a row, the path's row at "
            f"position {int(want[bad].reshape(-1)[0])}, {'before the root' if bool((want[bad] < 0).any()) else 'after it'}"
            " (a later row on the path, which the tree does not hold once the path branches). Per path such an index "
            "is a row after the token; tree training only reads a token's ancestors.")
    pos = positions.to(torch.int64)
    up = pred_index.to(torch.int64)
    jumps = [up]
    while (1 << len(jumps)) < index.shape[d]:  # a path's depth is below the row count: no host read
        half = jumps[-1]
        jumps.append(torch.where(half >= 0, half[half.clamp(min=0)], half))
    r = rows.reshape(-1).clone()
    w = want.reshape(-1)
    for hop in reversed(jumps):
        cand = hop[r]
        move = (cand >= 0) & (pos[cand.clamp(min=0)] >= w)
        r = torch.where(move, cand, r)
    return r.view(index.shape).to(index.dtype)


@ancestor_rows.register_fake
def _ancestor_rows_fake(index, dim, positions, pred_index, path_count, where):
    return torch.empty_like(index)


def _gather_parts(n: fx.Node) -> tuple[fx.Node, int, fx.Node, int] | None:
    """``(x, dim, index, argument position of the index)`` of a gather-like node, else None."""
    if is_call(n, (torch.gather,), ("gather",)):
        dim = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim")
        if len(n.args) > 2:
            return n.args[0], dim, n.args[2], 2
        return None
    if is_call(n, (torch.take_along_dim,), ("take_along_dim",)) and len(n.args) >= 2:
        dim = n.args[2] if len(n.args) > 2 else n.kwargs.get("dim")
        return (n.args[0], dim, n.args[1], 1) if dim is not None else None
    if is_call(n, (torch.index_select,), ("index_select",)) and len(n.args) > 2:
        return n.args[0], n.args[1], n.args[2], 2
    if n.op == "call_function" and n.target is operator.getitem and isinstance(n.args[1], tuple):
        # ``x[:, idx]``: whole slices, then one index tensor (an ``index_select`` along that dim)
        *lead, last = n.args[1]
        if isinstance(last, fx.Node) and all(i == slice(None) for i in lead):
            return n.args[0], len(lead), last, -1
    return None


def rewrite_position_gathers(gm: fx.GraphModule, ctx: PassContext,
                             no_structure: Callable[[fx.Node], None]) -> None:
    """Reads each gather along the rows at positions from the row's ancestors (module docstring)."""
    from treecompile.passes.moe import region_nodes

    g = gm.graph
    experts = region_nodes(gm, ctx.seq_len)  # their gathers dispatch tokens to experts: row indices
    for n in list(g.nodes):
        if n in ctx.created or n in experts:
            continue
        parts = _gather_parts(n)
        if parts is None:
            continue
        x, dim, index, at = parts
        xv, iv = value(x), value(index) if isinstance(index, fx.Node) else None
        if not (isinstance(dim, int) and isinstance(xv, torch.Tensor) and isinstance(iv, torch.Tensor)
                and not iv.is_floating_point() and iv.dtype != torch.bool and xv.dim() > 0):
            continue
        select = is_call(n, (torch.index_select,), ("index_select",)) or at == -1
        idim = 0 if select else dim % iv.dim() if iv.dim() else None
        if idim is None or not same_size(xv.shape[dim], ctx.seq_len) or (select and iv.dim() != 1) \
                or not same_size(iv.shape[idim], ctx.seq_len):
            continue
        if sum(same_size(d, ctx.seq_len) for d in (*xv.shape, *iv.shape)) != 2:
            continue  # rows at one dim of each, no [S, S] tensor (a gather over keys is not over rows)
        if any(is_call(a, ARANGE) for a in ancestors(index)) or is_call(index, ARANGE):
            continue  # a row index left as one (the identity): the row rules judge it
        if x in ctx.off_rows:
            continue  # a table over positions (read at positions), or a pass's table: no rows to follow
        if ctx.pred_index is None:
            no_structure(n)
        with g.inserting_before(n):
            counts = ctx.path_count if ctx.path_count is not None else \
                ctx.mark(g.call_function(torch.ones_like, (ctx.positions,)), like=n)
            rows = ctx.mark(g.call_function(torch.ops.treecompile.ancestor_rows.default,
                                            (index, idim, ctx.positions, ctx.pred_index, counts, location_of(n))),
                            like=n)
        rows.meta["example_value"] = iv
        args = list(n.args)
        if at == -1:
            args[1] = (*args[1][:-1], rows)
        else:
            args[at] = rows
        n.args = tuple(args)
        ctx.mark(n)
        ctx.count("position_gather")
