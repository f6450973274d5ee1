"""Custom (plain PyTorch) causal LMs for the architecture zoo, one manual spelling each.

Every model here is causal and written the way real model code writes it: scores by
``matmul`` / ``bmm`` / ``baddbmm`` / ``einsum``, causal masks from a ``tril`` buffer sliced
``[:T, :T]`` or ``masked_fill(-inf)``, softmax cast back with ``type_as`` / ``.to``, complex
RoPE, ALiBi, T5-style relative position bias, attention sinks, 3-D attention without a
head dim, an in-place MoE, an MLA that copies into an ``empty`` buffer, and so on. Each
takes ``idx [B, T]`` and returns logits ``[B, T, V]``. Models are tiny (dim 16-32, 1-2
layers, vocab 32).
"""

from __future__ import annotations

import math
import sys

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 32
DIM = 32
HEADS = 4
HD = DIM // HEADS
MAX_LEN = 64


class _LM(nn.Module):
    """Embedding, ``layers`` pre-norm blocks (``block(x) -> x``), final norm, head."""

    block_cls: type = nn.Module

    def __init__(self, layers: int = 2, **kw) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(self.block_cls(**kw) for _ in range(layers))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.norm(x))


class _Attn(nn.Module):
    """Shared projections: ``qkv(x) -> q, k, v`` as ``[B, H, T, hd]``; subclasses write ``attend``."""

    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.o = nn.Linear(DIM, DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))
        self.ln2 = nn.LayerNorm(DIM)
        self.register_buffer("causal", torch.tril(torch.ones(MAX_LEN, MAX_LEN)).view(1, 1, MAX_LEN, MAX_LEN))

    def heads(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(self.ln(x)).split(DIM, dim=-1)
        return [z.view(b, t, HEADS, HD).transpose(1, 2) for z in (q, k, v)]

    def forward(self, x):
        b, t, _ = x.shape
        y = self.attend(*self.heads(x))
        x = x + self.o(y.transpose(1, 2).reshape(b, t, DIM))
        return x + self.mlp(self.ln2(x))


# ----------------------------------------------------------------------- score spellings


class BmmAttn(_Attn):
    """Scores with ``torch.bmm`` over ``[B*H, T, hd]``; mask ``masked_fill`` from the tril buffer."""

    def attend(self, q, k, v):
        b, h, t, d = q.shape
        qf, kf, vf = (z.reshape(b * h, t, d) for z in (q, k, v))
        att = torch.bmm(qf, kf.transpose(1, 2)) / math.sqrt(d)
        att = att.view(b, h, t, t).masked_fill(self.causal[:, :, :t, :t] == 0, float("-inf"))
        att = F.softmax(att, dim=-1).view(b * h, t, t)
        return torch.bmm(att, vf).view(b, h, t, d)


class BaddbmmAttn(_Attn):
    """Bloom-style ``baddbmm(zeros, q, k^T, beta=0, alpha=scale)`` scores."""

    def attend(self, q, k, v):
        b, h, t, d = q.shape
        qf, kf = q.reshape(b * h, t, d), k.reshape(b * h, t, d)
        base = torch.zeros(b * h, t, t, dtype=q.dtype, device=q.device)
        att = torch.baddbmm(base, qf, kf.transpose(1, 2), beta=0.0, alpha=1.0 / math.sqrt(d)).view(b, h, t, t)
        att = att.masked_fill(self.causal[:, :, :t, :t] == 0, float("-inf"))
        return F.softmax(att, dim=-1) @ v


class EinsumAttn(_Attn):
    """``einsum('bhqd,bhkd->bhqk')`` scores and ``einsum('bhqk,bhkd->bhqd')`` output."""

    def attend(self, q, k, v):
        t = q.shape[2]
        att = torch.einsum("bhqd,bhkd->bhqk", q, k) * (q.shape[-1] ** -0.5)
        att = att.masked_fill(self.causal[:, :, :t, :t] == 0, float("-inf"))
        return torch.einsum("bhqk,bhkd->bhqd", att.softmax(dim=-1), v)


class MultiQueryEinsumAttn(_Attn):
    """PaLM-style multi-query attention (lucidrains/PaLM-pytorch): one key and value head,
    ``einsum('b h i d, b j d -> b h i j')`` and ``einsum('b h i j, b j d -> b h i d')``."""

    def attend(self, q, k, v):
        t = q.shape[2]
        k, v = k[:, 0], v.mean(dim=1)  # [b, t, d]: one key head, one value head
        sim = torch.einsum("b h i d, b j d -> b h i j", q * q.shape[-1] ** -0.5, k)
        sim = sim.masked_fill(self.causal[:, :, :t, :t] == 0, -torch.finfo(sim.dtype).max)
        return torch.einsum("b h i j, b j d -> b h i d", sim.softmax(dim=-1), v)


class TypeAsAttn(_Attn):
    """``softmax(scores.float(), dim=-1).type_as(q)`` (Llama-1 / Mistral reference code)."""

    def attend(self, q, k, v):
        t = q.shape[2]
        att = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(HD)
        att = att.masked_fill(self.causal[:, :, :t, :t] == 0, float("-inf"))
        return torch.matmul(F.softmax(att.float(), dim=-1).type_as(q), v)


class ToDtypeAttn(_Attn):
    """``softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)`` with an additive triu mask."""

    def attend(self, q, k, v):
        t = q.shape[2]
        mask = torch.full((t, t), float("-inf"), device=q.device).triu(1)
        att = q @ k.transpose(-2, -1) * HD**-0.5 + mask
        return F.softmax(att, dim=-1, dtype=torch.float32).to(q.dtype) @ v


class MaskedFillInfAttn(_Attn):
    """``masked_fill(ones(T, T).triu(1).bool(), -inf)`` built inline from the length."""

    def attend(self, q, k, v):
        t = q.shape[2]
        upper = torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1)
        att = (q @ k.mT) * HD**-0.5
        return att.masked_fill(upper, float("-inf")).softmax(-1) @ v


class TransposedKeysAttn(_Attn):
    """llm-foundry's torch attention: keys stored ``'b s (h d) -> b h d s'`` (two key heads
    repeated over the four query heads, ``repeat_interleave(dim=1)``), ``q.matmul(k)``, the
    causal mask ``~ones(s, s).tril()`` cut ``[-s_q:, -s_k:]`` filled with ``finfo.min``: the
    kernel gets keys and values whose last dim is not contiguous."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(DIM, DIM + 2 * 2 * HD)

    def heads(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(self.ln(x)).split([DIM, 2 * HD, 2 * HD], dim=-1)
        q = q.view(b, t, HEADS, HD).permute(0, 2, 1, 3)
        k = k.view(b, t, 2, HD).permute(0, 2, 3, 1)
        v = v.view(b, t, 2, HD).permute(0, 2, 1, 3)
        return q, k.repeat_interleave(HEADS // 2, dim=1), v.repeat_interleave(HEADS // 2, dim=1)

    def attend(self, q, k, v):
        s_q, s_k = q.size(2), k.size(-1)
        att = q.matmul(k) * HD**-0.5
        s = max(s_q, s_k)
        causal = ~att.new_ones(s, s, dtype=torch.float32).tril().to(torch.bool)
        att = att.masked_fill(causal[-s_q:, -s_k:].view(1, 1, s_q, s_k), torch.finfo(q.dtype).min)
        return torch.softmax(att, dim=-1).to(v.dtype).matmul(v)


class SdpaTrilMaskAttn(_Attn):
    """``scaled_dot_product_attention(attn_mask=tril_buffer[:T, :T].bool())``."""

    def attend(self, q, k, v):
        t = q.shape[2]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.causal[0, 0, :t, :t].bool())


class VmapMaskAttn(_Attn):
    """SDPA under a boolean mask built with nested ``torch.vmap`` over the query and key
    indices, as transformers 5.10 builds its masks."""

    def attend(self, q, k, v):
        idx = torch.arange(q.shape[2], device=q.device)
        allowed = torch.vmap(torch.vmap(lambda i, j: j <= i, in_dims=(None, 0)), in_dims=(0, None))(idx, idx)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)


class VmapHeadsAttn(SdpaTrilMaskAttn):
    """A per-head output gate computed under ``torch.vmap`` over the heads: batched ops that
    stay in the graph, between vmap level calls nothing reads."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Parameter(torch.randn(HEADS, HD, HD) / HD)

    def attend(self, q, k, v):
        y = super().attend(q, k, v)  # [B, H, T, hd]
        return torch.vmap(lambda yh, g: yh @ g, in_dims=(1, 0), out_dims=1)(y, self.gate)


class InPlaceScoresAttn(_Attn):
    """``att.masked_fill_(upper, -inf)`` as a statement (``att`` not rebound) before the softmax."""

    def attend(self, q, k, v):
        t = q.shape[2]
        att = (q @ k.mT) * HD**-0.5
        att.masked_fill_(self.causal[0, 0, :t, :t] == 0, float("-inf"))
        return att.softmax(-1) @ v


class InPlaceBiasAttn(_Attn):
    """A learned bias added to the scores in place (``att.add_(bias[:T, :T])``) under a causal
    mask: the rewrite must not drop it (T5-style biases have no tree form here)."""

    def __init__(self) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(MAX_LEN, MAX_LEN))

    def attend(self, q, k, v):
        t = q.shape[2]
        att = (q @ k.mT) * HD**-0.5
        att.add_(self.bias[:t, :t])
        return att.masked_fill(self.causal[0, 0, :t, :t] == 0, float("-inf")).softmax(-1) @ v


