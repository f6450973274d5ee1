"""Token mixing by learned ``[T, T]`` weights and attention whose scores are not ``q @ k^T``.

gMLP (Liu et al. 2021, "Pay Attention to MLPs") mixes the tokens in its spatial gating unit by a
learned ``[n, n]`` matrix cut to the sequence and kept lower-triangular when causal:
lucidrains/g-mlp-pytorch (``g_mlp_pytorch/g_mlp_pytorch.py``) spells it as a pointwise
``F.conv1d`` whose channels are the tokens (``weight[:n, :n]`` masked by ``triu_(1)``, ``bias[:n]``);
other ports keep a ``[max_len, max_len]`` parameter and an einsum with the matrix second
(``'b n d, m n -> b m d'``) plus a bias per position.

Synthesizer (Tay et al. 2021): the dense variant computes each token's scores over the ``max_len``
positions from the token alone (``w2(relu(w1(x)))[:, :n, :n]``), the random variant learns one
``[max_len, max_len]`` score matrix cut ``[:, :n, :n]``; both causal by a mask before the softmax.

A causal MLP-Mixer (Tolstikhin et al. 2021, its token-mixing MLP made causal for language
models): ``nn.Linear(max_len, max_len)`` over the sequence dim, its weight cut ``[:n, :n]`` and
multiplied by a ``tril`` buffer, applied with ``F.linear`` to ``x.transpose(1, 2)``.

L2 attention (Kim et al. 2021, "The Lipschitz Constant of Self-Attention"): scores
``-cdist(q, k) ** 2 / sqrt(d)``.

Variants that must be refused: gMLP without the causal mask (every token reads the later
ones), the dense Synthesizer cut from the end of its positions (``[..., -n:]``: the weights a
token gets change with the length).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from zoo_repos.common import CTX, DIM, VOCAB


class SpatialGatingUnit(nn.Module):
    """g-mlp-pytorch's unit: the gate's tokens mixed by a pointwise conv over ``dim_seq`` channels."""

    def __init__(self, dim: int, dim_seq: int, causal: bool = True) -> None:
        super().__init__()
        self.causal = causal
        self.norm = nn.LayerNorm(dim // 2)
        self.proj = nn.Conv1d(dim_seq, dim_seq, 1)
        nn.init.uniform_(self.proj.weight, -0.1, 0.1)
        nn.init.constant_(self.proj.bias, 1.0)

    def forward(self, x):
        device, n = x.device, x.shape[1]
        res, gate = x.chunk(2, dim=-1)
        gate = self.norm(gate)
        weight, bias = self.proj.weight, self.proj.bias
        weight, bias = weight[:n, :n], bias[:n]
        if self.causal:
            mask = torch.ones(weight.shape[:2], device=device).triu_(1).bool()
            weight = weight.masked_fill(mask[..., None], 0.0)
        gate = F.conv1d(gate, weight, bias)
        return gate * res


class EinsumGatingUnit(nn.Module):
    """A port keeping the matrix as a parameter: ``tril(W[:n, :n])``, an einsum with it second."""

    def __init__(self, dim: int, dim_seq: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim // 2)
        self.weight = nn.Parameter(torch.empty(dim_seq, dim_seq).uniform_(-0.1, 0.1))
        self.bias = nn.Parameter(torch.ones(dim_seq))

    def forward(self, x):
        n = x.shape[1]
        u, v = x.chunk(2, dim=-1)
        v = self.norm(v)
        w = torch.tril(self.weight[:n, :n])
        v = torch.einsum("b n d, m n -> b m d", v, w) + self.bias[:n, None]
        return u * v


class GMLPBlock(nn.Module):
    def __init__(self, unit: str = "conv", causal: bool = True) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.proj_in = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU())
        self.sgu = SpatialGatingUnit(4 * DIM, CTX, causal) if unit == "conv" else EinsumGatingUnit(4 * DIM, CTX)
        self.proj_out = nn.Linear(2 * DIM, DIM)

    def forward(self, x):
        return x + self.proj_out(self.sgu(self.proj_in(self.norm(x))))


class GMLPLM(nn.Module):
    def __init__(self, unit: str = "conv", causal: bool = True, depth: int = 2) -> None:
        super().__init__()
        self.to_embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(GMLPBlock(unit, causal) for _ in range(depth))
        self.to_logits = nn.Sequential(nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB))

    def forward(self, idx):
        x = self.to_embed(idx)
        for layer in self.layers:
            x = layer(x)
        return self.to_logits(x)


class SynthesizerDense(nn.Module):
    """One head: each token's scores over the ``max_len`` positions, cut to the length."""

    def __init__(self, from_end: bool = False) -> None:
        super().__init__()
        self.from_end = from_end
        self.w1 = nn.Linear(DIM, DIM)
        self.w2 = nn.Linear(DIM, CTX)
        self.value = nn.Linear(DIM, DIM)

    def forward(self, x):
        b, n, d = x.shape
        energy = self.w2(F.relu(self.w1(x)))
        energy = energy[:, :, -n:] if self.from_end else energy[:, :n, :n]
        mask = torch.triu(torch.ones(n, n, device=x.device), diagonal=1).bool()
        energy = energy.masked_fill(mask, float("-inf"))
        attn = F.softmax(energy, dim=-1)
        return torch.bmm(attn, self.value(x))


