"""labmlai/annotated_deep_learning_paper_implementations labml_nn/transformers (mha.py,
models.py, utils.py) at a tiny size.

Sequence-first ``[seq, batch, d]`` throughout; ``PrepareForMultiHeadAttention`` views the
projections as ``[seq, batch, heads, d_k]``; scores ``einsum('ibhd,jbhd->ijbh')`` scaled in
place, a ``subsequent_mask`` (``tril(ones(T, T)).bool().unsqueeze(-1)``, unsqueezed again to
``[seq_q, seq_k, batch, heads]``) applied with ``masked_fill(mask == 0, -inf)``, ``nn.Softmax(dim=1)``
over the keys, ``einsum('ijbh,jbhd->ibhd')``; pre-norm ``TransformerLayer`` with a ReLU
``FeedForward``; learned positional encodings ``positional_encodings[:x.shape[0]]``. Called as the
zoo calls models (``idx [B, T]``): the adapter transposes to sequence-first and back.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from zoo_repos.common import VOCAB

D_MODEL, HEADS, MAX_LEN = 32, 4, 64


def subsequent_mask(seq_len):
    return torch.tril(torch.ones(seq_len, seq_len)).to(torch.bool).unsqueeze(-1)


class PrepareForMultiHeadAttention(nn.Module):
    def __init__(self, d_model, heads, d_k, bias):
        super().__init__()
        self.linear = nn.Linear(d_model, heads * d_k, bias=bias)
        self.heads, self.d_k = heads, d_k

    def forward(self, x):
        head_shape = x.shape[:-1]
        return self.linear(x).view(*head_shape, self.heads, self.d_k)


class LabmlMultiHeadAttention(nn.Module):
    def __init__(self, heads, d_model, bias=True):
        super().__init__()
        self.d_k, self.heads = d_model // heads, heads
        self.query = PrepareForMultiHeadAttention(d_model, heads, self.d_k, bias)
        self.key = PrepareForMultiHeadAttention(d_model, heads, self.d_k, bias)
        self.value = PrepareForMultiHeadAttention(d_model, heads, self.d_k, True)
        self.softmax = nn.Softmax(dim=1)
        self.output = nn.Linear(d_model, d_model)
        self.scale = 1 / math.sqrt(self.d_k)

    def prepare_mask(self, mask, query_shape, key_shape):
        return mask.unsqueeze(-1)  # [seq_q, seq_k, batch, heads]

    def forward(self, *, query, key, value, mask=None):
        seq_len, batch_size, _ = query.shape
        if mask is not None:
            mask = self.prepare_mask(mask, query.shape, key.shape)
        query, key, value = self.query(query), self.key(key), self.value(value)
        scores = torch.einsum("ibhd,jbhd->ijbh", query, key)
        scores *= self.scale
        if mask is not None:
            scores = scores.masked_fill(mask == 0, float("-inf"))
        attn = self.softmax(scores)
        x = torch.einsum("ijbh,jbhd->ibhd", attn, value)
        return self.output(x.reshape(seq_len, batch_size, -1))


class LabmlLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.self_attn = LabmlMultiHeadAttention(HEADS, D_MODEL)
        self.feed_forward = nn.Sequential(nn.Linear(D_MODEL, 2 * D_MODEL), nn.ReLU(), nn.Linear(2 * D_MODEL, D_MODEL))
        self.norm_self_attn, self.norm_ff = nn.LayerNorm(D_MODEL), nn.LayerNorm(D_MODEL)

    def forward(self, *, x, mask):
        z = self.norm_self_attn(x)
        x = x + self.self_attn(query=z, key=z, value=z, mask=mask)
        return x + self.feed_forward(self.norm_ff(x))


class LabmlTransformerLM(nn.Module):
    def __init__(self, n_layers: int = 2, causal: bool = True) -> None:
        super().__init__()
        self.causal = causal
        self.embed = nn.Embedding(VOCAB, D_MODEL)
        self.positional_encodings = nn.Parameter(torch.zeros(MAX_LEN, 1, D_MODEL))
        self.layers = nn.ModuleList(LabmlLayer() for _ in range(n_layers))
        self.norm = nn.LayerNorm(D_MODEL)
        self.generator = nn.Linear(D_MODEL, VOCAB)

    def forward(self, idx):
        x = idx.t()
        mask = subsequent_mask(x.shape[0]).to(x.device) if self.causal else None
        h = self.embed(x) * math.sqrt(D_MODEL) + self.positional_encodings[:x.shape[0]]
        for layer in self.layers:
            h = layer(x=h, mask=mask)
        return self.generator(self.norm(h)).transpose(0, 1)
