"""Attention without a softmax on the tree: ``out[q] = sum over kv of (scale * q.k) * D(q, kv) * v[kv]``.

Linear attention written in its parallel form (``(q @ k^T).masked_fill(~causal, 0) @ v``),
RetNet's parallel retention (``(q @ k^T * gamma ** (i - j) * causal) @ v``) and any such
product whose pair factor ``D`` is a causal function of the distance ``i - j`` sum over the
keys a query sees. On a path those are the tokens before it; on the packed tree row they
are its ancestors-or-self (``kv <= q < subtree_end[kv]``, the interval rule), at the path
distance ``positions[q] - positions[kv]``:

    out[q] = sum_{kv ancestor-or-self of q} scale * (q . k[kv]) * table[h, pos[q] - pos[kv]] * v[kv]

with ``table[h, d] = D(h, d)`` (a distance past the table's end reads its last entry: a
one-entry table is a constant factor). Normalised linear attention divides each query's sum
by the sum of its weights, ``den[q] = sum_kv w[q, kv]`` (``normalize`` 1: ``den + eps``; 2:
``den.clamp(min=eps)``), as ``(A @ v) / A.sum(-1, keepdim=True)`` does per path.

The sum runs in blocks of ``BLOCK`` queries over the rows that can hold an ancestor of the
block (``kv < end of block`` with ``subtree_end[kv] > start of block``): the work is that of the
tree's attention, the memory ``BLOCK x`` those rows per block, never ``[S, S]``. The backward
recomputes each block's products and returns the gradients of ``q``, ``k``, ``v`` and the tables
(a learned decay gets its gradient).

The dense definition is `tree_pair_sum_reference` in :mod:`treecompile.kernels.attention.naive`.
"""

from __future__ import annotations

import torch

__all__ = ["tree_pair_sum", "BLOCK"]

Tensor = torch.Tensor

#: Queries per block.
BLOCK = 128


def _blocks(s: int, subtree_end: Tensor):
    """Per query block ``(q0, q1, rows)``: the rows that can be an ancestor-or-self of a query in
    it. The row lists are found on the host from one copy of ``subtree_end`` (one device sync per
    call, not one per block), one block at a time (O(S) at once), each moved to the device from
    pinned memory without waiting."""
    ends = subtree_end.cpu()
    for q0 in range(0, s, BLOCK):
        q1 = min(s, q0 + BLOCK)
        rows = torch.nonzero(ends[:q1] > q0).squeeze(1)
        if subtree_end.is_cuda:
            rows = rows.pin_memory().to(subtree_end.device, non_blocking=True)
        yield q0, q1, rows


def _factor(table: Tensor, qtable: Tensor | None, positions: Tensor, subtree_end: Tensor, q0: int, q1: int,
            rows: Tensor):
    """``(D [L, C, R] zero off the tree, distances [C, R], seen [C, R], query factor [Lq, C, 1] or
    None)`` of one block."""
    qi = torch.arange(q0, q1, device=rows.device)
    seen = (rows[None, :] <= qi[:, None]) & (subtree_end[rows][None, :] > qi[:, None])
    dist = (positions[q0:q1, None] - positions[rows][None, :]).clamp(min=0, max=table.shape[-1] - 1)
    d = table[:, dist] * seen.to(table.dtype)
    qf = None
    if qtable is not None:
        qf = qtable[:, positions[q0:q1].clamp(max=qtable.shape[-1] - 1)][..., None]
        d = d * qf
    return d, dist, seen, qf


def _expand(x: Tensor, heads: int) -> Tensor:
    g = heads // x.shape[1]
    return x if g == 1 else x.repeat_interleave(g, 1)


def _fold(x: Tensor, kv_heads: int) -> Tensor:
    """Sums the query heads' gradients of a shared key/value head back onto it."""
    b, h = x.shape[:2]
    g = h // kv_heads
    return x if g == 1 else x.reshape(b, kv_heads, g, *x.shape[2:]).sum(2)


@torch.library.custom_op("treecompile::tree_pair_sum", mutates_args=())
def tree_pair_sum(q: Tensor, k: Tensor, v: Tensor, table: Tensor, positions: Tensor, subtree_end: Tensor,
                  scale: float, normalize: int = 0, eps: float = 0.0, high: float = 0.0,
                  qtable: Tensor | None = None) -> Tensor:
    """The tree sum (module docstring).

    Args:
        q: ``[B, H, S, Dk]``; k: ``[B, Hk, S, Dk]``; v: ``[B, Hk, S, Dv]`` (``H`` a multiple of ``Hk``).
        table: ``[L, T]`` with ``L`` 1 or ``H``: the pair factor at each distance.
        positions, subtree_end: ``[S]`` the rows' path positions and subtree ends.
        scale: the constant factor on ``q . k``.
        normalize, eps, high: 0: no denominator; 1: each query's sum divided by the sum of its
            weights plus ``eps``; 2: by that sum clamped below at ``eps``; 3: by the sum of the
            weights' magnitudes clamped to ``[eps, high]`` (``high`` 0: no upper bound), as a
            constant (no gradient: RetNet's
            ``qk / qk.detach().abs().sum(-1).clamp(min, max)``).
        qtable: ``[Lq, T]`` (``Lq`` 1 or ``H``) or None: a factor of the query's path position
            on every weight of the query (RetNet's decay mask scaled per row).

    Returns:
        ``[B, H, S, Dv]``.
    """
    h = q.shape[1]
    out = q.new_zeros(*q.shape[:-1], v.shape[-1])
    table = table.to(q.dtype)
    qtable = None if qtable is None else qtable.to(q.dtype)
    for q0, q1, rows in _blocks(q.shape[2], subtree_end):
        d = _factor(table, qtable, positions, subtree_end, q0, q1, rows)[0]
        kr, vr = _expand(k[:, :, rows], h), _expand(v[:, :, rows], h)
        w = (q[:, :, q0:q1] @ kr.transpose(-1, -2)) * scale * d
        out[:, :, q0:q1] = w @ vr
        if normalize:
            out[:, :, q0:q1] /= _denominator(w, normalize, eps, high)[1]
    return out


