"""Attention spellings: GPT-2's first release, nn.MultiheadAttention, PyTorch examples, others."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from zoo_repos.common import CTX, DIM, HD, HEADS, LAYERS, VOCAB
from zoo_repos.gpt import NanoBlock, NanoCausalSelfAttention, NanoGPTConfig

# =============================================================================== GPT-2 (TF port)


def gpt2_gelu(x):
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * torch.pow(x, 3))))


def gpt2_softmax(x, axis=-1):
    x = x - x.amax(dim=axis, keepdim=True)
    ex = torch.exp(x)
    return ex / ex.sum(dim=axis, keepdim=True)


class GPT2Norm(nn.Module):
    """Normalize to mean = 0, std = 1, then do a diagonal affine transform."""

    def __init__(self, n_state, epsilon=1e-5):
        super().__init__()
        self.g = nn.Parameter(torch.ones(n_state))
        self.b = nn.Parameter(torch.zeros(n_state))
        self.epsilon = epsilon

    def forward(self, x, axis=-1):
        u = x.mean(dim=axis, keepdim=True)
        s = torch.square(x - u).mean(dim=axis, keepdim=True)
        x = (x - u) * torch.rsqrt(s + self.epsilon)
        return x * self.g + self.b


class GPT2Conv1d(nn.Module):
    def __init__(self, nx, nf):
        super().__init__()
        self.w = nn.Parameter(torch.randn(1, nx, nf) * 0.02)
        self.b = nn.Parameter(torch.zeros(nf))

    def forward(self, x):
        *start, nx = x.shape
        nf = self.w.shape[-1]
        return (torch.matmul(x.reshape(-1, nx), self.w.reshape(-1, nf)) + self.b).reshape(*start, nf)


def gpt2_attention_mask(nd, ns, *, dtype, device=None):
    """1's in the lower triangle, counting from the lower right corner."""
    i = torch.arange(nd, device=device)[:, None]
    j = torch.arange(ns, device=device)
    m = i >= j - ns + nd
    return m.to(dtype)


