"""A long causal convolution along each root path of a packed tree, by FFT per tree node.

``treecompile::tree_long_conv(u, k, node_table)``: for ``u`` ``[C, S]`` (the packed rows last)
and a kernel ``k`` ``[C, K]`` over distances,

    y[c, t] = sum_{d < K} k[c, d] * u[c, the d-th ancestor-or-self of t on its path]

which is what per-path training's ``irfft(rfft(u, n) * rfft(k, n), n)[..., :T]`` (with
``n >= T + K - 1``) computes for each token of a path (S4 / S4D, H3, Hyena). Each tree node's
rows are the last rows of its root path: they are computed by one FFT convolution over that
path (the node's ancestors' rows, then its own), so the work per node is that of one path as
long as its root path, and the memory ``C`` times that length. By induction over the nodes
in preorder, every row gets the output its path gives it.

The backward runs the nodes again with autograd (`autograd_inside`) and
returns the gradients of ``u`` and ``k``. The dense definition, a sum over each token's
ancestors at path distances, is `tree_long_conv_reference`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from treecompile.kernels.scans.recurrence import autograd_inside

__all__ = ["tree_long_conv", "tree_long_conv_reference"]


def _run(u: Tensor, k: Tensor, node_table: Tensor) -> Tensor:
    """The convolution of each node's rows over its root path, the nodes in row order."""
    outs: list[Tensor] = []
    paths: list[Tensor] = []
    width = k.shape[-1]
    for start, end, parent in node_table.tolist():
        own = torch.arange(start, end, device=u.device)
        rows = own if parent < 0 else torch.cat([paths[parent], own])
        paths.append(rows)
        length = rows.numel()
        taps = min(width, length)
        n = 1 << (length + taps - 2).bit_length()  # no wrap-around: n >= length + taps - 1
        seg = torch.fft.rfft(u.index_select(-1, rows), n=n) * torch.fft.rfft(k[..., :taps], n=n)
        outs.append(torch.fft.irfft(seg, n=n)[..., length - (end - start):length])
    return torch.cat(outs, -1)


@torch.library.custom_op("treecompile::tree_long_conv", mutates_args=())
def tree_long_conv(u: Tensor, k: Tensor, node_table: Tensor) -> Tensor:
    """The convolution (module docstring): ``u`` ``[C, S]``, ``k`` ``[C, K]``, ``node_table``
    ``[N, 3]`` CPU (start, end, parent; parents first, the nodes' rows in order). Returns ``[C, S]``."""
    with torch.no_grad():
        return _run(u, k, node_table)


@tree_long_conv.register_fake
def _tree_long_conv_fake(u, k, node_table):
    return torch.empty_like(u)


@torch.library.custom_op("treecompile::tree_long_conv_backward", mutates_args=())
def tree_long_conv_backward(grad: Tensor, u: Tensor, k: Tensor, node_table: Tensor) -> list[Tensor]:
    """``[d u, d k]`` of `tree_long_conv` (the nodes run again with autograd)."""
    with autograd_inside():
        lu, lk = u.detach().requires_grad_(True), k.detach().requires_grad_(True)
        du, dk = torch.autograd.grad(_run(lu, lk, node_table), (lu, lk), grad)
    return [du, dk]


@tree_long_conv_backward.register_fake
def _tree_long_conv_backward_fake(grad, u, k, node_table):
    return [torch.empty_like(u), torch.empty_like(k)]


def _setup(ctx, inputs, output):
    u, k, node_table = inputs
    ctx.save_for_backward(u, k)
    ctx.node_table = node_table


def _backward(ctx, grad):
    u, k = ctx.saved_tensors
    du, dk = torch.ops.treecompile.tree_long_conv_backward(grad.contiguous(), u, k, ctx.node_table)
    return du, dk, None


tree_long_conv.register_autograd(_backward, setup_context=_setup)


def tree_long_conv_reference(u: Tensor, k: Tensor, parent_row: Tensor) -> Tensor:
    """The dense definition: each row's sum over its ancestors-or-self, ``d`` steps up weighted
    by ``k[:, d]`` (zero past the kernel); ``parent_row[t]`` is the row before ``t`` on its path
    (-1 at a root)."""
    out = torch.zeros_like(u)
    for t in range(u.shape[-1]):
        row, d = t, 0
        while row >= 0 and d < k.shape[-1]:
            out[..., t] = out[..., t] + k[..., d] * u[..., row]
            row, d = int(parent_row[row]), d + 1
    return out
