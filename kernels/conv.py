"""Causal depthwise convolution over the sequence, on a row and on a tree.

Channel ``c`` of output row ``s`` is ``bias[c] + sum_j weight[c, j] * x[c, row_j(s)]`` for the
``K`` taps ``j``; tap ``K - 1`` is row ``s`` itself and tap ``K - 1 - d`` its ``d``-th
predecessor (zero where there is none). `causal_conv1d_reference` is that sum as a loop.

* ``treecompile::causal_conv1d(x, weight, bias)``: predecessors along the row (``s - d``),
  the semantics of Hugging Face's ``causal_conv1d_fn`` before its activation
  (:func:`treecompile.capture.drop_ins.hf_causal_conv1d_fn` is the drop-in the wrapper swaps in before capture).
* ``treecompile::tree_causal_conv1d(x, weight, bias, ancestors)``: predecessors along the
  row's own path, ``ancestors[s, d - 1]`` (``pred_index`` followed ``d`` times, -1 past the
  root), what the conv context pass puts in place of the former. A node's first rows read
  their parent's last rows (and the grandparent's where the parent is shorter than
  ``K - 1``), never the sibling that precedes them in DFS order.

Shapes: ``x`` ``[B, C, S]``, ``weight`` ``[C, K]``, ``bias`` ``[C]`` or None, ``ancestors``
``[S, K - 1]`` int64. Both ops share one gather-based forward and backward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["causal_conv1d_reference", "causal_conv1d", "tree_causal_conv1d", "row_ancestors"]

Tensor = torch.Tensor


def causal_conv1d_reference(x: Tensor, weight: Tensor, bias: Tensor | None, ancestors: Tensor | None = None) -> Tensor:
    """The causal depthwise conv as a loop over rows and taps (ancestors None: along the row)."""
    _, _, s = x.shape
    kk = weight.shape[1]
    out = x.new_zeros(x.shape) if bias is None else bias[None, :, None].expand(x.shape).clone()
    for row in range(s):
        for d in range(kk):
            src = row - d if ancestors is None else (row if d == 0 else int(ancestors[row, d - 1]))
            if src >= 0:
                out[:, :, row] += weight[:, kk - 1 - d] * x[:, :, src]
    return out


def row_ancestors(s: int, kk: int, device: torch.device | None = None) -> Tensor:
    """``[S, K - 1]`` ancestors along a plain row: ``s - d``, or -1 before the start."""
    rows = torch.arange(s, device=device)[:, None] - torch.arange(1, kk, device=device)[None, :]
    return rows.clamp(min=-1)


def _taps(ancestors: Tensor, s: int) -> Tensor:
    """``[S, K]`` source row of each tap (tap ``K - 1`` is the row itself); S (a zero column) where none."""
    own = torch.arange(s, device=ancestors.device)[:, None]
    taps = torch.cat([ancestors.flip(1), own], dim=1)
    return torch.where(taps < 0, s, taps)


def _gather(x: Tensor, taps: Tensor) -> Tensor:
    """``[B, C, S, K]``: the tap inputs of every row (zero column for missing predecessors)."""
    xp = F.pad(x, (0, 1))
    return xp[:, :, taps]


def _conv_forward(x: Tensor, weight: Tensor, bias: Tensor | None, ancestors: Tensor) -> Tensor:
    out = (_gather(x, _taps(ancestors, x.shape[-1])) * weight[None, :, None, :]).sum(-1)
    return out if bias is None else out + bias[None, :, None]


def _conv_backward(grad: Tensor, x: Tensor, weight: Tensor, ancestors: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(dx, dweight, dbias)``."""
    b, c, s = x.shape
    taps = _taps(ancestors, s)
    d_weight = torch.einsum("bcsk,bcs->ck", _gather(x, taps), grad)
    contrib = grad[..., None] * weight[None, :, None, :]  # [B, C, S, K]
    dxp = x.new_zeros(b, c, s + 1).index_add_(2, taps.reshape(-1), contrib.reshape(b, c, -1))
    return dxp[:, :, :s], d_weight, grad.sum((0, 2))


@torch.library.custom_op("treecompile::causal_conv1d", mutates_args=())
def causal_conv1d(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """Causal depthwise conv along the row, ``[B, C, S]`` (no activation)."""
    kk = weight.shape[1]
    return F.conv1d(x, weight[:, None, :], bias, padding=kk - 1, groups=x.shape[1])[:, :, : x.shape[-1]].contiguous()


@causal_conv1d.register_fake
def _causal_conv1d_fake(x, weight, bias):
    return x.new_empty(x.shape)  # contiguous, as the op returns, whatever x's strides (Inductor checks them)


@torch.library.custom_op("treecompile::tree_causal_conv1d", mutates_args=())
def tree_causal_conv1d(x: Tensor, weight: Tensor, bias: Tensor | None, ancestors: Tensor) -> Tensor:
    """Causal depthwise conv along each row's path, ``[B, C, S]`` (no activation)."""
    return _conv_forward(x, weight, bias, ancestors).contiguous()


@tree_causal_conv1d.register_fake
def _tree_causal_conv1d_fake(x, weight, bias, ancestors):
    torch._check(ancestors.shape[0] == x.shape[-1])
    return x.new_empty(x.shape)  # contiguous, as the op returns


def _setup_linear(ctx, inputs, output):
    x, weight, bias = inputs
    ctx.has_bias = bias is not None
    ctx.save_for_backward(x, weight)


def _backward_linear(ctx, grad):
    x, weight = ctx.saved_tensors
    dx, dw, db = _conv_backward(grad, x, weight, row_ancestors(x.shape[-1], weight.shape[1], x.device))
    return dx, dw, db if ctx.has_bias else None


def _setup_tree(ctx, inputs, output):
    x, weight, bias, ancestors = inputs
    ctx.has_bias = bias is not None
    ctx.save_for_backward(x, weight, ancestors)


def _backward_tree(ctx, grad):
    x, weight, ancestors = ctx.saved_tensors
    dx, dw, db = _conv_backward(grad, x, weight, ancestors)
    return dx, dw, db if ctx.has_bias else None, None


causal_conv1d.register_autograd(_backward_linear, setup_context=_setup_linear)
tree_causal_conv1d.register_autograd(_backward_tree, setup_context=_setup_tree)
