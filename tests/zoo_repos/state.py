"""Models that keep state between calls, as repositories write them: rotary tables cached on
the module (extended when a longer sequence comes) or in a buffer written in place, step
counters (a tensor buffer, a Python int).

A tree call must compute such state as the unmodified model does (a table over sequence
positions, one step per call) and leave the model, run on its own afterwards, as it would
be after an ordinary call (`treecompile.passes.state`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from zoo_repos.common import DIM, HD, HEADS, LAYERS, VOCAB

# =============================================================================== transformers 4.36 Llama


class Llama436RotaryEmbedding(nn.Module):
    """transformers v4.36.2 models/llama/modeling_llama.py ``LlamaRotaryEmbedding``: cos/sin
    tables built at init for ``max_position_embeddings`` and registered again, longer, when a
    longer sequence comes (``_set_cos_sin_cache``)."""

    def __init__(self, dim, max_position_embeddings=2048, base=10000, device=None):
        super().__init__()

        self.dim = dim
        self.max_position_embeddings = max_position_embeddings
        self.base = base
        inv_freq = 1.0 / (self.base ** (torch.arange(0, self.dim, 2).float().to(device) / self.dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

        # Build here to make `torch.jit.trace` work.
        self._set_cos_sin_cache(
            seq_len=max_position_embeddings, device=self.inv_freq.device, dtype=torch.get_default_dtype()
        )

    def _set_cos_sin_cache(self, seq_len, device, dtype):
        self.max_seq_len_cached = seq_len
        t = torch.arange(self.max_seq_len_cached, device=device, dtype=self.inv_freq.dtype)

        freqs = torch.outer(t, self.inv_freq)
        # Different from paper, but it uses a different permutation in order to obtain the same calculation
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cached", emb.cos().to(dtype), persistent=False)
        self.register_buffer("sin_cached", emb.sin().to(dtype), persistent=False)

    def forward(self, x, seq_len=None):
        # x: [bs, num_attention_heads, seq_len, head_size]
        if seq_len > self.max_seq_len_cached:
            self._set_cos_sin_cache(seq_len=seq_len, device=x.device, dtype=x.dtype)

        return (
            self.cos_cached[:seq_len].to(dtype=x.dtype),
            self.sin_cached[:seq_len].to(dtype=x.dtype),
        )


def llama436_rotate_half(x):
    """Rotates half the hidden dims of the input."""
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def llama436_apply_rotary_pos_emb(q, k, cos, sin, position_ids, unsqueeze_dim=1):
    cos = cos[position_ids].unsqueeze(unsqueeze_dim)
    sin = sin[position_ids].unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (llama436_rotate_half(q) * sin)
    k_embed = (k * cos) + (llama436_rotate_half(k) * sin)
    return q_embed, k_embed


class Llama436RMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class Llama436Attention(nn.Module):
    def __init__(self, max_position_embeddings):
        super().__init__()
        self.num_heads, self.head_dim = HEADS, HD
        self.q_proj = nn.Linear(DIM, DIM, bias=False)
        self.k_proj = nn.Linear(DIM, DIM, bias=False)
        self.v_proj = nn.Linear(DIM, DIM, bias=False)
        self.o_proj = nn.Linear(DIM, DIM, bias=False)
        self.rotary_emb = Llama436RotaryEmbedding(self.head_dim, max_position_embeddings=max_position_embeddings)

    def forward(self, hidden_states, position_ids):
        bsz, q_len, _ = hidden_states.size()
        query_states = self.q_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        kv_seq_len = key_states.shape[-2]
        cos, sin = self.rotary_emb(value_states, seq_len=kv_seq_len)
        query_states, key_states = llama436_apply_rotary_pos_emb(query_states, key_states, cos, sin, position_ids)
        attn_output = F.scaled_dot_product_attention(query_states, key_states, value_states, is_causal=q_len > 1)
        attn_output = attn_output.transpose(1, 2).contiguous().reshape(bsz, q_len, DIM)
        return self.o_proj(attn_output)


class Llama436LM(nn.Module):
    """transformers v4.36.2 ``LlamaForCausalLM`` cut down (SDPA attention, no KV cache, no
    padding mask): position ids ``arange(T)`` gathered from the rotary module's cached cos/sin
    tables, which it registers again, longer, when a sequence is longer than the table
    (``max_position_embeddings`` 16 here: a tree of more rows extends it)."""

    def __init__(self, max_position_embeddings=16):
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(
            nn.ModuleDict({"input_layernorm": Llama436RMSNorm(DIM), "self_attn": Llama436Attention(max_position_embeddings),
                           "post_attention_layernorm": Llama436RMSNorm(DIM), "gate_proj": nn.Linear(DIM, 2 * DIM, bias=False),
                           "up_proj": nn.Linear(DIM, 2 * DIM, bias=False), "down_proj": nn.Linear(2 * DIM, DIM, bias=False)})
            for _ in range(LAYERS)
        )
        self.norm = Llama436RMSNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, input_ids):
        seq_length = input_ids.shape[1]
        position_ids = torch.arange(0, seq_length, dtype=torch.long, device=input_ids.device).unsqueeze(0)
        return self.decode(input_ids, position_ids)

    def decode(self, input_ids, position_ids):
        hidden_states = self.embed_tokens(input_ids)
        for layer in self.layers:
            residual = hidden_states
            hidden_states = layer["self_attn"](layer["input_layernorm"](hidden_states), position_ids)
            hidden_states = residual + hidden_states
            residual = hidden_states
            h = layer["post_attention_layernorm"](hidden_states)
            hidden_states = residual + layer["down_proj"](F.silu(layer["gate_proj"](h)) * layer["up_proj"](h))
        return self.lm_head(self.norm(hidden_states))


class Llama436DynamicNTKRotaryEmbedding(Llama436RotaryEmbedding):
    """transformers v4.36.2 ``LlamaDynamicNTKScalingRotaryEmbedding`` (``rope_scaling={"type":
    "dynamic"}``): a sequence longer than ``max_position_embeddings`` rebuilds the tables with a
    base scaled by its length, so the table a position reads depends on the length of the
    sequence it is in."""

    def __init__(self, dim, max_position_embeddings=2048, base=10000, device=None, scaling_factor=2.0):
        self.scaling_factor = scaling_factor
        super().__init__(dim, max_position_embeddings, base, device)

    def _set_cos_sin_cache(self, seq_len, device, dtype):
        self.max_seq_len_cached = seq_len

        if seq_len > self.max_position_embeddings:
            base = self.base * (
                (self.scaling_factor * seq_len / self.max_position_embeddings) - (self.scaling_factor - 1)
            ) ** (self.dim / (self.dim - 2))
            inv_freq = 1.0 / (base ** (torch.arange(0, self.dim, 2).float().to(device) / self.dim))
            self.register_buffer("inv_freq", inv_freq, persistent=False)

        t = torch.arange(self.max_seq_len_cached, device=device, dtype=self.inv_freq.dtype)

        freqs = torch.outer(t, self.inv_freq)
        # Different from paper, but it uses a different permutation in order to obtain the same calculation
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cached", emb.cos().to(dtype), persistent=False)
        self.register_buffer("sin_cached", emb.sin().to(dtype), persistent=False)


class Llama436DynamicNTKLM(Llama436LM):
    """``Llama436LM`` with the dynamic-NTK rotary tables (16 positions): every path of the zoo's
    trees is shorter than 16 tokens (per-path training never rescales), while the second tree
    packs 26 rows, whose call takes the rescaling branch and computes the base from the packed
    length (refused: the length used as a value)."""

    def __init__(self, max_position_embeddings=16):
        super().__init__(max_position_embeddings)
        for layer in self.layers:
            layer["self_attn"].rotary_emb = Llama436DynamicNTKRotaryEmbedding(
                HD, max_position_embeddings=max_position_embeddings)


class Llama436PositionIdsLM(Llama436LM):
    """``Llama436LM`` taking ``position_ids`` as transformers v4.36.2 ``LlamaModel.forward`` does
    (``position_ids.view(-1, seq_length).long()`` when given, ``arange`` otherwise): the rotary
    table sliced to the length, ``cos_cached[:seq_len]``, is then gathered at the given ids."""

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        seq_length = input_ids.shape[1]
        if position_ids is None:
            position_ids = torch.arange(0, seq_length, dtype=torch.long, device=input_ids.device)
            position_ids = position_ids.unsqueeze(0).view(-1, seq_length)
        else:
            position_ids = position_ids.view(-1, seq_length).long()
        return self.decode(input_ids, position_ids)


# =============================================================================== rotary-embedding-torch


class LucidrainsRotaryEmbedding(nn.Module):
    """lucidrains/rotary-embedding-torch rotary_embedding_torch.py ``RotaryEmbedding``
    (``freqs_for="lang"``, the cache path): the frequencies of a sequence are written in place
    into the ``cached_freqs`` buffer (``self.cached_freqs[:seq_len] = freqs.detach()``) with
    their length in a Python int, and a later call no longer than that reads them back."""

    def __init__(self, dim, theta=10000, cache_if_possible=True, cache_max_seq_len=64):
        super().__init__()
        freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
        self.cache_if_possible = cache_if_possible
        self.cache_max_seq_len = cache_max_seq_len
        self.register_buffer("cached_freqs", torch.zeros(cache_max_seq_len, dim), persistent=False)
        self.cached_freqs_seq_len = 0
        self.freqs = nn.Parameter(freqs, requires_grad=False)
        self.learned_freq = False

    def forward(self, t, seq_len=None, offset=0):
        should_cache = (
            self.cache_if_possible and not self.learned_freq and seq_len is not None
            and (offset + seq_len) <= self.cache_max_seq_len
        )
        if should_cache and (offset + seq_len) <= self.cached_freqs_seq_len:
            return self.cached_freqs[offset:(offset + seq_len)].detach()

        freqs = self.freqs
        freqs = torch.einsum("..., f -> ... f", t.type(freqs.dtype), freqs)
        freqs = freqs.repeat_interleave(2, dim=-1)  # repeat(freqs, '... n -> ... (n r)', r = 2)

        if should_cache and offset == 0:
            self.cached_freqs[:seq_len] = freqs.detach()
            self.cached_freqs_seq_len = seq_len

        return freqs


class LucidrainsLegacyRotaryEmbedding(nn.Module):
    """rotary-embedding-torch 0.2 ``RotaryEmbedding``: ``cached_freqs`` registered as a None
    buffer beside a ``dummy`` buffer (for the device), and registered again with the
    frequencies in forward (``tmp_store``); read back while a sequence is no longer."""

    def __init__(self, dim, theta=10000):
        super().__init__()
        freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
        self.cache_if_possible = True
        self.tmp_store("cached_freqs", None)
        self.freqs = nn.Parameter(freqs, requires_grad=False)
        self.learned_freq = False
        self.tmp_store("dummy", torch.tensor(0))

    @property
    def device(self):
        return self.dummy.device

    def tmp_store(self, key, value):
        self.register_buffer(key, value, persistent=False)

    def forward(self, t, seq_len=None, offset=0):
        should_cache = self.cache_if_possible and not self.learned_freq and seq_len is not None
        if should_cache and self.cached_freqs is not None and (offset + seq_len) <= self.cached_freqs.shape[0]:
            return self.cached_freqs[offset:(offset + seq_len)].detach()
        freqs = torch.einsum("..., f -> ... f", t.type(self.freqs.dtype), self.freqs)
        freqs = freqs.repeat_interleave(2, dim=-1)
        if should_cache:
            self.tmp_store("cached_freqs", freqs.detach())
        return freqs


def lucidrains_rotate_half(x):
    x = x.unflatten(-1, (-1, 2))  # rearrange(x, '... (d r) -> ... d r', r = 2)
    x1, x2 = x.unbind(dim=-1)
    x = torch.stack((-x2, x1), dim=-1)
    return x.flatten(-2)  # rearrange(x, '... d r -> ... (d r)')


def lucidrains_apply_rotary_emb(freqs, t, start_index=0, scale=1.0, seq_dim=-2):
    dtype = t.dtype
    if t.ndim == 3:
        seq_len = t.shape[seq_dim]
        freqs = freqs[-seq_len:]
    rot_dim = freqs.shape[-1]
    end_index = start_index + rot_dim
    t_left, t_middle, t_right = t[..., :start_index], t[..., start_index:end_index], t[..., end_index:]
    t_transformed = (t_middle * freqs.cos() * scale) + (lucidrains_rotate_half(t_middle) * freqs.sin() * scale)
    out = torch.cat((t_left, t_transformed, t_right), dim=-1)
    return out.type(dtype)


class LucidrainsRotaryLM(nn.Module):
    """A decoder using rotary-embedding-torch's cached ``RotaryEmbedding`` (one per layer, as
    x-transformers and lucidrains' models hold it), called with ``t = arange(T)``; SDPA
    is_causal, LayerNorm, GELU MLP."""

    def __init__(self, rotary=LucidrainsRotaryEmbedding):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.rotary = nn.ModuleList(rotary(HD) for _ in range(LAYERS))
        self.norm1 = nn.ModuleList(nn.LayerNorm(DIM) for _ in range(LAYERS))
        self.qkv = nn.ModuleList(nn.Linear(DIM, 3 * DIM) for _ in range(LAYERS))
        self.out = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(LAYERS))
        self.norm2 = nn.ModuleList(nn.LayerNorm(DIM) for _ in range(LAYERS))
        self.ff = nn.ModuleList(nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))
                                for _ in range(LAYERS))
        self.norm_f = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, idx):
        b, n = idx.shape
        x = self.emb(idx)
        for i in range(LAYERS):
            q, k, v = self.qkv[i](self.norm1[i](x)).chunk(3, dim=-1)
            q, k, v = (t.view(b, n, HEADS, HD).transpose(1, 2) for t in (q, k, v))
            freqs = self.rotary[i](torch.arange(n, device=x.device), seq_len=n)
            q, k = lucidrains_apply_rotary_emb(freqs, q), lucidrains_apply_rotary_emb(freqs, k)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.out[i](y.transpose(1, 2).reshape(b, n, DIM))
            x = x + self.ff[i](self.norm2[i](x))
        return self.head(self.norm_f(x))


# =============================================================================== PaLM-pytorch


class PalmBlock(nn.Module):
    """lucidrains/PaLM-pytorch ``ParallelTransformerBlock``: attention and feed-forward in
    parallel from one fused projection, multi-query attention (one key and value head, einsum
    ``b h i d, b j d``), the scores shifted by their detached row maximum before the softmax
    (``sim - sim.amax(dim=-1, keepdim=True).detach()``), and the causal mask and rotary table
    cached lazily: registered as buffers (None at first) at the length of the call, sliced
    ``[:n]`` by later calls no longer than that."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.fused_dims = (DIM, HD, HD, 4 * DIM)
        self.fused_attn_ff_proj = nn.Linear(DIM, sum(self.fused_dims), bias=False)
        self.attn_out = nn.Linear(DIM, DIM, bias=False)
        self.ff_out = nn.Linear(2 * DIM, DIM, bias=False)
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, HD, 2).float() / HD)))
        self.register_buffer("mask", None, persistent=False)
        self.register_buffer("pos_emb", None, persistent=False)

    def get_mask(self, n, device):
        if self.mask is not None and self.mask.shape[-1] >= n:
            return self.mask[:n, :n]
        mask = torch.ones((n, n), device=device, dtype=torch.bool).triu(1)
        self.register_buffer("mask", mask, persistent=False)
        return mask

    def get_rotary_embedding(self, n, device):
        if self.pos_emb is not None and self.pos_emb.shape[-2] >= n:
            return self.pos_emb[:n]
        seq = torch.arange(n, device=device, dtype=self.inv_freq.dtype)
        freqs = torch.einsum("i , j -> i j", seq, self.inv_freq)
        pos_emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("pos_emb", pos_emb, persistent=False)
        return pos_emb

    @staticmethod
    def rotate(pos, t):
        x1, x2 = t.chunk(2, dim=-1)
        return t * pos.cos() + torch.cat((-x2, x1), dim=-1) * pos.sin()

    def forward(self, x):
        n, device = x.shape[1], x.device
        h = self.norm(x)
        q, k, v, ff = self.fused_attn_ff_proj(h).split(self.fused_dims, dim=-1)
        q = q.view(x.shape[0], n, HEADS, HD).transpose(1, 2)
        positions = self.get_rotary_embedding(n, device)
        q, k = self.rotate(positions, q), self.rotate(positions, k)
        sim = torch.einsum("b h i d, b j d -> b h i j", q * HD ** -0.5, k)
        sim = sim.masked_fill(self.get_mask(n, device), -torch.finfo(sim.dtype).max)
        sim = sim - sim.amax(dim=-1, keepdim=True).detach()
        out = torch.einsum("b h i j, b j d -> b h i d", sim.softmax(dim=-1), v)
        gate, y = ff.chunk(2, dim=-1)
        return x + self.attn_out(out.transpose(1, 2).reshape(x.shape)) + self.ff_out(F.silu(gate) * y)