class CausalConvSliceAttn(_Attn):
    """A depthwise causal conv spelled ``conv1d(x, padding=K - 1)[..., :-(K - 1)]`` after attention."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(DIM, DIM, 4, padding=3, groups=DIM)

    def attend(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def forward(self, x):
        x = super().forward(x)
        return x + self.conv(x.transpose(1, 2))[..., :-3].transpose(1, 2)


class ConvActCutAttn(CausalConvSliceAttn):
    """Mamba-2's spelling (mamba_simple.py): ``act(conv1d(x.transpose(1, 2)).transpose(1, 2))``
    cut ``[:, :T, :]`` after the activation; ``cut_first=False`` cuts ``[:, 3:, :]`` (the last T
    rows: each row reads the rows after it)."""

    def __init__(self, cut_first: bool = True) -> None:
        super().__init__()
        self.cut_first = cut_first

    def forward(self, x):
        x = _Attn.forward(self, x)
        t = x.shape[1]
        y = F.silu(self.conv(x.transpose(1, 2)).transpose(1, 2))
        return x + (y[:, :t, :] if self.cut_first else y[:, 3:, :])


class _SdpaAttn(_Attn):
    def attend(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class FunctionalConvAttn(_SdpaAttn):
    """A depthwise causal conv written functionally after attention, with no ``nn.Conv1d``
    module: ``F.conv1d(x, w, b, padding=K - 1, groups=C)[..., :-(K - 1)]``."""

    def __init__(self) -> None:
        super().__init__()
        self.conv_w = nn.Parameter(torch.randn(DIM, 1, 3) / 3)
        self.conv_b = nn.Parameter(torch.zeros(DIM))

    def forward(self, x):
        x = super().forward(x)
        return x + F.conv1d(x.transpose(1, 2), self.conv_w, self.conv_b, padding=2, groups=DIM)[..., :-2].transpose(1, 2)


class PointwiseConvAttn(_SdpaAttn):
    """Conformer's conv module without its depthwise conv: ``Conv1d(kernel_size=1)`` on
    ``x.transpose(1, 2)``, GLU over the channels, a second pointwise conv."""

    def __init__(self) -> None:
        super().__init__()
        self.pointwise_conv1 = nn.Conv1d(DIM, 2 * DIM, kernel_size=1)
        self.pointwise_conv2 = nn.Conv1d(DIM, DIM, kernel_size=1, stride=1, padding=0)

    def forward(self, x):
        x = super().forward(x)
        y = F.glu(self.pointwise_conv1(x.transpose(1, 2)), dim=1)
        return x + self.pointwise_conv2(F.silu(y)).transpose(1, 2)


def xtransformers_shift(t, amount):
    """lucidrains/x-transformers ``shift`` (``pad_at_dim(t, (amount, -amount), dim=-2)``)."""
    if amount == 0:
        return t
    amount = min(amount, t.shape[1])
    dims_from_right = 1
    zeros = (0, 0) * dims_from_right
    return F.pad(t, (*zeros, amount, -amount), value=0.0)


class ShiftTokensAttn(_SdpaAttn):
    """x-transformers ``ShiftTokens(shifts=(0, 1, 2))`` before attention: the features split in
    three, the second shifted by one token and the third by two (``F.pad`` along the sequence)."""

    def forward(self, x):
        feats = x.shape[-1] // 3
        segments = x.split(feats, dim=-1)
        shifted = [xtransformers_shift(t, a) for t, a in zip(segments[:3], (0, 1, 2))]
        return super().forward(torch.cat((*shifted, *segments[3:]), dim=-1))


class CatShiftAttn(_SdpaAttn):
    """A token shift as ``cat([x.new_zeros(b, 1, d), x[:, :-1]], dim=1)`` mixed into the MLP input."""

    def __init__(self) -> None:
        super().__init__()
        self.mix = nn.Parameter(torch.rand(DIM))

    def forward(self, x):
        b, _, d = x.shape
        prev = torch.cat([x.new_zeros(b, 1, d), x[:, :-1]], dim=1)
        return super().forward(x * self.mix + prev * (1 - self.mix))


class CropPadShiftAttn(_SdpaAttn):
    """A shift by two as ``F.pad(x[:, :-2], (0, 0, 2, 0))``, added after attention."""

    def forward(self, x):
        x = super().forward(x)
        return x + 0.5 * F.pad(x[:, :-2], (0, 0, 2, 0))


class NoneIndexPositionsLM(_LM):
    """Learned absolute positions ``[max_len, d]`` added as ``self.pos[None, :T, :]``."""

    block_cls = _SdpaAttn

    def __init__(self) -> None:
        super().__init__()
        self.pos = nn.Parameter(torch.randn(MAX_LEN, DIM) * 0.1)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx) + self.pos[None, : idx.shape[1], :]
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.norm(x))


class LazyTableAttn(_SdpaAttn):
    """Rotary angles read from a ``(cos, sin)`` table the model builds itself (``rope``),
    applied to q and k."""

    def attend(self, q, k, v, rope=None):
        cos, sin = rope
        q, k = (t * cos + torch.cat([-t[..., HD // 2:], t[..., :HD // 2]], -1) * sin for t in (q, k))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def forward(self, x, rope=None):
        b, t, _ = x.shape
        y = self.attend(*self.heads(x), rope=rope)
        x = x + self.o(y.transpose(1, 2).reshape(b, t, DIM))
        return x + self.mlp(self.ln2(x))


class LengthBranchLM(_LM):
    """A Python branch on the sequence length that changes the arithmetic without reading the
    length as a value (``if T > 8: x = x * 0.5``): per-path training decides it at each path's
    length, a packed row at its own."""

    block_cls = _SdpaAttn

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        if idx.shape[1] > 8:
            x = x * 0.5
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.norm(x))


class LazyRopeCacheLM(_LM):
    """TinyLlama / lit-gpt: ``if self.rope_cache is None: self.rope_cache = build_rope_cache(block_size)``
    on the first call (a tuple on the module, over the block size, not the sequence), then
    ``cos[:T]`` and ``sin[:T]``."""

    block_cls = LazyTableAttn
    block_size = MAX_LEN

    def __init__(self) -> None:
        super().__init__()
        self.rope_cache = None

    def build_rope_cache(self, device):
        theta = 1.0 / (10000 ** (torch.arange(0, HD, 2, device=device).float() / HD))
        idx_theta = torch.outer(torch.arange(self.block_size, device=device).float(), theta).repeat(1, 2)
        return torch.cos(idx_theta), torch.sin(idx_theta)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if self.rope_cache is None:
            self.rope_cache = self.build_rope_cache(idx.device)
        cos, sin = self.rope_cache
        x = self.emb(idx)
        for blk in self.blocks:
            x = blk(x, rope=(cos[:t].to(x.dtype), sin[:t].to(x.dtype)))
        return self.head(self.norm(x))


class FairseqSinusoidLM(_LM):
    """fairseq's ``SinusoidalPositionalEmbedding``: the sinusoid table built each call over
    ``padding_idx + 1 + T`` positions (``get_embedding``, the padding row zeroed), read at
    ``make_positions``' pad-aware counts ``cumsum(ids != pad) * mask + pad`` with ``index_select``."""

    block_cls = _SdpaAttn
    padding_idx = 1

    @staticmethod
    def get_embedding(num_embeddings: int, embedding_dim: int, padding_idx: int) -> torch.Tensor:
        half_dim = embedding_dim // 2
        emb = math.log(10000) / (half_dim - 1)
        emb = torch.exp(torch.arange(half_dim, dtype=torch.float) * -emb)
        emb = torch.arange(num_embeddings, dtype=torch.float).unsqueeze(1) * emb.unsqueeze(0)
        emb = torch.cat([torch.sin(emb), torch.cos(emb)], dim=1).view(num_embeddings, -1)
        emb[padding_idx, :] = 0
        return emb

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        bsz, seq_len = idx.shape
        weights = self.get_embedding(self.padding_idx + 1 + seq_len, DIM, self.padding_idx).to(self.head.weight)
        mask = idx.ne(self.padding_idx).int()
        positions = (torch.cumsum(mask, dim=1).type_as(mask) * mask).long() + self.padding_idx
        x = self.emb(idx) + weights.index_select(0, positions.view(-1)).view(bsz, seq_len, -1).detach()
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.norm(x))


class NeoxRotaryAttn(_SdpaAttn):
    """transformers 4.2x GPT-NeoX's rotary table: ``cos_cached`` ``[1, 1, L, d]`` built at init,
    ``cos_cached[:seq_len, ...]`` (a cut of its leading dim of size 1, which keeps it whole), then
    ``cos.squeeze(1).squeeze(0)[position_ids]`` with ``position_ids = arange(T)[None]``."""

    def __init__(self) -> None:
        super().__init__()
        inv_freq = 1.0 / (10000 ** (torch.arange(0, HD, 2).float() / HD))
        emb = torch.outer(torch.arange(MAX_LEN).float(), inv_freq).repeat(1, 2)
        self.cos_cached, self.sin_cached = emb.cos()[None, None, :, :], emb.sin()[None, None, :, :]

    def attend(self, q, k, v):
        t = q.shape[2]
        position_ids = torch.arange(0, t, dtype=torch.long, device=q.device).unsqueeze(0).view(-1, t)
        cos, sin = self.cos_cached[:t, ...].to(q), self.sin_cached[:t, ...].to(q)
        cos = cos.squeeze(1).squeeze(0)[position_ids].unsqueeze(1)
        sin = sin.squeeze(1).squeeze(0)[position_ids].unsqueeze(1)
        q, k = (z * cos + torch.cat([-z[..., HD // 2:], z[..., :HD // 2]], -1) * sin for z in (q, k))
        return super().attend(q, k, v)


class NeoxBaddbmmAttn(_Attn):
    """transformers 4.2x GPT-NeoX's ``_attn``: a boolean tril buffer cut ``[:, :, kl - ql : kl, :kl]``,
    scores ``baddbmm(zeros, q, k^T, beta=1.0, alpha=tensor(1.0) / self.norm_factor)`` with the
    scale a one-element buffer, ``where(causal_mask, scores, tensor(finfo.min))``."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("bias", torch.tril(torch.ones((MAX_LEN, MAX_LEN), dtype=torch.bool)).view(
            1, 1, MAX_LEN, MAX_LEN), persistent=False)
        self.register_buffer("norm_factor", torch.sqrt(torch.tensor(HD, dtype=torch.float32)), persistent=False)

    def attend(self, query, key, value):
        b, h, ql, d = query.size()
        kl = key.size(-2)
        causal_mask = self.bias[:, :, kl - ql:kl, :kl]
        scores = torch.zeros(b * h, ql, kl, dtype=query.dtype, device=key.device)
        scores = torch.baddbmm(scores, query.reshape(b * h, ql, d), key.reshape(b * h, kl, d).transpose(1, 2),
                               beta=1.0, alpha=torch.tensor(1.0, dtype=self.norm_factor.dtype) / self.norm_factor)
        scores = scores.view(b, h, ql, kl)
        mask_value = torch.tensor(torch.finfo(scores.dtype).min, dtype=scores.dtype).to(scores.device)
        return torch.matmul(F.softmax(torch.where(causal_mask, scores, mask_value), dim=-1), value)


class BufferShiftAttn(_SdpaAttn):
    """A token shift into a buffer: ``prev = torch.zeros_like(x); prev[:, 1:] = x[:, :-1]``."""

    def __init__(self) -> None:
        super().__init__()
        self.w_prev = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x):
        prev = torch.zeros_like(x)
        prev[:, 1:] = x[:, :-1]
        return super().forward(x + torch.tanh(self.w_prev(prev)))


class RollMaskedShiftAttn(_SdpaAttn):
    """A shift by two as ``roll(x, 2, dims=1).masked_fill(arange(T)[None, :, None] < 2, 0)``."""

    def forward(self, x):
        t = x.shape[1]
        first = (torch.arange(t, device=x.device) < 2)[None, :, None]
        prev = torch.roll(x, shifts=2, dims=1).masked_fill(first, 0.0)
        return super().forward(x + 0.5 * prev)


class RollMaskedWrongAttn(_SdpaAttn):
    """A roll by two whose masked_fill zeroes only the first row (``arange(T) == 0``)."""

    def forward(self, x):
        first = (torch.arange(x.shape[1], device=x.device) == 0)[None, :, None]
        return super().forward(x + 0.5 * torch.roll(x, shifts=2, dims=1).masked_fill(first, 0.0))


class RollShiftAttn(_SdpaAttn):
    """A token shift as ``torch.roll(x, 1, dims=1)`` with the wrapped-around first row zeroed in
    place (``prev[:, 0] = 0``), mixed into the attention input."""

    def forward(self, x):
        prev = torch.roll(x, 1, dims=1)
        prev[:, 0] = 0
        return super().forward(x + 0.5 * prev)


class RollShiftTwoAttn(_SdpaAttn):
    """A shift by two as ``torch.roll(x, shifts=2, dims=1)`` with the first two rows zeroed
    (``prev[:, :2] = 0``), added after attention."""

    def forward(self, x):
        x = super().forward(x)
        prev = x.roll(shifts=2, dims=1)
        prev[:, :2] = 0.0
        return x + 0.5 * prev


class RollNoZeroAttn(_SdpaAttn):
    """``torch.roll(x, 1, dims=1)`` without zeroing: the first row reads the sequence's last."""

    def forward(self, x):
        return super().forward(x + 0.5 * torch.roll(x, 1, dims=1))


class RollWrongZeroAttn(_SdpaAttn):
    """``torch.roll(x, 2, dims=1)`` with only the first row zeroed: the second reads the last."""

    def forward(self, x):
        prev = torch.roll(x, 2, dims=1)
        prev[:, 0] = 0
        return super().forward(x + 0.5 * prev)


class RollReadFirstAttn(_SdpaAttn):
    """``torch.roll(x, 1, dims=1)`` read (a per-row sum) before its first row is zeroed: that read
    sees the wrapped-around row."""

    def forward(self, x):
        prev = torch.roll(x, 1, dims=1)
        seen = prev.sum(-1, keepdim=True)
        prev[:, 0] = 0
        return super().forward(x + 0.5 * prev + 0.1 * seen)


class InPlaceCumsumAttn(_SdpaAttn):
    """A running sum written in place: ``h = x.clone(); h.cumsum_(1)``, mixed into the input."""

    def forward(self, x):
        h = x.clone()
        h.cumsum_(1)
        return super().forward(x + 0.1 * h)


class InPlaceCumprodAttn(_SdpaAttn):
    """A running product of a gate in (0, 1), in place: ``g = 0.5 + 0.4 * tanh(x); g.cumprod_(1)``."""

    def forward(self, x):
        g = 0.5 + 0.4 * torch.tanh(x)
        g.cumprod_(1)
        return super().forward(x + g)


class CumsumLinearAttn(_Attn):
    """Causal linear attention written with running sums (the naive form of the
    linear-transformer / Performer papers' causal attention): ``phi(q) . cumsum(phi(k) v^T) /
    phi(q) . cumsum(phi(k))`` with ``phi = elu + 1``."""

    def attend(self, q, k, v):
        q, k = F.elu(q) + 1, F.elu(k) + 1
        kv = torch.einsum("bhtd,bhte->bhtde", k, v).cumsum(dim=2)
        num = torch.einsum("bhtd,bhtde->bhte", q, kv)
        den = torch.einsum("bhtd,bhtd->bht", q, k.cumsum(dim=2))
        return num / den.unsqueeze(-1)


class QuadraticLinearAttn(_Attn):
    """Causal linear attention in its parallel form: ``(phi(q) @ phi(k)^T)`` zeroed above the
    diagonal by ``masked_fill(triu(ones(T, T), 1), 0)``, then ``@ v`` (no softmax)."""

    def attend(self, q, k, v):
        t = q.shape[2]
        a = (F.elu(q) + 1) @ (F.elu(k) + 1).transpose(-1, -2)
        a = a.masked_fill(torch.triu(torch.ones(t, t, dtype=torch.bool, device=q.device), 1), 0.0)
        return a @ v


class NormalisedLinearAttn(_Attn):
    """Normalised causal linear attention in its parallel form: ``A = phi(q) @ phi(k)^T`` masked
    causal, ``(A @ v) / (A.sum(-1, keepdim=True) + eps)`` (``before``: ``A / A.sum(...)`` then
    ``@ v``; ``clamp``: the sum clamped below instead of ``+ eps``)."""

    def __init__(self, before: bool = False, clamp: bool = False) -> None:
        super().__init__()
        self.before, self.clamp = before, clamp

    def attend(self, q, k, v):
        t = q.shape[2]
        a = (F.elu(q) + 1) @ (F.elu(k) + 1).transpose(-1, -2)
        a = a * torch.tril(torch.ones(t, t, device=q.device, dtype=q.dtype))
        den = a.sum(dim=-1, keepdim=True)
        den = den.clamp(min=1e-6) if self.clamp else den + 1e-6
        return a / den @ v if self.before else (a @ v) / den


class TrilLinearAttn(_Attn):
    """Linear attention as ``torch.tril(q @ k^T) / sqrt(d) @ v``."""

    def attend(self, q, k, v):
        return torch.tril(q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1]) @ v


class RetentionAttn(_Attn):
    """RetNet's parallel retention as microsoft/torchscale builds its decay mask
    (``index[:, None] - index[None, :]`` filled with ``inf`` above the diagonal, times
    ``log(1 - 2 ** (-5 - h))``, ``exp``, ``nan_to_num``), unnormalised:
    ``(q @ k^T * mask) @ v``. ``learned``: the log decay ``logsigmoid`` of a parameter per head
    (and the mask ``exp(decay * clamp(i - j, 0)) * (i >= j)``)."""

    def __init__(self, learned: bool = False, normalised: bool = False) -> None:
        super().__init__()
        gamma = 1 - 2 ** (-5.0 - torch.arange(HEADS, dtype=torch.float64))
        if learned:
            self.decay_logit = nn.Parameter(torch.log(gamma / (1 - gamma)))
        else:
            self.register_buffer("log_gamma", torch.log(gamma))
        self.learned, self.normalised = learned, normalised

    def attend(self, q, k, v):
        t = q.shape[2]
        decay = F.logsigmoid(self.decay_logit) if self.learned else self.log_gamma
        index = torch.arange(t).to(decay)
        if self.learned:  # a gradient through exp(inf * decay) would be NaN: the distances clamped instead
            d = index[:, None] - index[None, :]
            mask = torch.exp(decay[:, None, None] * d.clamp(min=0)) * (d >= 0)
        else:
            mask = torch.tril(torch.ones(t, t).to(decay))
            mask = torch.masked_fill(index[:, None] - index[None, :], ~mask.bool(), float("inf"))
            mask = torch.exp(mask * decay[:, None, None])
            mask = torch.nan_to_num(mask)
        if self.normalised:  # torchscale's: each row of the mask, then of the scores, scaled
            mask = mask / mask.sum(dim=-1, keepdim=True).sqrt()
        qk = q @ (k * HD ** -0.5).transpose(-1, -2) * mask
        if self.normalised:
            qk = qk / qk.detach().abs().sum(dim=-1, keepdim=True).clamp(min=1, max=5e4)
        return qk @ v


class LengthDecayAttn(_Attn):
    """A decay mask divided by the sequence length: per path that length is the path's, so the
    factor is not a function of the distance alone."""

    def attend(self, q, k, v):
        t = q.shape[2]
        i = torch.arange(t, device=q.device, dtype=q.dtype)
        d = (i[:, None] - i[None, :])
        mask = torch.where(d >= 0, 0.9 ** d, torch.zeros_like(d)) / t
        return (q @ k.transpose(-1, -2) * mask) @ v


class BidirectionalLinearAttn(_Attn):
    """Linear attention without a causal mask: every query sums over every key."""

    def attend(self, q, k, v):
        return ((F.elu(q) + 1) @ (F.elu(k) + 1).transpose(-1, -2)) @ v


def heinsen_associative_scan_log(log_coeffs, log_values):
    """lucidrains/minGRU-pytorch ``heinsen_associative_scan_log``."""
    a_star = log_coeffs.cumsum(dim=1)
    log_h0_plus_b_star = (log_values - a_star).logcumsumexp(dim=1)
    log_h = a_star + log_h0_plus_b_star
    return log_h.exp()


def mingru_g(x):
    return torch.where(x >= 0, x + 0.5, x.sigmoid())


def mingru_log_g(x):
    return torch.where(x >= 0, (F.relu(x) + 0.5).log(), -F.softplus(-x))


class MinGRUBlock(nn.Module):
    """lucidrains/minGRU-pytorch ``minGRU`` (parallel mode, no previous hidden state): the gated
    recurrence as a log-space associative scan (``cumsum`` and ``logcumsumexp`` over the
    sequence), then a feed-forward; no attention."""

    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(DIM)
        self.to_hidden_and_gate = nn.Linear(DIM, DIM * 2, bias=False)
        self.to_out = nn.Linear(DIM, DIM, bias=False)
        self.mlp = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))
        self.ln2 = nn.LayerNorm(DIM)

    def forward(self, x):
        hidden, gate = self.to_hidden_and_gate(self.ln(x)).chunk(2, dim=-1)
        log_coeffs = -F.softplus(gate)
        log_z = -F.softplus(-gate)
        log_tilde_h = mingru_log_g(hidden)
        out = heinsen_associative_scan_log(log_coeffs, log_z + log_tilde_h)
        x = x + self.to_out(out)
        return x + self.mlp(self.ln2(x))


def parallel_scan_log(log_coeffs, log_values):
    """"Were RNNs All We Needed?" ``parallel_scan_log``: ``log_values`` holds the initial state
    in front (T + 1 rows), the coefficients' running sum is padded in front to match."""
    a_star = F.pad(torch.cumsum(log_coeffs, dim=1), (0, 0, 1, 0))
    log_h0_plus_b_star = torch.logcumsumexp(log_values - a_star, dim=1)
    log_h = a_star + log_h0_plus_b_star
    return torch.exp(log_h)[:, 1:]


class MinLSTMBlock(nn.Module):
    """minLSTM of "Were RNNs All We Needed?" in log space: the initial state (learned) in front
    of the values, ``cat([log_g(h_0), log_i + log_tilde_h], dim=1)``, a scan over the T + 1 rows,
    the first row dropped; then a feed-forward, no attention."""

    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(DIM)
        self.linear_fih = nn.Linear(DIM, 3 * DIM)
        self.h_0 = nn.Parameter(torch.randn(1, 1, DIM))
        self.to_out = nn.Linear(DIM, DIM, bias=False)
        self.mlp = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))
        self.ln2 = nn.LayerNorm(DIM)

    def forward(self, x):
        f, i, h = self.linear_fih(self.ln(x)).chunk(3, dim=-1)
        diff = F.softplus(-f) - F.softplus(-i)
        log_f, log_i = -F.softplus(diff), -F.softplus(-diff)
        log_h_0 = mingru_log_g(self.h_0).expand(x.shape[0], 1, DIM)
        h = parallel_scan_log(log_f, torch.cat([log_h_0, log_i + mingru_log_g(h)], dim=1))
        x = x + self.to_out(h)
        return x + self.mlp(self.ln2(x))


