"""Attention whose scores are worked on as ``[T, T]`` tensors beyond a mask: Contextual Position
Encoding (Golovneva et al. 2024, "Contextual Position Encoding: Learning to Count What's
Important", the paper's listing of ``CoPE`` and ``SelfAttn``, as GitHub LMs copy it) in a small
pre-LN GPT with the heads folded into the batch for ``bmm``; stick-breaking attention
(shawntan/stickbreaking-attention, ``stickbreaking_attention/sb_ref.py``'s reference); xLSTM's
mLSTM in its parallel form (NX-AI/xlstm, ``xlstm/blocks/mlstm/backends.py``'s
``parallel_stabilized_simple``); and variants the dense pair rule must refuse.

CoPE counts positions by gates: ``gates = sigmoid(logits)`` of the already masked logits (0 on
the future), ``pos = gates.flip(-1).cumsum(-1).flip(-1)`` (for query ``i`` and key ``j``, the
gates of the keys from ``j`` to ``i``) clamped to ``npos_max - 1``, and the logits of the two
integer positions around it interpolated. ``npos_max`` is smaller than the sequence so the clamp
is live. Variants: ``mask_after`` adds the causal mask only after CoPE (the reverse sum then
counts future keys: not causal, and refused), ``query_softmax`` normalises over the queries.

Stick-breaking weighs key ``j`` of query ``i`` by ``beta_ij`` times ``1 - beta_ik`` for every key
``k`` between them: ``log_beta`` summed over the later keys by an einsum with
``ones(T, T).tril(-1)``, the remainder ``1 - sum`` going to the query's own value. Its variant
``mask_late`` masks ``log_beta`` only after that sum (the future keys' ``1 - beta`` would then
weigh the past: refused).

mLSTM's decay matrix is the cumulative log forget gates padded by a zero row, repeated into
``[T + 1, T + 1]``, minus its transpose and cut ``[..., 1:, 1:]`` (``c_i - c_j``), kept below the
diagonal by ``where(tril, ., -inf)``, plus the input gates; stabilised by its row maximum, times the
scores, normalised by ``max(|row sum|, exp(-max))``. Its variant ``stabilize_rowwise=False`` takes
the maximum over the whole matrix (every query's keys: refused).

Shaw et al. 2018's relative position representations as lucidrains/conformer writes them
(``conformer/conformer.py``'s ``Attention``: ``dist = seq[:, None] - seq[None, :]`` clamped to
``max_pos_emb``, ``rel_pos_emb(dist)`` a ``[T, T, d]`` table, ``einsum('b h n d, n r d -> b h n r')``
added to the scores), made causal by a ``triu`` mask, with the paper's relative values
(``einsum('b h i j, i j d -> b h i d')``) beside the weighted values. Its variant ``over_length``
rescales the distances by the length (``dist * max_pos_emb // n``: refused).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from zoo_repos.common import DIM, HEADS, LAYERS, VOCAB


class CoPE(nn.Module):
    def __init__(self, npos_max, head_dim):
        super().__init__()
        self.npos_max = npos_max
        self.pos_emb = nn.parameter.Parameter(torch.zeros(1, head_dim, npos_max))

    def forward(self, query, attn_logits):
        # compute positions
        gates = torch.sigmoid(attn_logits)
        pos = gates.flip(-1).cumsum(dim=-1).flip(-1)
        pos = pos.clamp(max=self.npos_max - 1)
        # interpolate from integer positions
        pos_ceil = pos.ceil().long()
        pos_floor = pos.floor().long()
        logits_int = torch.matmul(query, self.pos_emb)
        logits_ceil = logits_int.gather(-1, pos_ceil)
        logits_floor = logits_int.gather(-1, pos_floor)
        w = pos - pos_floor
        return logits_ceil * w + logits_floor * (1 - w)


class SelfAttn(nn.Module):
    def __init__(self, npos_max, head_dim, mask_after=False, query_softmax=False):
        super().__init__()
        self.cope = CoPE(npos_max, head_dim)
        self.head_dim = head_dim
        self.mask_after, self.query_softmax = mask_after, query_softmax

    def forward(self, query, key, val, mask):
        # q, k, v have dimensions batch x seq_len x head_dim
        attn_logits = torch.bmm(query, key.transpose(-1, -2))
        attn_logits = attn_logits / math.sqrt(self.head_dim)
        if self.mask_after:
            attn_logits += self.cope(query, attn_logits)
            attn_logits += mask.log()
        else:
            attn_logits += mask.log()
            attn_logits += self.cope(query, attn_logits)
        attn = torch.softmax(attn_logits, dim=-2 if self.query_softmax else -1)
        output = torch.bmm(attn, val)
        return output


class CoPEBlock(nn.Module):
    def __init__(self, npos_max=6, **variant):
        super().__init__()
        self.hd = DIM // HEADS
        self.ln1, self.ln2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.proj = nn.Linear(DIM, DIM)
        self.attn = SelfAttn(npos_max, self.hd, **variant)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=-1)
        q, k, v = [t.view(B, T, HEADS, self.hd).transpose(1, 2).reshape(B * HEADS, T, self.hd) for t in (q, k, v)]
        mask = torch.tril(torch.ones(T, T, device=x.device, dtype=x.dtype))
        y = self.attn(q, k, v, mask)
        y = y.view(B, HEADS, T, self.hd).transpose(1, 2).reshape(B, T, C)
        x = x + self.proj(y)
        return x + self.mlp(self.ln2(x))


def stickbreaking(q, k, v, mask, cum_weight, mask_late=False):
    """Stick-breaking attention weights."""
    logits = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    original_dtype = logits.dtype
    logits = logits.float() if original_dtype in (torch.float16, torch.bfloat16) else logits
    log_z = F.logsigmoid(logits).masked_fill(mask, -1e5).to(original_dtype)
    log_beta = F.logsigmoid(-logits)
    log_beta = log_beta if mask_late else log_beta.masked_fill(mask, 0).to(original_dtype)
    re_cum_log_beta = torch.einsum("bhij,jk->bhik", log_beta, cum_weight.to(log_beta))
    if mask_late:
        re_cum_log_beta = re_cum_log_beta.masked_fill(mask, 0)
    log_att = log_z + re_cum_log_beta
    att = log_att.exp()
    return att @ v, 1 - att.sum(dim=-1)


def sb_attention(q, k, v, length, attend_current=False, mask_late=False):
    cm = torch.ones(length, length).tril(-1).to(q)
    if attend_current:
        mask = torch.ones(length, length).triu(1).to(q.device).bool()
    else:
        mask = torch.ones(length, length).triu(0).to(q.device).bool()
    o, rem = stickbreaking(q, k, v, mask, cm, mask_late=mask_late)
    return o + rem[..., None] * v


class SBBlock(nn.Module):
    def __init__(self, attend_current=False, mask_late=False):
        super().__init__()
        self.hd = DIM // HEADS
        self.attend_current, self.mask_late = attend_current, mask_late
        self.ln1, self.ln2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.c_attn = nn.Linear(DIM, 3 * DIM)
        self.c_proj = nn.Linear(DIM, DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(self.ln1(x)).split(C, dim=2)
        q, k, v = [t.view(B, T, HEADS, self.hd).transpose(1, 2) for t in (q, k, v)]
        y = sb_attention(q, k, v, T, attend_current=self.attend_current, mask_late=self.mask_late)
        x = x + self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))
        return x + self.mlp(self.ln2(x))


def parallel_stabilized_simple(queries, keys, values, igate_preact, fgate_preact, lower_triangular_matrix=None,
                               stabilize_rowwise=True, eps=1e-6):
    """The mLSTM cell in its parallel, stabilised form: queries, keys, values ``(B, NH, S, DH)``,
    gate pre-activations ``(B, NH, S, 1)``."""
    B, NH, S, DH = queries.shape
    _dtype, _device = queries.dtype, queries.device
    log_fgates = F.logsigmoid(fgate_preact)  # (B, NH, S, 1)
    if lower_triangular_matrix is None or S < lower_triangular_matrix.size(-1):
        ltr = torch.tril(torch.ones((S, S), dtype=torch.bool, device=_device))
    else:
        ltr = lower_triangular_matrix
    log_fgates_cumsum = torch.cat([torch.zeros((B, NH, 1, 1), dtype=_dtype, device=_device),
                                   torch.cumsum(log_fgates, dim=-2)], dim=-2)  # (B, NH, S+1, 1)
    rep_log_fgates_cumsum = log_fgates_cumsum.repeat(1, 1, 1, S + 1)  # (B, NH, S+1, S+1)
    _log_fg_matrix = rep_log_fgates_cumsum - rep_log_fgates_cumsum.transpose(-2, -1)  # (B, NH, S+1, S+1)
    log_fg_matrix = torch.where(ltr, _log_fg_matrix[:, :, 1:, 1:], -float("inf"))  # (B, NH, S, S)
    log_D_matrix = log_fg_matrix + igate_preact.transpose(-2, -1)  # (B, NH, S, S)
    if stabilize_rowwise:
        max_log_D, _ = torch.max(log_D_matrix, dim=-1, keepdim=True)  # (B, NH, S, 1)
    else:
        max_log_D = torch.max(log_D_matrix.view(B, NH, -1), dim=-1, keepdim=True)[0].unsqueeze(-1)
    log_D_matrix_stabilized = log_D_matrix - max_log_D  # (B, NH, S, S)
    D_matrix = torch.exp(log_D_matrix_stabilized)  # (B, NH, S, S)
    keys_scaled = keys / math.sqrt(DH)
    qk_matrix = queries @ keys_scaled.transpose(-2, -1)  # (B, NH, S, S)
    C_matrix = qk_matrix * D_matrix  # (B, NH, S, S)
    normalizer = torch.maximum(C_matrix.sum(dim=-1, keepdim=True).abs(), torch.exp(-max_log_D))  # (B, NH, S, 1)
    C_matrix_normalized = C_matrix / (normalizer + eps)
    return C_matrix_normalized @ values  # (B, NH, S, DH)


class MLSTMBlock(nn.Module):
    """mLSTM layer cut down: q / k / v projections, input and forget gates from their concatenation
    (per head), the parallel cell, a per-head group norm, a learnable skip and a SiLU output gate."""

    def __init__(self, stabilize_rowwise=True):
        super().__init__()
        self.hd = DIM // HEADS
        self.stabilize_rowwise = stabilize_rowwise
        self.ln = nn.LayerNorm(DIM)
        self.q, self.k, self.v = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)
        self.igate, self.fgate = nn.Linear(3 * DIM, HEADS), nn.Linear(3 * DIM, HEADS)
        self.outnorm = nn.GroupNorm(HEADS, DIM)
        self.skip = nn.Parameter(torch.ones(DIM))
        self.z = nn.Linear(DIM, DIM)
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, x):
        B, S, C = x.shape
        h = self.ln(x)
        q, k, v = self.q(h), self.k(h), self.v(h)
        gate_in = torch.cat([q, k, v], dim=-1)
        ig = self.igate(gate_in).transpose(-1, -2).unsqueeze(-1)  # (B, NH, S, 1)
        fg = self.fgate(gate_in).transpose(-1, -2).unsqueeze(-1)
        q, k, v = [t.view(B, S, HEADS, self.hd).transpose(1, 2) for t in (q, k, v)]
        y = parallel_stabilized_simple(q, k, v, ig, fg, stabilize_rowwise=self.stabilize_rowwise)
        y = y.transpose(1, 2).reshape(B * S, C)
        y = self.outnorm(y).view(B, S, C) + self.skip * h
        return x + self.proj(y * F.silu(self.z(h)))


class ShawBlock(nn.Module):
    def __init__(self, max_pos_emb=4, over_length=False):
        super().__init__()
        self.hd, self.max_pos_emb, self.over_length = DIM // HEADS, max_pos_emb, over_length
        self.ln1, self.ln2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.to_q, self.to_kv = nn.Linear(DIM, DIM, bias=False), nn.Linear(DIM, 2 * DIM, bias=False)
        self.to_out = nn.Linear(DIM, DIM)
        self.rel_pos_emb = nn.Embedding(2 * max_pos_emb + 1, self.hd)
        self.rel_value_emb = nn.Embedding(2 * max_pos_emb + 1, self.hd)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

    def forward(self, x):
        b, n, _ = x.shape
        h = self.ln1(x)
        q, k, v = (self.to_q(h), *self.to_kv(h).chunk(2, dim=-1))
        q, k, v = [t.view(b, n, HEADS, self.hd).transpose(1, 2) for t in (q, k, v)]
        scale = self.hd ** -0.5
        dots = torch.einsum("b h i d, b h j d -> b h i j", q, k) * scale
        seq = torch.arange(n, device=x.device)
        dist = seq[:, None] - seq[None, :]
        if self.over_length:
            dist = dist * self.max_pos_emb // n
        dist = dist.clamp(-self.max_pos_emb, self.max_pos_emb) + self.max_pos_emb
        rel_pos_emb = self.rel_pos_emb(dist).to(q)
        pos_attn = torch.einsum("b h n d, n r d -> b h n r", q, rel_pos_emb) * scale
        dots = dots + pos_attn
        mask = torch.ones(n, n, device=x.device, dtype=torch.bool).triu(1)
        attn = dots.masked_fill(mask, -torch.finfo(dots.dtype).max).softmax(dim=-1)
        out = torch.einsum("b h i j, b h j d -> b h i d", attn, v)
        out = out + torch.einsum("b h i j, i j d -> b h i d", attn, self.rel_value_emb(dist))
        x = x + self.to_out(out.transpose(1, 2).reshape(b, n, DIM))
        return x + self.mlp(self.ln2(x))


class _BlocksLM(nn.Module):
    """Embedding, the blocks, a final LayerNorm and an untied head: the small GPT each spelling sits in."""

    block_cls: type = nn.Module

    def __init__(self, **variant):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(self.block_cls(**variant) for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, idx):
        x = self.wte(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


CoPELM = type("CoPELM", (_BlocksLM,), {"block_cls": CoPEBlock})
StickBreakingLM = type("StickBreakingLM", (_BlocksLM,), {"block_cls": SBBlock})
MLSTMLM = type("MLSTMLM", (_BlocksLM,), {"block_cls": MLSTMBlock})
ShawLM = type("ShawLM", (_BlocksLM,), {"block_cls": ShawBlock})
