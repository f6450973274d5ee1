"""x-transformers' decoder with its attention options that carry scores across heads and layers:
``Decoder(attn_talking_heads=True, residual_attn=True, gate_residual=True)``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from zoo_repos.common import DIM, HD, HEADS, LAYERS, VOCAB
from zoo_repos.xtransformers_olmo import XFeedForward, XLayerNorm, x_create_causal_mask


class XTalkingAttention(nn.Module):
    """x_transformers.py ``Attention`` with ``talking_heads``: the heads' scores mixed by a 1 x 1
    ``Conv2d`` before and after the softmax, the previous layer's pre-softmax scores added
    (``residual_attn``: RealFormer), and the pre-softmax scores kept as an intermediate."""

    def __init__(self, dim, dim_head=HD, heads=HEADS):
        super().__init__()
        self.heads, self.scale = heads, dim_head ** -0.5
        self.to_q = nn.Linear(dim, dim_head * heads, bias=False)
        self.to_k = nn.Linear(dim, dim_head * heads, bias=False)
        self.to_v = nn.Linear(dim, dim_head * heads, bias=False)
        self.pre_softmax_talking_heads = nn.Conv2d(heads, heads, 1, bias=False)
        self.post_softmax_talking_heads = nn.Conv2d(heads, heads, 1, bias=False)
        self.to_out = nn.Linear(dim_head * heads, dim, bias=False)

    def forward(self, x, prev_attn=None):
        b, n, _ = x.shape
        q, k, v = (t.view(b, n, self.heads, -1).transpose(1, 2) for t in (self.to_q(x), self.to_k(x), self.to_v(x)))
        dots = torch.einsum('b h i d, b h j d -> b h i j', q, k) * self.scale
        mask_value = -torch.finfo(dots.dtype).max
        if prev_attn is not None:
            dots = dots + prev_attn
        pre_softmax_attn = dots.clone()
        dots = self.pre_softmax_talking_heads(dots)
        i, j = dots.shape[-2:]
        dots = dots.masked_fill(x_create_causal_mask(i, j, device=x.device), mask_value)
        attn = F.softmax(dots, dim=-1, dtype=torch.float32).type(dots.dtype)
        attn = self.post_softmax_talking_heads(attn)
        out = torch.einsum('b h i j, b h j d -> b h i d', attn, v)
        return self.to_out(out.transpose(1, 2).reshape(b, n, -1)), pre_softmax_attn


class XGRUGating(nn.Module):
    """x_transformers.py ``GRUGating``: the residual joined by a ``GRUCell`` on the flattened tokens."""

    def __init__(self, dim):
        super().__init__()
        self.gru = nn.GRUCell(dim, dim)

    def forward(self, x, residual):
        gated_output = self.gru(x.reshape(-1, x.shape[-1]), residual.reshape(-1, x.shape[-1]))
        return gated_output.reshape_as(x)


class XTalkingDecoder(nn.Module):
    """``TransformerWrapper(attn_layers=Decoder(attn_talking_heads=True, residual_attn=True,
    gate_residual=True))`` with learned absolute positions: each attention layer adds the previous
    one's pre-softmax scores to its own."""

    def __init__(self, num_tokens=VOCAB, dim=DIM, depth=LAYERS, max_seq_len=64):
        super().__init__()
        self.token_emb = nn.Embedding(num_tokens, dim)
        self.pos_emb = nn.Embedding(max_seq_len, dim)
        self.layers = nn.ModuleList()
        for _ in range(depth):
            self.layers.append(nn.ModuleList([XLayerNorm(dim), XTalkingAttention(dim), XGRUGating(dim)]))
            self.layers.append(nn.ModuleList([XLayerNorm(dim), XFeedForward(dim), XGRUGating(dim)]))
        self.final_norm = XLayerNorm(dim)
        self.to_logits = nn.Linear(dim, num_tokens, bias=False)

    def forward(self, x):
        x = self.token_emb(x) + self.pos_emb(torch.arange(x.shape[1], device=x.device))
        prev_attn = None
        for norm, block, gate in self.layers:
            if isinstance(block, XTalkingAttention):
                out, prev_attn = block(norm(x), prev_attn=prev_attn)
            else:
                out = block(norm(x))
            x = gate(out, x)
        return self.to_logits(self.final_norm(x))