class RootedScanAttn(_SdpaAttn):
    """Scans over the sequence with a row in front that reads no token, that row dropped after:
    a running sum from a learned start, ``cat([h0.expand(b, 1, d), v], 1).cumsum(1)[:, 1:]``,
    a running product of a gate from 2, ``F.pad(g, (0, 0, 1, 0), value=2.0).cumprod(1)[:, -T:]``,
    and an exclusive running sum (the rows before each row), ``F.pad(v, (0, 0, 1, 0)).cumsum(1)[:, :-1]``."""

    def __init__(self) -> None:
        super().__init__()
        self.h0 = nn.Parameter(torch.randn(1, 1, DIM))

    def forward(self, x):
        b, t, d = x.shape
        run = torch.cat([self.h0.expand(b, 1, d), 0.3 * x], dim=1).cumsum(1)[:, 1:]
        gate = F.pad(0.5 + 0.4 * torch.tanh(x), (0, 0, 1, 0), value=2.0).cumprod(1)[:, -t:]
        before = F.pad(x, (0, 0, 1, 0)).cumsum(1)[:, :-1]
        return super().forward(x + 0.2 * run + 0.3 * gate + 0.1 * before)


class TokenRootScanAttn(_SdpaAttn):
    """A running sum whose row in front is the mean of the sequence, ``cat([x.mean(1,
    keepdim=True), x], 1).cumsum(1)[:, 1:]`` (refused: that row reads every token)."""

    def forward(self, x):
        return super().forward(x + 0.3 * torch.cat([x.mean(1, keepdim=True), x], dim=1).cumsum(1)[:, 1:])


class SmearAttn(_SdpaAttn):
    """nanochat / modded-nanogpt's smear: the first row kept, every later row plus a gated copy
    of the row before it, ``cat([x[:, :1], x[:, 1:] + gate * x[:, :-1]], dim=1)`` with
    ``gate = lambda * sigmoid(smear_gate(x[:, 1:, :8]))``."""

    def __init__(self) -> None:
        super().__init__()
        self.smear_gate = nn.Linear(8, 1, bias=False)
        self.smear_lambda = nn.Parameter(torch.tensor(0.7))

    def forward(self, x):
        gate = self.smear_lambda.to(x.dtype) * torch.sigmoid(self.smear_gate(x[:, 1:, :8]))
        return super().forward(torch.cat([x[:, :1], x[:, 1:] + gate * x[:, :-1]], dim=1))


class SmearFirstAttn(_SdpaAttn):
    """A smear whose later rows also read the first row, ``cat([x[:, :1], x[:, 1:] + x[:, :-1] *
    x[:, :1]])`` (refused: per path that is the path's first row, in the packed row only the first
    root's)."""

    def forward(self, x):
        return super().forward(torch.cat([x[:, :1], x[:, 1:] + x[:, :-1] * x[:, :1]], dim=1))


class RunningMeanAttn(_SdpaAttn):
    """A running mean of the hidden states over the sequence (``cumsum / arange(1, T + 1)``)
    mixed in before attention."""

    def forward(self, x):
        t = x.shape[1]
        mean = x.cumsum(1) / torch.arange(1, t + 1, device=x.device, dtype=x.dtype)[:, None]
        return super().forward(x + 0.5 * mean)


class RunningWindowAttn(_SdpaAttn):
    """A moving-window sum of the last 3 hidden states by cumsum differences, the earlier sum
    shifted by padding in front and cutting the end: ``c - F.pad(c, (0, 0, 3, 0))[:, :-3]``."""

    def forward(self, x):
        c = x.cumsum(1)
        win = c - F.pad(c, (0, 0, 3, 0))[:, :-3]
        return super().forward(x + 0.25 * win)


class RunningMaxAttn(_SdpaAttn):
    """A running max of a gate over the sequence (``cummax``), with its index as a feature."""

    def forward(self, x):
        best, where = x[..., :4].cummax(dim=1)
        return super().forward(x + best.sum(-1, keepdim=True) + 0.01 * where[..., :1].to(x.dtype))


class FillShiftAttn(_SdpaAttn):
    """Token shifts whose first rows read something other than zeros: a constant
    (``nn.ConstantPad1d((1, -1), 0.5)`` on channels-first rows), a learned initial state
    (RWKV-7 / Griffin: ``cat([x_prev0.expand(b, 1, d), x[:, :-1]])``) and the first row
    repeated (``cat([x[:, :1], x[:, :-1]])``)."""

    def __init__(self) -> None:
        super().__init__()
        self.shift = nn.ConstantPad1d((1, -1), 0.5)
        self.x_prev0 = nn.Parameter(torch.randn(1, 1, DIM))

    def forward(self, x):
        b = x.shape[0]
        constant = self.shift(x.transpose(1, 2)).transpose(1, 2)
        learned = torch.cat([self.x_prev0.expand(b, 1, DIM), x[:, :-1]], dim=1)
        repeated = torch.cat([x[:, :1], x[:, :-1]], dim=1)
        return super().forward(x + 0.3 * constant + 0.5 * (learned - x) + 0.2 * repeated)