class GPT2Attn(nn.Module):
    def __init__(self, n_state, n_head):
        super().__init__()
        self.n_head = n_head
        self.c_attn = GPT2Conv1d(n_state, n_state * 3)
        self.c_proj = GPT2Conv1d(n_state, n_state)

    def split_heads(self, x):
        # From [batch, sequence, features] to [batch, heads, sequence, features]
        *start, m = x.shape
        return x.reshape(*start, self.n_head, m // self.n_head).permute(0, 2, 1, 3)

    @staticmethod
    def merge_heads(x):
        x = x.permute(0, 2, 1, 3)
        *start, a, b = x.shape
        return x.reshape(*start, a * b)

    @staticmethod
    def mask_attn_weights(w):
        # w has shape [batch, heads, dst_sequence, src_sequence], where information flows from src to dst.
        _, _, nd, ns = w.shape
        b = gpt2_attention_mask(nd, ns, dtype=w.dtype, device=w.device)
        b = b.reshape(1, 1, nd, ns)
        w = w * b - torch.tensor(1e10, dtype=w.dtype) * (1 - b)
        return w

    def multihead_attn(self, q, k, v):
        # q, k, v have shape [batch, heads, sequence, features]
        w = torch.matmul(q, k.transpose(-1, -2))
        w = w * torch.rsqrt(torch.tensor(float(v.shape[-1]), dtype=w.dtype))
        w = self.mask_attn_weights(w)
        w = gpt2_softmax(w)
        a = torch.matmul(w, v)
        return a

    def forward(self, x):
        c = self.c_attn(x)
        q, k, v = map(self.split_heads, torch.split(c, c.shape[-1] // 3, dim=2))
        a = self.multihead_attn(q, k, v)
        a = self.merge_heads(a)
        return self.c_proj(a)


class GPT2Block(nn.Module):
    def __init__(self, nx, n_head):
        super().__init__()
        self.ln_1 = GPT2Norm(nx)
        self.attn = GPT2Attn(nx, n_head)
        self.ln_2 = GPT2Norm(nx)
        self.c_fc = GPT2Conv1d(nx, nx * 4)
        self.c_proj = GPT2Conv1d(nx * 4, nx)

    def forward(self, x):
        a = self.attn(self.ln_1(x))
        x = x + a
        m = self.c_proj(gpt2_gelu(self.c_fc(self.ln_2(x))))
        x = x + m
        return x


class GPT2TFPort(nn.Module):
    """openai/gpt-2 src/model.py (TensorFlow) ported line by line to PyTorch: the mask
    ``attention_mask(nd, ns)`` from ``range``s (``i >= j - ns + nd``) applied as arithmetic
    ``w * b - 1e10 * (1 - b)``, a hand-written softmax (``x - max``, ``exp``, ``/ sum``),
    hand-written norm and gelu, ``conv1d`` as a matmul of ``[1, nx, nf]`` weights,
    embeddings by indexing the ``wte`` / ``wpe`` parameters (``tf.gather``) at
    ``positions_for = past_length + range(nsteps)`` tiled over the batch, tied output
    ``h @ wte^T``."""

    def __init__(self, n_vocab=VOCAB, n_ctx=CTX, n_embd=DIM, n_head=HEADS, n_layer=LAYERS):
        super().__init__()
        self.wpe = nn.Parameter(torch.randn(n_ctx, n_embd) * 0.01)
        self.wte = nn.Parameter(torch.randn(n_vocab, n_embd) * 0.02)
        self.h = nn.ModuleList([GPT2Block(n_embd, n_head) for _ in range(n_layer)])
        self.ln_f = GPT2Norm(n_embd)

    @staticmethod
    def expand_tile(value, size):
        """Add a new axis of given size."""
        ndims = value.dim()
        return value.unsqueeze(0).repeat(size, *([1] * ndims))

    def positions_for(self, tokens, past_length):
        batch_size, nsteps = tokens.shape
        return self.expand_tile(past_length + torch.arange(nsteps, device=tokens.device), batch_size)

    def forward(self, X, past=None):
        batch, sequence = X.shape
        past_length = 0
        h = self.wte[X] + self.wpe[self.positions_for(X, past_length)]
        for block in self.h:
            h = block(h)
        h = self.ln_f(h)
        h_flat = h.reshape(batch * sequence, -1)
        logits = torch.matmul(h_flat, self.wte.t())
        return logits.reshape(batch, sequence, -1)


# =============================================================================== nn.MultiheadAttention


class MHABlock(nn.Module):
    def __init__(self, causal: bool):
        super().__init__()
        self.causal = causal
        self.ln_1 = nn.LayerNorm(DIM)
        self.attn = nn.MultiheadAttention(DIM, HEADS, batch_first=True)
        self.ln_2 = nn.LayerNorm(DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

    def forward(self, x):
        h = self.ln_1(x)
        if self.causal:
            T = x.size(1)
            mask = nn.Transformer.generate_square_subsequent_mask(T, device=x.device, dtype=x.dtype)
            a, _ = self.attn(h, h, h, attn_mask=mask, is_causal=True, need_weights=False)
        else:
            a, _ = self.attn(h, h, h)
        x = x + a
        return x + self.mlp(self.ln_2(x))


class MHALM(nn.Module):
    """A GPT with ``nn.MultiheadAttention(batch_first=True)`` blocks and learned positions.
    ``causal=True``: every layer passes ``attn_mask=nn.Transformer.generate_square_subsequent_mask(T)``
    with ``is_causal=True``. ``causal=False``: the first layer calls ``self.attn(h, h, h)``
    without a mask (a bidirectional layer: not a causal LM), the second is nanoGPT's SDPA
    block."""

    def __init__(self, causal: bool):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, DIM)
        self.wpe = nn.Embedding(CTX, DIM)
        second = MHABlock(True) if causal else NanoBlock(NanoGPTConfig(flash=True))
        self.blocks = nn.ModuleList([MHABlock(causal), second])
        self.ln_f = nn.LayerNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, idx):
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for b in self.blocks:
            x = b(x)
        return self.lm_head(self.ln_f(x))


class PositionalEncoding(nn.Module):
    r"""pytorch/examples word_language_model/model.py ``PositionalEncoding``: a sinusoid
    table ``pe[:x.size(0), :]`` (sequence-first)."""

    def __init__(self, d_model, dropout=0.1, max_len=5000):
        super().__init__()
        self.dropout = nn.Dropout(p=dropout)

        pe = torch.zeros(max_len, d_model)
        position = torch.arange(0, max_len, dtype=torch.float).unsqueeze(1)
        div_term = torch.exp(torch.arange(0, d_model, 2).float() * (-math.log(10000.0) / d_model))
        pe[:, 0::2] = torch.sin(position * div_term)
        pe[:, 1::2] = torch.cos(position * div_term)
        pe = pe.unsqueeze(0).transpose(0, 1)
        self.register_buffer('pe', pe)

    def forward(self, x):
        x = x + self.pe[:x.size(0), :]
        return self.dropout(x)


class TorchExamplesTransformerLM(nn.Transformer):
    """pytorch/examples word_language_model/model.py ``TransformerModel``: a subclass of
    ``nn.Transformer`` using only its encoder, the mask from
    ``_generate_square_subsequent_mask`` (``(triu(ones(sz, sz)) == 1).transpose(0, 1)``,
    ``masked_fill(-inf)`` / ``masked_fill(0.0)``, float32) cached on the module as
    ``self.src_mask`` and rebuilt when the length changes, sequence-first layout, and
    ``log_softmax`` output. Changed: takes ``idx [B, T]`` and returns ``[B, T, V]``
    (transposing in and out); 2 encoder and 1 (unused) decoder layer."""

    def __init__(self, ntoken=VOCAB, ninp=DIM, nhead=HEADS, nhid=4 * DIM, nlayers=LAYERS, dropout=0.5):
        super().__init__(d_model=ninp, nhead=nhead, dim_feedforward=nhid, num_encoder_layers=nlayers,
                         num_decoder_layers=1)
        self.model_type = 'Transformer'
        self.src_mask = None
        self.pos_encoder = PositionalEncoding(ninp, dropout, max_len=CTX)

        self.input_emb = nn.Embedding(ntoken, ninp)
        self.ninp = ninp
        self.decoder = nn.Linear(ninp, ntoken)

    def _generate_square_subsequent_mask(self, sz):
        mask = (torch.triu(torch.ones(sz, sz)) == 1).transpose(0, 1)
        mask = mask.float().masked_fill(mask == 0, float('-inf')).masked_fill(mask == 1, float(0.0))
        return mask

    def forward(self, idx, has_mask=True):
        src = idx.t()
        if has_mask:
            device = src.device
            if self.src_mask is None or self.src_mask.size(0) != len(src):
                mask = self._generate_square_subsequent_mask(len(src)).to(device)
                self.src_mask = mask
        else:
            self.src_mask = None

        src = self.input_emb(src) * math.sqrt(self.ninp)
        src = self.pos_encoder(src)
        output = self.encoder(src, mask=self.src_mask)
        output = self.decoder(output)
        return F.log_softmax(output, dim=-1).transpose(0, 1)


# =============================================================================== more spellings


class DiffShiftLM(nn.Module):
    """After each attention, ``h = h + torch.diff(h, dim=1, prepend=torch.zeros_like(h[:, :1]))``:
    a token shift by difference (each row minus the previous row of the sequence)."""

    class _Block(NanoBlock):
        def forward(self, x):
            h = x + self.attn(self.ln_1(x))
            h = h + torch.diff(h, dim=1, prepend=torch.zeros_like(h[:, :1]))
            return h + self.mlp(self.ln_2(h))

    def __init__(self):
        super().__init__()
        cfg = NanoGPTConfig(flash=True)
        self.wte = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([self._Block(cfg) for _ in range(LAYERS)])
        self.ln_f = nn.LayerNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, idx):
        x = self.wte(idx)
        for b in self.blocks:
            x = b(x)
        return self.lm_head(self.ln_f(x))


class LinspacePosLM(nn.Module):
    """Sinusoidal positions (the pytorch/examples formula) evaluated at
    ``torch.linspace(0, T - 1, T)`` (safari's ``t_rescaled`` spelling of ``arange(T)``),
    added to the token embeddings, then nanoGPT SDPA blocks."""

    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, DIM)
        self.register_buffer("div_term", torch.exp(torch.arange(0, DIM, 2).float() * (-math.log(10000.0) / DIM)))
        self.blocks = nn.ModuleList([NanoBlock(NanoGPTConfig(flash=True)) for _ in range(LAYERS)])
        self.ln_f = nn.LayerNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

    def positions(self, T, device):
        return torch.linspace(0, T - 1, T, device=device, dtype=self.div_term.dtype)

    def forward(self, idx):
        position = self.positions(idx.size(1), idx.device)[:, None]
        pe = torch.cat([torch.sin(position * self.div_term), torch.cos(position * self.div_term)], dim=-1)
        x = self.wte(idx) + pe
        for b in self.blocks:
            x = b(x)
        return self.lm_head(self.ln_f(x))


