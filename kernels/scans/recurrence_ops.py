"""The custom ops of the gated recurrences (see :mod:`treecompile.kernels.scans.recurrence`).

:func:`register` registers, for one kind (``gated_delta_rule``, ``kimi_delta_rule``, ``ssd_scan``), the
linear-sequence op the wrapper swaps in for a model's kernel, its tree form (what the SSM
state pass puts in its place) and their backward, which recomputes the forward under
autograd and differentiates it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from treecompile.kernels.scans import recurrence as _rec
from treecompile.kernels.dtypes import compute_dtype

__all__ = ["register"]

Tensor = torch.Tensor


# ----------------------------------------------------------------------------- ops

def _run(fn: Callable, inputs: list[Tensor], initial_state: Tensor | None, *rest, **options):
    ct = compute_dtype(inputs[0].dtype)
    init = None if initial_state is None else initial_state.to(ct)
    return fn(*(x.to(ct) for x in inputs), init, *rest, **options)


def _tree_options(scan_kernel: str, q: Tensor, g: Tensor, delta: bool) -> dict:
    """``tree_recurrence``'s keyword arguments for the tree op's ``scan_kernel`` name. A gate per
    key channel (Kimi Delta Attention) runs the torch scan: the variable-length kernels take a
    gate per head."""
    if g.dim() == q.dim():
        return {"delta": delta, "varlen": None}
    return {"delta": delta, "varlen": _rec.varlen_kernel(scan_kernel, q.device, delta, compute_dtype(q.dtype))}


def _grads(fn: Callable, inputs: list[Tensor], initial_state: Tensor | None, d_outs: list, *rest, **options):
    """Gradients of ``fn``'s outputs (weighted by ``d_outs``; None skips one) for every input."""
    with _rec.autograd_inside():
        leaves = [x.detach().requires_grad_() for x in inputs]
        init = None if initial_state is None else initial_state.detach().requires_grad_()
        outs = _run(fn, leaves, init, *rest, **options)
        outs = outs if isinstance(outs, tuple) else (outs,)
        pairs = [(o, d.to(o.dtype)) for o, d in zip(outs, d_outs) if d is not None]
        wrt = leaves + ([init] if init is not None else [])
        grads = torch.autograd.grad([o for o, _ in pairs], wrt, [d for _, d in pairs], allow_unused=True)
    # Contiguous, as the fake kernels say (Inductor checks the strides of an op's outputs).
    grads = [torch.zeros(x.shape, dtype=x.dtype, device=x.device) if gr is None else gr.to(x.dtype).contiguous()
             for gr, x in zip(grads, wrt)]
    d_init = grads[5] if init is not None else inputs[0].new_zeros(0)
    return (*grads[:5], d_init)


def register(kind: str, *, delta: bool) -> tuple[Callable, Callable]:
    """Registers ``treecompile::{kind}``, ``treecompile::tree_{kind}`` and their backward.

    Returns the linear and the tree op.
    """
    lib = f"treecompile::{kind}"

    @torch.library.custom_op(lib, mutates_args=())
    def linear(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor | None
               ) -> tuple[Tensor, Tensor]:
        out, final = _run(_rec.chunked_recurrence, [q, k, v, g, beta], initial_state, delta=delta)
        return out.to(v.dtype).contiguous(), final.to(v.dtype).contiguous()

    @linear.register_fake
    def _linear_fake(q, k, v, g, beta, initial_state):
        b, _, h, dk = k.shape
        return v.new_empty(v.shape), v.new_empty(b, h, dk, v.shape[-1])

    @torch.library.custom_op(f"treecompile::tree_{kind}", mutates_args=())
    def tree(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor | None,
             node_table: Tensor, scan_kernel: str = "auto") -> Tensor:
        # Not ``kernel``: Inductor's fallback lowering takes an argument of that name itself.
        out = _run(_rec.tree_recurrence, [q, k, v, g, beta], initial_state, node_table,
                   **_tree_options(scan_kernel, q, g, delta))
        return out.to(v.dtype).contiguous()

    @tree.register_fake
    def _tree_fake(q, k, v, g, beta, initial_state, node_table, scan_kernel="auto"):
        return v.new_empty(v.shape)

    # d_initial_state is empty ([0]) when there is no initial state.
    @torch.library.custom_op(f"treecompile::{kind}_backward", mutates_args=())
    def backward(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor | None,
                 d_out: Tensor, d_final: Tensor | None, node_table: Tensor | None, scan_kernel: str
                 ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
        inputs = [q, k, v, g, beta]
        if node_table is None:
            return _grads(_rec.chunked_recurrence, inputs, initial_state, [d_out, d_final], delta=delta)
        return _grads(_rec.tree_recurrence, inputs, initial_state, [d_out], node_table,
                      **_tree_options(scan_kernel, q, g, delta))

    @backward.register_fake
    def _backward_fake(q, k, v, g, beta, initial_state, d_out, d_final, node_table, scan_kernel):
        d_init = q.new_empty(0) if initial_state is None else initial_state.new_empty(initial_state.shape)
        return (*(x.new_empty(x.shape) for x in (q, k, v, g, beta)), d_init)

    def save_inputs(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    def save_tree_inputs(ctx, inputs, output):
        ctx.save_for_backward(*inputs[:7])
        ctx.kernel = inputs[7]

    def backward_linear(ctx, d_out, d_final):
        q, k, v, g, beta, init = ctx.saved_tensors
        grads = backward(q, k, v, g, beta, init, d_out, d_final, None, "torch")
        return (*grads[:5], grads[5] if init is not None else None)

    def backward_tree(ctx, d_out):
        q, k, v, g, beta, init, node_table = ctx.saved_tensors
        grads = backward(q, k, v, g, beta, init, d_out, None, node_table, ctx.kernel)
        return (*grads[:5], grads[5] if init is not None else None, None, None)

    linear.register_autograd(backward_linear, setup_context=save_inputs)
    tree.register_autograd(backward_tree, setup_context=save_tree_inputs)
    return linear, tree
