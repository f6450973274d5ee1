"""The plain reference implementations of the scan family's kernels: the definitions a reader can
check by eye, used by the tests as the ground truth the fast kernels beside them are compared with.

* `recurrence_reference`: the scalar-gated recurrence of
  :mod:`treecompile.kernels.scans.recurrence`, token by token (O(S) sequential steps), and its
  two forms, `gated_delta_rule_reference` (Gated DeltaNet, :mod:`treecompile.kernels.scans.gdn`)
  and `ssd_scan_reference` (Mamba2's SSD, :mod:`treecompile.kernels.scans.mamba2`); with a gate
  per key channel, `channel_delta_rule_reference` (Kimi Delta Attention, :mod:`treecompile.kernels.scans.kda`)
  and `gla_scan_reference` (Gated Linear Attention, :mod:`treecompile.kernels.scans.gla`).
* `selective_scan_reference`: Mamba's selective scan
  (:mod:`treecompile.kernels.scans.selective_scan`), token by token.
* `path_cumsum_reference`: the running sum along each row's root path
  (:mod:`treecompile.kernels.scans.path_scan`), a loop over pairs of rows: O(S^2).
* `path_scan_reference`: any scan along each row's root path, each path gathered and scanned
  with torch's own op: O(S x depth), O(S^2) for a single path.

All run on a sequence (or a packed tree's rows) in the inputs' dtype, with no chunking.
"""

from __future__ import annotations

import torch

__all__ = ["channel_delta_rule_reference", "gated_delta_rule_reference", "gla_scan_reference", "path_cumsum_reference", "path_scan_reference", "recurrence_reference",
           "selective_scan_reference", "ssd_scan_reference"]

Tensor = torch.Tensor


def recurrence_reference(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor | None = None, *, delta: bool
) -> tuple[Tensor, Tensor]:
    """The recurrence token by token, in the inputs' dtype: ``(out [B, S, H, Dv], final [B, H, Dk, Dv])``."""
    b, s, h, dk = k.shape
    state = q.new_zeros(b, h, dk, v.shape[-1]) if initial_state is None else initial_state.to(q.dtype).clone()
    out = q.new_zeros(b, s, h, v.shape[-1])
    for t in range(s):
        # A gate per head [B, S, H] decays the whole state; one per key channel [B, S, H, Dk] its rows.
        state = state * (g[:, t].exp()[..., None] if g.dim() == k.dim() else g[:, t].exp()[..., None, None])
        written = v[:, t] - torch.einsum("bhkv,bhk->bhv", state, k[:, t]) if delta else v[:, t]
        state = state + k[:, t, :, :, None] * (beta[:, t, :, None] * written)[:, :, None, :]
        out[:, t] = torch.einsum("bhkv,bhk->bhv", state, q[:, t])
    return out, state


def gated_delta_rule_reference(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """The gated delta rule, token by token, in the inputs' dtype: ``(out [B, S, H, Dv], final [B, H, Dk, Dv])``."""
    return recurrence_reference(q, k, v, g, beta, initial_state, delta=True)


def channel_delta_rule_reference(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Kimi Delta Attention (the delta rule with ``g`` ``[B, S, H, Dk]``, a decay per key
    channel), token by token: ``(out [B, S, H, Dv], final [B, H, Dk, Dv])``."""
    return recurrence_reference(q, k, v, g, beta, initial_state, delta=True)


def gla_scan_reference(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Gated Linear Attention (the plain form with ``g`` ``[B, S, H, Dk]``, a decay per key
    channel), token by token: ``(out [B, S, H, Dv], final [B, H, Dk, Dv])``."""
    return recurrence_reference(q, k, v, g, beta, initial_state, delta=False)


def ssd_scan_reference(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """The scan token by token, in the recurrence's notation: ``(out [B, S, H, Dv], final [B, H, Dk, Dv])``."""
    return recurrence_reference(q, k, v, g, beta, initial_state, delta=False)


def selective_scan_reference(
    u: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, initial_state: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """The selective scan token by token, in the inputs' dtype: ``(y [B, S, D], final [B, D, N])``."""
    b, s, d = u.shape
    h = u.new_zeros(b, d, A.shape[-1]) if initial_state is None else initial_state.to(u.dtype).clone()
    y = u.new_zeros(b, s, d)
    for t in range(s):
        h = torch.exp(dt[:, t, :, None] * A) * h + u[:, t, :, None] * B[:, t, None, :]
        y[:, t] = (h * C[:, t, None, :]).sum(-1)
    return y, h


def path_cumsum_reference(x: torch.Tensor, dim: int, subtree_end: torch.Tensor) -> torch.Tensor:
    """The definition, a loop over pairs: row ``r`` sums its ancestors-or-self ``k``
    (``k <= r < subtree_end[k]``)."""
    xs = x.movedim(dim, -1).to(torch.int64)
    out = torch.zeros_like(xs)
    end = subtree_end.tolist()
    for r in range(xs.shape[-1]):
        for k in range(r + 1):
            if r < end[k]:
                out[..., r] += xs[..., k]
    return out.movedim(-1, dim)


def path_scan_reference(x: torch.Tensor, dim: int, pred_index: torch.Tensor, op: str) -> list[torch.Tensor]:
    """The definition: each row's root path gathered (following ``pred_index``) and scanned with
    torch's own op, keeping the last element; for cummax / cummin also the row of each value."""
    xs = x.movedim(dim, 0)
    pred = pred_index.tolist()
    vals, rows = [], []
    for r in range(xs.shape[0]):
        path = [r]
        while pred[path[-1]] >= 0:
            path.append(pred[path[-1]])
        path = path[::-1]
        scanned = getattr(torch, op)(xs[path], 0)
        if isinstance(scanned, torch.Tensor):
            vals.append(scanned[-1])
        else:
            vals.append(scanned.values[-1])
            rows.append(torch.tensor(path)[scanned.indices[-1]])
    out = [torch.stack(vals).movedim(0, dim)]
    if rows:
        out.append(torch.stack(rows).movedim(0, dim))
    return out
