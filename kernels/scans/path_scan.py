"""Running sums along each token's root path (RoBERTa-style positions on a tree).

A model that numbers its tokens with a running sum over the sequence
(``cumsum(input_ids != pad) + pad``, RoBERTa's ``create_position_ids_from_input_ids``,
fairseq's ``make_positions``) counts, on a path, the tokens before it on that path. On a
packed tree row those are the row's ancestors-or-self: the rows ``k <= r`` whose subtree
still contains ``r`` (``subtree_end[k] > r``). So

    path_cumsum(x)[r] = sum(x[k] for k <= r) - sum(x[k] for k with subtree_end[k] <= r)

(every row whose subtree ended at or before ``r`` lies before ``r``): two running sums,
O(S). Exact for integer and boolean inputs (the only ones the positions pass rewrites);
floating-point sums would cancel large partial sums, so they are left refused.

The definitions, written plainly, are `path_cumsum_reference` and `path_scan_reference` in
:mod:`treecompile.kernels.scans.naive`.
"""

from __future__ import annotations

import torch

__all__ = ["path_cumsum", "path_scan", "PATH_SCANS"]


def path_cumsum(x: torch.Tensor, dim: int, subtree_end: torch.Tensor) -> torch.Tensor:
    """``x.cumsum(dim)`` along each row's root path (``x`` integer or bool, ``x.shape[dim] == S``).

    Args:
        x: ``[..., S, ...]`` with the rows on ``dim``.
        dim: the rows' dim.
        subtree_end: ``[S]`` exclusive end row of each row's subtree.

    Returns:
        ``[..., S, ...]`` int64 (as ``cumsum`` of an integer tensor).
    """
    xs = x.movedim(dim, -1).to(torch.int64)
    s = xs.shape[-1]
    ended = xs.new_zeros(*xs.shape[:-1], s + 1).index_add_(-1, subtree_end.to(torch.int64), xs)
    out = xs.cumsum(-1) - ended.cumsum(-1)[..., :s]
    return out.movedim(-1, dim)


# --------------------------------------------------------------------------- any scan, any dtype
#
# ``cumsum`` / ``cumprod`` / ``logcumsumexp`` / ``cummax`` / ``cummin`` of floating-point
# values along each row's root path, by pointer jumping: after level ``l`` each row holds the
# scan of itself and its ``2**l - 1`` nearest ancestors (all of them if fewer), so
# ``ceil(log2(depth))`` levels of one gather and one combine each give the whole root path:
# O(S log depth), every partial result an honest partial scan (no difference of large sums,
# which would cancel in floating point). ``depth`` is read from the node table on the host.

#: The scans `path_scan` runs: name -> (combine(earlier, later), for the arg scans the
#: comparison that keeps the later element, as torch's own keeps the last of equal ones).
PATH_SCANS = {
    "cumsum": (torch.add, None),
    "cumprod": (torch.mul, None),
    "logcumsumexp": (torch.logaddexp, None),
    "cummax": (None, torch.ge),
    "cummin": (None, torch.le),
}


def _max_depth(node_table: torch.Tensor | None, s: int) -> int:
    """The longest root path in tokens, from the ``[N, 3]`` CPU node table (start, end, parent;
    parents before children), or ``s`` without one."""
    if node_table is None or node_table.numel() == 0:
        return s
    depth: list[int] = []
    for start, end, parent in node_table.tolist():
        depth.append((depth[parent] if parent >= 0 else 0) + end - start)
    return max(depth)


def _jumps(pred_index: torch.Tensor, levels: int) -> list[torch.Tensor]:
    """``[pred, 2nd ancestor, 4th ancestor, ...]`` row indices, -1 past the root."""
    out, j = [], pred_index.to(torch.int64)
    for _ in range(levels):
        out.append(j)
        j = torch.where(j >= 0, j.index_select(0, j.clamp(min=0)), j)
    return out


