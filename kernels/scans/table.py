"""The recurrent scans a tree routes, one entry each: all the passes need to know of a scan.

A scan op ``treecompile::KIND(x0, x1, x2, x3, x4, initial_state)`` with its tree form
``treecompile::tree_KIND(..., node_table, kernel)`` (each in its own kernel module, with its
reference) is routed along the paths by ``passes/ssm_state.py`` and streamed by
``passes/stream.py``, both reading :data:`SCANS`: a new scan kernel is its op module here in
``kernels/``, an entry below, and its drop-in in ``treecompile/capture/drop_ins.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from treecompile.kernels.scans import gdn as _gdn  # noqa: F401  (registers the treecompile:: GDN ops)
from treecompile.kernels.scans import gla as _gla  # noqa: F401  (registers the treecompile:: GLA ops)
from treecompile.kernels.scans import kda as _kda  # noqa: F401  (registers the treecompile:: KDA ops)
from treecompile.kernels.scans import mamba as _mamba  # noqa: F401  (registers the treecompile:: selective-scan ops)
from treecompile.kernels.scans import mamba2 as _mamba2  # noqa: F401  (registers the treecompile:: SSD ops)

Tensor = torch.Tensor

__all__ = ["ScanKind", "SCANS", "stream_selective_scan"]


@dataclass(frozen=True)
class ScanKind:
    """What the passes read of one scan kind.

    Attributes:
        rank: the rank of its first input over the packed row: ``[1, S, H, D]`` (4) or
            ``[1, S, D]`` (3).
        state_of: ``state_of(x0, ..., x4) -> ((H, Dk, Dv), dtype)``: its state's size, from the
            call's example values, as the streaming stack keeps it ``[H, Dk, Dv]``.
        stream: a part's scan started from injected states and reading states out (signature
            of `treecompile.passes.stream.stream_scan_fn`), or None for the generic form there
            (a scan whose one row can write any ``Dk`` row of the state).
    """

    rank: int
    state_of: Callable[..., tuple[tuple, torch.dtype]]
    stream: Callable | None = None


def stream_selective_scan(u: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, states: Tensor, node_table: Tensor,
                          readouts: Tensor, kernel: str = "auto") -> tuple[Tensor, Tensor]:
    """The tree selective scan (Mamba-1, :mod:`treecompile.kernels.scans.selective_scan`) of a part,
    started from states of earlier parts, reading out states for later parts, through the
    unchanged ``treecompile::tree_selective_scan`` op, with the node table of `stream_scan_fn`.

    Its state ``[D, N]`` is kept on the stack as ``[D, N, 1]`` (one head per channel, ``Dk = N``,
    ``Dv = 1``). A given state cannot be written by one row (a row's write ``u B^T`` has rank
    one), and a row that writes also decays unless ``dt = 0``; the scan takes its write ``u``
    apart from its step ``dt`` for this:

    * an *injection node* of ``N`` rows per given state ``S``: row ``t`` has ``u = S[:, t]``,
      ``dt = 0``, ``B = e_t``, ``C = 0``, run from the zero state: no decay (``exp(0) = 1``), and
      row ``t`` writes column ``t`` alone (``S[:, t] * 1`` and exact zeros), so after the node
      the state is ``S`` exactly;
    * a *readout node* of ``N`` rows per state to return: ``u = dt = B = 0``, ``C = e_t`` (no
      decay, no write), so row ``t`` outputs column ``t`` of the parent's final state, exactly.

    Args:
        u, dt: ``[1, S, D]``; A: ``[D, N]``; B, C: ``[1, S, N]`` (as for the tree op).
        states: ``[E, D, N, 1]`` the injected states.
        node_table, readouts, kernel: as for `stream_scan_fn`.

    Returns:
        ``(y [1, S, D], read [R, D, N, 1])``.
    """
    n_in, d, n, _ = states.shape
    n_out = readouts.shape[0]
    s = u.shape[1]
    ins = (states[..., 0].to(u.dtype).transpose(1, 2).reshape(n_in * n, d), dt.new_zeros(n_in * n, d),
           torch.eye(n, dtype=B.dtype, device=B.device).repeat(n_in, 1), C.new_zeros(n_in * n, n))
    outs = (u.new_zeros(n_out * n, d), dt.new_zeros(n_out * n, d), B.new_zeros(n_out * n, n),
            torch.eye(n, dtype=C.dtype, device=C.device).repeat(n_out, 1))
    full = [torch.cat([a, x[0], b])[None] for a, x, b in zip(ins, (u, dt, B, C), outs)]
    out = torch.ops.treecompile.tree_selective_scan(full[0], full[1], A, full[2], full[3], None, node_table, kernel)
    own = out[:, n_in * n:n_in * n + s]
    read = out[0, n_in * n + s:].reshape(n_out, n, d).transpose(1, 2)[..., None]
    return own, read


def _qkv_state(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor) -> tuple[tuple, torch.dtype]:
    return (q.shape[2], q.shape[3], v.shape[3]), v.dtype


def _selective_state(u: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor) -> tuple[tuple, torch.dtype]:
    return (u.shape[2], A.shape[-1], 1), u.dtype  # [D, N] kept as [D, N, 1]


#: The scan kinds, by op name.
SCANS: dict[str, ScanKind] = {
    "gated_delta_rule": ScanKind(4, _qkv_state),
    "kimi_delta_rule": ScanKind(4, _qkv_state),
    "gla_scan": ScanKind(4, _qkv_state),
    "ssd_scan": ScanKind(4, _qkv_state),
    "selective_scan": ScanKind(3, _selective_state, stream_selective_scan),
}