class PalmLM(nn.Module):
    """PaLM-pytorch's ``PaLM``: embedding, `PalmBlock` layers, LayerNorm, a tied head."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(PalmBlock() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(DIM)

    def forward(self, idx):
        x = self.emb(idx)
        for block in self.blocks:
            x = block(x)
        return self.norm(x) @ self.emb.weight.t()


# =============================================================================== written and read back


class FilledTableLM(nn.Module):
    """Sinusoidal positions from a preallocated buffer filled in place up to the longest
    sequence seen and read back in the same call (``self.table[:T] = ...; x + self.table[:T]``,
    with the filled length in a Python int), then nanoGPT-style SDPA blocks."""

    def __init__(self, max_len=64):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.register_buffer("table", torch.zeros(max_len, DIM), persistent=False)
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, DIM, 2).float() / DIM), persistent=False)
        self.filled = 0
        self.blocks = nn.ModuleList(_SdpaBlock() for _ in range(LAYERS))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, idx):
        T = idx.shape[1]
        if T > self.filled:
            angles = torch.arange(T, dtype=self.inv_freq.dtype, device=idx.device)[:, None] * self.inv_freq
            self.table[:T, 0::2] = angles.sin()
            self.table[:T, 1::2] = angles.cos()
            self.filled = T
        x = self.emb(idx) + self.table[:T]
        for block in self.blocks:
            x = block(x)
        return self.head(x)


# =============================================================================== counters


class _SdpaBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.qkv, self.proj = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (z.view(b, t, HEADS, HD).transpose(1, 2) for z in self.qkv(self.ln1(x)).split(DIM, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, DIM))
        return x + self.mlp(self.ln2(x))


class CountingLM(nn.Module):
    """Learned positions ``wpe(arange(T))`` and SDPA blocks, counting its calls as training
    code does: ``self.steps += 1`` on a tensor buffer (saved in the state dict), and
    ``self.num_calls += 1`` on a Python int."""

    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, DIM), nn.Embedding(64, DIM)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self.num_calls = 0
        self.blocks = nn.ModuleList(_SdpaBlock() for _ in range(LAYERS))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, idx):
        self.steps += 1
        self.num_calls += 1
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


# ====================================================== caches rebuilt or grown at the call's length


class MegatronRotaryEmbedding(nn.Module):
    """EleutherAI/gpt-neox (Megatron) ``RotaryEmbedding``: the tables are plain attributes,
    rebuilt whenever the length differs from the cached one (``seq_len != self.seq_len_cached``),
    sequence-first ``[T, 1, 1, d]``."""

    def __init__(self, dim: int, base: float = 10000.0):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (base ** (torch.arange(0, dim, 2).double() / dim)))
        self.seq_len_cached = None
        self.cos_cached = None
        self.sin_cached = None

    def forward(self, x, seq_dim=1, seq_len=None):
        if seq_len is None:
            seq_len = x.shape[seq_dim]
        if seq_len != self.seq_len_cached:
            self.seq_len_cached = seq_len
            t = torch.arange(x.shape[seq_dim], device=x.device).type_as(self.inv_freq)
            freqs = torch.einsum("i,j->ij", t, self.inv_freq)
            emb = torch.cat((freqs, freqs), dim=-1).to(x.device)
            self.cos_cached = emb.cos()[:, None, None, :]
            self.sin_cached = emb.sin()[:, None, None, :]
        return self.cos_cached, self.sin_cached


class MegatronRotaryLM(nn.Module):
    """Sequence-first attention with `MegatronRotaryEmbedding`'s tables read whole (``sliced=False``,
    as Megatron's fused path does) or cut ``cos[offset:T + offset]`` (gpt-neox's
    ``apply_rotary_pos_emb``), SDPA causal."""

    def __init__(self, sliced: bool = True):
        super().__init__()
        self.sliced = sliced
        self.emb, self.head = nn.Embedding(VOCAB, DIM), nn.Linear(DIM, VOCAB)
        self.rotary = MegatronRotaryEmbedding(HD)
        self.ln, self.qkv, self.proj = nn.LayerNorm(DIM), nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)

    def forward(self, idx):
        b, t = idx.shape
        x = self.emb(idx).transpose(0, 1)  # [T, B, D]
        q, k, v = (z.view(t, b, HEADS, HD) for z in self.qkv(self.ln(x)).split(DIM, -1))
        cos, sin = self.rotary(v, seq_dim=0)
        if self.sliced:
            cos, sin = cos[0:q.shape[0] + 0, ...], sin[0:q.shape[0] + 0, ...]
        q, k = q * cos + llama436_rotate_half(q) * sin, k * cos + llama436_rotate_half(k) * sin
        q, k, v = (z.permute(1, 2, 0, 3) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).permute(2, 0, 1, 3).reshape(t, b, DIM)
        return self.head(x + self.proj(y)).transpose(0, 1)


class GrownMaskLM(nn.Module):
    """A causal mask kept as a plain attribute and grown to the call's length when it is too
    short (``if self.mask is None or self.mask.shape[-1] < T``), read ``self.mask[:T, :T]`` as
    SDPA's boolean mask (OLMo's and x-transformers' cached masks)."""

    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, DIM), nn.Embedding(64, DIM)
        self.block, self.head = _SdpaBlock(), nn.Linear(DIM, VOCAB)
        self.mask = None

    def forward(self, idx):
        t = idx.shape[1]
        if self.mask is None or self.mask.shape[-1] < t:
            self.mask = torch.ones(t, t, dtype=torch.bool, device=idx.device).tril()
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        b = x.shape[0]
        q, k, v = (z.view(b, t, HEADS, HD).transpose(1, 2) for z in self.block.qkv(self.block.ln1(x)).split(DIM, -1))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask[:t, :t])
        x = x + self.block.proj(y.transpose(1, 2).reshape(b, t, DIM))
        return self.head(x + self.block.mlp(self.block.ln2(x)))
