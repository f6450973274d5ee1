"""nanoGPT, minGPT and modded-nanoGPT, as their repositories write them."""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from zoo_repos.common import CTX, DIM, HEADS, LAYERS, VOCAB

# =============================================================================== nanoGPT


@dataclass
class NanoGPTConfig:
    block_size: int = CTX
    vocab_size: int = VOCAB
    n_layer: int = LAYERS
    n_head: int = HEADS
    n_embd: int = DIM
    dropout: float = 0.0
    bias: bool = True
    # nanoGPT sets this from ``hasattr(torch.nn.functional, 'scaled_dot_product_attention')``;
    # here it is a field so that both of its attention paths can be built.
    flash: bool = True


class NanoLayerNorm(nn.Module):
    """ LayerNorm but with an optional bias. PyTorch doesn't support simply bias=False """

    def __init__(self, ndim, bias):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, input):
        return F.layer_norm(input, self.weight.shape, self.weight, self.bias, 1e-5)


class NanoCausalSelfAttention(nn.Module):
    """karpathy/nanoGPT model.py ``CausalSelfAttention``: fused ``c_attn``, and either SDPA
    ``is_causal=True`` (``flash``) or the manual path with the ``bias`` tril buffer
    ``[1, 1, block_size, block_size]`` and ``masked_fill(self.bias[:,:,:T,:T] == 0, -inf)``."""

    def __init__(self, config):
        super().__init__()
        assert config.n_embd % config.n_head == 0
        # key, query, value projections for all heads, but in a batch
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        # output projection
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        # regularization
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout
        self.flash = config.flash
        if not self.flash:
            # causal mask to ensure that attention is only applied to the left in the input sequence
            self.register_buffer("bias", torch.tril(torch.ones(config.block_size, config.block_size))
                                        .view(1, 1, config.block_size, config.block_size))

    def forward(self, x):
        B, T, C = x.size()  # batch size, sequence length, embedding dimensionality (n_embd)

        # calculate query, key, values for all heads in batch and move head forward to be the batch dim
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)

        # causal self-attention; Self-attend: (B, nh, T, hs) x (B, nh, hs, T) -> (B, nh, T, T)
        if self.flash:
            # efficient attention using Flash Attention CUDA kernels
            y = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=None, dropout_p=self.dropout if self.training else 0, is_causal=True)
        else:
            # manual implementation of attention
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float('-inf'))
            att = F.softmax(att, dim=-1)
            att = self.attn_dropout(att)
            y = att @ v  # (B, nh, T, T) x (B, nh, T, hs) -> (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # re-assemble all head outputs side by side

        # output projection
        y = self.resid_dropout(self.c_proj(y))
        return y


