"""Mamba's selective scan (Mamba-1, S6) on a sequence and on a tree.

Per batch row, channel ``d`` and state index ``n``, with the state ``h`` ``[D, N]``:

    h_t[d, n] = exp(dt_t[d] * A[d, n]) * h_{t-1}[d, n] + u_t[d] * B_t[n]     # decay, write
    y_t[d]    = sum_n h_t[d, n] * C_t[n]                                      # read

Mamba's layer (Gu and Dao, 2023) writes ``u = dt * x``: its step ``dt`` (after bias and
softplus) both sets the decay and scales the input ``x``. The scan here takes the write
``u`` as an input of its own, so that a row with ``dt = 0`` writes without decaying; the
``D * x`` skip and the ``silu(z)`` gate act on each row alone and stay outside (see
:func:`treecompile.capture.drop_ins.hf_mamba_selective_scan`). Unlike Mamba2's scan the decay differs
along the state (``A`` is ``[D, N]``), so it is not a scalar-gated recurrence of
:mod:`treecompile.kernels.scans.recurrence`; it is gated linear attention with one head per
channel, ``Dk = N`` and ``Dv = 1``, which is how streamed parts keep its state (``[D, N, 1]``).

* `selective_scan_reference` (in :mod:`treecompile.kernels.scans.naive`): that loop, token by token,
  the definition a reader can check by eye.
* `chunked_selective_scan`: the same map in ``O(sqrt(S))`` sequential steps, differentiable.
  The rows are cut into ``L`` chunks of ``L`` rows (``L = ceil(sqrt(S))``); every chunk runs
  from the zero state at once (``L`` steps over all chunks together), keeping the decay
  from its start to each row; then the chunks' start states follow in ``S / L`` steps, and
  each row adds its chunk's start state times that decay. Products and sums only, as in
  the loop (no division by a decay, no exp of a positive number). Zero rows (``u = dt = B
  = C = 0``) leave the state bit-for-bit unchanged (``exp(0) = 1``, the write is ``0``), so
  padding a sequence at its end with them is exact.
* `tree_selective_scan`: the scan on a packed tree. Each tree node's rows run from its
  *parent node's final state* (roots from the call's initial state, or zeros), nodes of
  one depth together as one zero-padded batch (split where lengths differ widely, as
  :func:`treecompile.kernels.scans.recurrence.tree_recurrence` does), so the sequential steps
  follow how deep the tree is in nodes. Siblings read the same parent state tensor, so
  autograd sums their gradients into it, as it does per path.

Memory: ``O(S * D * N)`` (the states of every row, as Hugging Face's torch fallback holds its
discretised ``A`` and ``B * x``); nothing is ``O(S^2)``. The ops (:mod:`treecompile.kernels.scans.mamba`)
compute in at least float32. Shapes: ``u, dt`` ``[B, S, D]``, ``A`` ``[D, N]``, ``B, C``
``[B, S, N]``, states ``[B, D, N]``; ``node_table`` ``[M, 3]`` int64 (start row, end row,
parent node in preorder, -1 for a root), on the CPU. The tree form takes one packed row.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from treecompile.kernels.scans.recurrence import CHUNK, node_levels, padding_groups

__all__ = ["chunked_selective_scan", "tree_selective_scan"]

Tensor = torch.Tensor


def chunked_selective_scan(
    u: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, initial_state: Tensor | None = None, *,
    chunk: int | None = None,
) -> tuple[Tensor, Tensor]:
    """The selective scan in ``chunk + S / chunk`` sequential steps, differentiable, in the inputs' dtype.

    Args:
        u, dt: ``[B, S, D]`` the write (``dt * x`` in Mamba) and the step.
        A: ``[D, N]`` the (negative) continuous decay rates.
        B, C: ``[B, S, N]`` the write and read vectors.
        initial_state: ``[B, D, N]`` or None (zeros).
        chunk: rows per chunk, default ``ceil(sqrt(S))`` (fewest sequential steps).

    Returns:
        ``(y [B, S, D], final [B, D, N])``.
    """
    b, s, d = u.shape
    n = A.shape[-1]
    h0 = u.new_zeros(b, d, n) if initial_state is None else initial_state.to(u.dtype)
    if s == 0:
        return u.new_zeros(b, 0, d), h0
    size = chunk or math.isqrt(s - 1) + 1
    pad = (-s) % size
    # [B, c, L, D] and [B, c, L, N]; the zero rows at the end are exact no-ops.
    u, dt = (torch.nn.functional.pad(x, (0, 0, 0, pad)).unflatten(1, (-1, size)) for x in (u, dt))
    B, C = (torch.nn.functional.pad(x, (0, 0, 0, pad)).unflatten(1, (-1, size)) for x in (B, C))
    # 1. Every chunk from the zero state, all chunks at once; ``reach``: the decay from the
    # chunk's start to each row (the product of the decays so far). [B, c, D, N] per step.
    h = u.new_zeros(b, u.shape[1], d, n)
    r = torch.ones_like(h)
    local, reach = [], []
    for t in range(size):
        decay = torch.exp(dt[:, :, t, :, None] * A)
        h = decay * h + u[:, :, t, :, None] * B[:, :, t, None, :]
        r = decay * r
        local.append(h)
        reach.append(r)
    # 2. Each chunk's start state: the previous chunk's, decayed over it, plus what it wrote.
    starts = [h0]
    for c in range(u.shape[1] - 1):
        starts.append(reach[-1][:, c] * starts[-1] + local[-1][:, c])
    start = torch.stack(starts, 1)[:, :, None]  # [B, c, 1, D, N]
    # 3. Each row's state, and what it reads.
    states = torch.addcmul(torch.stack(local, 2), torch.stack(reach, 2), start)  # [B, c, L, D, N]
    y = (states @ C[..., None]).squeeze(-1).flatten(1, 2)[:, :s]
    return y, states[:, -1, -1]


def tree_selective_scan(
    u: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, initial_state: Tensor | None, node_table: Tensor,
) -> Tensor:
    """The selective scan on a packed tree (one row, ``B = 1``), differentiable: ``y [1, S, D]``.

    Each depth level is one batch of its nodes' rows, right-padded with zero rows to the
    longest node of the level (split so that padding at most doubles its rows), started
    from the parents' final states.
    """
    if u.shape[0] != 1:
        raise ValueError(f"the tree selective scan runs one packed row, got a batch of {u.shape[0]}")
    s, d = u.shape[1:]
    root = u.new_zeros(d, A.shape[-1]) if initial_state is None else initial_state[0].to(u.dtype)
    table = node_table.cpu().numpy()
    start, end, parent = table[:, 0], table[:, 1], table[:, 2]
    # A zero row at index S for the padding.
    padded = [torch.cat([x[0], x.new_zeros(1, x.shape[-1])]) for x in (u, dt, B, C)]
    finals: list[Tensor | None] = [None] * len(table)
    rows_out, vals_out = [], []
    for level in node_levels(node_table):
        lengths = end[level] - start[level]
        init = torch.stack([root if parent[m] < 0 else finals[parent[m]] for m in level.tolist()])
        for group in padding_groups(lengths, CHUNK):
            width = int(lengths[group].max())
            offs = np.arange(width)[None, :]
            valid = offs < lengths[group][:, None]
            rows = np.where(valid, start[level][group][:, None] + offs, s)
            index = torch.from_numpy(rows).to(u.device, non_blocking=True)
            gu, gdt, gb, gc = (x[index] for x in padded)
            out, final = chunked_selective_scan(gu, gdt, A, gb, gc, init[torch.from_numpy(group).to(init.device)])
            rows_out.append(rows[valid])
            vals_out.append(out[torch.from_numpy(valid).to(u.device, non_blocking=True)])
            for i, m in enumerate(level[group].tolist()):
                finals[m] = final[i]
    order = np.argsort(np.concatenate(rows_out), kind="stable")
    return torch.cat(vals_out)[torch.from_numpy(order).to(u.device)][None]
