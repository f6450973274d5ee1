"""x-transformers' decoder (rotary, xPos) and OLMo (allenai/OLMo)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from zoo_repos.common import CTX, DIM, HD, HEADS, LAYERS, VOCAB

# =============================================================================== x-transformers


def _exists(val):
    return val is not None


class XRotaryEmbedding(nn.Module):
    """lucidrains/x-transformers x_transformers.py ``RotaryEmbedding`` (with ``use_xpos``).
    ``rearrange`` calls are spelled out with view/stack/flatten (einops is not installed
    here); the ``@autocast('cuda', enabled=False)`` decorators are left out."""

    def __init__(self, dim, use_xpos=False, scale_base=512, interpolation_factor=1., base=10000,
                 base_rescale_factor=1.):
        super().__init__()
        base *= base_rescale_factor ** (dim / (dim - 2))

        inv_freq = 1. / (base ** (torch.arange(0, dim, 2).float() / dim))
        self.register_buffer('inv_freq', inv_freq)

        assert interpolation_factor >= 1.
        self.interpolation_factor = interpolation_factor

        if not use_xpos:
            self.register_buffer('scale', None)
            return

        scale = (torch.arange(0, dim, 2) + 0.4 * dim) / (1.4 * dim)

        self.scale_base = scale_base
        self.register_buffer('scale', scale)

    def forward(self, t, offset=0):
        max_pos = t.max() + 1

        if t.ndim == 1:
            t = t[None]  # rearrange(t, 'n -> 1 n')

        freqs = torch.einsum('b i , j -> b i j', t.type_as(self.inv_freq), self.inv_freq) / self.interpolation_factor
        freqs = torch.stack((freqs, freqs), dim=-1)
        freqs = freqs.flatten(-2)  # rearrange(freqs, '... d r -> ... (d r)')

        if not _exists(self.scale):
            return freqs, 1.

        power = (t - (max_pos // 2)) / self.scale_base
        scale = self.scale ** power[..., None]  # rearrange(power, '... n -> ... n 1')
        scale = torch.stack((scale, scale), dim=-1)
        scale = scale.flatten(-2)  # rearrange(scale, '... d r -> ... (d r)')

        return freqs, scale


def x_rotate_half(x):
    x = x.unflatten(-1, (-1, 2))  # rearrange(x, '... (d r) -> ... d r', r = 2)
    x1, x2 = x.unbind(dim=-1)
    x = torch.stack((-x2, x1), dim=-1)
    return x.flatten(-2)  # rearrange(x, '... d r -> ... (d r)')


def x_apply_rotary_pos_emb(t, freqs, scale=1):
    rot_dim, seq_len, orig_dtype = freqs.shape[-1], t.shape[-2], t.dtype

    freqs = freqs[:, -seq_len:, :]
    scale = scale[:, -seq_len:, :] if torch.is_tensor(scale) else scale

    if t.ndim == 4 and freqs.ndim == 3:
        freqs = freqs[:, None]  # rearrange(freqs, 'b n d -> b 1 n d')

        if torch.is_tensor(scale):
            scale = scale[:, None]  # rearrange(scale, 'b n d -> b 1 n d')

    # partial rotary embeddings, Wang et al. GPT-J
    t, t_unrotated = t[..., :rot_dim], t[..., rot_dim:]
    t = (t * freqs.cos() * scale) + (x_rotate_half(t) * freqs.sin() * scale)
    out = torch.cat((t, t_unrotated), dim=-1)

    return out.type(orig_dtype)


def x_create_causal_mask(i, j, device):
    return torch.ones((i, j), device=device, dtype=torch.bool).triu(j - i + 1)


class XAttend(nn.Module):
    """x-transformers attend.py ``Attend`` on its non-flash path: einsum scores,
    ``masked_fill(create_causal_mask(i, j), -finfo.max)``, softmax in float32 then
    ``.type(dtype)``, einsum output."""

    def __init__(self, causal=False, scale=None):
        super().__init__()
        self.scale = scale
        self.causal = causal
        self.create_causal_mask = x_create_causal_mask
        self.attn_fn = lambda t: F.softmax(t, dim=-1, dtype=torch.float32)

    def forward(self, q, k, v, mask=None):
        n, heads, kv_heads, device = q.shape[-2], q.shape[1], k.shape[1], q.device
        scale = self.scale if self.scale is not None else q.shape[-1] ** -0.5
        causal = self.causal
        if n == 1 and causal:
            causal = False
        kv_einsum_eq = 'b j d' if k.ndim == 3 else 'b h j d'
        sim = torch.einsum(f'b h i d, {kv_einsum_eq} -> b h i j', q, k)
        sim = sim * scale

        i, j, dtype = *sim.shape[-2:], sim.dtype
        mask_value = -torch.finfo(sim.dtype).max
        if causal:
            causal_mask = self.create_causal_mask(i, j, device=device)
            sim = sim.masked_fill(causal_mask, mask_value)

        attn = self.attn_fn(sim)
        attn = attn.type(dtype)
        out = torch.einsum(f'b h i j, {kv_einsum_eq} -> b h i d', attn, v)
        return out


class XLayerNorm(nn.Module):
    def __init__(self, dim, unit_offset=False):
        """
        bias-less layernorm has been shown to be more stable. most newer models have moved towards rmsnorm,
        also bias-less
        """
        super().__init__()
        self.unit_offset = unit_offset

        self.ln = nn.LayerNorm(dim, elementwise_affine=False)
        self.gamma = nn.Parameter(torch.ones(dim))
        nn.init.constant_(self.gamma, 1. - float(unit_offset))

    def forward(self, x):
        normed = self.ln(x)
        gamma = self.gamma + float(self.unit_offset)
        return normed * gamma


class XAttention(nn.Module):
    def __init__(self, dim, dim_head=HD, heads=HEADS, causal=True):
        super().__init__()
        self.heads = heads
        q_dim = k_dim = v_dim = out_dim = dim_head * heads
        self.to_q = nn.Linear(dim, q_dim, bias=False)
        self.to_k = nn.Linear(dim, k_dim, bias=False)
        self.to_v = nn.Linear(dim, v_dim, bias=False)
        self.attend = XAttend(causal=causal)
        self.to_out = nn.Linear(out_dim, dim, bias=False)

    def forward(self, x, rotary_pos_emb=None):
        b, n, _ = x.shape
        h = self.heads
        q, k, v = self.to_q(x), self.to_k(x), self.to_v(x)
        # rearrange 'b n (h d) -> b h n d'
        q, k, v = (t.view(b, n, h, -1).transpose(1, 2) for t in (q, k, v))
        if _exists(rotary_pos_emb):
            freqs, xpos_scale = rotary_pos_emb
            q_xpos_scale, k_xpos_scale = (xpos_scale, xpos_scale ** -1.) if _exists(xpos_scale) else (1., 1.)
            q = x_apply_rotary_pos_emb(q, freqs, q_xpos_scale)
            k = x_apply_rotary_pos_emb(k, freqs, k_xpos_scale)
        out = self.attend(q, k, v)
        out = out.transpose(1, 2).reshape(b, n, -1)  # rearrange 'b h n d -> b n (h d)'
        return self.to_out(out)


class XFeedForward(nn.Module):
    def __init__(self, dim, mult=4):
        super().__init__()
        inner_dim = int(dim * mult)
        self.ff = nn.Sequential(nn.Sequential(nn.Linear(dim, inner_dim), nn.GELU()), nn.Identity(),
                                nn.Linear(inner_dim, dim))

    def forward(self, x):
        return self.ff(x)


class XTransformerDecoder(nn.Module):
    """lucidrains/x-transformers ``TransformerWrapper(attn_layers=Decoder(rotary_xpos=True))``:
    pre-norm layers with their bias-less ``LayerNorm``, rotary of ``dim_head // 2`` dims
    with xPos scaling (``power = (t - max_pos // 2) / scale_base``, q scaled by ``scale``
    and k by ``scale ** -1``), positions ``arange(x.shape[1] + mem_len) - mem_len``, causal
    einsum attention (``Attend``), GELU feed-forward, final norm, no absolute positions.
    ``dim_head`` is 8 here (their default 64); no memory tokens, no cache."""

    def __init__(self, num_tokens=VOCAB, dim=DIM, depth=LAYERS, heads=HEADS, dim_head=HD, rotary_xpos=True,
                 rotary_xpos_scale_base=512):
        super().__init__()
        self.token_emb = nn.Embedding(num_tokens, dim)
        rotary_emb_dim = dim_head // 2
        self.rotary_pos_emb = XRotaryEmbedding(rotary_emb_dim, use_xpos=rotary_xpos, scale_base=rotary_xpos_scale_base)
        self.layers = nn.ModuleList()
        for _ in range(depth):
            self.layers.append(nn.ModuleList([XLayerNorm(dim), XAttention(dim, dim_head, heads, causal=True)]))
            self.layers.append(nn.ModuleList([XLayerNorm(dim), XFeedForward(dim)]))
        self.final_norm = XLayerNorm(dim)
        self.to_logits = nn.Linear(dim, num_tokens, bias=False)

    def forward(self, x):
        x = self.token_emb(x.long())
        mem_len = 0
        seq_pos_offset = 0
        pos = torch.arange(x.shape[1] + mem_len + seq_pos_offset, device=x.device) - mem_len
        rotary_pos_emb = self.rotary_pos_emb(pos)
        for norm, block in self.layers:
            residual = x
            x = norm(x)
            if isinstance(block, XAttention):
                out = block(x, rotary_pos_emb=rotary_pos_emb)
            else:
                out = block(x)
            x = out + residual
        x = self.final_norm(x)
        return self.to_logits(x)


# =============================================================================== OLMo


@dataclass
class OlmoConfig:
    d_model: int = DIM
    n_heads: int = HEADS
    n_layers: int = LAYERS
    mlp_ratio: int = 4
    vocab_size: int = VOCAB
    embedding_size: int = VOCAB
    max_sequence_length: int = CTX
    rope_theta: float = 10000.0
    rope_full_precision: bool = True
    include_bias: bool = False
    layer_norm_eps: float = 1e-5
    weight_tying: bool = True
    scale_logits: bool = False

    @property
    def effective_n_kv_heads(self) -> int:
        return self.n_heads


class BufferCache(dict):
    """
    Cache for attention biases and other things that would normally be stored as buffers.
    We avoid using buffers because we've run into various issues doing so with FSDP.
    """


def olmo_ensure_finite_(x: torch.Tensor, check_neg_inf: bool = True, check_pos_inf: bool = False):
    if check_neg_inf:
        x.masked_fill_(x == float("-inf"), torch.finfo(x.dtype).min)
    if check_pos_inf:
        x.masked_fill_(x == float("inf"), torch.finfo(x.dtype).max)


def olmo_causal_attention_bias(seq_len: int, device: torch.device) -> torch.FloatTensor:
    att_bias = torch.triu(
        torch.ones(seq_len, seq_len, device=device, dtype=torch.float),
        diagonal=1,
    )
    att_bias.masked_fill_(att_bias == 1, torch.finfo(att_bias.dtype).min)
    return att_bias.view(1, 1, seq_len, seq_len)  # type: ignore


def olmo_get_causal_attention_bias(cache: BufferCache, seq_len: int, device: torch.device) -> torch.Tensor:
    if (causal_bias := cache.get("causal_attention_bias")) is not None and causal_bias.shape[-1] >= seq_len:
        if causal_bias.device != device:
            causal_bias = causal_bias.to(device)
            cache["causal_attention_bias"] = causal_bias
        return causal_bias
    with torch.autocast(device.type, enabled=False):
        causal_bias = olmo_causal_attention_bias(seq_len, device)
    cache["causal_attention_bias"] = causal_bias
    return causal_bias


class OlmoLayerNorm(nn.Module):
    """OLMo ``LayerNorm`` (default, not low precision), weight without bias (``include_bias=False``)."""

    def __init__(self, config: OlmoConfig, size=None):
        super().__init__()
        self.eps = config.layer_norm_eps
        self.normalized_shape = (size or config.d_model,)
        self.weight = nn.Parameter(torch.ones(self.normalized_shape))
        self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.normalized_shape, weight=self.weight, bias=self.bias, eps=self.eps)


class OlmoRotaryEmbedding(nn.Module):
    """
    [Rotary positional embeddings (RoPE)](https://arxiv.org/abs/2104.09864).
    """

    def __init__(self, config: OlmoConfig, cache: BufferCache):
        super().__init__()
        self.config = config
        self.__cache = cache
        # Warm up cache.
        self.get_rotary_embedding(config.max_sequence_length, torch.device("cpu"))

    def get_rotary_embedding(self, seq_len: int, device: torch.device):
        if (
            (pos_sin := self.__cache.get("rope_pos_sin")) is not None
            and (pos_cos := self.__cache.get("rope_pos_cos")) is not None
            and pos_sin.shape[-2] >= seq_len
            and pos_cos.shape[-2] >= seq_len
        ):
            if pos_sin.device != device:
                pos_sin = pos_sin.to(device)
                self.__cache["rope_pos_sin"] = pos_sin
            if pos_cos.device != device:
                pos_cos = pos_cos.to(device)
                self.__cache["rope_pos_cos"] = pos_cos
            return pos_sin[:, :, :seq_len, :], pos_cos[:, :, :seq_len, :]

        with torch.autocast(device.type, enabled=False):
            dim = self.config.d_model // self.config.n_heads
            inv_freq = 1.0 / (
                self.config.rope_theta ** (torch.arange(0, dim, 2, device=device, dtype=torch.float) / dim)
            )
            seq = torch.arange(seq_len, device=device, dtype=torch.float)
            freqs = torch.einsum("i , j -> i j", seq, inv_freq)
            positions = torch.cat((freqs, freqs), dim=-1)
            pos_sin, pos_cos = positions.sin()[None, None, :, :], positions.cos()[None, None, :, :]
        self.__cache["rope_pos_sin"] = pos_sin
        self.__cache["rope_pos_cos"] = pos_cos
        return pos_sin, pos_cos

    def rotate_half(self, x: torch.Tensor) -> torch.Tensor:
        B, nh, T, hs = x.size()
        x = x.view(B, nh, T, 2, hs // 2)
        x1, x2 = x.unbind(dim=-2)
        return torch.cat((-x2, x1), dim=-1)

    def apply_rotary_pos_emb(self, pos_sin, pos_cos, t):
        return ((t * pos_cos) + (self.rotate_half(t) * pos_sin)).to(t.dtype)

    def forward(self, q, k):
        if self.config.rope_full_precision:
            q_, k_ = q.float(), k.float()
        else:
            q_, k_ = q, k

        with torch.autocast(q.device.type, enabled=False):
            query_len, key_len = q_.shape[-2], k_.shape[-2]  # could be different if layer_past not None
            pos_sin, pos_cos = self.get_rotary_embedding(key_len, q_.device)
            pos_sin = pos_sin.type_as(q_)
            pos_cos = pos_cos.type_as(q_)
            q_ = self.apply_rotary_pos_emb(
                pos_sin[:, :, key_len - query_len : key_len, :],
                pos_cos[:, :, key_len - query_len : key_len, :],
                q_,
            )
            k_ = self.apply_rotary_pos_emb(pos_sin, pos_cos, k_)
        return q_.type_as(q), k_.type_as(k)


class OlmoSwiGLU(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x, gate = x.chunk(2, dim=-1)
        return F.silu(gate) * x

    @property
    def output_multiplier(self) -> float:
        return 0.5


class OlmoSequentialBlock(nn.Module):
    """OLMo ``OLMoBlock`` + ``OLMoSequentialBlock`` (no flash-attn, no activation checkpointing)."""

    def __init__(self, layer_id: int, config: OlmoConfig, cache: BufferCache):
        super().__init__()
        self.layer_id = layer_id
        self.config = config
        self.hidden_size = config.mlp_ratio * config.d_model
        self.__cache = cache
        self.dropout = nn.Dropout(0.0)
        self.act = OlmoSwiGLU()
        self.attn_out = nn.Linear(config.d_model, config.d_model, bias=config.include_bias)
        self.ff_out = nn.Linear(int(self.act.output_multiplier * self.hidden_size), config.d_model,
                                bias=config.include_bias)
        self.rotary_emb = OlmoRotaryEmbedding(config, self.__cache)
        head_dim = config.d_model // config.n_heads
        self.fused_dims = (
            config.d_model,
            config.effective_n_kv_heads * head_dim,
            config.effective_n_kv_heads * head_dim,
        )
        self.att_proj = nn.Linear(config.d_model, sum(self.fused_dims), bias=config.include_bias)
        self.ff_proj = nn.Linear(config.d_model, self.hidden_size, bias=config.include_bias)
        self.attn_norm = OlmoLayerNorm(config, size=config.d_model)
        self.ff_norm = OlmoLayerNorm(config, size=config.d_model)

    @classmethod
    def _cast_attn_bias(cls, bias: torch.Tensor, input_dtype: torch.dtype) -> torch.Tensor:
        target_dtype = input_dtype
        if bias.device.type == "cuda" and torch.is_autocast_enabled():
            target_dtype = torch.get_autocast_gpu_dtype()
        elif bias.device.type == "cpu" and torch.is_autocast_cpu_enabled():
            target_dtype = torch.get_autocast_cpu_dtype()
        if bias.dtype != target_dtype:
            bias = bias.to(target_dtype)
            olmo_ensure_finite_(bias, check_neg_inf=True, check_pos_inf=False)
        return bias

    def _scaled_dot_product_attention(self, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False):
        # torch's sdpa doesn't support GQA, so we're doing this
        assert k.size(1) == v.size(1)
        num_kv_heads = k.size(1)
        num_q_heads = q.size(1)
        if num_q_heads != num_kv_heads:
            assert num_q_heads % num_kv_heads == 0
            k = k.repeat_interleave(num_q_heads // num_kv_heads, dim=1, output_size=num_q_heads)
            v = v.repeat_interleave(num_q_heads // num_kv_heads, dim=1, output_size=num_q_heads)

        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal)

    def attention(self, q, k, v, attention_bias=None):
        B, T, C = q.size()  # batch size, sequence length, d_model
        dtype = k.dtype

        # Move head forward to be next to the batch dim.
        q = q.view(B, T, self.config.n_heads, C // self.config.n_heads).transpose(1, 2)
        k = k.view(B, T, self.config.effective_n_kv_heads, C // self.config.n_heads).transpose(1, 2)
        v = v.view(B, T, self.config.effective_n_kv_heads, C // self.config.n_heads).transpose(1, 2)

        query_len, key_len = q.shape[-2], k.shape[-2]  # could be different if layer_past not None

        # Apply rotary embeddings.
        q, k = self.rotary_emb(q, k)

        if attention_bias is not None:
            # Resize and cast attention bias.
            attention_bias = self._cast_attn_bias(
                attention_bias[:, :, key_len - query_len : key_len, :key_len], dtype
            )

        att = self._scaled_dot_product_attention(
            q, k, v,
            attn_mask=attention_bias,
            dropout_p=0.0,
            is_causal=attention_bias is None,
        )

        # Re-assemble all head outputs side-by-side.
        att = att.transpose(1, 2).contiguous().view(B, T, C)

        # Apply output projection.
        return self.attn_out(att), None

    def forward(self, x, attention_bias=None):
        h = self.attn_norm(x)
        qkv = self.att_proj(h)
        q, k, v = qkv.split(self.fused_dims, dim=-1)
        att, cache = self.attention(q, k, v, attention_bias)
        x = x + self.dropout(att)
        og_x = x
        x = self.ff_norm(x)
        x = self.ff_proj(x)
        x = self.act(x)
        x = self.ff_out(x)
        x = self.dropout(x)
        x = og_x + x
        return x, cache


class OLMoOutput(NamedTuple):
    logits: torch.FloatTensor
    attn_key_values: list | None
    hidden_states: tuple | None


class OLMo(nn.Module):
    """allenai/OLMo olmo/model.py ``OLMo`` (sequential blocks, RoPE, SwiGLU, weight tying):
    the causal bias ``triu(ones(seq_len, seq_len), diagonal=1)`` filled in place with
    ``finfo(float32).min`` and cached in a ``BufferCache`` dict (not a buffer, so it stays
    float32 in a float64 model), sliced and cast by ``_cast_attn_bias`` (with
    ``ensure_finite_`` in place) and passed to SDPA as an additive ``attn_mask``; RoPE
    tables cached in the same dict, applied in float32 (``rope_full_precision``). As in
    OLMo, the bias path runs only when an ``attention_mask`` (or bias, or ALiBi) is given;
    otherwise SDPA ``is_causal=True``. Left out: KV cache, ALiBi, document masking, block
    groups, activation checkpointing, flash-attn."""

    def __init__(self, config: OlmoConfig | None = None):
        super().__init__()
        self.config = config = config or OlmoConfig()
        self.__cache = BufferCache()
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.embedding_size, config.d_model),
                emb_drop=nn.Dropout(0.0),
                ln_f=OlmoLayerNorm(config),
            )
        )
        blocks = [OlmoSequentialBlock(i, config, self.__cache) for i in range(config.n_layers)]
        self.transformer.update({"blocks": nn.ModuleList(blocks)})
        # Warm up cache.
        olmo_get_causal_attention_bias(self.__cache, config.max_sequence_length, torch.device("cpu"))

    def forward(self, input_ids, attention_mask=None, attention_bias=None):
        batch_size, seq_len = input_ids.size()
        past_length = 0
        x = self.transformer.wte(input_ids)  # type: ignore
        x = self.transformer.emb_drop(x)  # type: ignore

        # Transform the attention mask into what the blocks expect.
        if attention_mask is not None:
            # shape: (batch_size, 1, 1, seq_len)
            attention_mask = attention_mask.to(dtype=torch.float).view(batch_size, -1)[:, None, None, :]
            attention_mask = (1.0 - attention_mask) * torch.finfo(attention_mask.dtype).min

        # Merge attention mask with attention bias.
        if attention_bias is not None or attention_mask is not None:
            if attention_bias is None:
                attention_bias = olmo_get_causal_attention_bias(self.__cache, past_length + seq_len, x.device)
            elif attention_bias.dtype in (torch.int8, torch.bool):
                attention_bias = attention_bias.to(dtype=torch.float)
                attention_bias.masked_fill_(attention_bias == 0.0, torch.finfo(attention_bias.dtype).min)

            # Transform to the right shape and data type.
            mask_len = seq_len
            if attention_mask is not None:
                mask_len = attention_mask.shape[-1]
            attention_bias = attention_bias[:, :, :mask_len, :mask_len].to(dtype=torch.float)

            # Add in the masking bias.
            if attention_mask is not None:
                attention_bias = attention_bias + attention_mask
                # Might get -infs after adding attention mask, since dtype.min + dtype.min = -inf.
                olmo_ensure_finite_(attention_bias, check_neg_inf=True, check_pos_inf=False)

        for block in self.transformer.blocks:
            x, cache = block(x, attention_bias=attention_bias)

        x = self.transformer.ln_f(x)  # type: ignore
        if self.config.weight_tying:
            logits = F.linear(x, self.transformer.wte.weight, None)  # type: ignore
        else:
            logits = self.transformer.ff_out(x)  # type: ignore
        if self.config.scale_logits:
            logits.mul_(1 / math.sqrt(self.config.d_model))
        return OLMoOutput(logits=logits, attn_key_values=None, hidden_states=None)


class OlmoTrainerCall(nn.Module):
    """OLMo as its trainer calls it: ``model(input_ids, attention_mask=batch["attention_mask"])``
    with an all-ones mask (no padding), which takes the additive ``attention_bias`` path."""

    def __init__(self):
        super().__init__()
        self.model = OLMo()

    def forward(self, idx):
        return self.model(idx, attention_mask=torch.ones_like(idx)).logits