class NanoMLP(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        x = self.c_fc(x)
        x = self.gelu(x)
        x = self.c_proj(x)
        x = self.dropout(x)
        return x


class NanoBlock(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.ln_1 = NanoLayerNorm(config.n_embd, bias=config.bias)
        self.attn = NanoCausalSelfAttention(config)
        self.ln_2 = NanoLayerNorm(config.n_embd, bias=config.bias)
        self.mlp = NanoMLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class NanoGPT(nn.Module):
    """karpathy/nanoGPT model.py ``GPT``: learned ``wpe(arange(0, t, dtype=torch.long))``,
    weight tying (``wte.weight = lm_head.weight``), LayerNorm with optional bias, the
    ``assert t <= block_size``. Changed: without ``targets`` nanoGPT returns the last
    position's logits only; here the training path's logits over every position are returned
    (with ``loss`` None)."""

    def __init__(self, config=None, **kw):
        super().__init__()
        config = config or NanoGPTConfig(**kw)
        assert config.vocab_size is not None
        assert config.block_size is not None
        self.config = config

        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([NanoBlock(config) for _ in range(config.n_layer)]),
            ln_f=NanoLayerNorm(config.n_embd, bias=config.bias),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # https://paperswithcode.com/method/weight-tying

    def forward(self, idx, targets=None):
        device = idx.device
        b, t = idx.size()
        assert t <= self.config.block_size, \
            f"Cannot forward sequence of length {t}, block size is only {self.config.block_size}"
        pos = torch.arange(0, t, dtype=torch.long, device=device)  # shape (t)

        # forward the GPT model itself
        tok_emb = self.transformer.wte(idx)  # token embeddings of shape (b, t, n_embd)
        pos_emb = self.transformer.wpe(pos)  # position embeddings of shape (t, n_embd)
        x = self.transformer.drop(tok_emb + pos_emb)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        logits = self.lm_head(x)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss


# =============================================================================== minGPT


class NewGELU(nn.Module):
    """
    Implementation of the GELU activation function currently in Google BERT repo (identical to OpenAI GPT).
    Reference: Gaussian Error Linear Units (GELU) paper: https://arxiv.org/abs/1606.08415
    """

    def forward(self, x):
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


@dataclass
class MinGPTConfig:
    n_layer: int = LAYERS
    n_head: int = HEADS
    n_embd: int = DIM
    vocab_size: int = VOCAB
    block_size: int = CTX
    embd_pdrop: float = 0.0
    resid_pdrop: float = 0.0
    attn_pdrop: float = 0.0


class MinGPTCausalSelfAttention(nn.Module):
    """
    A vanilla multi-head masked self-attention layer with a projection at the end.
    """

    def __init__(self, config):
        super().__init__()
        assert config.n_embd % config.n_head == 0
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.attn_dropout = nn.Dropout(config.attn_pdrop)
        self.resid_dropout = nn.Dropout(config.resid_pdrop)
        # causal mask to ensure that attention is only applied to the left in the input sequence
        self.register_buffer("bias", torch.tril(torch.ones(config.block_size, config.block_size))
                                     .view(1, 1, config.block_size, config.block_size))
        self.n_head = config.n_head
        self.n_embd = config.n_embd

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float('-inf'))
        att = F.softmax(att, dim=-1)
        att = self.attn_dropout(att)
        y = att @ v  # (B, nh, T, T) x (B, nh, T, hs) -> (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # re-assemble all head outputs side by side
        y = self.resid_dropout(self.c_proj(y))
        return y


class MinGPTBlock(nn.Module):
    """ an unassuming Transformer block """

    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = MinGPTCausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = nn.ModuleDict(dict(
            c_fc=nn.Linear(config.n_embd, 4 * config.n_embd),
            c_proj=nn.Linear(4 * config.n_embd, config.n_embd),
            act=NewGELU(),
            dropout=nn.Dropout(config.resid_pdrop),
        ))
        m = self.mlp
        self.mlpf = lambda x: m.dropout(m.c_proj(m.act(m.c_fc(x))))  # MLP forward

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlpf(self.ln_2(x))
        return x


class MinGPT(nn.Module):
    """karpathy/minGPT mingpt/model.py ``GPT``: the ``bias`` tril buffer with
    ``masked_fill(-inf)``, ``NewGELU`` written by hand, the MLP called through a lambda
    closure (``self.mlpf``), learned positions ``wpe(arange(0, t).unsqueeze(0))``, no tying.
    Returns ``(logits, loss)`` as minGPT does."""

    def __init__(self, config=None):
        super().__init__()
        config = config or MinGPTConfig()
        self.block_size = config.block_size
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.embd_pdrop),
            h=nn.ModuleList([MinGPTBlock(config) for _ in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)

    def forward(self, idx, targets=None):
        device = idx.device
        b, t = idx.size()
        assert t <= self.block_size, f"Cannot forward sequence of length {t}, block size is only {self.block_size}"
        pos = torch.arange(0, t, dtype=torch.long, device=device).unsqueeze(0)  # shape (1, t)

        tok_emb = self.transformer.wte(idx)  # token embeddings of shape (b, t, n_embd)
        pos_emb = self.transformer.wpe(pos)  # position embeddings of shape (1, t, n_embd)
        x = self.transformer.drop(tok_emb + pos_emb)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        logits = self.lm_head(x)

        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)

        return logits, loss


# =============================================================================== modded-nanogpt


class ModdedRotary(torch.nn.Module):
    """modded-nanogpt train_gpt2.py @607f2a38 (2024-11-20) ``Rotary``: cos/sin recomputed
    and cached on the module whenever the sequence length changes, in bfloat16."""

    def __init__(self, dim, base=10000):
        super().__init__()
        self.dim = dim
        self.base = base
        self.inv_freq = None
        self.seq_len_cached = None
        self.cos_cached = None
        self.sin_cached = None

    def forward(self, x):
        seq_len = x.shape[1]
        if seq_len != self.seq_len_cached:
            self.inv_freq = 1.0 / (self.base ** (torch.arange(0, self.dim, 2, device=x.device).float() / self.dim))
            self.seq_len_cached = seq_len
            t = torch.arange(seq_len, device=x.device).type_as(self.inv_freq)
            freqs = torch.outer(t, self.inv_freq)
            self.cos_cached = freqs.cos().bfloat16()
            self.sin_cached = freqs.sin().bfloat16()
        return self.cos_cached[None, :, None, :], self.sin_cached[None, :, None, :]