class FinfoBiasBufferLM(nn.Module):
    """An additive 0 / ``finfo(float32).min`` causal bias registered as a module buffer
    ``[1, 1, CTX, CTX]`` (OLMo's bias, kept as a buffer as older codebases do), sliced
    ``[:, :, :T, :T]`` and added to ``q @ k^T``; manual softmax attention."""

    class _Attn(NanoCausalSelfAttention):
        def __init__(self, config):
            super().__init__(config)
            bias = torch.triu(torch.ones(CTX, CTX), diagonal=1)
            bias.masked_fill_(bias == 1, torch.finfo(bias.dtype).min)
            self.register_buffer("causal_bias", bias.view(1, 1, CTX, CTX), persistent=False)

        def forward(self, x):
            B, T, C = x.size()
            q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
            q, k, v = (z.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for z in (q, k, v))
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1))) + self.causal_bias[:, :, :T, :T]
            y = F.softmax(att, dim=-1) @ v
            return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))

    class _Block(NanoBlock):
        def __init__(self, config):
            super().__init__(config)
            self.attn = FinfoBiasBufferLM._Attn(config)

    def __init__(self):
        super().__init__()
        cfg = NanoGPTConfig(flash=True)
        self.wte = nn.Embedding(VOCAB, DIM)
        self.wpe = nn.Embedding(CTX, DIM)
        self.blocks = nn.ModuleList([self._Block(cfg) for _ in range(LAYERS)])
        self.ln_f = nn.LayerNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1), device=idx.device))
        for b in self.blocks:
            x = b(x)
        return self.lm_head(self.ln_f(x))