class FillConvAttn(_SdpaAttn):
    """Causal convs whose padding is not zeros: ``nn.Conv1d(padding=K - 1,
    padding_mode="replicate")(x)[..., :T]`` (padded on both sides, the end cut) and
    ``F.conv1d(F.pad(x, (K - 1, 0), value=1.0), w, b, groups=C)``; and a zero-padded one cut after
    transposing back, as mamba2-minimal writes it: ``conv(x.transpose(1, 2)).transpose(1, 2)[:, :T]``."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(DIM, DIM, 3, groups=DIM, padding=2, padding_mode="replicate")
        self.conv2 = nn.Conv1d(DIM, DIM, 4, groups=DIM, padding=3)
        self.conv_w = nn.Parameter(torch.randn(DIM, 1, 3) / 3)
        self.conv_b = nn.Parameter(torch.randn(DIM) / 3)

    def forward(self, x):
        t = x.shape[1]
        xt = x.transpose(1, 2)
        replicated = self.conv(xt)[..., :t]
        valued = F.conv1d(F.pad(xt, (2, 0), value=1.0), self.conv_w, self.conv_b, groups=DIM)
        cut_late = self.conv2(xt).transpose(1, 2)[:, :t, :]
        return super().forward(x + 0.5 * (replicated + valued).transpose(1, 2) + 0.5 * cut_late)


class WindowAttn(_SdpaAttn):
    """Windows over the last 3 rows: a causal PoolFormer's ``avg_pool1d(F.pad(x, (2, 0),
    mode="replicate"), 3, stride=1)``, a running max over ``F.pad(.., value=-1).unfold(-1, 3, 1)``,
    and fairseq's LightweightConv taps ``F.pad(x, (0, 0, 2, 0)).unfold(1, 3, 1)`` weighted by a
    softmax per channel."""

    def __init__(self) -> None:
        super().__init__()
        self.taps = nn.Parameter(torch.randn(DIM, 3))

    def forward(self, x):
        xt = x.transpose(1, 2)
        mean = F.avg_pool1d(F.pad(xt, (2, 0), mode="replicate"), 3, stride=1)
        top = F.pad(xt, (2, 0), value=-1.0).unfold(-1, 3, 1).amax(-1)
        light = (F.pad(x, (0, 0, 2, 0)).unfold(1, 3, 1) * self.taps.softmax(-1)).sum(-1)
        return super().forward(x + 0.3 * (mean + top).transpose(1, 2) + 0.5 * light)


class MixingAttn(_SdpaAttn):
    """Fixed causal mixing matrices times the rows: OpenNMT's Average Attention
    (``cumulative_average_mask``: ``tril(ones(T, T)) * (1 / arange(1, T + 1))[:, None]`` built in
    float32, expanded over the batch, cast, ``matmul(mask, x)``) and a running sum
    ``torch.tril(torch.ones(T, T)) @ x``."""

    def forward(self, x):
        b, t, _ = x.shape
        triangle = torch.tril(torch.ones(t, t, dtype=torch.float, device=x.device))
        weights = torch.ones(1, t, dtype=torch.float, device=x.device) / torch.arange(
            1, t + 1, dtype=torch.float, device=x.device)
        mask = (triangle * weights.transpose(0, 1)).unsqueeze(0).expand(b, t, t).to(x.dtype)
        mean = torch.matmul(mask, x)
        total = torch.tril(torch.ones(t, t, dtype=x.dtype, device=x.device)) @ x
        return super().forward(x + 0.5 * mean + 0.05 * total)


class LengthMixingAttn(_SdpaAttn):
    """A causal running sum divided by the whole length, ``(tril(ones(T, T)) / T) @ x``
    (refused: per path T is the path's length)."""

    def forward(self, x):
        t = x.shape[1]
        return super().forward(x + (torch.tril(torch.ones(t, t, dtype=x.dtype, device=x.device)) / t) @ x)


class BufferMixingAttn(_SdpaAttn):
    """A running mean whose matrix is sliced from a buffer, ``(tri[:T, :T] / arange(1, T + 1)[:, None]) @ x``
    (refused: a buffer's values may change between calls)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("tri", torch.tril(torch.ones(64, 64)))

    def forward(self, x):
        t = x.shape[1]
        scale = torch.arange(1, t + 1, dtype=x.dtype, device=x.device)[:, None]
        return super().forward(x + (self.tri[:t, :t].to(x.dtype) / scale) @ x)


class FutureMixingAttn(_SdpaAttn):
    """A running sum over the rows after each row, ``triu(ones(T, T)) @ x`` (refused)."""

    def forward(self, x):
        t = x.shape[1]
        return super().forward(x + 0.1 * torch.triu(torch.ones(t, t, dtype=x.dtype, device=x.device)) @ x)


class FirstTokenResetAttn(_SdpaAttn):
    """Griffin's RG-LRU reset (recurrentgemma): ``segment_pos = arange(T)``, ``reset =
    segment_pos == 0``, and the input multiplier ``reset + ~reset * sqrt(1 - a^2)``: the first
    token of the sequence gets a different scale."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(DIM, DIM)

    def forward(self, x):
        segment_pos = torch.arange(x.shape[1], device=x.device)[None].expand(x.shape[0], -1)
        reset = segment_pos == 0
        a = torch.sigmoid(self.gate(x))
        multiplier = reset[..., None] + ~reset[..., None] * torch.sqrt(1 - a * a)
        return super().forward(x * multiplier)


class LastTokenFlagAttn(_SdpaAttn):
    """A flag on the last row, ``arange(T) == T - 1`` (refused: per path the last token is the
    path's)."""

    def forward(self, x):
        t = x.shape[1]
        last = (torch.arange(t, device=x.device) == t - 1)[None, :, None]
        return super().forward(x + last.to(x.dtype))


class ReflectConvAttn(_SdpaAttn):
    """A "causal" conv over ``F.pad(x, (K - 1, 0), mode="reflect")``: the padding reflects rows
    1 .. K - 1, which come after the first row (refused)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv_w = nn.Parameter(torch.randn(DIM, 1, 3) / 3)

    def forward(self, x):
        y = F.conv1d(F.pad(x.transpose(1, 2), (2, 0), mode="reflect"), self.conv_w, groups=DIM)
        return super().forward(x + y.transpose(1, 2))


class LastRowShiftAttn(_SdpaAttn):
    """A shift whose first row reads the last: ``cat([x[:, -1:], x[:, :-1]])`` (refused)."""

    def forward(self, x):
        return super().forward(x + 0.5 * torch.cat([x[:, -1:], x[:, :-1]], dim=1))


class MeanRowShiftAttn(_SdpaAttn):
    """A shift whose first row is the mean over the sequence: ``cat([x.mean(1, keepdim=True),
    x[:, :-1]])`` (refused: the fill reads every token)."""

    def forward(self, x):
        return super().forward(x + 0.5 * torch.cat([x.mean(1, keepdim=True), x[:, :-1]], dim=1))


def _spelling(attn_cls):
    return type(f"{attn_cls.__name__}LM", (_LM,), {"block_cls": attn_cls, "__doc__": attn_cls.__doc__})


MultiQueryEinsumLM = _spelling(MultiQueryEinsumAttn)
TransposedKeysLM = _spelling(TransposedKeysAttn)
ConvActCutLM = _spelling(ConvActCutAttn)
(BmmLM, BaddbmmLM, EinsumLM, TypeAsLM, ToDtypeLM, MaskedFillInfLM, SdpaTrilMaskLM, VmapMaskLM, VmapHeadsLM,
 InPlaceScoresLM, InPlaceBiasLM, CausalConvSliceLM, FunctionalConvLM, ShiftTokensLM, CatShiftLM, CropPadShiftLM) = (
    _spelling(c)
    for c in (BmmAttn, BaddbmmAttn, EinsumAttn, TypeAsAttn, ToDtypeAttn, MaskedFillInfAttn, SdpaTrilMaskAttn,
              VmapMaskAttn, VmapHeadsAttn, InPlaceScoresAttn, InPlaceBiasAttn, CausalConvSliceAttn, FunctionalConvAttn,
              ShiftTokensAttn, CatShiftAttn, CropPadShiftAttn)
)
RollShiftLM, RollShiftTwoLM, RollNoZeroLM, RollWrongZeroLM, RollReadFirstLM, InPlaceCumsumLM, InPlaceCumprodLM = (
    _spelling(c) for c in (RollShiftAttn, RollShiftTwoAttn, RollNoZeroAttn, RollWrongZeroAttn, RollReadFirstAttn,
                           InPlaceCumsumAttn, InPlaceCumprodAttn))
QuadraticLinearLM, TrilLinearLM, LengthDecayLM, BidirectionalLinearLM, NormalisedLinearLM = (
    _spelling(c) for c in (QuadraticLinearAttn, TrilLinearAttn, LengthDecayAttn, BidirectionalLinearAttn,
                           NormalisedLinearAttn))


class RetentionLM(_LM):
    """RetNet's parallel retention (`RetentionAttn`) in every block."""

    block_cls = RetentionAttn


PointwiseConvLM = _spelling(PointwiseConvAttn)
RunningWindowLM = _spelling(RunningWindowAttn)
BufferShiftLM, RollMaskedShiftLM, RollMaskedWrongLM = (
    _spelling(BufferShiftAttn), _spelling(RollMaskedShiftAttn), _spelling(RollMaskedWrongAttn))
FillShiftLM, FillConvLM, WindowLM, ReflectConvLM, LastRowShiftLM, MeanRowShiftLM = (
    _spelling(c) for c in (FillShiftAttn, FillConvAttn, WindowAttn, ReflectConvAttn, LastRowShiftAttn,
                           MeanRowShiftAttn))
FirstTokenResetLM, LastTokenFlagLM = _spelling(FirstTokenResetAttn), _spelling(LastTokenFlagAttn)
NeoxRotaryLM, NeoxBaddbmmLM = _spelling(NeoxRotaryAttn), _spelling(NeoxBaddbmmAttn)
MixingLM, LengthMixingLM, FutureMixingLM, BufferMixingLM = (
    _spelling(c) for c in (MixingAttn, LengthMixingAttn, FutureMixingAttn, BufferMixingAttn))
CumsumLinearLM, MinGRULM, RunningMeanLM, RunningMaxLM = (
    _spelling(c) for c in (CumsumLinearAttn, MinGRUBlock, RunningMeanAttn, RunningMaxAttn))
MinLSTMLM, RootedScanLM, TokenRootScanLM = (_spelling(c) for c in (MinLSTMBlock, RootedScanAttn, TokenRootScanAttn))
SmearLM, SmearFirstLM = _spelling(SmearAttn), _spelling(SmearFirstAttn)


# ----------------------------------------------------------------------- score biases read from the tokens


class _GatedAttn(_Attn):
    """`_Attn` with a gate per head and token, ``gate(ln(x))`` as ``[B, H, T]``, passed to ``attend``."""

    def __init__(self, bias_heads: int = HEADS) -> None:
        super().__init__()
        self.gate = nn.Linear(DIM, bias_heads)

    def forward(self, x):
        b, t, _ = x.shape
        y = self.attend(*self.heads(x), self.gate(self.ln(x)).transpose(1, 2))
        x = x + self.o(y.transpose(1, 2).reshape(b, t, DIM))
        return x + self.mlp(self.ln2(x))


class ForgettingAttn(_GatedAttn):
    """The Forgetting Transformer (Lin et al., 2025) as its reference writes it: a forget gate
    per head and token, ``c = cumsum(logsigmoid(f))`` over the sequence, and the scores
    ``q k^T / sqrt(d) + c_i - c_j`` (the log of the product of the gates between the two
    tokens), causal by the tril buffer."""

    def attend(self, q, k, v, f):
        t = q.shape[2]
        c = F.logsigmoid(f).cumsum(-1)
        att = q @ k.transpose(-2, -1) * HD**-0.5 + (c[..., :, None] - c[..., None, :])
        att = att.masked_fill(self.causal[:, :, :t, :t] == 0, float("-inf"))
        return att.softmax(-1) @ v


class KeyGateAttn(_GatedAttn):
    """A bias per key read from its token (Doge's dynamic mask without its top-k), added before
    the scale, one gate shared by the heads (``bias_heads=1``) or one per head; ``subtract``:
    the bias subtracted after the scale; ``mqa``: one key and value head broadcast over the
    query heads by the products."""

    def __init__(self, bias_heads: int = HEADS, subtract: bool = False, mqa: bool = False) -> None:
        super().__init__(bias_heads)
        self.subtract, self.mqa = subtract, mqa

    def attend(self, q, k, v, g):
        t = q.shape[2]
        if self.mqa:
            k, v = k[:, :1], v[:, :1]
        if self.subtract:
            att = q @ k.transpose(-2, -1) * HD**-0.5 - F.softplus(g)[:, :, None, :]
        else:
            att = (q @ k.transpose(-2, -1) + F.softplus(g).unsqueeze(-2)) * HD**-0.5
        att = att.masked_fill(self.causal[:, :, :t, :t] == 0, float("-inf"))
        return att.softmax(-1) @ v


class KeyGateCapAttn(_GatedAttn):
    """A bias per key read from its token subtracted after a soft-cap ``30 tanh(x / 30)``."""

    def attend(self, q, k, v, g):
        t = q.shape[2]
        att = q @ k.transpose(-2, -1) * HD**-0.5
        att = 30 * torch.tanh(att / 30) - F.softplus(g)[:, :, None, :]
        att = att.masked_fill(self.causal[:, :, :t, :t] == 0, float("-inf"))
        return att.softmax(-1) @ v


ForgettingLM, KeyGateLM, KeyGateCapLM = (_spelling(c) for c in (ForgettingAttn, KeyGateAttn, KeyGateCapAttn))


PAD = 5  # a token of the zoo's trees (tests/zoo.py TREES), so the padding masks below block keys there


class _PaddedAttn(_Attn):
    """`_Attn` whose ``attend`` also gets ``keep = ids != PAD`` ``[B, T]`` (a key padding mask, as
    models trained on padded batches compute it from the ids)."""

    def forward(self, x, keep):
        b, t, _ = x.shape
        y = self.attend(*self.heads(x), keep)
        x = x + self.o(y.transpose(1, 2).reshape(b, t, DIM))
        return x + self.mlp(self.ln2(x))


class PaddingFillAttn(_PaddedAttn):
    """Causal by the tril buffer, then ``masked_fill(~keep[:, None, None, :], -inf)``."""

    def attend(self, q, k, v, keep):
        t = q.shape[2]
        att = q @ k.transpose(-2, -1) * HD**-0.5
        att = att.masked_fill(self.causal[:, :, :t, :t] == 0, float("-inf"))
        att = att.masked_fill(~keep[:, None, None, :], float("-inf"))
        return att.softmax(-1) @ v


class PaddingSdpaAttn(_PaddedAttn):
    """SDPA with ``attn_mask = causal & keep[:, None, None, :]`` (``bias``: the float form, an
    additive causal mask plus ``-1e9`` on padded keys; ``alone``: the key mask without a causal
    one, bidirectional)."""

    def __init__(self, form: str = "bool") -> None:
        super().__init__()
        self.form = form

    def attend(self, q, k, v, keep):
        t = q.shape[2]
        causal = self.causal[:, :, :t, :t].bool()
        if self.form == "bias":
            mask = torch.zeros(t, t, dtype=q.dtype, device=q.device).masked_fill(~causal, float("-inf"))
            mask = mask + torch.zeros(keep.shape, dtype=q.dtype, device=q.device).masked_fill(~keep, -1e9)[:, None, None]
        else:
            mask = keep[:, None, None, :] if self.form == "alone" else causal & keep[:, None, None, :]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class PaddedLM(_LM):
    """`_LM` whose blocks get the key padding mask ``ids != PAD``."""

    block_cls = PaddingFillAttn

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        keep = idx != PAD
        x = self.emb(idx)
        for blk in self.blocks:
            x = blk(x, keep)
        return self.head(self.norm(x))


PaddingSdpaLM = type("PaddingSdpaLM", (PaddedLM,), {"block_cls": PaddingSdpaAttn, "__doc__": PaddingSdpaAttn.__doc__})


class ExtendedMaskAttn(_PaddedAttn):
    """BERT-style extended mask ``(1 - keep[:, None, None, :]) * -10000`` added to the scores,
    then the causal tril buffer."""

    def attend(self, q, k, v, keep):
        t = q.shape[2]
        extended = (1.0 - keep[:, None, None, :].to(q.dtype)) * -10000.0
        att = q @ k.transpose(-2, -1) * HD**-0.5 + extended
        att = att.masked_fill(self.causal[:, :, :t, :t] == 0, float("-inf"))
        return att.softmax(-1) @ v


class EncoderLayerPaddingBlock(nn.Module):
    """``nn.TransformerEncoderLayer`` with a boolean causal ``src_mask`` (True above the
    diagonal) and a boolean ``src_key_padding_mask = ~keep``. (A float causal mask beside the
    boolean padding mask makes torch warn about the mixed types: on torch 2.13 with a message
    alone, which the capture issues after the graph; on 2.14 with keyword arguments, which
    Dynamo cannot reorder, so the model is refused naming the line.)"""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(DIM, HEADS, 2 * DIM, dropout=0.0, batch_first=True)

    def forward(self, x, keep):
        t = x.shape[1]
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        return self.layer(x, src_mask=causal, src_key_padding_mask=~keep, is_causal=True)


class DiffAttn(_Attn):
    """The Differential Transformer as its reference (microsoft/unilm, ``multihead_diffattn.py``)
    writes it: ``2H`` heads of half width, scores cleaned by ``nan_to_num``, a triu ``-inf``
    mask, ``softmax(dtype=float32)``, the maps viewed ``[B, H, 2, T, T]`` and combined
    ``p[:, :, 0] - lam * p[:, :, 1]`` (``lam`` from four learned vectors) before ``@ v`` with
    ``H`` value heads of double width, then a sub-LayerNorm. ``exact``: the float32 casts left
    out (softmax and ``lam`` in the model's dtype)."""

    def __init__(self, exact: bool = False) -> None:
        super().__init__()
        self.h, self.d = HEADS // 2, HD
        self.lambda_init = 0.8 - 0.6 * math.exp(-0.3 * 0)
        self.lambda_q1, self.lambda_k1, self.lambda_q2, self.lambda_k2 = (
            nn.Parameter(torch.randn(self.d) * 0.1) for _ in range(4))
        self.subln = nn.LayerNorm(2 * self.d)
        self.exact = exact

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(self.ln(x)).split(DIM, dim=-1)
        q = q.view(b, t, 2 * self.h, self.d).transpose(1, 2) * self.d ** -0.5
        k = k.view(b, t, 2 * self.h, self.d).transpose(1, 2)
        v = v.view(b, t, self.h, 2 * self.d).transpose(1, 2)
        w = torch.nan_to_num(torch.matmul(q, k.transpose(-1, -2)))
        cast = (lambda z: z) if self.exact else (lambda z: z.float())
        w = w + torch.triu(cast(torch.zeros([t, t], dtype=q.dtype)).fill_(float("-inf")).type_as(w), 1)
        w = (F.softmax(w, dim=-1) if self.exact else F.softmax(w, dim=-1, dtype=torch.float32)).type_as(w)
        lam1 = torch.exp(cast(torch.sum(self.lambda_q1 * self.lambda_k1, dim=-1))).type_as(q)
        lam2 = torch.exp(cast(torch.sum(self.lambda_q2 * self.lambda_k2, dim=-1))).type_as(q)
        w = w.view(b, self.h, 2, t, t)
        w = w[:, :, 0] - (lam1 - lam2 + self.lambda_init) * w[:, :, 1]
        y = self.subln(torch.matmul(w, v)) * (1 - self.lambda_init)
        x = x + self.o(y.transpose(1, 2).reshape(b, t, DIM))
        return x + self.mlp(self.ln2(x))


DiffLM = _spelling(DiffAttn)


class LogitScaleAttn(_Attn):
    """Cosine attention with a learned logit scale per head (Swin Transformer V2): normalised q
    and k, scores times ``exp(clamp(logit_scale, max=log(100)))``, then the tril buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.logit_scale = nn.Parameter(torch.log(10 * torch.ones(HEADS, 1, 1)))

    def attend(self, q, k, v):
        t = q.shape[2]
        att = F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-2, -1)
        att = att * torch.clamp(self.logit_scale, max=math.log(100.0)).exp()
        att = att.masked_fill(self.causal[:, :, :t, :t] == 0, float("-inf"))
        return att.softmax(-1) @ v


class ScalableSoftmaxAttn(_Attn):
    """Scalable-Softmax (Nakanishi, 2025): the scores times ``s * log(n)`` per query, ``n`` the keys
    it sees (``arange(1, T + 1)``), ``s`` learned per head; ``temperature``: the scores divided
    by a learned temperature per head instead."""

    def __init__(self, temperature: bool = False) -> None:
        super().__init__()
        self.s = nn.Parameter(torch.ones(HEADS, 1, 1) * 0.4)
        self.temperature = temperature

    def attend(self, q, k, v):
        t = q.shape[2]
        att = q @ k.transpose(-2, -1) * HD**-0.5
        if self.temperature:
            att = att / self.s
        else:
            att = att * (self.s * torch.log(torch.arange(1, t + 1, device=q.device, dtype=q.dtype)[:, None]))
        att = att.masked_fill(self.causal[:, :, :t, :t] == 0, float("-inf"))
        return att.softmax(-1) @ v


LogitScaleLM, ScalableSoftmaxLM = (_spelling(c) for c in (LogitScaleAttn, ScalableSoftmaxAttn))


class MemoryKVAttn(_Attn):
    """Learned memory keys and values (x-transformers' ``num_mem_kv``): ``M`` per head,
    expanded over the batch and concatenated before the sequence's keys and values, the causal
    mask padded with ``M`` readable columns (``masked``: the first query may not read them;
    ``sdpa``: SDPA with the padded boolean mask of what each query may read)."""

    def __init__(self, memory: int = 2, masked: bool = False, sdpa: bool = False) -> None:
        super().__init__()
        self.mem_k = nn.Parameter(torch.randn(HEADS, memory, HD))
        self.mem_v = nn.Parameter(torch.randn(HEADS, memory, HD))
        self.memory, self.masked, self.sdpa = memory, masked, sdpa

    def attend(self, q, k, v):
        b, _, t, _ = q.shape
        mem_k, mem_v = (x.unsqueeze(0).expand(b, -1, -1, -1) for x in (self.mem_k, self.mem_v))
        k, v = torch.cat((mem_k, k), dim=-2), torch.cat((mem_v, v), dim=-2)
        if self.sdpa:
            allowed = F.pad(torch.ones(t, t, dtype=torch.bool, device=q.device).tril(), (self.memory, 0), value=True)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        att = q @ k.transpose(-2, -1) * HD**-0.5
        blocked = F.pad(torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1), (self.memory, 0), value=False)
        if self.masked:
            blocked[0, : self.memory] = True
        att = att.masked_fill(blocked, float("-inf"))
        return att.softmax(-1) @ v


MemoryKVLM = _spelling(MemoryKVAttn)


ExtendedMaskLM, EncoderLayerPaddingLM = (
    type(f"{c.__name__}LM", (PaddedLM,), {"block_cls": c, "__doc__": c.__doc__})
    for c in (ExtendedMaskAttn, EncoderLayerPaddingBlock))


# ----------------------------------------------------------------------- positions


class ComplexRopeAttn(_Attn):
    """Llama-1 reference RoPE: ``freqs_cis = polar(1, outer(arange(T), inv))``, ``view_as_complex``."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("inv", 1.0 / (10000.0 ** (torch.arange(0, HD, 2).double() / HD)), persistent=False)

    def attend(self, q, k, v):
        t = q.shape[2]
        ang = torch.outer(torch.arange(t, device=q.device, dtype=self.inv.dtype), self.inv)
        freqs = torch.polar(torch.ones_like(ang), ang)

        def rot(z):
            zc = torch.view_as_complex(z.reshape(*z.shape[:-1], -1, 2).contiguous())
            return torch.view_as_real(zc * freqs).flatten(-2)

        return F.scaled_dot_product_attention(rot(q), rot(k), v, is_causal=True)


class _TableRopeAttn(_Attn):
    """RoPE from a precomputed complex ``freqs_cis`` table sliced ``[:T]`` (Llama-1 / Mistral reference)."""

    def __init__(self) -> None:
        super().__init__()
        inv = 1.0 / (10000.0 ** (torch.arange(0, HD, 2).double() / HD))
        ang = torch.outer(torch.arange(MAX_LEN).double(), inv)
        self.register_buffer("freqs_cis", torch.polar(torch.ones_like(ang), ang), persistent=False)

    def attend(self, q, k, v):
        freqs = self.freqs_cis[: q.shape[2]]

        def rot(z):
            zc = torch.view_as_complex(z.reshape(*z.shape[:-1], -1, 2).contiguous())
            return torch.view_as_real(zc * freqs).flatten(-2)

        return F.scaled_dot_product_attention(rot(q), rot(k), v, is_causal=True)


class RangeRopeAttn(ComplexRopeAttn):
    """RoPE angles from positions built as ``q.new_tensor(range(T))``: a Python range of the
    length, which Dynamo turns into numbers (the length becomes a constant)."""

    def attend(self, q, k, v):
        ang = torch.outer(q.new_tensor(range(q.shape[2])).to(self.inv.dtype), self.inv)
        freqs = torch.polar(torch.ones_like(ang), ang)

        def rot(z):
            zc = torch.view_as_complex(z.reshape(*z.shape[:-1], -1, 2).contiguous())
            return torch.view_as_real(zc * freqs).flatten(-2)

        return F.scaled_dot_product_attention(rot(q), rot(k), v, is_causal=True)


ComplexRopeLM = _spelling(ComplexRopeAttn)
ComplexRopeTableLM = _spelling(_TableRopeAttn)
RangeRopeLM = _spelling(RangeRopeAttn)


class AlibiAttn(_Attn):
    """ALiBi: ``scores + slope[h] * (j - i)`` from ``arange(T)``, then the tril buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("slopes", 2.0 ** (-8.0 * torch.arange(1, HEADS + 1) / HEADS), persistent=False)

    def attend(self, q, k, v):
        t = q.shape[2]
        pos = torch.arange(t, device=q.device)
        rel = (pos[None, :] - pos[:, None]).to(q.dtype)
        att = q @ k.transpose(-2, -1) * HD**-0.5 + self.slopes.to(q.dtype)[:, None, None] * rel
        att = att.masked_fill(self.causal[:, :, :t, :t] == 0, float("-inf"))
        return att.softmax(-1) @ v


AlibiLM = _spelling(AlibiAttn)


class AbsAlibiAttn(AlibiAttn):
    """x-transformers' ``AlibiPositionalBias`` (its bias not cached): ``-|j - i| * slope[h]``
    from two aranges, added before the causal mask, which it leaves unblocked."""

    def attend(self, q, k, v):
        t = q.shape[2]
        i_arange, j_arange = torch.arange(t, device=q.device), torch.arange(t, device=q.device)
        bias = -torch.abs(j_arange[None, None, :] - i_arange[None, :, None]) * self.slopes[:, None, None]
        att = q @ k.transpose(-2, -1) * HD**-0.5 + bias.to(q.dtype)
        att = att.masked_fill(self.causal[:, :, :t, :t] == 0, float("-inf"))
        return att.softmax(-1) @ v


AbsAlibiLM = _spelling(AbsAlibiAttn)


class BtlmAlibiAttn(AlibiAttn):
    """cerebras BTLM: the symmetric ALiBi ``-|j - i| * slope`` added after the causal
    ``torch.where(tril, scores, finfo.min)``, in place and cast to the scores' dtype
    (``attn_weights += position_bias.type_as(attn_weights)``): the cast's ``type_as`` reads the
    scores for their dtype only."""

    def attend(self, q, k, v):
        t = q.shape[2]
        rel = torch.abs(torch.arange(t, device=q.device)[None, :] - torch.arange(t, device=q.device)[:, None])
        position_bias = (self.slopes / -1.0)[:, None, None] * rel.unsqueeze(0).expand(HEADS, -1, -1)
        att = torch.matmul(q, k.transpose(-1, -2)) * HD**-0.5
        att = torch.where(self.causal[:, :, :t, :t].bool(), att, torch.finfo(att.dtype).min)
        att += position_bias.type_as(att).unsqueeze(0)
        return nn.functional.softmax(att, dim=-1) @ v


BtlmAlibiLM = _spelling(BtlmAlibiAttn)


class PatternMaskAttn(_Attn):
    """A causal mask of another pattern, built from two aranges: ``"strided"`` is OpenAI's Sparse
    Transformer strided head (``q >= k`` and ``(q - k) % 3 == 0``, applied as
    ``w * mask + -1e9 * (1 - mask)``), ``"dilated"`` a dilated window by ``masked_fill``
    (``(q - k) % 2 == 0`` and ``q - k < 6``); ``"chunked"`` keeps the keys of the query's chunk of 4
    (``q // 4 == k // 4``: Llama 4's chunks, a function of the positions), ``"fixed"`` the Sparse
    Transformer's fixed heads (the query's chunk and every chunk's last key: neither) and ``"half"``
    the keys less than ``T // 2`` before (a pattern that changes with the length)."""

    def __init__(self, pattern: str = "strided") -> None:
        super().__init__()
        self.pattern = pattern

    def attend(self, q, k, v):
        t = q.shape[2]
        x = torch.arange(t, device=q.device).view(t, 1)
        y = x.transpose(0, 1)
        causal = x >= y
        keep = {"strided": (x - y) % 3 == 0, "dilated": ((x - y) % 2 == 0) & (x - y < 6),
                "chunked": x // 4 == y // 4, "fixed": (x // 4 == y // 4) | (y % 4 == 3),
                "half": x - y < t // 2}[self.pattern] & causal
        w = torch.matmul(q, k.transpose(-1, -2)) * HD**-0.5
        if self.pattern == "strided":
            mask = keep.to(w.dtype).view(1, 1, t, t)
            w = w * mask + -1e9 * (1 - mask)
        else:
            w = w.masked_fill(~keep, float("-inf"))
        return F.softmax(w, dim=-1) @ v


PatternMaskLM = _spelling(PatternMaskAttn)


class SdpaPatternMaskAttn(PatternMaskAttn):
    """The same patterns as SDPA's boolean ``attn_mask``."""

    def attend(self, q, k, v):
        t = q.shape[2]
        x = torch.arange(t, device=q.device).view(t, 1)
        y = x.transpose(0, 1)
        keep = {"strided": (x - y) % 3 == 0, "chunked": x // 4 == y // 4}[self.pattern] & (x >= y)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep)


SdpaPatternMaskLM = _spelling(SdpaPatternMaskAttn)


class T5BiasAttn(_Attn):
    """T5-style relative position bias: a learned ``[buckets, H]`` table at ``bucket(i - j)``."""

    BUCKETS = 8

    def __init__(self) -> None:
        super().__init__()
        self.rel = nn.Embedding(self.BUCKETS, HEADS)

    def attend(self, q, k, v):
        t = q.shape[2]
        ctx = torch.arange(t, device=q.device)[:, None]
        mem = torch.arange(t, device=q.device)[None, :]
        bucket = (ctx - mem).clamp(0, self.BUCKETS - 1)
        bias = self.rel(bucket).permute(2, 0, 1)[None]
        att = q @ k.transpose(-2, -1) + bias
        att = att.masked_fill(self.causal[:, :, :t, :t] == 0, float("-inf"))
        return att.softmax(-1) @ v


T5BiasLM = _spelling(T5BiasAttn)


def t5_relative_position_bucket(relative_position, bidirectional=True, num_buckets=32, max_distance=128):
    """transformers models/t5/modeling_t5.py ``T5Attention._relative_position_bucket``."""
    relative_buckets = 0
    if bidirectional:
        num_buckets //= 2
        relative_buckets += (relative_position > 0).to(torch.long) * num_buckets
        relative_position = torch.abs(relative_position)
    else:
        relative_position = -torch.min(relative_position, torch.zeros_like(relative_position))
    # now relative_position is in the range [0, inf)

    # half of the buckets are for exact increments in positions
    max_exact = num_buckets // 2
    is_small = relative_position < max_exact

    # The other half of the buckets are for logarithmically bigger bins in positions up to max_distance
    relative_position_if_large = max_exact + (
        torch.log(relative_position.float() / max_exact)
        / math.log(max_distance / max_exact)
        * (num_buckets - max_exact)
    ).to(torch.long)
    relative_position_if_large = torch.min(
        relative_position_if_large, torch.full_like(relative_position_if_large, num_buckets - 1)
    )

    relative_buckets += torch.where(is_small, relative_position, relative_position_if_large)
    return relative_buckets


class T5BucketsAttn(_Attn):
    """T5's own bias (``compute_bias`` with ``bidirectional=False``, as a decoder computes it):
    log-spaced relative position buckets into a learned ``Embedding(buckets, H)``, added to the
    unscaled scores, under the causal tril buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.relative_attention_num_buckets, self.relative_attention_max_distance = 8, 16
        self.relative_attention_bias = nn.Embedding(self.relative_attention_num_buckets, HEADS)

    def compute_bias(self, query_length, key_length, device=None):
        context_position = torch.arange(query_length, dtype=torch.long, device=device)[:, None]
        memory_position = torch.arange(key_length, dtype=torch.long, device=device)[None, :]
        relative_position = memory_position - context_position  # shape (query_length, key_length)
        relative_position_bucket = t5_relative_position_bucket(
            relative_position, bidirectional=False, num_buckets=self.relative_attention_num_buckets,
            max_distance=self.relative_attention_max_distance,
        )
        values = self.relative_attention_bias(relative_position_bucket)  # shape (query_length, key_length, num_heads)
        values = values.permute([2, 0, 1]).unsqueeze(0)  # shape (1, num_heads, query_length, key_length)
        return values

    def attend(self, q, k, v):
        t = q.shape[2]
        scores = torch.matmul(q, k.transpose(3, 2)) + self.compute_bias(t, t, device=q.device)
        scores = scores.masked_fill(self.causal[:, :, :t, :t] == 0, float("-inf"))
        return torch.softmax(scores.float(), dim=-1).type_as(scores) @ v


class T5MaskedBiasAttn(T5BucketsAttn):
    """Hugging Face T5's decoder spelling: the causal mask (``finfo.min`` where blocked) added
    into the position bias, ``position_bias = compute_bias(..) + mask``, then ``scores +=
    position_bias``. With ``future`` the mask blocks the keys before the query instead (refused)."""

    future = False

    def attend(self, q, k, v):
        t = q.shape[2]
        allowed = self.causal[:, :, :t, :t]
        if self.future:
            allowed = allowed.transpose(-1, -2)
        mask = (1.0 - allowed) * torch.finfo(q.dtype).min
        position_bias = self.compute_bias(t, t, device=q.device) + mask
        scores = torch.matmul(q, k.transpose(3, 2))
        scores += position_bias
        return torch.softmax(scores.float(), dim=-1).type_as(scores) @ v


class T5FutureBiasAttn(T5MaskedBiasAttn):
    __doc__ = T5MaskedBiasAttn.__doc__
    future = True


class LearnedAlibiAttn(_Attn):
    """ALiBi with learned slopes (a parameter per head) on the scaled scores."""

    def __init__(self) -> None:
        super().__init__()
        self.slopes = nn.Parameter(2.0 ** (-8.0 * torch.arange(1, HEADS + 1) / HEADS))

    def attend(self, q, k, v):
        t = q.shape[2]
        pos = torch.arange(t, device=q.device)
        rel = (pos[None, :] - pos[:, None]).to(q.dtype)
        att = (q @ k.transpose(-2, -1) + self.slopes.to(q.dtype)[:, None, None] * rel) * HD**-0.5
        att = att.masked_fill(self.causal[:, :, :t, :t] == 0, float("-inf"))
        return att.softmax(-1) @ v


class AbsolutePairBiasAttn(_Attn):
    """A learned bias of the query's absolute position plus the distance: not a function of
    the distance alone (refused)."""

    def __init__(self) -> None:
        super().__init__()
        self.rel = nn.Parameter(torch.zeros(MAX_LEN))
        self.absolute = nn.Parameter(torch.zeros(MAX_LEN))

    def attend(self, q, k, v):
        t = q.shape[2]
        i = torch.arange(t, device=q.device)
        bias = self.rel[(i[:, None] - i[None, :]).clamp(min=0)] + self.absolute[i][:, None]
        att = q @ k.transpose(-2, -1) * HD**-0.5 + bias
        att = att.masked_fill(self.causal[:, :, :t, :t] == 0, float("-inf"))
        return att.softmax(-1) @ v


T5MaskedBiasLM, T5FutureBiasLM = _spelling(T5MaskedBiasAttn), _spelling(T5FutureBiasAttn)
T5BucketsLM, LearnedAlibiLM, AbsolutePairBiasLM = (
    _spelling(c) for c in (T5BucketsAttn, LearnedAlibiAttn, AbsolutePairBiasAttn))


class SinkAttn(_Attn):
    """gpt-oss attention sinks: a learned per-head logit concatenated to the scores, dropped after softmax."""

    def __init__(self) -> None:
        super().__init__()
        self.sinks = nn.Parameter(torch.zeros(HEADS))

    def attend(self, q, k, v):
        b, h, t, _ = q.shape
        att = q @ k.transpose(-2, -1) * HD**-0.5
        att = att.masked_fill(self.causal[:, :, :t, :t] == 0, float("-inf"))
        sink = self.sinks.view(1, h, 1, 1).expand(b, h, t, 1)
        probs = torch.cat([att, sink], dim=-1).softmax(-1)[..., :-1]
        return probs @ v


SinkLM = _spelling(SinkAttn)


class NoHeadAttnLM(nn.Module):
    """3-D single-head attention: ``softmax(q @ k^T masked) @ v`` on ``[B, T, D]``, no head dim."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.q, self.k, self.v = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)
        self.ln = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)
        self.register_buffer("causal", torch.tril(torch.ones(MAX_LEN, MAX_LEN)))

    def forward(self, idx):
        t = idx.shape[1]
        x = self.emb(idx)
        att = self.q(x) @ self.k(x).transpose(1, 2) / math.sqrt(DIM)
        att = att.masked_fill(self.causal[:t, :t] == 0, float("-inf")).softmax(-1)
        return self.head(self.ln(x + att @ self.v(x)))


class OffsetPositionsLM(_LM):
    """Learned positions past an offset: ``self.pos[:, 2:T + 2]`` (a parameter over ``MAX_LEN + 2``
    entries, the first two kept for padding or a prefix token, as OPT's and fairseq's learned
    positions and ViT-style ``pos_embed[:, 1:T + 1]`` keep them); ``tail=True`` reads
    ``self.pos[:, -T:]`` instead, the last T entries, which depend on the sequence length."""

    block_cls = _SdpaAttn

    def __init__(self, tail: bool = False) -> None:
        super().__init__()
        self.tail = tail
        self.pos = nn.Parameter(torch.randn(1, MAX_LEN + 2, DIM))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        x = self.emb(idx) + (self.pos[:, -T:] if self.tail else self.pos[:, 2:T + 2])
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.norm(x))


class WpeShortTableLM(nn.Module):
    """Learned positions ``wpe(arange(T))`` from a 16-entry table: trees may have more rows
    than the table has positions, as long as every path fits."""

    def __init__(self) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, DIM), nn.Embedding(16, DIM)
        self.blocks = nn.ModuleList([SdpaTrilMaskAttn()])
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for b in self.blocks:
            x = b(x)
        return self.head(x)


# ----------------------------------------------------------------------- in-place code


class IndexAddMoE(nn.Module):
    """Top-2 of 4 experts; each expert's output is accumulated with ``index_add_`` into a zero buffer."""

    def __init__(self, experts: int = 4) -> None:
        super().__init__()
        self.router = nn.Linear(DIM, experts, bias=False)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(DIM, DIM), nn.SiLU(), nn.Linear(DIM, DIM))
                                     for _ in range(experts))

    def forward(self, x):
        b, t, d = x.shape
        flat = x.reshape(-1, d)
        w, idx = self.router(flat).softmax(-1).topk(2, dim=-1)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            hit = (idx == e).to(flat.dtype)  # [N, 2]
            weight = (w * hit).sum(-1, keepdim=True)  # 0 where the expert is not chosen
            rows = torch.arange(flat.shape[0], device=x.device)
            out.index_add_(0, rows, weight * expert(flat))
        return out.view(b, t, d)