def _denominator(w: Tensor, normalize: int, eps: float, high: float) -> tuple[Tensor, Tensor]:
    """``(the weights' row sum, the denominator)`` of a normalised sum."""
    if normalize == 3:
        total = w.abs().sum(-1, keepdim=True)
        return total, total.clamp(min=eps, max=high if high > 0 else None)
    total = w.sum(-1, keepdim=True)
    return total, (total + eps if normalize == 1 else total.clamp(min=eps))


@tree_pair_sum.register_fake
def _tree_pair_sum_fake(q, k, v, table, positions, subtree_end, scale, normalize=0, eps=0.0, high=0.0,
                        qtable=None):
    return q.new_empty(*q.shape[:-1], v.shape[-1])


@torch.library.custom_op("treecompile::tree_pair_sum_backward", mutates_args=())
def tree_pair_sum_backward(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, table: Tensor, positions: Tensor,
                           subtree_end: Tensor, scale: float, normalize: int = 0, eps: float = 0.0,
                           high: float = 0.0,
                           qtable: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients of `tree_pair_sum` for ``q``, ``k``, ``v``, ``table`` and ``qtable`` (zeros of
    ``table``'s shape when there is none), each block's products recomputed."""
    h, hk = q.shape[1], k.shape[1]
    tab = table.to(q.dtype)
    qtab = None if qtable is None else qtable.to(q.dtype)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    dtable = torch.zeros(table.shape, dtype=q.dtype, device=q.device)
    dqtable = torch.zeros((qtable if qtable is not None else table).shape, dtype=q.dtype, device=q.device)
    grad = grad.to(q.dtype)
    for q0, q1, rows in _blocks(q.shape[2], subtree_end):
        d, dist, seen, qf = _factor(tab, qtab, positions, subtree_end, q0, q1, rows)
        kr, vr = _expand(k[:, :, rows], h), _expand(v[:, :, rows], h)
        qb, gb = q[:, :, q0:q1], grad[:, :, q0:q1]
        a = (qb @ kr.transpose(-1, -2)) * scale  # [B, H, C, R]
        w = a * d
        if normalize:  # out = (w @ v) / den: the sum's gradient over den, less the denominator's share
            total, den = _denominator(w, normalize, eps, high)
            gb = gb / den
            dw = gb @ vr.transpose(-1, -2)
            if normalize != 3:  # 3: the denominator is a constant
                dden = -(gb * (w @ vr)).sum(-1, keepdim=True) / den
                if normalize == 2:
                    dden = dden * (total >= eps).to(dden.dtype)
                dw = dw + dden
        else:
            dw = gb @ vr.transpose(-1, -2)
        dv.index_add_(2, rows, _fold(w.transpose(-1, -2) @ gb, hk))
        da = dw * d * scale
        dq[:, :, q0:q1] = da @ kr
        dk.index_add_(2, rows, _fold(da.transpose(-1, -2) @ qb, hk))
        # The tables' gradients: the pairs' dW * A summed over the batch (and the heads a table
        # row serves), by distance for the table and by the query's position for the query table.
        dd = (dw * a).sum(0) * seen.to(dw.dtype)  # [H, C, R]
        dist_part = dd if qf is None else dd * qf
        dist_part = dist_part.sum(0, keepdim=True) if tab.shape[0] == 1 else dist_part
        dtable.index_add_(1, dist.reshape(-1), dist_part.reshape(dist_part.shape[0], -1))
        if qf is not None:
            dcol = (dd * tab[:, dist]).sum(-1)  # [H, C]
            dcol = dcol.sum(0, keepdim=True) if qtab.shape[0] == 1 else dcol
            where = positions[q0:q1].clamp(max=qtab.shape[-1] - 1)
            dqtable.index_add_(1, where, dcol)
    return dq, dk, dv, dtable.to(table.dtype), dqtable.to((qtable if qtable is not None else table).dtype)


@tree_pair_sum_backward.register_fake
def _tree_pair_sum_backward_fake(grad, q, k, v, table, positions, subtree_end, scale, normalize=0, eps=0.0,
                                 high=0.0, qtable=None):
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(table),
            torch.empty_like(qtable if qtable is not None else table))


def _setup(ctx, inputs, output):
    q, k, v, table, positions, subtree_end, scale, normalize, eps, high, qtable = inputs
    ctx.save_for_backward(q, k, v, table, positions, subtree_end, qtable)
    ctx.options = (scale, normalize, eps, high)


def _backward(ctx, grad):
    q, k, v, table, positions, subtree_end, qtable = ctx.saved_tensors
    dq, dk, dv, dtable, dqtable = tree_pair_sum_backward(grad, q, k, v, table, positions, subtree_end, *ctx.options,
                                                         qtable)
    return dq, dk, dv, dtable, None, None, None, None, None, None, None if qtable is None else dqtable


tree_pair_sum.register_autograd(_backward, setup_context=_setup)