# =============================================================================== gpt-oss (torch reference)


def gptoss_sdpa(Q, K, V, S, sm_scale, sliding_window=0):
    """openai/gpt-oss gpt_oss/torch/model.py ``sdpa``: token-major tensors without a batch dim,
    K and V expanded over the query heads of each key head, a learned sink logit per head."""
    # sliding_window == 0 means no sliding window
    n_tokens, n_heads, q_mult, d_head = Q.shape
    assert K.shape == (n_tokens, n_heads, d_head)
    assert V.shape == (n_tokens, n_heads, d_head)
    K = K[:, :, None, :].expand(-1, -1, q_mult, -1)
    V = V[:, :, None, :].expand(-1, -1, q_mult, -1)
    S = S.reshape(n_heads, q_mult, 1, 1).expand(-1, -1, n_tokens, -1)
    mask = torch.triu(Q.new_full((n_tokens, n_tokens), -float("inf")), diagonal=1)
    if sliding_window > 0:
        mask += torch.tril(mask.new_full((n_tokens, n_tokens), -float("inf")), diagonal=-sliding_window)
    QK = torch.einsum("qhmd,khmd->hmqk", Q, K)
    QK *= sm_scale
    QK += mask[None, None, :, :]
    QK = torch.cat([QK, S], dim=-1)
    W = torch.softmax(QK, dim=-1)
    W = W[..., :-1]
    attn = torch.einsum("hmqk,khmd->qhmd", W, V)
    return attn.reshape(n_tokens, -1)