class InplaceMoEBlock(SdpaTrilMaskAttn):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = IndexAddMoE()


InplaceMoELM = type("InplaceMoELM", (_LM,), {"block_cls": InplaceMoEBlock, "__doc__": IndexAddMoE.__doc__})


class BoolMaskMoE(IndexAddMoE):
    """DeepSeek-MoE's training path: the hidden states repeated once per chosen expert
    (``repeat_interleave(k)``), ``y = torch.empty_like(h)`` and ``y[flat_idx == i] = expert(h[flat_idx == i])``
    per expert (the mask computed twice), then the weighted sum over the k copies. With
    ``write_between`` the routing indices are written in place between the two masks (refused:
    the second mask chooses other rows)."""

    def __init__(self, experts: int = 4, k: int = 2, write_between: bool = False) -> None:
        super().__init__(experts)
        self.k, self.write_between = k, write_between

    def forward(self, x):
        b, t, d = x.shape
        flat = x.reshape(-1, d)
        w, idx = self.router(flat).softmax(-1).topk(self.k, dim=-1)
        flat_idx = idx.view(-1)
        h = flat.repeat_interleave(self.k, dim=0)
        y = torch.empty_like(h)
        for i, expert in enumerate(self.experts):
            out = expert(h[flat_idx == i])
            if self.write_between:
                flat_idx.add_(1).remainder_(len(self.experts))
            y[flat_idx == i] = out
        return (y.view(-1, self.k, d) * w.unsqueeze(-1)).sum(1).view(b, t, d)


