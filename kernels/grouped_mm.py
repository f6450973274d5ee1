"""A grouped matrix product over rows sorted by group, capturable in every dtype.

``treecompile::grouped_mm(input [S, D_in], weight [G, D_in, D_out], offs [G]) -> [S, D_out]``:
rows ``offs[g - 1]:offs[g]`` (``offs[-1]`` read as 0) times ``weight[g]``, what Hugging Face's
``grouped_mm`` experts compute per projection. Hugging Face runs ``torch._grouped_mm`` where
it can (bfloat16 under compile) and otherwise a fallback op whose backward, in transformers
5.10 to 5.17 (5.23 made it an op), loops over ``offs.tolist()`` in Python: AOTAutograd cannot trace that loop
(a data-dependent size), so a float32 or float64 MoE failed to compile. Here the forward and
the backward are both opaque ops: the loop runs at execution time, never under tracing.
"""

from __future__ import annotations

import torch

__all__ = ["grouped_mm"]

Tensor = torch.Tensor


def _groups(offs: Tensor):
    start = 0
    for g, end in enumerate(offs.tolist()):  # one host sync per call
        if end > start:
            yield g, start, end
        start = end


@torch.library.custom_op("treecompile::grouped_mm", mutates_args=())
def grouped_mm(input: Tensor, weight: Tensor, offs: Tensor) -> Tensor:
    out = input.new_zeros(input.shape[0], weight.shape[2])
    for g, start, end in _groups(offs):
        out[start:end] = input[start:end] @ weight[g]
    return out


@grouped_mm.register_fake
def _grouped_mm_fake(input, weight, offs):
    return input.new_empty(input.shape[0], weight.shape[2])


@torch.library.custom_op("treecompile::grouped_mm_backward", mutates_args=())
def grouped_mm_backward(input: Tensor, weight: Tensor, offs: Tensor, d_out: Tensor) -> tuple[Tensor, Tensor]:
    d_input, d_weight = torch.zeros_like(input), torch.zeros_like(weight)
    for g, start, end in _groups(offs):
        d_input[start:end] = d_out[start:end] @ weight[g].T
        d_weight[g] = input[start:end].T @ d_out[start:end]
    return d_input, d_weight


@grouped_mm_backward.register_fake
def _grouped_mm_backward_fake(input, weight, offs, d_out):
    return torch.empty_like(input), torch.empty_like(weight)


def _setup(ctx, inputs, output):
    input, weight, offs = inputs
    ctx.save_for_backward(input, weight, offs)


def _backward(ctx, d_out):
    input, weight, offs = ctx.saved_tensors
    d_input, d_weight = grouped_mm_backward(input, weight, offs, d_out.contiguous())
    return d_input, d_weight, None


grouped_mm.register_autograd(_backward, setup_context=_setup)
