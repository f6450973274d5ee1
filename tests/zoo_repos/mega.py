"""MEGA (facebookresearch/mega): an EMA applied by FFT and a relative bias built by the
pad/tile Toeplitz trick."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from zoo_repos.common import CTX, DIM, LAYERS, VOCAB


class MultiHeadEMA(nn.Module):
    """fairseq/modules/exponential_moving_average.py (unidirectional): the kernel
    ``(p * beta) * exp(arange(L) * log(q))`` contracted with ``gamma``, applied by
    ``rfft`` / ``irfft`` over ``2L`` (the float casts before the FFT dropped: float64)."""

    def __init__(self, embed_dim, ndim=2):
        super().__init__()
        self.embed_dim, self.ndim = embed_dim, ndim
        self.scale = math.sqrt(1.0 / self.ndim)
        self.delta = nn.Parameter(torch.randn(embed_dim, ndim, 1) * 0.2)
        self.alpha = nn.Parameter(torch.randn(embed_dim, ndim, 1) * 0.2)
        self.beta = nn.Parameter(torch.randn(embed_dim, ndim, 1) * 0.02 + 1.0)
        self.gamma = nn.Parameter(torch.randn(embed_dim, ndim))
        self.omega = nn.Parameter(torch.randn(embed_dim))

    def _calc_coeffs(self):
        p = torch.sigmoid(self.delta)
        alpha = torch.sigmoid(self.alpha)
        q = 1.0 - p * alpha
        return p, q

    def _compute_kernel(self, length):
        p, q = self._calc_coeffs()
        vander = torch.arange(length).to(p).view(1, 1, length) * torch.log(q)  # D x N x L
        kernel = (p * self.beta) * torch.exp(vander)
        return torch.einsum("dnl,dn->dl", kernel, self.gamma * self.scale)

    def forward(self, x):
        seq_len, bsz, embed_dim = x.size()  # L x B x D
        residual = x * self.omega
        x = x.permute(1, 2, 0)  # B x D x L
        k = self._compute_kernel(seq_len)
        fft_len = seq_len
        s = 0
        k_f = torch.fft.rfft(k, n=2 * fft_len)
        x_f = torch.fft.rfft(x, n=2 * fft_len)
        out = torch.fft.irfft(x_f * k_f, n=2 * fft_len)[..., s: s + seq_len]
        out = out.type_as(x)
        out = out.permute(2, 0, 1)  # B x D x L -> L x B x D
        return F.silu(out + residual)


class SimpleRelativePositionalBias(nn.Module):
    """fairseq/modules/relative_positional_bias.py: the ``2T - 1`` entries around the centre of
    a learned vector padded by ``T``, tiled ``T`` times, cut and viewed ``[T, 3T - 2]``, sliced to
    ``[T, T]``: entry ``(i, j)`` is ``rel_pos_bias[max_positions - 1 + j - i]``. Variants: ``"from-start"``
    takes the ``2T - 1`` entries from the vector's start (a function of ``i - j`` that changes
    with ``T``); ``"untiled"`` views the vector repeated without the pad (not a function of ``i - j``)."""

    def __init__(self, max_positions=CTX, bias="centred"):
        super().__init__()
        self.max_positions = max_positions
        self.bias = bias
        self.rel_pos_bias = nn.Parameter(torch.randn(2 * max_positions - 1) * 0.02)

    def forward(self, seq_len):
        b = self.rel_pos_bias[(self.max_positions - seq_len):(self.max_positions + seq_len - 1)]
        if self.bias == "from-start":
            b = self.rel_pos_bias[:2 * seq_len - 1]
        if self.bias == "untiled":
            return b[:seq_len].repeat(seq_len).view(seq_len, seq_len) * b[seq_len - 1:, None]
        t = F.pad(b, (0, seq_len))  # 3 * seq_len - 1
        t = torch.tile(t, (seq_len,))
        t = t[:-seq_len]
        t = t.view(seq_len, 3 * seq_len - 2)
        r = (2 * seq_len - 1) // 2
        start = r
        end = t.size(1) - r
        return t[:, start:end]


class MovingAverageGatedAttention(nn.Module):
    """fairseq/modules/moving_average_gated_attention.py: EMA, single-head softmax attention
    with the relative bias and a ``triu(-inf)`` future mask, ``torch.addcmul`` gated update."""

    def __init__(self, embed_dim=DIM, zdim=16, hdim=64, bias="centred"):
        super().__init__()
        self.embed_dim, self.zdim, self.hdim = embed_dim, zdim, hdim
        self.scaling = self.zdim ** -0.5
        self.move = MultiHeadEMA(embed_dim)
        self.v_proj = nn.Linear(embed_dim, hdim)
        self.mx_proj = nn.Linear(embed_dim, zdim + hdim + 2 * embed_dim)
        self.h_proj = nn.Linear(hdim, embed_dim)
        self.gamma = nn.Parameter(torch.randn(2, zdim) * 0.02)
        self.beta = nn.Parameter(torch.zeros(2, zdim))
        self.rel_pos_bias = SimpleRelativePositionalBias(bias=bias)

    def softmax_attention(self, q, k, attn_mask):
        slen = k.size(1)
        bias = self.rel_pos_bias(slen)
        q = q * self.scaling
        qk = torch.bmm(q, k.transpose(1, 2)) + bias  # B x L x S
        qk = qk + attn_mask.unsqueeze(0)
        return F.softmax(qk, dim=-1).type_as(qk)

    def forward(self, x, attn_mask):
        residual = x
        v = F.silu(self.v_proj(x))  # L x B x E
        mx = self.move(x)
        base = self.mx_proj(mx)
        u, zr, hx = torch.split(base, [self.embed_dim, self.zdim + self.hdim, self.embed_dim], dim=-1)
        u = torch.sigmoid(u)
        z, r = torch.split(F.silu(zr), [self.zdim, self.hdim], dim=-1)
        z = z.unsqueeze(2) * self.gamma + self.beta  # L x B x 2 x S
        q, k = torch.unbind(z, dim=2)
        q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
        attn_weights = self.softmax_attention(q, k, attn_mask)
        h = torch.bmm(attn_weights, v).transpose(0, 1)  # L x B x E
        h = F.silu(hx + self.h_proj(h * r))
        return torch.addcmul(residual, u, h - residual)


def fill_with_neg_inf(t):
    return t.float().fill_(float("-inf")).type_as(t)


class MegaLM(nn.Module):
    """MEGA decoder layers (prenorm), sequence-first inside."""

    def __init__(self, bias="centred"):
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList([MovingAverageGatedAttention(DIM, bias=bias) for _ in range(LAYERS)])
        self.norms = nn.ModuleList([nn.LayerNorm(DIM) for _ in range(LAYERS)])
        self.output_projection = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, src_tokens):
        seq_len = src_tokens.size(1)
        x = self.embed_tokens(src_tokens).transpose(0, 1)  # B x T x C -> T x B x C
        attn_mask = torch.triu(fill_with_neg_inf(x.new_zeros(seq_len, seq_len)), 1)
        for layer, norm in zip(self.layers, self.norms):
            x = layer(norm(x), attn_mask)
        return self.output_projection(x.transpose(0, 1))
