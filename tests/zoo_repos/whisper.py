"""openai/whisper ``whisper/model.py``: the text decoder, cut to its self-attention.

Whisper imports the attention op by name at module level (``from torch.nn.functional import
scaled_dot_product_attention``) and calls it with ``is_causal=mask is not None and n_ctx > 1``:
a comparison of the length, which is a symbolic bool while the length is symbolic.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from zoo_repos.common import CTX, DIM, HEADS, LAYERS, VOCAB

try:
    from torch.nn.functional import scaled_dot_product_attention

    SDPA_AVAILABLE = True
except (ImportError, RuntimeError, OSError):
    scaled_dot_product_attention = None
    SDPA_AVAILABLE = False


class LayerNorm(nn.LayerNorm):
    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x).type(x.dtype)  # whisper: x.float() (a float32 norm in a float64 model)


class Linear(nn.Linear):
    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))


class MultiHeadAttention(nn.Module):
    use_sdpa = True

    def __init__(self, n_state: int, n_head: int):
        super().__init__()
        self.n_head = n_head
        self.query = Linear(n_state, n_state)
        self.key = Linear(n_state, n_state, bias=False)
        self.value = Linear(n_state, n_state)
        self.out = Linear(n_state, n_state)

    def forward(self, x: Tensor, mask: Optional[Tensor] = None):
        q, k, v = self.query(x), self.key(x), self.value(x)
        wv, qk = self.qkv_attention(q, k, v, mask)
        return self.out(wv), qk

    def qkv_attention(self, q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor] = None):
        n_batch, n_ctx, n_state = q.shape
        scale = (n_state // self.n_head) ** -0.25
        q = q.view(*q.shape[:2], self.n_head, -1).permute(0, 2, 1, 3)
        k = k.view(*k.shape[:2], self.n_head, -1).permute(0, 2, 1, 3)
        v = v.view(*v.shape[:2], self.n_head, -1).permute(0, 2, 1, 3)
        if SDPA_AVAILABLE and MultiHeadAttention.use_sdpa:
            a = scaled_dot_product_attention(q, k, v, is_causal=mask is not None and n_ctx > 1)
            out = a.permute(0, 2, 1, 3).flatten(start_dim=2)
            qk = None
        else:
            qk = (q * scale) @ (k * scale).transpose(-1, -2)
            if mask is not None:
                qk = qk + mask[:n_ctx, :n_ctx]
            qk = qk.float()
            w = F.softmax(qk, dim=-1).to(q.dtype)
            out = (w @ v).permute(0, 2, 1, 3).flatten(start_dim=2)
            qk = qk.detach()
        return out, qk


class ResidualAttentionBlock(nn.Module):
    def __init__(self, n_state: int, n_head: int):
        super().__init__()
        self.attn = MultiHeadAttention(n_state, n_head)
        self.attn_ln = LayerNorm(n_state)
        self.mlp = nn.Sequential(Linear(n_state, 4 * n_state), nn.GELU(), Linear(4 * n_state, n_state))
        self.mlp_ln = LayerNorm(n_state)

    def forward(self, x: Tensor, mask: Optional[Tensor] = None):
        x = x + self.attn(self.attn_ln(x), mask=mask)[0]
        return x + self.mlp(self.mlp_ln(x))


class WhisperTextDecoder(nn.Module):
    """``TextDecoder`` without the cross-attention and the KV cache: learned positions sliced
    ``[offset : offset + T]``, the ``-inf`` ``triu_(1)`` mask buffer handed to each block, logits
    against the token embedding; attention by the imported SDPA (``use_sdpa``, whisper's default).
    Its float32 casts (the norm's input, the logits) are left out: the zoo compares in float64."""

    def __init__(self, n_vocab: int = VOCAB, n_ctx: int = CTX, n_state: int = DIM, n_head: int = HEADS,
                 n_layer: int = LAYERS):
        super().__init__()
        self.token_embedding = nn.Embedding(n_vocab, n_state)
        self.positional_embedding = nn.Parameter(torch.empty(n_ctx, n_state))
        self.blocks = nn.ModuleList([ResidualAttentionBlock(n_state, n_head) for _ in range(n_layer)])
        self.ln = LayerNorm(n_state)
        mask = torch.empty(n_ctx, n_ctx).fill_(-np.inf).triu_(1)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        offset = 0
        x = self.token_embedding(x) + self.positional_embedding[offset: offset + x.shape[-1]]
        for block in self.blocks:
            x = block(x, mask=self.mask)
        x = self.ln(x)
        return x @ torch.transpose(self.token_embedding.weight.to(x.dtype), 0, 1)  # whisper: .float()