class BoolMaskMoEBlock(SdpaTrilMaskAttn):
    def __init__(self, write_between: bool = False) -> None:
        super().__init__()
        self.mlp = BoolMaskMoE(write_between=write_between)


class BoolMaskMoEWrittenBlock(BoolMaskMoEBlock):
    def __init__(self) -> None:
        super().__init__(write_between=True)


BoolMaskMoELM = type("BoolMaskMoELM", (_LM,), {"block_cls": BoolMaskMoEBlock, "__doc__": BoolMaskMoE.__doc__})
BoolMaskMoEWrittenLM = type("BoolMaskMoEWrittenLM", (_LM,), {"block_cls": BoolMaskMoEWrittenBlock,
                                                             "__doc__": BoolMaskMoE.__doc__})


class MlaEmptyAttn(_Attn):
    """DeepSeek-style MLA: a low-rank KV, a decoupled key part, keys assembled by writing
    both parts into ``new_empty(...)``: ``k[..., :n].copy_(k_nope)`` as DeepSeek-V2/V3 do,
    or by slice assignment ``k[..., :n] = k_nope`` (``copy=False``)."""

    NOPE, ROPE = 6, 2

    def __init__(self, copy: bool = True) -> None:
        super().__init__()
        self.copy = copy
        self.kv_down = nn.Linear(DIM, 8)
        self.kv_up = nn.Linear(8, HEADS * (self.NOPE + HD))
        self.k_rope = nn.Linear(DIM, self.ROPE, bias=False)
        self.q = nn.Linear(DIM, HEADS * (self.NOPE + self.ROPE))

    def forward(self, x):
        b, t, _ = x.shape
        h = self.ln(x)
        q = self.q(h).view(b, t, HEADS, -1).transpose(1, 2)
        kv = self.kv_up(self.kv_down(h)).view(b, t, HEADS, -1).transpose(1, 2)
        k_nope, v = kv.split([self.NOPE, HD], dim=-1)
        k_pe = self.k_rope(h).view(b, 1, t, self.ROPE).expand(b, HEADS, t, self.ROPE)
        k = k_nope.new_empty(b, HEADS, t, self.NOPE + self.ROPE)
        if self.copy:
            k[..., : self.NOPE].copy_(k_nope)
            k[..., self.NOPE :].copy_(k_pe)
        else:
            k[..., : self.NOPE] = k_nope
            k[..., self.NOPE :] = k_pe
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(y.transpose(1, 2).reshape(b, t, DIM))
        return x + self.mlp(self.ln2(x))