def modded_apply_rotary_emb(x, cos, sin):
    assert x.ndim == 4  # multihead attention
    d = x.shape[3] // 2
    x1 = x[..., :d]
    x2 = x[..., d:]
    y1 = x1 * cos + x2 * sin
    y2 = x1 * (-sin) + x2 * cos
    return torch.cat([y1, y2], 3).type_as(x)


class CastedLinear(nn.Linear):
    def forward(self, x):
        return F.linear(x, self.weight.to(x.dtype))


class ModdedCausalSelfAttention(nn.Module):

    def __init__(self, n_embd, n_head):
        super().__init__()
        self.n_head = n_head
        self.n_embd = n_embd
        self.head_dim = self.n_embd // self.n_head
        assert self.n_embd % self.n_head == 0
        self.c_q = CastedLinear(self.n_embd, self.n_embd, bias=False)
        self.c_k = CastedLinear(self.n_embd, self.n_embd, bias=False)
        self.c_v = CastedLinear(self.n_embd, self.n_embd, bias=False)
        # output projection
        self.c_proj = CastedLinear(self.n_embd, self.n_embd, bias=False)
        self.c_proj.weight.data.zero_()  # zero init suggested by @Grad62304977
        self.rotary = ModdedRotary(self.head_dim)
        self.lamb = nn.Parameter(torch.tensor(0.5))  # @Grad62304977

    def forward(self, x, v1=None):
        B, T, C = x.size()  # batch size, sequence length, embedding dimensionality (n_embd)
        q = self.c_q(x).view(B, T, self.n_head, self.head_dim)
        k = self.c_k(x).view(B, T, self.n_head, self.head_dim)
        v = self.c_v(x).view(B, T, self.n_head, self.head_dim)
        if v1 is None:
            v1 = v  # This happens if we are in the first block. v needs to be accessed by subsequent blocks
        v = (1 - self.lamb) * v + self.lamb * v1.view_as(v)  # @Grad62304977
        cos, sin = self.rotary(q)
        q, k = F.rms_norm(q, (q.size(-1),)), F.rms_norm(k, (k.size(-1),))  # QK norm suggested by @Grad62304977
        q, k = modded_apply_rotary_emb(q, cos, sin), modded_apply_rotary_emb(k, cos, sin)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        y = y.transpose(1, 2).contiguous().view_as(x)  # re-assemble all head outputs side by side
        y = self.c_proj(y)
        return y, v1


class ModdedMLP(nn.Module):

    def __init__(self, n_embd):
        super().__init__()
        self.c_fc = CastedLinear(n_embd, 4 * n_embd, bias=False)
        self.c_proj = CastedLinear(4 * n_embd, n_embd, bias=False)
        self.c_proj.weight.data.zero_()  # zero init suggested by @Grad62304977

    def forward(self, x):
        x = self.c_fc(x)
        x = F.relu(x).square()  # https://arxiv.org/abs/2109.08668v2; ~1-2% better than GELU
        x = self.c_proj(x)
        return x


class ModdedBlock(nn.Module):

    def __init__(self, n_embd, n_head):
        super().__init__()
        self.attn = ModdedCausalSelfAttention(n_embd, n_head)
        self.mlp = ModdedMLP(n_embd)
        self.lambdas = nn.Parameter(torch.tensor([1., 0.]))

    def forward(self, x, v1, x0):
        x = self.lambdas[0] * x + self.lambdas[1] * x0
        x1, v1 = self.attn(F.rms_norm(x, (x.size(-1),)), v1)
        x = x + x1
        x = x + self.mlp(F.rms_norm(x, (x.size(-1),)))
        return x, v1


