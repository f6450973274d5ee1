"""Tiny models the tree_compile tests run, and the helpers that compare them per path.

The custom models cover the three ways plain PyTorch code writes causal attention and
positions: ``F.scaled_dot_product_attention(is_causal=True)`` with RoPE from
``torch.arange(T)``, manual softmax attention with a registered ``tril`` buffer and a
learned position table indexed by ``arange``, and RoPE read from a cached table sliced
``[:T]``. The refused models mix the sequence in ways a tree cannot make exact.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import treecompile as tc
from treecompile.core.reference import per_path_loss

from testing import COMPILE_TOL, backward_grads

VOCAB = 64

#: What is compared -> (rtol, atol), each with its reason.
TOL = COMPILE_TOL  # tolerances live in tests/testing.py, with their reasons

# Trees with the awkward cases: 1-token nodes, a path that is a prefix of another,
# duplicate identical paths, branching at the first token, a forest of two trees.
TREES = {
    "branchy": [[[1, 2, 3, 4], [1, 2, 5], [1, 2, 3, 4, 6], [1, 2, 5], [1, 7, 8, 9, 10, 11]]],
    "forest": [[[3, 4, 5, 6, 7], [3, 4, 9]], [[8, 2], [8, 9, 10, 1, 2, 3], [8, 9, 11]]],
    "single": [[[5, 6, 7, 8, 9, 10, 11, 12, 13]]],
}


def make_batch(name: str, *, path_bits: bool = True) -> tuple[tc.TreeBatch, list[tc.TrajectoryTree]]:
    trees = [tc.TrajectoryTree.from_sequences(paths) for paths in TREES[name]]
    return tc.pack(trees, path_bits=path_bits), trees


def rope(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x`` ``[B, H, T, D]`` at positions ``pos`` ``[T]``."""
    d = x.shape[-1]
    inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=x.dtype, device=x.device) / d))
    ang = pos.to(x.dtype)[:, None] * inv[None, :]
    cos, sin = ang.cos(), ang.sin()
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class SdpaBlock(nn.Module):
    """Pre-norm block: causal SDPA with GQA and RoPE, then an MLP."""

    def __init__(self, dim: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, dim // heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * kv_heads * self.hd)
        self.o = nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.norm1(x)
        q = self.q(h).view(b, t, self.heads, self.hd).transpose(1, 2)
        k, v = self.kv(h).view(b, t, 2, self.kv_heads, self.hd).unbind(2)
        k, v = k.transpose(1, 2), v.transpose(1, 2)
        q, k = rope(q, pos), rope(k, pos)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.o(y.transpose(1, 2).reshape(b, t, -1))
        return x + self.mlp(self.norm2(x))


class NanoGPT(nn.Module):
    """nanoGPT-style LM: SDPA(is_causal=True), RoPE at ``torch.arange(T)``, tied-free head."""

    def __init__(self, vocab: int = VOCAB, dim: int = 32, heads: int = 4, kv_heads: int = 2, layers: int = 2):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(SdpaBlock(dim, heads, kv_heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(0, idx.shape[1], dtype=torch.long, device=idx.device)
        x = self.emb(idx)
        for blk in self.blocks:
            x = blk(x, pos)
        return self.head(self.norm(x))


class ManualBlock(nn.Module):
    """GPT-2-style block: manual softmax attention with a registered causal ``tril`` buffer."""

    def __init__(self, dim: int, heads: int, block_size: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.fc = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.register_buffer("bias", torch.tril(torch.ones(block_size, block_size)).view(1, 1, block_size, block_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :t, :t] == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(b, t, c)
        x = x + self.proj(y)
        return x + self.fc(self.ln2(x))


class ManualGPT(nn.Module):
    """Learned absolute positions ``wpe(arange(T))`` and manual masked-softmax attention."""

    def __init__(self, vocab: int = VOCAB, dim: int = 32, heads: int = 4, layers: int = 2, block_size: int = 64):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, dim), nn.Embedding(block_size, dim)
        self.blocks = nn.ModuleList(ManualBlock(dim, heads, block_size) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x))


class CachedRopeLM(nn.Module):
    """RoPE from cos/sin tables precomputed as buffers and sliced ``[:T]``; causal SDPA."""

    def __init__(self, vocab: int = VOCAB, dim: int = 32, heads: int = 2, max_len: int = 64):
        super().__init__()
        self.heads, self.hd = heads, dim // heads
        self.emb = nn.Embedding(vocab, dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.o = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab)
        inv = 1.0 / (10000.0 ** (torch.arange(0, self.hd, 2, dtype=torch.float64) / self.hd))
        ang = torch.arange(max_len, dtype=torch.float64)[:, None] * inv[None, :]
        self.register_buffer("cos_cached", ang.cos(), persistent=False)
        self.register_buffer("sin_cached", ang.sin(), persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        b, t = idx.shape
        x = self.emb(idx)
        q, k, v = (z.view(b, t, self.heads, self.hd).transpose(1, 2) for z in self.qkv(x).chunk(3, -1))
        cos, sin = self.cos_cached[:t], self.sin_cached[:t]

        def rot(z):
            z1, z2 = z[..., : self.hd // 2], z[..., self.hd // 2 :]
            return torch.cat([z1 * cos - z2 * sin, z1 * sin + z2 * cos], dim=-1)

        y = F.scaled_dot_product_attention(rot(q), rot(k), v, is_causal=True)
        return self.head(x + self.o(y.transpose(1, 2).reshape(b, t, -1)))


class ConvLM(nn.Module):
    """A causal convolution over the sequence that mixes channels (``groups=1``): its taps
    read the rows before each token on its path (the conv context pass's tap convs)."""

    def __init__(self, vocab: int = VOCAB, dim: int = 16, kernel: int = 3):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.conv = nn.Conv1d(dim, dim, kernel, padding=kernel - 1)
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        y = self.conv(x.transpose(1, 2))[..., : idx.shape[1]].transpose(1, 2)
        return self.head(x + y)


class GruLM(nn.Module):
    """A recurrent layer over the sequence."""

    def __init__(self, vocab: int = VOCAB, dim: int = 16):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.rnn = nn.GRU(dim, dim, batch_first=True)
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        y, _ = self.rnn(self.emb(idx))
        return self.head(y)


class BiGruLM(GruLM):
    """A bidirectional recurrent layer over the sequence (not causal)."""

    def __init__(self, vocab: int = VOCAB, dim: int = 16):
        super().__init__(vocab, dim)
        self.rnn = nn.GRU(dim, dim // 2, batch_first=True, bidirectional=True)


class CumsumLM(nn.Module):
    """A running mean over the sequence (cumsum), as in some linear-attention toys."""

    def __init__(self, vocab: int = VOCAB, dim: int = 16):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        n = torch.arange(1, idx.shape[1] + 1, dtype=x.dtype, device=x.device)
        return self.head(x + x.cumsum(1) / n[:, None])


def tiny(cls, seed: int = 0, **kw) -> nn.Module:
    torch.manual_seed(seed)
    return cls(**kw).double().eval()


def compare_with_paths(
    model: nn.Module, compiled, batch, trees, tol: str | None = None, tree_run: tuple | None = None
) -> dict[str, float]:
    """Runs the tree and the per-path reference; returns max |diff| of loss, logprobs and grads.

    Both sides get fresh gradients; the reference runs the unmodified model on each
    root-to-leaf path alone. The batch uses the default token-mean loss on both sides.
    With ``tol`` (a key of :data:`TOL`), also asserts loss, logprobs and every gradient
    are within it, naming the parameter that is not. ``tree_run``: the tree side's
    ``(out, grads)`` from :func:`testing.backward_grads`, when the caller already ran it.
    """
    out, tree_grads = tree_run if tree_run is not None else backward_grads(model, lambda: compiled(batch))
    tree_loss = out.loss.detach().clone()
    model.zero_grad(set_to_none=True)
    ref = per_path_loss(model, trees)
    ref.loss.backward()
    worst_name, worst = "", 0.0
    for n, p in model.named_parameters():
        if p.grad is None:
            continue
        assert n in tree_grads, f"parameter {n} got a gradient per path but none on the tree"
        d = (tree_grads[n] - p.grad).abs().max().item()
        if d >= worst:
            worst_name, worst = n, d
    missing = set(tree_grads) - {n for n, p in model.named_parameters() if p.grad is not None}
    assert not missing, f"parameters with a tree gradient but none per path: {sorted(missing)}"
    if tol is not None:
        rtol, atol = TOL[tol]
        torch.testing.assert_close(tree_loss, ref.loss.detach(), rtol=rtol, atol=atol, msg=lambda m: f"loss: {m}")
        for n, p in model.named_parameters():
            if p.grad is not None:
                torch.testing.assert_close(
                    tree_grads[n], p.grad, rtol=rtol, atol=atol, msg=lambda m, n=n: f"grad of {n}: {m}"
                )
        for i in range(batch.num_paths):
            rows = batch.path_rows(i)
            torch.testing.assert_close(
                out.logprobs.detach()[rows], ref.logprobs[i], rtol=rtol, atol=atol,
                msg=lambda m, i=i: f"logprobs of path {i}: {m}",
            )
    model.zero_grad(set_to_none=True)
    lp_diff = _logprob_diff(out.logprobs.detach(), ref.logprobs, batch, trees)
    return {
        "loss": (tree_loss - ref.loss.detach()).abs().item(),
        "logprobs": lp_diff,
        "grad": worst,
        "grad_param": worst_name,
    }


def _logprob_diff(tree_lp: torch.Tensor, path_lps: list[torch.Tensor], batch, trees) -> float:
    worst = 0.0
    for p in range(batch.num_paths):
        rows = batch.path_rows(p)
        worst = max(worst, (tree_lp[rows] - path_lps[p]).abs().max().item())
    return worst


def test_custom_models_are_causal():
    """Sanity of the fixtures: a later token never changes an earlier output."""
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    for cls in (NanoGPT, ManualGPT, CachedRopeLM, ConvLM, GruLM, CumsumLM):
        m = tiny(cls)
        full = m(ids)
        short = m(ids[:, :4])
        np.testing.assert_allclose(full[:, :4].detach().numpy(), short.detach().numpy(), atol=1e-12, err_msg=cls.__name__)