def _scan_rows(xs: torch.Tensor, pred_index: torch.Tensor, node_table: torch.Tensor | None, op: str
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(values, rows)`` of the scan of ``xs`` ``[S, ...]`` along each row's root path (``rows``:
    for cummax / cummin, the row each value comes from; else None). Differentiable."""
    combine, keep_later = PATH_SCANS[op]
    s = xs.shape[0]
    levels = max(_max_depth(node_table, s) - 1, 0).bit_length()
    shape = (s,) + (1,) * (xs.dim() - 1)
    val = xs
    rows = torch.arange(s, device=xs.device).view(shape).expand(xs.shape) if keep_later is not None else None
    for j in _jumps(pred_index, levels):
        has = (j >= 0).view(shape)
        at = j.clamp(min=0)
        earlier = val.index_select(0, at)
        if keep_later is None:
            val = torch.where(has, combine(earlier, val), val)
        else:
            later = keep_later(val, earlier) | ~has
            rows = torch.where(later, rows, rows.index_select(0, at))
            val = torch.where(later, val, earlier)
    if rows is not None:
        val = xs.gather(0, rows)  # the same values, with the gradient going to the row they come from
    return val, rows


def _scan_rows_backward(xs: torch.Tensor, g: torch.Tensor, pred_index: torch.Tensor,
                        node_table: torch.Tensor | None, op: str) -> torch.Tensor:
    """The gradient of `_scan_rows`'s values with respect to ``xs`` ``[S, ...]``, given theirs."""
    combine, keep_later = PATH_SCANS[op]
    if keep_later is not None:
        _, rows = _scan_rows(xs, pred_index, node_table, op)
        return torch.zeros_like(xs).scatter_add_(0, rows, g)
    s = xs.shape[0]
    shape = (s,) + (1,) * (xs.dim() - 1)
    jumps = _jumps(pred_index, max(_max_depth(node_table, s) - 1, 0).bit_length())
    vals = [xs]
    for j in jumps:  # the forward's levels, kept
        has = (j >= 0).view(shape)
        vals.append(torch.where(has, combine(vals[-1].index_select(0, j.clamp(min=0)), vals[-1]), vals[-1]))
    for level in reversed(range(len(jumps))):
        j, v, out = jumps[level], vals[level], vals[level + 1]
        has = (j >= 0).view(shape)
        at = j.clamp(min=0)
        earlier = v.index_select(0, at)
        if op == "cumsum":  # out = earlier + v
            d_earlier, d_v = g, g
        elif op == "cumprod":  # out = earlier * v
            d_earlier, d_v = g * v, g * earlier
        else:  # logcumsumexp: out = logaddexp(earlier, v); nothing flows where both are -inf
            dead = out == float("-inf")
            d_earlier = torch.where(dead, 0.0, g * torch.exp(earlier - out))
            d_v = torch.where(dead, 0.0, g * torch.exp(v - out))
        g = torch.where(has, d_v, g).index_add(0, at, torch.where(has, d_earlier, torch.zeros_like(d_earlier)))
    return g


@torch.library.custom_op("treecompile::path_scan", mutates_args=())
def path_scan(x: torch.Tensor, dim: int, pred_index: torch.Tensor, node_table: torch.Tensor | None, op: str
              ) -> list[torch.Tensor]:
    """The scan ``op`` (a key of `PATH_SCANS`) of ``x`` along each row's root path.

    Args:
        x: ``[..., S, ...]`` with the rows on ``dim``.
        dim: the rows' dim.
        pred_index: ``[S]`` each row's predecessor on its path (-1 at a root).
        node_table: ``[N, 3]`` CPU node table (its depth bounds the levels), or None.
        op: ``cumsum``, ``cumprod``, ``logcumsumexp``, ``cummax`` or ``cummin``.

    Returns:
        ``[values]``, or for cummax / cummin ``[values, rows]`` (the row each value comes from).
    """
    val, rows = _scan_rows(x.movedim(dim, 0), pred_index, node_table, op)
    out = [val.movedim(0, dim).contiguous()]
    if rows is not None:
        out.append(rows.movedim(0, dim).contiguous())
    return out


@path_scan.register_fake
def _path_scan_fake(x, dim, pred_index, node_table, op):
    out = [torch.empty_like(x)]
    if PATH_SCANS[op][1] is not None:
        out.append(torch.empty_like(x, dtype=torch.int64))
    return out


def _path_scan_setup(ctx, inputs, output):
    x, dim, pred_index, node_table, op = inputs
    ctx.save_for_backward(x, pred_index)
    ctx.node_table, ctx.dim, ctx.op = node_table, dim, op


@torch.library.custom_op("treecompile::path_scan_backward", mutates_args=())
def path_scan_backward(grad: torch.Tensor, x: torch.Tensor, dim: int, pred_index: torch.Tensor,
                       node_table: torch.Tensor | None, op: str) -> torch.Tensor:
    """The gradient of `path_scan`'s values with respect to ``x``: the levels recomputed, then
    walked back, each level's gather becoming a scatter-add into the ancestor (no large sums
    cancel in the backward either); for cummax / cummin, the gradient goes to the row each
    value comes from."""
    return _scan_rows_backward(x.movedim(dim, 0), grad.movedim(dim, 0), pred_index, node_table, op).movedim(0, dim)


@path_scan_backward.register_fake
def _path_scan_backward_fake(grad, x, dim, pred_index, node_table, op):
    return torch.empty_like(x)


def _path_scan_backward(ctx, grads):
    x, pred_index = ctx.saved_tensors
    g = grads[0]
    if g is None or not x.dtype.is_floating_point:
        return None, None, None, None, None
    gx = torch.ops.treecompile.path_scan_backward(g.contiguous(), x, ctx.dim, pred_index, ctx.node_table, ctx.op)
    return gx, None, None, None, None


path_scan.register_autograd(_path_scan_backward, setup_context=_path_scan_setup)