class ModdedNanoGPT(nn.Module):
    """KellerJordan/modded-nanogpt train_gpt2.py at commit 607f2a38 (2024-11-20, the last
    record before FlexAttention): rotary cached on the module (``seq_len_cached``, bf16
    cos/sin), qk ``F.rms_norm``, relu^2 MLP, value residual (``v1`` and ``lamb``), x0
    lambdas, U-net skip connections (``skip_weights``), ``CastedLinear``, SDPA
    ``is_causal=True``, tanh logit soft-cap and ``logits.float()``. Changed: the forward
    returns those logits instead of the cross-entropy against ``target``. (Its current
    train_gpt.py uses flash-attn varlen kernels.)"""

    def __init__(self, vocab_size=VOCAB, n_layer=2, n_head=HEADS, n_embd=DIM):
        super().__init__()
        # U-net design by @brendanh0gan
        self.num_encoder_layers = n_layer // 2  # Half of the layers for encoder
        self.num_decoder_layers = n_layer - self.num_encoder_layers  # Remaining for decoder
        # Add learnable skip connection weights for decoder layers
        self.skip_weights = nn.Parameter(torch.ones(self.num_decoder_layers))

        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab_size, n_embd),
            h=nn.ModuleList([ModdedBlock(n_embd, n_head) for _ in range(n_layer)]),
        ))
        self.lm_head = CastedLinear(n_embd, vocab_size, bias=False)
        self.lm_head.weight.data.zero_()  # @Grad62304977

    def forward(self, idx):
        x = self.transformer.wte(idx)  # token embeddings of shape (b, t, n_embd)
        x = F.rms_norm(x, (x.size(-1),))  # @Grad62304977
        x0 = x
        v1 = None

        # Store outputs for U-Net skip connections
        skip_connections = []
        # Encoder pass - process only the first half of the blocks
        for i in range(self.num_encoder_layers):
            x, v1 = self.transformer.h[i](x, v1, x0)
            skip_connections.append(x)
        # Decoder pass - process the remaining blocks with weighted skip connections
        for i in range(self.num_decoder_layers):
            x = x + self.skip_weights[i] * skip_connections.pop()
            x, v1 = self.transformer.h[self.num_encoder_layers + i](x, v1, x0)

        x = F.rms_norm(x, (x.size(-1),))
        logits = self.lm_head(x)
        logits = 30 * torch.tanh(logits / 30)  # @Grad62304977
        logits = logits.float()
        return logits


class ModdedFlexRotary(torch.nn.Module):
    """modded-nanogpt records/track_1_short/2024-12-04_ValueEmbed/train_gpt2.py ``Rotary``."""

    def __init__(self, dim, base=10000):
        super().__init__()
        self.register_buffer('inv_freq', (1 / base) ** (torch.arange(0, dim, 2) / dim))
        self.seq_len_cached = None
        self.cos_cached = None
        self.sin_cached = None

    def forward(self, x):
        seq_len = x.shape[1]
        if seq_len != self.seq_len_cached:
            t = torch.arange(seq_len, device=x.device)
            freqs = torch.outer(t, self.inv_freq)
            self.seq_len_cached = seq_len
            self.cos_cached = freqs.cos()
            self.sin_cached = freqs.sin()
        cos, sin = self.cos_cached[None, :, None, :], self.sin_cached[None, :, None, :]
        # apply_rotary_emb(x, cos, sin)
        x1, x2 = x.chunk(2, dim=3)
        y1 = x1 * cos + x2 * sin
        y2 = x1 * (-sin) + x2 * cos
        return torch.cat((y1, y2), 3).type_as(x)


def _norm(x):
    return F.rms_norm(x, (x.size(-1),))


class ModdedFlexAttention(nn.Module):
    sdpa_reference = False

    def __init__(self, dim, n_head):
        super().__init__()
        assert dim % n_head == 0
        self.n_head = n_head
        self.c_q = CastedLinear(dim, dim, bias=False)
        self.c_k = CastedLinear(dim, dim, bias=False)
        self.c_v = CastedLinear(dim, dim, bias=False)
        # value residual lambda
        self.lamb = nn.Parameter(torch.tensor(0.5))  # @Grad62304977
        # rotary embeddings
        self.rotary = ModdedFlexRotary(dim // n_head)  # dim // n_head = head_dim
        # output projection
        self.c_proj = CastedLinear(dim, dim, bias=False)
        self.c_proj.weight.data.zero_()  # zero init suggested by @Grad62304977

    def forward(self, x, vi, block_mask):
        from torch.nn.attention.flex_attention import flex_attention

        B, T = x.size(0), x.size(1)  # batch size, sequence length
        assert B == 1, "Must use batch size = 1 for FlexAttention"
        q = self.c_q(x).view(B, T, self.n_head, -1)
        k = self.c_k(x).view(B, T, self.n_head, -1)
        v = self.c_v(x).view(B, T, self.n_head, -1)
        v = (1 - self.lamb) * v + self.lamb * vi.view_as(v)  # @Grad62304977
        q, k = _norm(q), _norm(k)  # QK norm suggested by @Grad62304977
        q, k = self.rotary(q), self.rotary(k)
        if self.sdpa_reference:  # (tests) the same causal attention where FlexAttention has no backward (CPU)
            y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        else:
            y = flex_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=block_mask)
        y = y.transpose(1, 2).contiguous().view_as(x)  # re-assemble all head outputs side by side
        y = self.c_proj(y)
        return y