class SynthesizerRandom(nn.Module):
    """One learned ``[1, max_len, max_len]`` score matrix, cut to the length, masked by -1e9."""

    def __init__(self) -> None:
        super().__init__()
        self.attention = nn.Parameter(torch.randn(1, CTX, CTX))
        self.value = nn.Linear(DIM, DIM)

    def forward(self, x):
        b, n, d = x.shape
        energy = self.attention[:, :n, :n]
        mask = torch.tril(torch.ones(n, n, device=x.device)).view(1, n, n)
        energy = energy.masked_fill(mask == 0, -1e9)
        attn = F.softmax(energy, dim=-1)
        return torch.matmul(attn, self.value(x))


class L2Attention(nn.Module):
    """Tied query and key weights, scores ``-||q_i - k_j||^2 / sqrt(d)`` per head."""

    def __init__(self, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.qk = nn.Linear(DIM, DIM, bias=False)
        self.v = nn.Linear(DIM, DIM)
        self.register_buffer("bias", torch.tril(torch.ones(CTX, CTX)).view(1, 1, CTX, CTX))

    def forward(self, x):
        b, n, d = x.shape
        hd = d // self.heads
        q = self.qk(x).view(b, n, self.heads, hd).transpose(1, 2)
        v = self.v(x).view(b, n, self.heads, hd).transpose(1, 2)
        att = -torch.cdist(q, q) ** 2 / math.sqrt(hd)
        att = att.masked_fill(self.bias[:, :, :n, :n] == 0, float("-inf"))
        y = att.softmax(dim=-1) @ v
        return y.transpose(1, 2).reshape(b, n, d)


class CausalTokenMixing(nn.Module):
    """MLP-Mixer's token mixing, causal: ``F.linear(x^T, W[:n, :n] * tril[:n, :n], b[:n])``, GELU."""

    def __init__(self) -> None:
        super().__init__()
        self.token_mix = nn.Linear(CTX, CTX)
        self.register_buffer("causal", torch.tril(torch.ones(CTX, CTX)))

    def forward(self, x):
        n = x.shape[1]
        w = self.token_mix.weight[:n, :n] * self.causal[:n, :n]
        y = F.linear(x.transpose(1, 2), w, self.token_mix.bias[:n])
        return F.gelu(y).transpose(1, 2)


class MixerBlock(nn.Module):
    def __init__(self, mixer: nn.Module) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.mix = mixer
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

    def forward(self, x):
        x = x + self.mix(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class MixerLM(nn.Module):
    """Embeddings, two blocks of ``kind`` (``dense``, ``dense-from-end``, ``random``, ``l2``, ``mixer``), head."""

    def __init__(self, kind: str = "dense") -> None:
        super().__init__()
        make = {"dense": lambda: SynthesizerDense(), "dense-from-end": lambda: SynthesizerDense(from_end=True),
                "random": SynthesizerRandom, "l2": L2Attention, "mixer": CausalTokenMixing}[kind]
        self.wte = nn.Embedding(VOCAB, DIM)
        self.wpe = nn.Embedding(CTX, DIM)
        self.blocks = nn.ModuleList(MixerBlock(make()) for _ in range(2))
        self.ln_f = nn.LayerNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))
