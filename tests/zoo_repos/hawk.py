"""Hawk (Griffin's recurrent blocks alone) written on google-deepmind/recurrentgemma's torch port
(``recurrentgemma/torch/layers.py``: ``BlockDiagonalLinear``, ``SqrtBoundDerivative``, ``RGLRU``,
``rnn_scan``; ``modules.py``'s ``RecurrentBlock`` and ``ResidualBlock``) at a tiny size.

``rnn_scan`` is the repository's loop over the tokens, ``h_t = (a_t * ~reset_t) * h_{t-1} + x_t``
with ``reset = segment_pos == 0``; the RG-LRU's input normalisation ``sqrt(1 - a^2)`` goes through
the repository's clipped-derivative ``autograd.Function``. The repository's ``Conv1D`` (a loop
over the temporal shifts with a document mask, ``_pad_window``) with ``repo_conv``, else a
depthwise ``nn.Conv1d`` cut to the length. Left out: the local-attention blocks; the inference
cache.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from zoo_repos.common import DIM, LAYERS, VOCAB


class SqrtBoundDerivative(torch.autograd.Function):
    """Computes a square root with a gradient clipped at `max_gradient`."""

    @staticmethod
    def forward(ctx, x, max_gradient=1000.0):
        ctx.save_for_backward(x)
        ctx.max_gradient = max_gradient
        return torch.sqrt(x)

    @staticmethod
    def backward(ctx, grad_output):
        (x,) = ctx.saved_tensors
        clipped_x_times_4 = torch.clip(4.0 * x, min=1 / (ctx.max_gradient ** 2))
        return grad_output / torch.sqrt(clipped_x_times_4), None


def rnn_scan(x, a, reset, h0, acc_dtype=torch.float32):
    """Runs the recurrence of a linear RNN (x, a [b, t, d], reset [b, t], h0 [b, d])."""
    assert x.ndim == 3
    assert a.shape == x.shape[-a.ndim:]
    assert a.dtype == x.dtype
    assert type(a) is type(x)
    assert h0 is None or h0.dtype == acc_dtype
    # Multiply `a` by the reset.
    a = a * ~reset[..., None]
    h_t = torch.zeros(x[:, 0].shape, dtype=acc_dtype, device=x.device) if h0 is None else h0
    y = torch.zeros_like(x)
    for t in range(x.shape[1]):
        h_t = a[:, t].type(acc_dtype) * h_t + x[:, t].type(acc_dtype)
        y[:, t] = h_t.type(x.dtype)
    return y, h_t


class BlockDiagonalLinear(nn.Module):
    def __init__(self, width, num_blocks):
        super().__init__()
        self.num_blocks, self.block_width = num_blocks, width // num_blocks
        self.w = nn.Parameter(torch.randn(num_blocks, self.block_width, self.block_width) / self.block_width ** 0.5)
        self.b = nn.Parameter(torch.zeros(num_blocks, self.block_width))

    def forward(self, x):
        x = x.unflatten(-1, (self.num_blocks, self.block_width))  # "... (h i) -> ... h i"
        y = torch.einsum("... h i, h i j -> ... h j", x, self.w) + self.b
        return y.flatten(-2)  # "... h j -> ... (h j)"


class RGLRU(nn.Module):
    """A Real-Gated Linear Recurrent Unit (RG-LRU) layer."""

    def __init__(self, width, num_heads, acc_dtype=torch.float32):
        super().__init__()
        self.acc_dtype = acc_dtype
        self.a_param = nn.Parameter(torch.rand(width) + 0.5)
        self.input_gate = BlockDiagonalLinear(width, num_heads)
        self.a_gate = BlockDiagonalLinear(width, num_heads)

    def forward(self, x, segment_pos):
        reset = segment_pos == 0
        gate_x = torch.sigmoid(self.input_gate(x))
        gate_a = torch.sigmoid(self.a_gate(x))
        log_a = -8.0 * gate_a * F.softplus(self.a_param)
        a = torch.exp(log_a)
        a_square = torch.exp(2 * log_a)
        gated_x = x * gate_x
        multiplier = SqrtBoundDerivative.apply(1 - a_square, 1000.0)
        multiplier = reset[..., None] + ~reset[..., None] * multiplier
        normalized_x = gated_x * multiplier.type(x.dtype)
        y, _ = rnn_scan(x=normalized_x, a=a, reset=reset, h0=None, acc_dtype=self.acc_dtype)
        return y


class Conv1D(nn.Module):
    """recurrentgemma's ``Conv1D`` on its training path (no cache): a loop over the temporal
    shifts, each window ``x[:, :T - shift]`` masked by the document starts ahead of it (slices of
    ``segment_pos != 0`` ANDed) and padded back to the length (``_pad_window``)."""

    def __init__(self, width, temporal_width=4):
        super().__init__()
        self.width, self.temporal_width = width, temporal_width
        self.w = nn.Parameter(torch.randn(temporal_width, width) * 0.1)
        self.b = nn.Parameter(torch.randn(width) * 0.1)

    def forward(self, x, segment_pos):
        prompt_len, output_len = 0, x.shape[1]
        conv_output = 0.0
        for temporal_shift in range(self.temporal_width):
            start_idx, end_idx = self._convolution_window_indices(prompt_len=prompt_len, shift_back=temporal_shift,
                                                                  output_len=output_len)
            x_window = x[:, start_idx:end_idx]
            window_mask = self._compute_document_mask(segment_pos=segment_pos, start_idx=start_idx, end_idx=end_idx,
                                                      max_look_ahead=temporal_shift)
            x_window = x_window * window_mask[:, :, None]
            x_window = self._pad_window(x_window, output_len)
            w = self.w[self.temporal_width - temporal_shift - 1][None, None, :]
            conv_output = conv_output + x_window * w
        return conv_output + self.b[None, None]

    def _convolution_window_indices(self, *, prompt_len, shift_back, output_len):
        start_idx = max(prompt_len - shift_back, 0)
        end_idx = prompt_len + output_len - shift_back
        return start_idx, end_idx

    def _compute_document_mask(self, *, segment_pos, start_idx, end_idx, max_look_ahead):
        not_a_document_start = (segment_pos != 0).type(torch.bool)
        mask = torch.ones_like(not_a_document_start[:, start_idx:end_idx])
        for shift in range(1, max_look_ahead + 1):
            mask = mask & not_a_document_start[:, start_idx + shift:end_idx + shift]
        return mask

    def _pad_window(self, window, output_len):
        padding_len = output_len - window.shape[1]  # 0 for the first shift: a pad by nothing
        return F.pad(window, (0, 0, padding_len, 0))


class ResidualBlock(nn.Module):
    def __init__(self, width=DIM, repo_conv=False):
        super().__init__()
        self.temporal_pre_norm, self.channel_pre_norm = nn.RMSNorm(width), nn.RMSNorm(width)
        self.linear_y, self.linear_x = nn.Linear(width, width), nn.Linear(width, width)
        self.repo_conv = repo_conv
        self.conv_1d = Conv1D(width) if repo_conv else nn.Conv1d(width, width, 4, padding=3, groups=width)
        self.rg_lru = RGLRU(width, num_heads=4, acc_dtype=torch.float64)
        self.linear_out = nn.Linear(width, width)
        self.ffw_up = nn.Linear(width, 4 * width)
        self.ffw_down = nn.Linear(2 * width, width)

    def forward(self, raw_x, segment_pos):
        x = self.temporal_pre_norm(raw_x)
        y = F.gelu(self.linear_y(x), approximate="tanh")
        h = self.linear_x(x)
        if self.repo_conv:
            h = self.conv_1d(h, segment_pos)
        else:
            h = self.conv_1d(h.transpose(1, 2))[..., :h.shape[1]].transpose(1, 2)
        x = self.linear_out(self.rg_lru(h, segment_pos) * y)
        residual = x + raw_x
        up0, up1 = self.ffw_up(self.channel_pre_norm(residual)).chunk(2, dim=-1)
        return self.ffw_down(F.gelu(up0, approximate="tanh") * up1) + residual


class HawkLM(nn.Module):
    def __init__(self, logits_soft_cap=30.0, repo_conv=False):
        super().__init__()
        self.embedder = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(ResidualBlock(repo_conv=repo_conv) for _ in range(LAYERS))
        self.final_norm = nn.RMSNorm(DIM)
        self.logits_soft_cap = logits_soft_cap

    def forward(self, tokens):
        segment_pos = torch.arange(tokens.shape[1], device=tokens.device)[None].expand(tokens.shape[0], -1)
        x = self.embedder(tokens) * math.sqrt(self.embedder.weight.shape[1])
        for block in self.blocks:
            x = block(x, segment_pos)
        logits = self.final_norm(x) @ self.embedder.weight.T
        c = self.logits_soft_cap
        return torch.tanh(logits / c) * c