class ModdedFlexBlock(nn.Module):

    def __init__(self, n_embd, n_head):
        super().__init__()
        self.attn = ModdedFlexAttention(n_embd, n_head)
        self.mlp = ModdedMLP(n_embd)
        self.lambdas = nn.Parameter(torch.tensor([1., 0.]))

    def forward(self, x, vi, x0, block_mask):
        x = self.lambdas[0] * x + self.lambdas[1] * x0
        x = x + self.attn(_norm(x), vi, block_mask)
        x = x + self.mlp(_norm(x))
        return x


class ModdedNanoGPTFlex(nn.Module):
    """KellerJordan/modded-nanogpt records/track_1_short/2024-12-04_ValueEmbed/train_gpt2.py:
    ``flex_attention`` under a ``BlockMask`` built in the forward by ``create_block_mask``,
    token value embeddings (``vte`` chunked per layer), U-net skips, qk norm, rotary cached
    on the module. Changed: the mask_mod is the causal part of their
    ``document_causal_mask`` only (no document or sliding-window terms); ``flex_attention``
    and ``create_block_mask`` are called as they are, not wrapped in ``torch.compile`` as
    the record does at module level; ``idx`` is ``[1, T]`` (they take a flat ``[T]`` and
    add the batch dim); the forward returns the soft-capped logits, not the loss."""

    def __init__(self, vocab_size=VOCAB, n_layer=2, n_head=HEADS, n_embd=DIM):
        super().__init__()
        self.n_layer = n_layer
        # U-net design by @brendanh0gan
        self.num_encoder_layers = n_layer // 2  # Half of the layers for encoder
        self.num_decoder_layers = n_layer - self.num_encoder_layers  # Remaining for decoder
        # Add learnable skip connection weights for decoder layers
        self.skip_weights = nn.Parameter(torch.ones(self.num_decoder_layers))

        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab_size, n_embd),
            # token value embeddings by @KoszarskyB - inspired by @Grad62304977's value residual learning
            vte=nn.Embedding(vocab_size, n_embd * n_layer),
            h=nn.ModuleList([ModdedFlexBlock(n_embd, n_head) for _ in range(n_layer)]),
        ))
        self.lm_head = CastedLinear(n_embd, vocab_size, bias=False)
        self.lm_head.weight.data.zero_()  # @Grad62304977

    def forward(self, idx):
        from torch.nn.attention.flex_attention import create_block_mask

        def causal_mask(b, h, q_idx, kv_idx):
            return q_idx >= kv_idx

        S = idx.size(1)
        block_mask = create_block_mask(causal_mask, None, None, S, S, device=idx.device)

        # forward the GPT model itself
        x = self.transformer.wte(idx)  # token embeddings of shape (b, t, n_embd)
        x = _norm(x)  # @Grad62304977
        x0 = x
        vi = self.transformer.vte(idx).chunk(self.n_layer, dim=-1)

        # Store outputs for U-Net skip connections
        skip_connections = []
        # Encoder pass - process only the first half of the blocks
        for i in range(self.num_encoder_layers):
            x = self.transformer.h[i](x, vi[i], x0, block_mask)
            skip_connections.append(x)
        # Decoder pass - process the remaining blocks with weighted skip connections
        for i in range(self.num_decoder_layers):
            x = x + self.skip_weights[i] * skip_connections.pop()
            x = self.transformer.h[self.num_encoder_layers + i](x, vi[self.num_encoder_layers + i], x0, block_mask)

        x = _norm(x)
        logits = self.lm_head(x)
        logits = 30 * torch.tanh(logits / 30)  # @Grad62304977
        logits = logits.float()
        return logits


@contextlib.contextmanager
def sdpa_reference(model: nn.Module):
    """The per-path reference of a FlexAttention model on CPU, where FlexAttention has no
    backward: its causal ``flex_attention`` computed by SDPA with ``is_causal=True`` (the same
    function), for the duration of the reference run."""
    layers = [m for m in model.modules() if isinstance(m, ModdedFlexAttention)]
    for m in layers:
        m.sdpa_reference = True
    try:
        yield
    finally:
        for m in layers:
            m.sdpa_reference = False
