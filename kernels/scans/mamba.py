"""Mamba's selective scan (Mamba-1): its ops.

The scan, per batch row and channel ``d``, with state ``h`` ``[D, N]`` (see
:mod:`treecompile.kernels.scans.selective_scan`, which computes it):

    h_t = exp(dt_t[:, None] * A) * h_{t-1} + u_t[:, None] * B_t[None, :]
    y_t = h_t C_t

Registered ops:

* ``treecompile::selective_scan(u, dt, A, B, C, initial_state)`` ``-> (y, final_state)``: the
  linear-sequence core of Hugging Face's ``mamba_selective_scan`` (Mamba, Falcon-Mamba,
  Jamba, Zamba) after its bias, softplus and ``u = dt * x``, which the drop-in in
  :mod:`treecompile.capture.drop_ins` does outside the op. The wrapper swaps a model's kernel for the
  drop-in before capture, so each layer is one node the SSM state pass can find.
* ``treecompile::tree_selective_scan(u, dt, A, B, C, initial_state, node_table, scan_kernel)``
  ``-> y``: what the pass puts in its place; each tree node runs from its parent node's
  final state.
* ``treecompile::selective_scan_backward``: both ops' backward, which recomputes the forward
  under autograd and differentiates it (no per-row state is kept between the passes).

All compute in at least float32 and return ``u``'s dtype. ``scan_kernel`` is the name
``tree_compile(scan_kernel=...)`` took: ``"auto"`` and ``"torch"`` run the torch scan, which is
the only one there is for this scan; ``"fla"`` raises (flash-linear-attention has none for
it), as does an unknown name. The loop above, token by token, is `selective_scan_reference` in
:mod:`treecompile.kernels.scans.naive`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from treecompile.kernels.scans import selective_scan as _scan
from treecompile.kernels.dtypes import compute_dtype
from treecompile.kernels.scans.recurrence import SCAN_KERNELS, autograd_inside

__all__ = ["selective_scan", "tree_selective_scan", "check_scan_kernel"]

Tensor = torch.Tensor


def check_scan_kernel(name: str) -> None:
    """Raises unless ``name`` runs the selective scan: ``"auto"`` and ``"torch"`` (the torch scan).

    Raises:
        ValueError: an unknown name.
        RuntimeError: ``"fla"``, which has no selective-scan kernel.
    """
    if name not in SCAN_KERNELS:
        raise ValueError(f"unknown scan kernel {name!r}; valid scan kernels: {', '.join(SCAN_KERNELS)}")
    if name == "fla":
        raise RuntimeError("treecompile: scan_kernel='fla' cannot be used: flash-linear-attention has no kernel for "
                           "Mamba's selective scan (Mamba-1); scan_kernel='auto' or 'torch' runs the torch scan")


def _run(fn: Callable, inputs: list[Tensor], initial_state: Tensor | None, *rest):
    ct = compute_dtype(inputs[0].dtype)
    init = None if initial_state is None else initial_state.to(ct)
    return fn(*(x.to(ct) for x in inputs), init, *rest)


def _grads(fn: Callable, inputs: list[Tensor], initial_state: Tensor | None, d_outs: list, *rest):
    """Gradients of ``fn``'s outputs (weighted by ``d_outs``; None skips one) for every input."""
    with autograd_inside():
        leaves = [x.detach().requires_grad_() for x in inputs]
        init = None if initial_state is None else initial_state.detach().requires_grad_()
        outs = _run(fn, leaves, init, *rest)
        outs = outs if isinstance(outs, tuple) else (outs,)
        pairs = [(o, d.to(o.dtype)) for o, d in zip(outs, d_outs) if d is not None]
        wrt = leaves + ([init] if init is not None else [])
        grads = torch.autograd.grad([o for o, _ in pairs], wrt, [d for _, d in pairs], allow_unused=True)
    # Contiguous, as the fake kernels say (Inductor checks the strides of an op's outputs).
    grads = [torch.zeros(x.shape, dtype=x.dtype, device=x.device) if gr is None else gr.to(x.dtype).contiguous()
             for gr, x in zip(grads, wrt)]
    d_init = grads[5] if init is not None else inputs[0].new_zeros(0)
    return (*grads[:5], d_init)


@torch.library.custom_op("treecompile::selective_scan", mutates_args=())
def selective_scan(u: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, initial_state: Tensor | None
                   ) -> tuple[Tensor, Tensor]:
    """The selective scan along the row: ``(y [B, S, D], final [B, D, N])``."""
    y, final = _run(_scan.chunked_selective_scan, [u, dt, A, B, C], initial_state)
    # A fresh final state: the scan's is a view into its row states (a storage offset the fake has not).
    return y.to(u.dtype).contiguous(), final.to(u.dtype).clone(memory_format=torch.contiguous_format)


@selective_scan.register_fake
def _selective_scan_fake(u, dt, A, B, C, initial_state):
    return u.new_empty(u.shape), u.new_empty(u.shape[0], u.shape[2], A.shape[-1])


@torch.library.custom_op("treecompile::tree_selective_scan", mutates_args=())
def tree_selective_scan(u: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, initial_state: Tensor | None,
                        node_table: Tensor, scan_kernel: str = "auto") -> Tensor:
    """The selective scan along each row's path: ``y [1, S, D]``."""
    # Not ``kernel``: Inductor's fallback lowering takes an argument of that name itself.
    check_scan_kernel(scan_kernel)
    y = _run(_scan.tree_selective_scan, [u, dt, A, B, C], initial_state, node_table)
    return y.to(u.dtype).contiguous()


@tree_selective_scan.register_fake
def _tree_selective_scan_fake(u, dt, A, B, C, initial_state, node_table, scan_kernel="auto"):
    return u.new_empty(u.shape)


# d_initial_state is empty ([0]) when there is no initial state.
@torch.library.custom_op("treecompile::selective_scan_backward", mutates_args=())
def _backward(u: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, initial_state: Tensor | None, d_out: Tensor,
              d_final: Tensor | None, node_table: Tensor | None
              ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    inputs = [u, dt, A, B, C]
    if node_table is None:
        return _grads(_scan.chunked_selective_scan, inputs, initial_state, [d_out, d_final])
    return _grads(_scan.tree_selective_scan, inputs, initial_state, [d_out], node_table)


@_backward.register_fake
def _backward_fake(u, dt, A, B, C, initial_state, d_out, d_final, node_table):
    d_init = u.new_empty(0) if initial_state is None else initial_state.new_empty(initial_state.shape)
    return (*(x.new_empty(x.shape) for x in (u, dt, A, B, C)), d_init)


def _save_inputs(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _save_tree_inputs(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:7])


def _backward_linear(ctx, d_out, d_final):
    u, dt, A, B, C, init = ctx.saved_tensors
    grads = _backward(u, dt, A, B, C, init, d_out, d_final, None)
    return (*grads[:5], grads[5] if init is not None else None)


def _backward_tree(ctx, d_out):
    u, dt, A, B, C, init, node_table = ctx.saved_tensors
    grads = _backward(u, dt, A, B, C, init, d_out, None, node_table)
    return (*grads[:5], grads[5] if init is not None else None, None, None)


selective_scan.register_autograd(_backward_linear, setup_context=_save_inputs)
tree_selective_scan.register_autograd(_backward_tree, setup_context=_save_tree_inputs)