MlaEmptyLM = type("MlaEmptyLM", (_LM,), {"block_cls": MlaEmptyAttn, "__doc__": MlaEmptyAttn.__doc__})


class InplaceResidualAttn(SdpaTrilMaskAttn):
    """A block whose residual adds are in place: ``x += attn(x)``, ``x += mlp(x)``."""

    def forward(self, x):
        b, t, _ = x.shape
        a = self.o(self.attend(*self.heads(x)).transpose(1, 2).reshape(b, t, DIM))
        x = x + 0.0  # a fresh tensor no autograd node saved
        x += a
        m = self.mlp(self.ln2(x))
        x = x.clone()
        x.add_(m)
        return x


InplaceResidualLM = _spelling(InplaceResidualAttn)


# ----------------------------------------------------------------------- other mixing


class ClampMinNormLM(_LM):
    """RMS norm written with an element-wise ``torch.max(rms, eps)`` (not a reduction)."""

    class _Block(SdpaTrilMaskAttn):
        def forward(self, x):
            rms = x.pow(2).mean(-1, keepdim=True).sqrt()
            x = x / torch.max(rms, torch.tensor(1e-6, dtype=x.dtype))
            return super().forward(x)

    block_cls = _Block


class GatherShiftLM(_LM):
    """Token shift as a gather along the row: ``x[:, (arange(T) - 1).clamp(min=0)]``."""

    class _Block(SdpaTrilMaskAttn):
        def forward(self, x):
            t = x.shape[1]
            prev = x[:, (torch.arange(t, device=x.device) - 1).clamp(min=0)]
            return super().forward(x + 0.5 * prev)

    block_cls = _Block


class SeparatorGatherLM(_LM):
    """Each token also reads the hidden state at the last separator (token 5) at or before it:
    ``x.gather(1, cummax(where(ids == 5, arange(T), 0)))`` (position 0 before any separator)."""

    block_cls = SdpaTrilMaskAttn

    def __init__(self) -> None:
        super().__init__()
        self.mix = nn.Linear(2 * DIM, DIM)

    def read(self, idx, x):
        b, t, d = x.shape
        pos = torch.arange(t, device=idx.device).expand(b, t)
        last = torch.where(idx == 5, pos, torch.zeros_like(pos)).cummax(dim=1).values
        return x.gather(1, last[..., None].expand(b, t, d))

    def forward(self, idx):
        x = self.emb(idx)
        for blk in self.blocks:
            x = blk(x)
        x = x + self.mix(torch.cat([x, self.read(idx, x)], -1))
        return self.head(self.norm(x))


class NextRowGatherLM(SeparatorGatherLM):
    """A token 7 reads the row after it: ``x.gather(1, arange(T) + (ids == 7))`` (a later row)."""

    def read(self, idx, x):
        b, t, d = x.shape
        v = torch.arange(t, device=idx.device).expand(b, t) + (idx == 7).long()
        return x.gather(1, v[..., None].expand(b, t, d))


class LengthNormPosLM(_LM):
    """Length-normalised positions ``arange(T) / T`` added to the embeddings."""

    def __init__(self) -> None:
        super().__init__()
        self.pos_dir = nn.Parameter(torch.linspace(-1.0, 1.0, DIM))  # not constant: survives the norms

    def forward(self, idx):
        t = idx.shape[1]
        x = self.emb(idx) + (torch.arange(t, device=idx.device) / t).to(self.emb.weight.dtype)[:, None] * self.pos_dir
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.norm(x))

    block_cls = SdpaTrilMaskAttn


class CheckpointLM(_LM):
    """Blocks run under ``torch.utils.checkpoint`` (a higher-order op with its own subgraph)."""

    block_cls = SdpaTrilMaskAttn

    def forward(self, idx):
        x = self.emb(idx)
        for blk in self.blocks:
            x = torch.utils.checkpoint.checkpoint(blk, x, use_reentrant=False)
        return self.head(self.norm(x))


class ShortTrilLM(_LM):
    """A 16-entry causal ``tril`` buffer sliced ``[:T, :T]`` (nanoGPT's ``block_size``): a tree
    may have more rows than the buffer as long as every path fits."""

    class _Block(_Attn):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("causal", torch.tril(torch.ones(16, 16)).view(1, 1, 16, 16))

        def attend(self, q, k, v):
            t = q.shape[2]
            att = (q @ k.transpose(-2, -1)) * HD**-0.5
            att = att.masked_fill(self.causal[:, :, :t, :t] == 0, float("-inf"))
            return att.softmax(-1) @ v

    block_cls = _Block


class ShortRopeTableLM(_LM):
    """RoPE from 16-entry cos/sin tables sliced ``[:T]``, on trees with more rows than that."""

    class _Block(_Attn):
        def __init__(self) -> None:
            super().__init__()
            inv = 1.0 / (10000.0 ** (torch.arange(0, HD, 2).double() / HD))
            ang = torch.outer(torch.arange(16).double(), inv)
            self.register_buffer("cos_cached", torch.cat([ang.cos(), ang.cos()], -1), persistent=False)
            self.register_buffer("sin_cached", torch.cat([ang.sin(), ang.sin()], -1), persistent=False)

        def attend(self, q, k, v):
            t = q.shape[2]
            cos, sin = self.cos_cached[:t], self.sin_cached[:t]

            def rot(z):
                z1, z2 = z[..., : HD // 2], z[..., HD // 2 :]
                return z * cos + torch.cat([-z2, z1], -1) * sin

            return F.scaled_dot_product_attention(rot(q), rot(k), v, is_causal=True)

    block_cls = _Block


class LengthScaledAlibiAttn(_Attn):
    """An ALiBi-like bias ``(j - i) / T``: its slope depends on the row count, not only on positions."""

    def attend(self, q, k, v):
        t = q.shape[2]
        pos = torch.arange(t, device=q.device)
        rel = (pos[None, :] - pos[:, None]).to(q.dtype) / t
        att = q @ k.transpose(-2, -1) * HD**-0.5 + rel
        att = att.masked_fill(self.causal[:, :, :t, :t] == 0, float("-inf"))
        return att.softmax(-1) @ v


LengthScaledAlibiLM = _spelling(LengthScaledAlibiAttn)


class LengthScaledAbsAttn(_Attn):
    """A bias of the distance scaled by the row count, ``-|j - i| * 4 / T`` (not linear in ``j``:
    judged as a function of the distance, whose table changes with the length)."""

    def attend(self, q, k, v):
        t = q.shape[2]
        pos = torch.arange(t, device=q.device)
        bias = -torch.abs(pos[None, :] - pos[:, None]).to(q.dtype) * (4.0 / t)
        att = q @ k.transpose(-2, -1) * HD**-0.5 + bias
        att = att.masked_fill(self.causal[:, :, :t, :t] == 0, float("-inf"))
        return att.softmax(-1) @ v


LengthScaledAbsLM = _spelling(LengthScaledAbsAttn)


# ----------------------------------------------------------------------- a model's own FlexAttention
# score_mods and mask_mods as pytorch-labs/attention-gym writes them (mods/softcapping.py,
# mods/alibi.py, masks/sliding_window.py, masks/document_mask.py), used in a decoder that builds
# its BlockMask in the forward. ``flex_attention`` is looked up in this module at each call, so
# the per-path reference can run it densely (FlexAttention has no backward on CPU).

from torch.nn.attention.flex_attention import create_block_mask, flex_attention  # noqa: E402


def generate_tanh_softcap(soft_cap):
    def tanh_softcap(score, b, h, q_idx, kv_idx):
        return soft_cap * torch.tanh(score / soft_cap)

    return tanh_softcap


def generate_alibi_bias(num_heads):
    def get_slopes(n):
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start * start**i for i in range(n)]

    alibi_slopes = torch.tensor(get_slopes(num_heads), dtype=torch.float64)

    def alibi_mod(score, b, h, q_idx, kv_idx):
        scale = alibi_slopes[h]
        bias = (kv_idx - q_idx) * scale
        return score + bias

    return alibi_mod


