"""QwenLM/Qwen modeling_qwen.py (Qwen-1 remote code, the non-flash path) at a tiny size.

Fused ``c_attn`` with bias; ``RotaryEmbedding`` caching ``[cos, sin]`` on itself over
``max(2 * seqlen, 16)`` positions (rebuilt when a longer sequence comes, with its NTK alpha),
cut ``[:, :seq_len]`` and applied in float32 on ``[b, s, h, d]``; ``logn_tensor`` (a buffer of
``log(i, seq_length)`` past the training length) cut ``[:, key_len - q_len : key_len]`` scaling the
queries; a boolean ``tril`` buffer cut ``[:, :, key_len - q_len : key_len, :key_len]`` applied
with ``torch.where(mask, w, finfo.min)``; RMSNorm, the ``w1 * silu(w2)`` MLP. Left out: the KV
cache, flash attention, dropout, the dynamic NTK alpha of inference.
"""

import math
import torch
import torch.nn as nn
import torch.nn.functional as F


class RotaryEmbedding(torch.nn.Module):
    def __init__(self, dim, base=10000):
        super().__init__()
        self.dim = dim
        self.base = base
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self._seq_len_cached = 0
        self._ntk_alpha_cached = 1.0
        self._rotary_pos_emb_cache = None

    def update_rotary_pos_emb_cache(self, seqlen, ntk_alpha=1.0):
        if seqlen > self._seq_len_cached or ntk_alpha != self._ntk_alpha_cached:
            base = self.base * ntk_alpha ** (self.dim / (self.dim - 2))
            self.inv_freq = 1.0 / (base ** (torch.arange(0, self.dim, 2, device=self.inv_freq.device).float() / self.dim))
            self._seq_len_cached = max(2 * seqlen, 16)
            self._ntk_alpha_cached = ntk_alpha
            seq = torch.arange(self._seq_len_cached, device=self.inv_freq.device)
            freqs = torch.outer(seq.type_as(self.inv_freq), self.inv_freq)
            emb = torch.cat((freqs, freqs), dim=-1)
            emb = emb[None, :, None, :]  # "n d -> 1 n 1 d"
            cos, sin = emb.cos(), emb.sin()
            self._rotary_pos_emb_cache = [cos, sin]

    def forward(self, max_seq_len, ntk_alpha=1.0):
        self.update_rotary_pos_emb_cache(max_seq_len, ntk_alpha)
        cos, sin = self._rotary_pos_emb_cache
        return [cos[:, :max_seq_len], sin[:, :max_seq_len]]


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(t, freqs):
    cos, sin = freqs
    rot_dim = freqs[0].shape[-1]
    t_, t_pass_ = t[..., :rot_dim], t[..., rot_dim:]
    t_ = t_.float()
    t_pass_ = t_pass_.float()
    t_ = (t_ * cos.to(t_)) + (_rotate_half(t_) * sin.to(t_))
    return torch.cat((t_, t_pass_), dim=-1).type_as(t)


class QWenAttention(nn.Module):
    def __init__(self, hidden_size=32, num_heads=4, seq_length=8, max_positions=64):
        super().__init__()
        self.register_buffer("bias", torch.tril(torch.ones((max_positions, max_positions), dtype=torch.bool)).view(
            1, 1, max_positions, max_positions), persistent=False)
        self.num_heads = num_heads
        self.head_dim = hidden_size // num_heads
        self.split_size = hidden_size
        self.c_attn = nn.Linear(hidden_size, 3 * hidden_size)
        self.c_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        logn_list = [math.log(i, seq_length) if i > seq_length else 1 for i in range(1, 32768)]
        self.register_buffer("logn_tensor", torch.tensor(logn_list)[None, :, None, None], persistent=False)

    def _attn(self, query, key, value):
        attn_weights = torch.matmul(query, key.transpose(-1, -2))
        attn_weights = attn_weights / torch.full([], value.size(-1) ** 0.5, dtype=attn_weights.dtype)
        query_length, key_length = query.size(-2), key.size(-2)
        causal_mask = self.bias[:, :, key_length - query_length: key_length, :key_length]
        mask_value = torch.finfo(attn_weights.dtype).min
        mask_value = torch.full([], mask_value, dtype=attn_weights.dtype).to(attn_weights.device)
        attn_weights = torch.where(causal_mask, attn_weights.to(attn_weights.dtype), mask_value)
        attn_weights = nn.functional.softmax(attn_weights, dim=-1)
        attn_weights = attn_weights.type(value.dtype)
        return torch.matmul(attn_weights, value)

    def forward(self, hidden_states, rotary_pos_emb):
        mixed_x_layer = self.c_attn(hidden_states)
        query, key, value = mixed_x_layer.split(self.split_size, dim=2)
        query = query.view(query.size()[:-1] + (self.num_heads, self.head_dim))
        key = key.view(key.size()[:-1] + (self.num_heads, self.head_dim))
        value = value.view(value.size()[:-1] + (self.num_heads, self.head_dim))
        query = apply_rotary_pos_emb(query, rotary_pos_emb)
        key = apply_rotary_pos_emb(key, rotary_pos_emb)
        seq_start = key.size(1) - query.size(1)
        seq_end = key.size(1)
        logn_tensor = self.logn_tensor[:, seq_start:seq_end, :, :].type_as(query)
        query = query * logn_tensor.expand_as(query)
        query, key, value = query.permute(0, 2, 1, 3), key.permute(0, 2, 1, 3), value.permute(0, 2, 1, 3)
        attn_output = self._attn(query, key, value)
        attn_output = attn_output.transpose(1, 2).contiguous()
        attn_output = attn_output.view(attn_output.size()[:-2] + (self.num_heads * self.head_dim,))
        return self.c_proj(attn_output)


class QWenBlock(nn.Module):
    def __init__(self, hidden_size=32, ff=64):
        super().__init__()
        self.ln_1 = nn.RMSNorm(hidden_size, eps=1e-6)
        self.attn = QWenAttention(hidden_size)
        self.ln_2 = nn.RMSNorm(hidden_size, eps=1e-6)
        self.w1 = nn.Linear(hidden_size, ff // 2, bias=False)
        self.w2 = nn.Linear(hidden_size, ff // 2, bias=False)
        self.c_proj = nn.Linear(ff // 2, hidden_size, bias=False)

    def forward(self, x, rotary_pos_emb):
        x = x + self.attn(self.ln_1(x), rotary_pos_emb)
        h = self.ln_2(x)
        return x + self.c_proj(self.w1(h) * F.silu(self.w2(h)))


class QWen1LM(nn.Module):
    def __init__(self, vocab_size=32, hidden_size=32, n_layers=2):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, hidden_size)
        self.rotary_emb = RotaryEmbedding(hidden_size // 4)
        self.h = nn.ModuleList([QWenBlock(hidden_size) for _ in range(n_layers)])
        self.ln_f = nn.RMSNorm(hidden_size, eps=1e-6)
        self.lm_head = nn.Linear(hidden_size, vocab_size, bias=False)

    def forward(self, input_ids):
        hidden_states = self.wte(input_ids)
        kv_seq_len = hidden_states.size()[1]
        rotary_pos_emb = self.rotary_emb(kv_seq_len, ntk_alpha=1.0)
        for block in self.h:
            hidden_states = block(hidden_states, rotary_pos_emb)
        return self.lm_head(self.ln_f(hidden_states))
