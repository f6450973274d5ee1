"""karpathy/nanochat nanochat/gpt.py and nanochat/flash_attention.py (the SDPA path, as on CPU).

Written to nanochat's spellings at a tiny size: functional ``F.rms_norm`` after the embedding
and as QK norm, rotary ``cos`` / ``sin`` buffers over ten times the context kept in bfloat16
and cut ``[:, T0:T0 + T]``, value embeddings on alternating layers mixed into ``v`` through
``2 * sigmoid(ve_gate(x[..., :C]))``, the smear (each row plus a gated copy of the row before
it), ``resid_lambdas`` / ``x0_lambdas``, relu^2, per-projection scalars, a padded vocabulary
cut from the logits, float32 logits soft-capped at 15. Attention is the SDPA fallback of
``flash_attn_func``: ``is_causal`` when the window covers the sequence, else a boolean mask
``col <= row & row - col <= window`` built from ``arange`` (the "S" layers' window is half the
context, shorter than the trees' paths). Left out: the KV cache, FA3, the optimizer setup.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from zoo_repos.common import VOCAB

N_EMBD, N_HEAD, N_KV_HEAD, SEQUENCE_LEN = 32, 4, 2, 8


def norm(x):
    return F.rms_norm(x, (x.size(-1),))


def rotate(x, cos, sin):
    half = x.shape[3] // 2
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * cos + b * sin, a * (-sin) + b * cos], 3)


def sdpa_window(q, k, v, window, enable_gqa):
    """``flash_attn_func``'s SDPA fallback on ``(B, H, T, D)``, training (Tq == Tk)."""
    tq, tk = q.size(2), k.size(2)
    if (window < 0 or window >= tq) and tq == tk:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=enable_gqa)
    row = (tk - tq) + torch.arange(tq, device=q.device).unsqueeze(1)
    col = torch.arange(tk, device=q.device).unsqueeze(0)
    mask = col <= row
    if 0 <= window < tk:
        mask = mask & ((row - col) <= window)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=enable_gqa)


class ChatAttention(nn.Module):
    def __init__(self, has_ve: bool) -> None:
        super().__init__()
        self.hd = N_EMBD // N_HEAD
        self.c_q = nn.Linear(N_EMBD, N_HEAD * self.hd, bias=False)
        self.c_k = nn.Linear(N_EMBD, N_KV_HEAD * self.hd, bias=False)
        self.c_v = nn.Linear(N_EMBD, N_KV_HEAD * self.hd, bias=False)
        self.c_proj = nn.Linear(N_EMBD, N_EMBD, bias=False)
        self.ve_gate_channels = 8
        self.ve_gate = nn.Linear(self.ve_gate_channels, N_KV_HEAD, bias=False) if has_ve else None
        self.c_proj_scalar = nn.Parameter(torch.ones(N_EMBD))

    def forward(self, x, ve, cos_sin, window):
        b, t, _ = x.size()
        q = self.c_q(x).view(b, t, N_HEAD, self.hd)
        k = self.c_k(x).view(b, t, N_KV_HEAD, self.hd)
        v = self.c_v(x).view(b, t, N_KV_HEAD, self.hd)
        if ve is not None:
            gate = 2 * torch.sigmoid(self.ve_gate(x[..., :self.ve_gate_channels]))
            v = v + gate.unsqueeze(-1) * ve.view(b, t, N_KV_HEAD, self.hd)
        cos, sin = cos_sin
        q, k = norm(rotate(q, cos, sin)), norm(rotate(k, cos, sin))
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        y = sdpa_window(q, k, v, window, enable_gqa=N_HEAD != N_KV_HEAD).transpose(1, 2)
        return self.c_proj(y.contiguous().view(b, t, -1)) * self.c_proj_scalar


class ChatMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c_fc = nn.Linear(N_EMBD, 4 * N_EMBD, bias=False)
        self.c_proj = nn.Linear(4 * N_EMBD, N_EMBD, bias=False)
        self.c_proj_scalar = nn.Parameter(torch.ones(N_EMBD))

    def forward(self, x):
        return self.c_proj(F.relu(self.c_fc(x)).square()) * self.c_proj_scalar


class ChatBlock(nn.Module):
    def __init__(self, has_ve: bool) -> None:
        super().__init__()
        self.attn_norm, self.mlp_norm = nn.RMSNorm(N_EMBD), nn.RMSNorm(N_EMBD)
        self.attn, self.mlp = ChatAttention(has_ve), ChatMLP()

    def forward(self, x, ve, cos_sin, window):
        x = x + self.attn(self.attn_norm(x), ve, cos_sin, window)
        return x + self.mlp(self.mlp_norm(x))


class NanoChat(nn.Module):
    """nanochat's GPT: 2 layers, window pattern "SL" (half the context, then all of it)."""

    def __init__(self, n_layer: int = 2, pad_vocab_to: int = 64) -> None:
        super().__init__()
        padded = (VOCAB + pad_vocab_to - 1) // pad_vocab_to * pad_vocab_to
        has_ve = [i % 2 == (n_layer - 1) % 2 for i in range(n_layer)]
        self.windows = [SEQUENCE_LEN // 2 if i % 2 == 0 else SEQUENCE_LEN for i in range(n_layer)]
        self.windows[-1] = SEQUENCE_LEN
        self.wte = nn.Embedding(padded, N_EMBD)
        self.h = nn.ModuleList(ChatBlock(v) for v in has_ve)
        self.lm_head = nn.Linear(N_EMBD, padded, bias=False)
        self.resid_lambdas = nn.Parameter(torch.ones(n_layer))
        self.x0_lambdas = nn.Parameter(torch.full((n_layer,), 0.1))
        kv_dim = N_KV_HEAD * (N_EMBD // N_HEAD)
        self.value_embeds = nn.ModuleDict({str(i): nn.Embedding(padded, kv_dim) for i in range(n_layer) if has_ve[i]})
        self.smear_gate = nn.Linear(8, 1, bias=False)
        self.smear_lambda = nn.Parameter(torch.tensor(0.5))
        hd = N_EMBD // N_HEAD
        inv_freq = 1.0 / (10000 ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
        freqs = torch.outer(torch.arange(SEQUENCE_LEN * 10, dtype=torch.float32), inv_freq)
        self.register_buffer("cos", freqs.cos().bfloat16()[None, :, None, :], persistent=False)
        self.register_buffer("sin", freqs.sin().bfloat16()[None, :, None, :], persistent=False)

    def forward(self, idx):
        b, t = idx.size()
        assert t <= self.cos.size(1)
        t0 = 0
        cos_sin = self.cos[:, t0:t0 + t], self.sin[:, t0:t0 + t]
        x = norm(self.wte(idx))
        if t > 1:
            gate = self.smear_lambda.to(x.dtype) * torch.sigmoid(self.smear_gate(x[:, 1:, :8]))
            x = torch.cat([x[:, :1], x[:, 1:] + gate * x[:, :-1]], dim=1)
        x0 = x
        for i, block in enumerate(self.h):
            x = self.resid_lambdas[i] * x + self.x0_lambdas[i] * x0
            ve = self.value_embeds[str(i)](idx) if str(i) in self.value_embeds else None
            x = block(x, ve, cos_sin, self.windows[i])
        logits = self.lm_head(norm(x))[..., :VOCAB].float()
        return 15 * torch.tanh(logits / 15)
