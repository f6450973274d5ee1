"""EleutherAI/gpt-neox (megatron/model/positional_embeddings.py ``ParallelKerpleLog``, the
``kerple_log`` position embedding, and transformer.py's torch softmax path) at a tiny size.

One ``ParallelKerpleLog`` is made by the model and handed to every layer (gpt-neox builds the
rpe once). Its forward clamps its two parameters in place through ``.data`` (in every layer's
call), caches the ``tril`` distance matrix ``arange(k)[:, None].repeat(1, k) + arange(0, -k, -1)``
on itself, and adds ``-p * log(1 + a * diff)`` to the scores; the mask is gpt-neox's
``tril(ones) < 0.5`` filled with -10000 in place. Model parallelism, fused softmax, dropout and
the inference cache are left out. ``shrink`` makes the clamp a write that is not idempotent
(``p.data = p.data * 0.5``), which the layers after the first would read changed.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from zoo_repos.common import DIM, HEADS, VOCAB


class ParallelKerpleLog(nn.Module):
    """Kernelized T5 Relative Position Bias parallelized in the heads dimension"""

    def __init__(self, heads, shrink=False):
        super().__init__()
        self.heads = heads
        self.num_heads_per_partition = heads
        self.eps = 1e-2
        self.shrink = shrink

        # The kernel has the form -p*log(1+a*|m-n|)
        def get_parameter(scale):
            return nn.Parameter(torch.rand(self.num_heads_per_partition)[:, None, None] * scale)

        self.bias_p = get_parameter(2)
        self.bias_a = get_parameter(1)
        self.cached_matrix = None
        self.cached_seq_len = None

    def forward(self, x):
        # [b, np, sq, sk]
        seq_len_k = x.shape[-1]
        if self.cached_seq_len != seq_len_k:
            diff = torch.tril(
                torch.arange(seq_len_k, device=x.device).view(seq_len_k, 1).repeat(1, seq_len_k)
                + torch.arange(0, -seq_len_k, -1, device=x.device)
            )
            diff = diff.to(x.dtype)
            self.cached_seq_len = seq_len_k
            self.cached_matrix = diff
        else:
            diff = self.cached_matrix
        if self.shrink:
            self.bias_p.data = self.bias_p.data * 0.5
        else:
            self.bias_p.data = self.bias_p.data.clamp(min=self.eps)
            self.bias_a.data = self.bias_a.data.clamp(min=self.eps)
        bias = -self.bias_p * torch.log(1 + self.bias_a * diff)  # log kernel
        return x + bias


class ParallelSelfAttention(nn.Module):
    def __init__(self, rpe):
        super().__init__()
        self.hn = DIM // HEADS
        self.query_key_value = nn.Linear(DIM, 3 * DIM)
        self.dense = nn.Linear(DIM, DIM)
        self.norm_factor = math.sqrt(self.hn)
        self.rpe = rpe

    def forward(self, hidden_states, ltor_mask):
        # [sq, b, h] sequence-first, as gpt-neox
        sq, b, _ = hidden_states.shape
        mixed = self.query_key_value(hidden_states).view(sq, b, HEADS, 3 * self.hn)
        query_layer, key_layer, value_layer = torch.split(mixed, self.hn, dim=3)
        # [b, np, sq, sk]
        q = query_layer.reshape(sq, b * HEADS, -1).transpose(0, 1)
        k = key_layer.reshape(sq, b * HEADS, -1).transpose(0, 1)
        scores = torch.baddbmm(torch.zeros(b * HEADS, sq, sq, dtype=q.dtype, device=q.device), q, k.transpose(1, 2),
                               beta=0.0, alpha=1.0 / self.norm_factor).view(b, HEADS, sq, sq)
        scores = self.rpe(scores)
        scores.masked_fill_(ltor_mask, -10000.0)
        probs = torch.nn.Softmax(dim=-1)(scores)
        v = value_layer.reshape(sq, b * HEADS, -1).transpose(0, 1)
        context = torch.bmm(probs.view(b * HEADS, sq, sq), v)
        context = context.view(b, HEADS, sq, self.hn).permute(2, 0, 1, 3).reshape(sq, b, DIM)
        return self.dense(context)


class ParallelTransformerLayer(nn.Module):
    def __init__(self, rpe):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(DIM)
        self.post_attention_layernorm = nn.LayerNorm(DIM)
        self.attention = ParallelSelfAttention(rpe)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

    def forward(self, x, mask):
        # gpt-neox's parallel residual (gpt_j_residual)
        return x + self.attention(self.input_layernorm(x), mask) + self.mlp(self.post_attention_layernorm(x))


class NeoXKerpleLM(nn.Module):
    def __init__(self, layers=2, shrink=False):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        rpe = ParallelKerpleLog(HEADS, shrink=shrink)
        self.layers = nn.ModuleList(ParallelTransformerLayer(rpe) for _ in range(layers))
        self.final_norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, idx):
        b, t = idx.shape
        # get_ltor_masks_and_position_ids: tril(ones) < 0.5
        mask = torch.tril(torch.ones((1, t, t), device=idx.device)).view(1, 1, t, t) < 0.5
        x = self.embed(idx).transpose(0, 1)  # [s, b, h]
        for layer in self.layers:
            x = layer(x, mask)
        return self.head(self.final_norm(x)).transpose(0, 1)


def kerple_params_above_eps(model: NeoXKerpleLM) -> NeoXKerpleLM:
    """Moves the KERPLE parameters above the clamp's eps (the zoo's perturbation gives them either
    sign): the clamp runs in every call and leaves them as they are, as in training after the first
    step, so the model after a tree call holds what it held before."""
    rpe = model.layers[0].attention.rpe
    with torch.no_grad():
        for p in (rpe.bias_p, rpe.bias_a):
            p.copy_(p.abs() + 0.05)
    return model
