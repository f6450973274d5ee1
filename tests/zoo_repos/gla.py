"""Gated Linear Attention written on flash-linear-attention's kernels (sustcsonglin/flash-linear-attention,
``fla/layers/gla.py`` and ``fla/ops/gla/naive.py``) at a tiny size.

fla's GLA layer: q / k / v projections, a low-rank ``gk_proj`` (``Linear(d, 16) -> Linear(16, K)``)
with ``logsigmoid(gk) / gate_logit_normalizer``, the kernel on ``[B, T, H, D]``, a per-head RMSNorm
gated by ``swish(g_proj(x))``, ``o_proj``. The kernel is called by one of fla's names (``mode``):
``naive_recurrent_gla`` (the reference loop over the tokens, as fla writes it, without its
``.float()`` casts so that the float64 zoo compares in float64), ``chunk_gla`` (the Triton kernel's
name and arguments, computed here by the same loop: no CUDA), or ``fused_recurrent_gla`` with a
decay on the values too (``gv``), which treecompile's GLA scan does not take.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from zoo_repos.common import DIM, LAYERS, VOCAB


def naive_recurrent_gla(q, k, v, gk, initial_state=None, output_final_state=False):
    dtype = q.dtype
    q, k, v, gk = map(lambda x: x.transpose(1, 2), (q, k, v, gk))
    B, H, T, K, V = *q.shape, v.shape[-1]
    o = torch.zeros_like(v)
    scale = K ** -0.5
    h = q.new_zeros(B, H, K, V)
    if initial_state is not None:
        h += initial_state
    for i in range(T):
        q_i = q[:, :, i] * scale
        k_i = k[:, :, i]
        v_i = v[:, :, i]
        gk_i = gk[:, :, i].exp()
        kv_i = k_i[..., None] * v_i[..., None, :]
        h = h * gk_i[..., None] + kv_i
        o[:, :, i] = (q_i[..., None] * h).sum(-2)
    if not output_final_state:
        h = None
    return o.transpose(1, 2).to(dtype), h


def chunk_gla(q, k, v, g, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None):
    """fla's chunked kernel's signature (Triton on CUDA); here its reference loop."""
    scale = k.shape[-1] ** -0.5 if scale is None else scale
    o, h = naive_recurrent_gla(q * (scale / k.shape[-1] ** -0.5), k, v, g, initial_state, output_final_state)
    return o, h


def fused_recurrent_gla(q, k, v, gk=None, gv=None, scale=None, initial_state=None, output_final_state=False,
                        reverse=False, cu_seqlens=None):
    """fla's fused recurrent kernel's signature, with a decay on the values (``gv``)."""
    v = v * torch.exp(gv).cumsum(1) if gv is not None else v  # a stand-in read of gv (the real kernel decays v)
    return chunk_gla(q, k, v, gk, scale, initial_state, output_final_state)


class RMSNormGated(nn.Module):
    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x, g):
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight
        return x * F.silu(g)


class GatedLinearAttention(nn.Module):
    def __init__(self, hidden_size=DIM, num_heads=2, gate_low_rank_dim=16, gate_logit_normalizer=16, mode="naive"):
        super().__init__()
        self.num_heads, self.mode, self.gate_logit_normalizer = num_heads, mode, gate_logit_normalizer
        self.key_dim, self.value_dim = hidden_size // 2, hidden_size
        self.head_k_dim, self.head_v_dim = self.key_dim // num_heads, self.value_dim // num_heads
        self.q_proj = nn.Linear(hidden_size, self.key_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, self.key_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, self.value_dim, bias=False)
        self.g_proj = nn.Linear(hidden_size, self.value_dim, bias=False)
        self.gk_proj = nn.Sequential(nn.Linear(hidden_size, gate_low_rank_dim, bias=False),
                                     nn.Linear(gate_low_rank_dim, self.key_dim, bias=True))
        self.o_proj = nn.Linear(self.value_dim, hidden_size, bias=False)
        self.g_norm_swish_gate = RMSNormGated(self.head_v_dim)

    def forward(self, hidden_states):
        q, k, v = self.q_proj(hidden_states), self.k_proj(hidden_states), self.v_proj(hidden_states)
        gk = self.gk_proj(hidden_states)
        q, k, gk = (x.unflatten(-1, (self.num_heads, self.head_k_dim)) for x in (q, k, gk))
        v = v.unflatten(-1, (self.num_heads, self.head_v_dim))
        gk = F.logsigmoid(gk) / self.gate_logit_normalizer
        if self.mode == "naive":
            o, _ = naive_recurrent_gla(q, k, v, gk)
        elif self.mode == "chunk":
            o, _ = chunk_gla(q, k, v, g=gk, scale=None, initial_state=None, output_final_state=False)
        else:
            o, _ = fused_recurrent_gla(q, k, v, gk=gk, gv=gk.mean(-1, keepdim=True).expand_as(v))
        g = self.g_proj(hidden_states).unflatten(-1, (self.num_heads, self.head_v_dim))
        return self.o_proj(self.g_norm_swish_gate(o, g).flatten(-2))


class GLALM(nn.Module):
    def __init__(self, **layer):
        super().__init__()
        self.embeddings = nn.Embedding(VOCAB, DIM)
        self.attn_norms = nn.ModuleList(nn.LayerNorm(DIM) for _ in range(LAYERS))
        self.attns = nn.ModuleList(GatedLinearAttention(**layer) for _ in range(LAYERS))
        self.mlp_norms = nn.ModuleList(nn.LayerNorm(DIM) for _ in range(LAYERS))
        self.mlps = nn.ModuleList(nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.SiLU(), nn.Linear(2 * DIM, DIM))
                                  for _ in range(LAYERS))
        self.norm = nn.LayerNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, idx):
        x = self.embeddings(idx)
        for an, attn, mn, mlp in zip(self.attn_norms, self.attns, self.mlp_norms, self.mlps):
            x = x + attn(an(x))
            x = x + mlp(mn(x))
        return self.lm_head(self.norm(x))
