"""The steps of an associative scan by pointer jumping, on a row and on a tree.

An inclusive scan of an associative ``op`` (JAX's ``lax.associative_scan``, hand-ported to
PyTorch by many state-space repositories) folds each row with every row before it. Pointer
jumping computes it in ``J`` steps: at step ``h`` each row combines the value of the row
``2**h`` before it with its own, ``x[r] = op(x[r - 2**h], x[r])``, where there is one. After the
steps row ``r`` holds the fold of rows ``0 .. r``. On a tree "the row ``2**h`` before" is the
``2**h``-th ancestor on the row's path (`treecompile.passes.path_jumps` builds the table), and
the fold is the path's.

* ``treecompile::row_earlier(x, dim, hop)``: ``x`` with row ``r`` (along ``dim``) replaced by row
  ``r - 2**hop`` (the row itself where there is none).
* ``treecompile::row_has_earlier(x, dim, hop)``: ``[S]`` bool, whether row ``r - 2**hop`` exists.

Both along the row here; the path jumps pass replaces them by the path's ancestors.
`associative_scan_reference` is the fold as a loop.
"""

from __future__ import annotations

from typing import Callable

import torch

__all__ = ["JUMPS", "row_earlier", "row_has_earlier", "associative_scan_reference"]

Tensor = torch.Tensor

#: Steps of the scan: folds paths of up to ``2**JUMPS`` rows.
JUMPS = 20


def _sources(s: int, hop: int, device) -> Tensor:
    """Row ``r - 2**hop`` of each row ``r`` (negative where there is none)."""
    return torch.arange(s, device=device) - (1 << hop)


def _read(s: int, hop: int, device) -> Tensor:
    """The row each row reads: ``r - 2**hop``, or ``r`` itself where there is none."""
    src = _sources(s, hop, device)
    return torch.where(src < 0, src + (1 << hop), src)


@torch.library.custom_op("treecompile::row_earlier", mutates_args=())
def row_earlier(x: Tensor, dim: int, hop: int) -> Tensor:
    """``x`` with row ``r`` along ``dim`` replaced by row ``r - 2**hop`` (itself where none)."""
    return x.index_select(dim, _read(x.shape[dim], hop, x.device)).contiguous()


@row_earlier.register_fake
def _row_earlier_fake(x, dim, hop):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _setup(ctx, inputs, output):
    x, dim, hop = inputs
    ctx.dim, ctx.hop, ctx.size = dim, hop, x.shape[dim]


def _backward(ctx, grad):
    return torch.zeros_like(grad).index_add_(ctx.dim, _read(ctx.size, ctx.hop, grad.device), grad), None, None


row_earlier.register_autograd(_backward, setup_context=_setup)


@torch.library.custom_op("treecompile::row_has_earlier", mutates_args=())
def row_has_earlier(x: Tensor, dim: int, hop: int) -> Tensor:
    """``[S]`` bool: whether row ``r - 2**hop`` exists (``S`` the size of ``x`` along ``dim``)."""
    return _sources(x.shape[dim], hop, x.device) >= 0


@row_has_earlier.register_fake
def _row_has_earlier_fake(x, dim, hop):
    return x.new_empty((x.shape[dim],), dtype=torch.bool)


def associative_scan_reference(op: Callable, elems: list[Tensor], dim: int) -> list[Tensor]:
    """The inclusive scan of ``op`` (``op(earlier, later)``) along ``dim`` as a loop over the rows."""
    out = [[e.select(dim, 0)] for e in elems]
    for r in range(1, elems[0].shape[dim]):
        acc = op([o[-1] for o in out], [e.select(dim, r) for e in elems])
        for o, a in zip(out, acc):
            o.append(a)
    return [torch.stack(o, dim) for o in out]