class GptOssAttentionBlock(nn.Module):
    """gpt-oss ``AttentionBlock``: RMSNorm, fused qkv, rotary on the token-major q and k, `gptoss_sdpa`
    with a sliding window on even layers, residual (its YaRN rotary as plain RoPE here)."""

    def __init__(self, layer_idx: int, kv_heads: int = 2) -> None:
        super().__init__()
        self.head_dim, self.num_attention_heads, self.num_key_value_heads = HD, HEADS, kv_heads
        self.sliding_window = 4 if layer_idx % 2 == 0 else 0
        self.sinks = nn.Parameter(torch.randn(HEADS))
        self.norm = nn.RMSNorm(DIM, eps=1e-5)
        self.qkv = nn.Linear(DIM, HD * (HEADS + 2 * kv_heads))
        self.out = nn.Linear(HD * HEADS, DIM)
        self.sm_scale = 1 / math.sqrt(HD)

    def rope(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        inv_freq = 1.0 / (10000 ** (torch.arange(0, HD, 2, dtype=torch.float64) / HD))
        freqs = torch.einsum("i,j->ij", torch.arange(n, dtype=torch.float64), inv_freq)
        cos, sin = freqs.cos().unsqueeze(-2).to(x.dtype), freqs.sin().unsqueeze(-2).to(x.dtype)
        x1, x2 = torch.chunk(x.view(n, -1, HD), 2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).reshape(x.shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self.norm(x)
        qkv = self.qkv(t)
        q = qkv[:, : self.num_attention_heads * self.head_dim].contiguous()
        k = qkv[:, self.num_attention_heads * self.head_dim: (self.num_attention_heads + self.num_key_value_heads)
                * self.head_dim].contiguous()
        v = qkv[:, (self.num_attention_heads + self.num_key_value_heads) * self.head_dim:].contiguous()
        q = q.view(-1, self.num_key_value_heads, self.num_attention_heads // self.num_key_value_heads, self.head_dim)
        k = k.view(-1, self.num_key_value_heads, self.head_dim)
        v = v.view(-1, self.num_key_value_heads, self.head_dim)
        q, k = self.rope(q), self.rope(k)
        t = gptoss_sdpa(q, k, v, self.sinks, self.sm_scale, self.sliding_window)
        return x + self.out(t)


class GptOssReference(nn.Module):
    """gpt-oss ``Transformer`` on one sequence ``[n_tokens]`` (the reference runs without a batch
    dim), two attention blocks (sliding, full), each followed by a SwiGLU MLP in place of its MoE."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, DIM)
        self.block = nn.ModuleList(GptOssAttentionBlock(i) for i in range(2))
        self.mlp = nn.ModuleList(nn.Sequential(nn.RMSNorm(DIM), nn.Linear(DIM, 2 * DIM), nn.SiLU(),
                                               nn.Linear(2 * DIM, DIM)) for _ in range(2))
        self.norm = nn.RMSNorm(DIM, eps=1e-5)
        self.unembedding = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embedding(x[0])
        for block, mlp in zip(self.block, self.mlp):
            x = block(x)
            x = x + mlp(x)
        return self.unembedding(self.norm(x))[None]


class TransformerLensAttention(nn.Module):
    """TransformerLens ``Attention``: ``W_Q``/``W_K``/``W_V`` as ``[heads, d_model, d_head]``
    parameters applied by ``einsum('bpm,hmd->bphd')``, scores ``einsum('bqhd,bkhd->bhqk', q, k)``,
    ``torch.where(self.mask[:q, :k], scores, self.IGNORE)`` with a ``tril`` buffer and an ``-inf``
    buffer, softmax, its NaN zeroed (``where(isnan(pattern), zeros_like(pattern), pattern)``), and
    the values first in ``einsum('bkhd,bhqk->bqhd', v, pattern)``."""

    def __init__(self):
        super().__init__()
        self.W_Q, self.W_K, self.W_V = (nn.Parameter(torch.randn(HEADS, DIM, HD) / DIM ** 0.5) for _ in range(3))
        self.W_O = nn.Parameter(torch.randn(HEADS, HD, DIM) / HD ** 0.5)
        self.b_Q, self.b_K, self.b_V = (nn.Parameter(torch.zeros(HEADS, HD)) for _ in range(3))
        self.b_O = nn.Parameter(torch.zeros(DIM))
        self.register_buffer("mask", torch.tril(torch.ones((CTX, CTX)).bool()))
        self.register_buffer("IGNORE", torch.tensor(-torch.inf))

    def forward(self, x):
        q = torch.einsum("bpm,hmd->bphd", x, self.W_Q) + self.b_Q
        k = torch.einsum("bpm,hmd->bphd", x, self.W_K) + self.b_K
        v = torch.einsum("bpm,hmd->bphd", x, self.W_V) + self.b_V
        attn_scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / HD ** 0.5
        q_len, k_len = attn_scores.size(-2), attn_scores.size(-1)
        attn_scores = torch.where(self.mask[k_len - q_len:k_len, :k_len], attn_scores, self.IGNORE)
        pattern = F.softmax(attn_scores, dim=-1)
        pattern = torch.where(torch.isnan(pattern), torch.zeros_like(pattern), pattern)
        z = torch.einsum("bkhd,bhqk->bqhd", v, pattern)
        return torch.einsum("bqhd,hdm->bqm", z, self.W_O) + self.b_O


class TransformerLensLM(nn.Module):
    """TransformerLens ``HookedTransformer`` (hooks left out): embed plus a learned ``pos_embed``
    sliced to the length, pre-LN blocks of `TransformerLensAttention` and a GELU MLP, unembed."""

    def __init__(self):
        super().__init__()
        self.W_E, self.W_pos = nn.Parameter(torch.randn(VOCAB, DIM) * 0.1), nn.Parameter(torch.randn(CTX, DIM) * 0.1)
        self.ln1, self.ln2 = (nn.ModuleList(nn.LayerNorm(DIM) for _ in range(LAYERS)) for _ in range(2))
        self.attn = nn.ModuleList(TransformerLensAttention() for _ in range(LAYERS))
        self.mlp = nn.ModuleList(nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))
                                 for _ in range(LAYERS))
        self.W_U = nn.Parameter(torch.randn(DIM, VOCAB) * 0.1)

    def forward(self, tokens):
        x = self.W_E[tokens] + self.W_pos[:tokens.size(-1)][None]
        for ln1, attn, ln2, mlp in zip(self.ln1, self.attn, self.ln2, self.mlp):
            x = x + attn(ln1(x))
            x = x + mlp(ln2(x))
        return x @ self.W_U