def causal_mask(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def generate_chunked_causal(chunk):
    """Llama 4's chunked attention as a mask_mod: causal within chunks of ``chunk`` tokens."""

    def chunked(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx // chunk == kv_idx // chunk)

    return chunked


class FlexModsAttn(_Attn):
    """``flex_attention(q, k, v, score_mod=..., block_mask=create_block_mask(mask_mod, ...))``
    with the functions the subclass names."""

    def mods(self):
        return None, causal_mask

    def attend(self, q, k, v):
        t = q.shape[2]
        score_mod, mask_mod = self.mods()
        block_mask = create_block_mask(mask_mod, None, None, t, t, device=q.device)
        return sys.modules[__name__].flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask)


class FlexSoftcapAttn(FlexModsAttn):
    """attention-gym ``generate_tanh_softcap(20)`` as the score_mod, causal mask."""

    def mods(self):
        return generate_tanh_softcap(20.0), causal_mask


class FlexAlibiAttn(FlexModsAttn):
    """attention-gym ``generate_alibi_bias(H)``: slopes in a captured tensor indexed by head."""

    def mods(self):
        return generate_alibi_bias(HEADS), causal_mask


class FlexChunkedAttn(FlexModsAttn):
    """A chunked causal mask_mod (chunks of 4 tokens, Llama 4's attention_chunk_size)."""

    def mods(self):
        return None, generate_chunked_causal(4)


class FlexLearnedBiasAttn(FlexModsAttn):
    """A learned relative-position bias table ``[H, 16]`` read by the score_mod at
    ``min(q_idx - kv_idx, 15)``: its gradient comes through the tree kernel."""

    def __init__(self) -> None:
        super().__init__()
        self.rel_bias = nn.Parameter(torch.zeros(HEADS, 16))

    def mods(self):
        table = self.rel_bias

        def learned_bias(score, b, h, q_idx, kv_idx):
            return score + table[h, (q_idx - kv_idx).clamp(0, 15)]

        return learned_bias, causal_mask


class FlexDocumentAttn(FlexModsAttn):
    """attention-gym's document mask: ``document_id[q_idx] == document_id[kv_idx]`` with the
    documents counted from separator tokens (id 0) of the row."""

    def attend(self, q, k, v):
        t = q.shape[2]
        document_id = self.document_id

        def document_causal(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (document_id[q_idx] == document_id[kv_idx])

        block_mask = create_block_mask(document_causal, None, None, t, t, device=q.device)
        return sys.modules[__name__].flex_attention(q, k, v, block_mask=block_mask)


class FlexDocumentLM(_LM):
    block_cls = FlexDocumentAttn

    def forward(self, idx):
        doc = (idx[0] == 0).long().cumsum(0)
        for blk in self.blocks:
            blk.document_id = doc
        return super().forward(idx)


class FlexPerHeadAttn(FlexModsAttn):
    """A mask_mod that reads the head: head h keeps a sliding window of h + 2 keys
    (``create_block_mask`` over every head)."""

    def head_mask(self):
        def per_head_window(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (q_idx - kv_idx < h + 2)

        return per_head_window

    def attend(self, q, k, v):
        t = q.shape[2]
        block_mask = create_block_mask(self.head_mask(), None, q.shape[1], t, t, device=q.device)
        return sys.modules[__name__].flex_attention(q, k, v, block_mask=block_mask)


class FlexHeadBidirectionalAttn(FlexPerHeadAttn):
    """Head 0 causal, the other heads see every token: not causal, whatever head 0 shows."""

    def head_mask(self):
        def head0_causal(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) | (h > 0)

        return head0_causal


class FlexLengthWindowAttn(FlexModsAttn):
    """A sliding-window mask_mod whose window closes over the sequence length (``q - kv < T // 2``):
    per path the window is the path's, on the packed row it would be the row's."""

    def attend(self, q, k, v):
        t = q.shape[2]

        def half_window(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (q_idx - kv_idx < t // 2)

        block_mask = create_block_mask(half_window, None, None, t, t, device=q.device)
        return sys.modules[__name__].flex_attention(q, k, v, block_mask=block_mask)


FlexLengthWindowLM = _spelling(FlexLengthWindowAttn)
FlexSoftcapLM, FlexAlibiLM, FlexChunkedLM, FlexLearnedBiasLM, FlexPerHeadLM, FlexHeadBidirectionalLM = (
    _spelling(c) for c in (FlexSoftcapAttn, FlexAlibiAttn, FlexChunkedAttn, FlexLearnedBiasAttn, FlexPerHeadAttn,
                           FlexHeadBidirectionalAttn))


def dense_flex_reference(model: nn.Module):
    """The per-path reference of the models above on CPU: ``flex_attention`` computed densely
    for the duration of the run, ``score_mod`` and ``mask_mod`` evaluated on every (b, h, q,
    kv) by ``vmap`` (the function FlexAttention computes, with a backward)."""
    import contextlib

    from torch.func import vmap
    from torch.nn.attention.flex_attention import create_mask

    def dense(q, k, v, score_mod=None, block_mask=None, scale=None, **kw):
        b, h, t, d = q.shape
        s = (q @ k.transpose(-2, -1)) * (d**-0.5 if scale is None else scale)
        if score_mod is not None:
            fn = score_mod
            for dims in [(0, None, None, None, 0), (0, None, None, 0, None), (0, None, 0, None, None),
                         (0, 0, None, None, None)]:
                fn = vmap(fn, in_dims=dims, out_dims=0)
            s = fn(s, torch.arange(b), torch.arange(h), torch.arange(t), torch.arange(s.shape[-1]))
        if block_mask is not None:
            mask = create_mask(block_mask.mask_mod, b, h, t, s.shape[-1], device=q.device)
            s = s.masked_fill(~mask, float("-inf"))
        return torch.softmax(s, dim=-1) @ v

    @contextlib.contextmanager
    def swapped():
        module = sys.modules[__name__]
        saved = module.flex_attention
        module.flex_attention = dense
        try:
            yield
        finally:
            module.flex_attention = saved

    return swapped()


# ----------------------------------------------------------------------- torch.nn transformer layers


class TorchDecoderLayerLM(nn.Module):
    """``nn.TransformerDecoderLayer`` (batch_first, dropout 0) with ``tgt_mask`` from
    ``generate_square_subsequent_mask`` and ``tgt_is_causal=True``; its cross-attention reads a
    learned memory of 3 vectors (``memory="learned"``), or the layer's own input under the same
    causal ``memory_mask`` (``memory="input"``, a decoder-only use of the layer)."""

    def __init__(self, memory: str = "learned") -> None:
        super().__init__()
        self.memory_kind = memory
        self.emb = nn.Embedding(VOCAB, DIM)
        self.layer = nn.TransformerDecoderLayer(DIM, HEADS, 2 * DIM, dropout=0.0, batch_first=True)
        self.memory = nn.Parameter(torch.randn(1, 3, DIM))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, idx):
        x = self.emb(idx)
        t = idx.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=idx.device, dtype=x.dtype)
        if self.memory_kind == "learned":
            x = self.layer(x, self.memory.expand(x.shape[0], -1, -1), tgt_mask=mask, tgt_is_causal=True)
        else:
            x = self.layer(x, x, tgt_mask=mask, memory_mask=mask, tgt_is_causal=True, memory_is_causal=True)
        return self.head(x)


class StaticKeysMemoryLM(nn.Module):
    """``F.multi_head_attention_forward`` from the rows to a learned memory, with ``static_k`` /
    ``static_v`` given: the function then attends to those, not to the projected memory."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.mha = nn.MultiheadAttention(DIM, HEADS)
        self.memory = nn.Parameter(torch.randn(3, 1, DIM))
        self.static_k = nn.Parameter(torch.randn(HEADS, 5, DIM // HEADS))
        self.static_v = nn.Parameter(torch.randn(HEADS, 5, DIM // HEADS))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, idx):
        x = self.emb(idx).transpose(0, 1)  # [T, 1, DIM]
        m = self.mha
        out, _ = F.multi_head_attention_forward(
            x, self.memory, self.memory, DIM, HEADS, m.in_proj_weight, m.in_proj_bias, None, None, False, 0.0,
            m.out_proj.weight, m.out_proj.bias, training=False, need_weights=False, static_k=self.static_k,
            static_v=self.static_v)
        return self.head((x + out).transpose(0, 1))


class MHAExtraKeysLM(nn.Module):
    """``nn.MultiheadAttention(add_bias_kv=..., add_zero_attn=...)`` under a causal
    ``attn_mask``: a learned key and value, and a zero key and value, appended after the
    sequence's keys and visible to every query."""

    def __init__(self, bias_kv: bool = True, zero_attn: bool = True) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.mha = nn.MultiheadAttention(DIM, HEADS, dropout=0.0, batch_first=True, add_bias_kv=bias_kv,
                                         add_zero_attn=zero_attn)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, idx):
        x = self.emb(idx)
        mask = nn.Transformer.generate_square_subsequent_mask(idx.shape[1], device=idx.device, dtype=x.dtype)
        y, _ = self.mha(x, x, x, attn_mask=mask, need_weights=False)
        return self.head(x + y)


class FourDimRopeCacheAttn(_SdpaAttn):
    """Rotary tables cached as ``[1, 1, max_len, hd]`` buffers and sliced ``cache[:, :, :T, ...]``
    (the 4-D spelling of GPT-NeoX-style caches)."""

    def __init__(self) -> None:
        super().__init__()
        inv = 1.0 / 10000 ** (torch.arange(0, HD, 2).double() / HD)
        ang = torch.arange(MAX_LEN).double()[:, None] * inv
        emb = torch.cat([ang, ang], -1)
        self.register_buffer("cos_cached", emb.cos()[None, None], persistent=False)
        self.register_buffer("sin_cached", emb.sin()[None, None], persistent=False)

    def attend(self, q, k, v):
        t = q.shape[2]
        cos, sin = self.cos_cached[:, :, :t, ...], self.sin_cached[:, :, :t, ...]

        def rot(x):
            x1, x2 = x[..., : HD // 2], x[..., HD // 2:]
            return x * cos + torch.cat((-x2, x1), -1) * sin

        return super().attend(rot(q), rot(k), v)


FourDimRopeCacheLM = _spelling(FourDimRopeCacheAttn)


class EllipsisRopeCacheAttn(FourDimRopeCacheAttn):
    """apple/corenet's OpenELM rotary: the ``[1, 1, max_len, hd]`` caches sliced
    ``cache[..., key_len - query_len : key_len, :]`` for the queries and ``cache[..., :key_len, :]``
    for the keys."""

    def attend(self, q, k, v):
        q_len, k_len = q.shape[2], k.shape[2]

        def rot(x, cos, sin):
            x1, x2 = x[..., : HD // 2], x[..., HD // 2:]
            return x * cos + torch.cat((-x2, x1), -1) * sin

        q = rot(q, self.cos_cached[..., k_len - q_len: k_len, :], self.sin_cached[..., k_len - q_len: k_len, :])
        k = rot(k, self.cos_cached[..., :k_len, :], self.sin_cached[..., :k_len, :])
        return _SdpaAttn.attend(self, q, k, v)


EllipsisRopeCacheLM = _spelling(EllipsisRopeCacheAttn)


class FullCausalConvAttn(_SdpaAttn):
    """Causal convs that mix channels after attention: WaveNet-style dilated
    ``nn.Conv1d(C, C, 2, dilation=2, padding=2)[..., :-2]`` and a MADE / PixelCNN-style centred
    kernel whose taps after the centre are masked to zero (``conv1d(x, w * mask, padding=1)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.dilated = nn.Conv1d(DIM, DIM, 2, dilation=2, padding=2)
        self.made_w = nn.Parameter(torch.randn(DIM, DIM, 3) / DIM)
        self.made_b = nn.Parameter(torch.zeros(DIM))
        self.register_buffer("made_mask", torch.tensor([1.0, 1.0, 0.0]).expand(DIM, DIM, 3).clone(), persistent=False)

    def forward(self, x):
        x = super().forward(x)
        h = x.transpose(1, 2)
        h = self.dilated(h)[..., :-2] + F.conv1d(h, self.made_w * self.made_mask, self.made_b, padding=1)
        return x + 0.5 * h.transpose(1, 2)


FullCausalConvLM = _spelling(FullCausalConvAttn)


class TalkingHeadsAttn(_Attn):
    """lucidrains/x-transformers' pre-softmax talking heads: the scaled scores through
    ``nn.Conv2d(heads, heads, 1, bias=False)`` (each head's scores a learned combination of
    every head's), then the causal ``masked_fill``, a softmax and an einsum with the values.
    ``form``: "conv", "einsum" (``einsum('b h i j, h g -> b g i j', sim, W)``), "mqa" (one key
    and value head, repeated), "masked-first" (the mask applied before the mix: mixed too),
    "both" (x-transformers' pre- and post-softmax talking heads: the probabilities mixed too),
    "post" (the post-softmax mix alone)."""

    def __init__(self, form: str = "conv") -> None:
        super().__init__()
        self.form = form
        self.talking = nn.Conv2d(HEADS, HEADS, 1, bias=False)
        self.post_talking = nn.Conv2d(HEADS, HEADS, 1, bias=False)
        self.mix = nn.Parameter(torch.eye(HEADS) + 0.3 * torch.randn(HEADS, HEADS))
        if form == "mqa":
            self.kv = nn.Linear(DIM, 2 * HD)

    def attend(self, q, k, v):
        t = q.shape[2]
        if self.form == "mqa":
            b = q.shape[0]
            k, v = (z.view(b, t, 1, HD).transpose(1, 2).expand(-1, HEADS, -1, -1)
                    for z in self.kv(self.ln(self._x)).split(HD, dim=-1))
        sim = torch.einsum("b h i d, b h j d -> b h i j", q, k) * HD ** -0.5
        causal = torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1)
        if self.form == "masked-first":
            sim = sim.masked_fill(causal, -torch.finfo(sim.dtype).max)
        if self.form == "einsum":
            sim = torch.einsum("b h i j, h g -> b g i j", sim, self.mix)
        elif self.form != "post":
            sim = self.talking(sim)
        if self.form != "masked-first":
            sim = sim.masked_fill(causal, -torch.finfo(sim.dtype).max)
        attn = sim.softmax(dim=-1)
        if self.form in ("both", "post"):
            attn = self.post_talking(attn)
        return torch.einsum("b h i j, b h j d -> b h i d", attn, v)

    def forward(self, x):
        self._x = x
        try:
            return super().forward(x)
        finally:
            del self._x


TalkingHeadsLM = _spelling(TalkingHeadsAttn)
