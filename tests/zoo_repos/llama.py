"""torchtitan's Llama 3, Mistral's MoE reference and the Llama-1 reference code."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from zoo_repos.common import CTX, DIM, HD, HEADS, LAYERS, VOCAB

# =============================================================================== torchtitan


@dataclass
class TitanArgs:
    dim: int = DIM
    n_layers: int = LAYERS
    n_heads: int = HEADS
    n_kv_heads: int | None = 2
    vocab_size: int = VOCAB
    multiple_of: int = 16
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 500000
    max_seq_len: int = CTX
    depth_init: bool = True


def titan_precompute_freqs_cis(dim: int, end: int, theta: float = 10000.0) -> torch.Tensor:
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    t = torch.arange(end, device=freqs.device)
    freqs = torch.outer(t, freqs).float()
    freqs_cis = torch.polar(torch.ones_like(freqs), freqs)  # complex64
    return freqs_cis


def titan_reshape_for_broadcast(freqs_cis: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    ndim = x.ndim
    assert ndim > 1
    seqlen = x.shape[1]
    freqs_cis = freqs_cis[0:seqlen]
    assert freqs_cis.shape == (seqlen, x.shape[-1])
    shape = [d if i == 1 or i == ndim - 1 else 1 for i, d in enumerate(x.shape)]
    return freqs_cis.view(*shape)


def titan_apply_rotary_emb(xq, xk, freqs_cis):
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = titan_reshape_for_broadcast(freqs_cis, xq_)
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


def titan_repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """torch.repeat_interleave(x, dim=2, repeats=n_rep)"""
    bs, slen, n_kv_heads, head_dim = x.shape
    if n_rep == 1:
        return x
    return (
        torch.unsqueeze(x, dim=3)
        .expand(bs, slen, n_kv_heads, n_rep, head_dim)
        .reshape(bs, slen, n_kv_heads * n_rep, head_dim)
    )


class TitanScaledDotProductAttention(torch.nn.Module):
    """torchtitan/models/attention.py ``ScaledDotProductAttention`` (causal only), with its
    ``sdpa_kernel(backends, set_priority=True)`` context."""

    def __init__(self) -> None:
        super().__init__()
        from torch.nn.attention import SDPBackend

        self.backends = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]

    def forward(self, q, k, v, scale=None):
        from torch.nn.attention import sdpa_kernel

        assert self.backends, "SDPA Backends should not be empty."
        with sdpa_kernel(self.backends, set_priority=True):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)


class TitanAttention(nn.Module):

    def __init__(self, model_args: TitanArgs):
        super().__init__()
        self.n_heads = model_args.n_heads
        self.n_kv_heads = model_args.n_heads if model_args.n_kv_heads is None else model_args.n_kv_heads
        self.n_rep = self.n_heads // self.n_kv_heads
        self.head_dim = model_args.dim // model_args.n_heads

        self.wq = nn.Linear(model_args.dim, model_args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(model_args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(model_args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(model_args.n_heads * self.head_dim, model_args.dim, bias=False)
        self.sdpa = TitanScaledDotProductAttention()

    def forward(self, x, freqs_cis):
        bs, seqlen, _ = x.shape
        xq, xk, xv = self.wq(x), self.wk(x), self.wv(x)

        xq = xq.view(bs, seqlen, -1, self.head_dim)
        xk = xk.view(bs, seqlen, -1, self.head_dim)
        xv = xv.view(bs, seqlen, -1, self.head_dim)

        xq, xk = titan_apply_rotary_emb(xq, xk, freqs_cis=freqs_cis)

        keys = titan_repeat_kv(xk, self.n_rep)  # (bs, seqlen, n_local_heads, head_dim)
        values = titan_repeat_kv(xv, self.n_rep)  # (bs, seqlen, n_local_heads, head_dim)

        xq = xq.transpose(1, 2)  # (bs, n_local_heads, seqlen, head_dim)
        xk = keys.transpose(1, 2)  # (bs, n_local_heads, seqlen, head_dim)
        xv = values.transpose(1, 2)  # (bs, n_local_heads, seqlen, head_dim)

        output = self.sdpa(xq, xk, xv)

        output = output.transpose(1, 2).contiguous()  # (bs, seqlen, n_local_heads, head_dim)
        output = output.view(bs, seqlen, -1)
        return self.wo(output)


class TitanFeedForward(nn.Module):

    def __init__(self, dim, hidden_dim, multiple_of, ffn_dim_multiplier):
        super().__init__()
        hidden_dim = int(2 * hidden_dim / 3)
        if ffn_dim_multiplier is not None:
            hidden_dim = int(ffn_dim_multiplier * hidden_dim)
        hidden_dim = multiple_of * ((hidden_dim + multiple_of - 1) // multiple_of)

        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TitanTransformerBlock(nn.Module):

    def __init__(self, layer_id: int, model_args: TitanArgs):
        super().__init__()
        self.n_heads = model_args.n_heads
        self.dim = model_args.dim
        self.attention = TitanAttention(model_args)
        self.feed_forward = TitanFeedForward(
            dim=model_args.dim,
            hidden_dim=4 * model_args.dim,
            multiple_of=model_args.multiple_of,
            ffn_dim_multiplier=model_args.ffn_dim_multiplier,
        )
        self.attention_norm = nn.RMSNorm(model_args.dim, eps=model_args.norm_eps)
        self.ffn_norm = nn.RMSNorm(model_args.dim, eps=model_args.norm_eps)

    def forward(self, x, freqs_cis):
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        out = h + self.feed_forward(self.ffn_norm(h))
        return out


class TitanLlama3(nn.Module):
    """pytorch/torchtitan torchtitan/models/llama3/model/model.py at commit 177b295d2
    (2025-07-22; the file has since been folded into generic decoder classes):
    ``precompute_freqs_cis`` (complex64, a persistent buffer of ``max_seq_len`` rows),
    ``apply_rotary_emb`` with ``view_as_complex`` and ``reshape_for_broadcast`` slicing
    ``freqs_cis[0:seqlen]``, ``repeat_kv`` by expand/reshape, SDPA ``is_causal=True`` under
    ``sdpa_kernel``, ``nn.RMSNorm``, layers in a ``ModuleDict``. Left out: flex attention,
    pipeline stages, ``init_weights``."""

    def __init__(self, model_args: TitanArgs | None = None):
        super().__init__()
        model_args = model_args or TitanArgs()
        self.model_args = model_args
        self.vocab_size = model_args.vocab_size
        self.n_layers = model_args.n_layers

        self.tok_embeddings = nn.Embedding(model_args.vocab_size, model_args.dim)
        self.register_buffer("freqs_cis", self._precompute_freqs_cis(), persistent=True)

        self.layers = torch.nn.ModuleDict()
        for layer_id in range(model_args.n_layers):
            self.layers[str(layer_id)] = TitanTransformerBlock(layer_id, model_args)
        self.norm = nn.RMSNorm(model_args.dim, eps=model_args.norm_eps)
        self.output = nn.Linear(model_args.dim, model_args.vocab_size, bias=False)

    def _precompute_freqs_cis(self) -> torch.Tensor:
        return titan_precompute_freqs_cis(
            self.model_args.dim // self.model_args.n_heads,
            self.model_args.max_seq_len,
            self.model_args.rope_theta,
        )

    def forward(self, tokens):
        # passthrough for nonexistent layers, allows easy configuration of pipeline parallel stages
        h = self.tok_embeddings(tokens) if self.tok_embeddings else tokens

        for layer in self.layers.values():
            h = layer(h, self.freqs_cis)

        h = self.norm(h) if self.norm else h
        output = self.output(h) if self.output else h
        return output


# =============================================================================== Mistral MoE


@dataclass
class MistralArgs:
    dim: int = DIM
    n_layers: int = LAYERS
    head_dim: int = HD
    hidden_dim: int = 64
    n_heads: int = HEADS
    n_kv_heads: int = 2
    norm_eps: float = 1e-5
    vocab_size: int = VOCAB
    num_experts: int = 4
    num_experts_per_tok: int = 2
    rope_theta: float = 1000000.0


def mistral_repeat_kv(keys: torch.Tensor, values: torch.Tensor, repeats: int):
    keys = torch.repeat_interleave(keys, repeats=repeats, dim=2)
    values = torch.repeat_interleave(values, repeats=repeats, dim=2)
    return keys, values


def mistral_reshape_for_broadcast(freqs_cis: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """
    freqs_cis: complex - (seq_len, head_dim / 2)
    x: complex - (bsz, seq_len, head_dim / 2)
    """
    ndim = x.ndim
    assert 1 < ndim
    assert freqs_cis.shape == (x.shape[1], x.shape[-1]), (freqs_cis.shape, (x.shape[1], x.shape[-1]))
    shape = [d if i == 1 or i == ndim - 1 else 1 for i, d in enumerate(x.shape)]
    return freqs_cis.view(*shape)


def mistral_apply_rotary_emb(xq, xk, freqs_cis):
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = mistral_reshape_for_broadcast(freqs_cis, xq_)
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


class MistralAttention(nn.Module):
    """mistral-src moe_one_file_ref.py ``Attention`` on its prefill path, without the KV
    cache writes (``cache_k[:bsz].scatter_(...)``): scores by ``matmul``, ``scores +=
    mask[None, None, ...]``, ``softmax(scores.float()).type_as(query)``."""

    def __init__(self, args: MistralArgs):
        super().__init__()
        self.args = args
        self.n_heads: int = args.n_heads
        self.n_kv_heads: int = args.n_kv_heads
        self.repeats = self.n_heads // self.n_kv_heads
        self.scale = self.args.head_dim ** -0.5
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)

    def forward(self, x, freqs_cis, positions, mask):
        bsz, seqlen, _ = x.shape
        xq, xk, xv = self.wq(x), self.wk(x), self.wv(x)
        xq = xq.view(bsz, seqlen, self.n_heads, self.args.head_dim)
        xk = xk.view(bsz, seqlen, self.n_kv_heads, self.args.head_dim)
        xv = xv.view(bsz, seqlen, self.n_kv_heads, self.args.head_dim)
        xq, xk = mistral_apply_rotary_emb(xq, xk, freqs_cis=freqs_cis)

        # prefill
        key, value = mistral_repeat_kv(xk, xv, self.repeats)

        query = xq.transpose(1, 2)
        key = key.transpose(1, 2)
        value = value.transpose(1, 2)
        # scores : [bsz, n_heads, seqlen | 1, seqlen]
        scores = torch.matmul(query, key.transpose(2, 3)) * self.scale

        if mask is not None:
            scores += mask[None, None, ...]

        scores = scores.float()
        scores = nn.functional.softmax(scores, dim=-1).type_as(query)
        output = torch.matmul(scores, value)  # (bs, n_local_heads, slen, head_dim)
        output = output.transpose(1, 2).contiguous().view(bsz, seqlen, -1)
        return self.wo(output)


class MistralSdpaAttention(MistralAttention):
    """The same projections and complex RoPE, attending with SDPA ``is_causal=True`` (as
    transformers' ``MixtralSdpaAttention`` did) instead of the manual scores + mask."""

    def forward(self, x, freqs_cis, positions, mask):
        bsz, seqlen, _ = x.shape
        xq, xk, xv = self.wq(x), self.wk(x), self.wv(x)
        xq = xq.view(bsz, seqlen, self.n_heads, self.args.head_dim)
        xk = xk.view(bsz, seqlen, self.n_kv_heads, self.args.head_dim)
        xv = xv.view(bsz, seqlen, self.n_kv_heads, self.args.head_dim)
        xq, xk = mistral_apply_rotary_emb(xq, xk, freqs_cis=freqs_cis)
        key, value = mistral_repeat_kv(xk, xv, self.repeats)
        output = F.scaled_dot_product_attention(xq.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                                                is_causal=True)
        output = output.transpose(1, 2).contiguous().view(bsz, seqlen, -1)
        return self.wo(output)


class MistralFeedForward(nn.Module):
    def __init__(self, args: MistralArgs):
        super().__init__()
        self.w1 = nn.Linear(args.dim, args.hidden_dim, bias=False)
        self.w2 = nn.Linear(args.hidden_dim, args.dim, bias=False)
        self.w3 = nn.Linear(args.dim, args.hidden_dim, bias=False)

    def forward(self, x) -> torch.Tensor:
        return self.w2(nn.functional.silu(self.w1(x)) * self.w3(x))


class MistralRMSNorm(torch.nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        output = self._norm(x.float()).type_as(x)
        return output * self.weight


class MistralMoeLayer(nn.Module):
    """mistral-src moe_one_file_ref.py ``MoeLayer``: ``topk`` on the gate logits, softmax
    over the chosen weights, per expert ``batch_idx, nth_expert = torch.where(selected_experts
    == i)`` and ``results[batch_idx] += weights[batch_idx, nth_expert, None] *
    expert(inputs_squashed[batch_idx])``. With ``index_add=True``, the dispatch of
    transformers' Mixtral before its experts were fused (``expert_mask = one_hot(...).permute(2,
    1, 0)``, ``idx, top_x = torch.where(expert_mask[expert_idx])``,
    ``final_hidden_states.index_add_(0, top_x, ...)``) instead."""

    def __init__(self, experts, gate, args: MistralArgs, index_add: bool = False):
        super().__init__()
        assert len(experts) > 0
        self.experts = nn.ModuleList(experts)
        self.gate = gate
        self.args = args
        self.index_add = index_add

    def forward(self, inputs: torch.Tensor):
        if self.index_add:
            return self._hf_legacy(inputs)
        inputs_squashed = inputs.view(-1, inputs.shape[-1])
        gate_logits = self.gate(inputs_squashed)
        weights, selected_experts = torch.topk(gate_logits, self.args.num_experts_per_tok)
        weights = nn.functional.softmax(weights, dim=1, dtype=torch.float).type_as(inputs)
        results = torch.zeros_like(inputs_squashed)
        for i, expert in enumerate(self.experts):
            batch_idx, nth_expert = torch.where(selected_experts == i)
            results[batch_idx] += weights[batch_idx, nth_expert, None] * expert(inputs_squashed[batch_idx])
        return results.view_as(inputs)

    def _hf_legacy(self, hidden_states):
        batch_size, sequence_length, hidden_dim = hidden_states.shape
        hidden_states = hidden_states.view(-1, hidden_dim)
        router_logits = self.gate(hidden_states)
        routing_weights = F.softmax(router_logits, dim=1, dtype=torch.float)
        routing_weights, selected_experts = torch.topk(routing_weights, self.args.num_experts_per_tok, dim=-1)
        routing_weights /= routing_weights.sum(dim=-1, keepdim=True)
        routing_weights = routing_weights.to(hidden_states.dtype)
        final_hidden_states = torch.zeros(
            (batch_size * sequence_length, hidden_dim), dtype=hidden_states.dtype, device=hidden_states.device
        )
        expert_mask = torch.nn.functional.one_hot(selected_experts, num_classes=self.args.num_experts).permute(2, 1, 0)
        for expert_idx in range(self.args.num_experts):
            expert_layer = self.experts[expert_idx]
            idx, top_x = torch.where(expert_mask[expert_idx])
            current_state = hidden_states[None, top_x].reshape(-1, hidden_dim)
            current_hidden_states = expert_layer(current_state) * routing_weights[top_x, idx, None]
            final_hidden_states.index_add_(0, top_x, current_hidden_states.to(hidden_states.dtype))
        return final_hidden_states.reshape(batch_size, sequence_length, hidden_dim)


class MistralTransformerBlock(nn.Module):
    def __init__(self, args: MistralArgs, index_add: bool):
        super().__init__()
        self.n_heads = args.n_heads
        self.dim = args.dim
        # transformers' Mixtral (with the index_add_ dispatch) attends with SDPA
        self.attention = MistralSdpaAttention(args) if index_add else MistralAttention(args)
        self.feed_forward = MistralMoeLayer(
            experts=[MistralFeedForward(args=args) for _ in range(args.num_experts)],
            gate=nn.Linear(args.dim, args.num_experts, bias=False),
            args=args,
            index_add=index_add,
        )
        self.attention_norm = MistralRMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = MistralRMSNorm(args.dim, eps=args.norm_eps)
        self.args = args

    def forward(self, x, freqs_cis, positions, mask):
        r = self.attention.forward(self.attention_norm(x), freqs_cis, positions, mask)
        h = x + r
        r = self.feed_forward.forward(self.ffn_norm(h))
        out = h + r
        return out


def mistral_precompute_freqs_cis(dim: int, end: int, theta: float) -> torch.Tensor:
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    t = torch.arange(end, device=freqs.device)  # type: ignore
    freqs = torch.outer(t, freqs).float()  # type: ignore
    return torch.polar(torch.ones_like(freqs), freqs)  # complex64


class MistralMoE(nn.Module):
    """mistralai/mistral-src moe_one_file_ref.py ``Transformer`` (single pipeline rank): the
    ``freqs_cis`` property caching a complex64 table on the module (not a buffer: "the dtype
    is different from the module's dtype"), indexed ``self.freqs_cis[positions]``; the mask
    ``torch.log(torch.tril(torch.full((seqlen, seqlen), fill_value=1)))`` (log 0 = -inf);
    ``outs.float()``. Changed: the table has ``2 * CTX`` rows (theirs 128 000), the forward
    takes ``idx`` and builds ``positions = torch.arange(0, seqlen)`` as their ``generate``
    does, and the KV cache is left out. ``index_add=True``: the MoE layers use the
    pre-fusion transformers Mixtral dispatch and the attention is SDPA ``is_causal`` (as that
    Mixtral's was), so that the case isolates the dispatch."""

    def __init__(self, args: MistralArgs | None = None, index_add: bool = False):
        super().__init__()
        self.args = args = args or MistralArgs()
        self.vocab_size = args.vocab_size
        self._precomputed_freqs_cis = None
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.norm = MistralRMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        layers = [MistralTransformerBlock(args=args, index_add=index_add) for _ in range(args.n_layers)]
        self.layers = nn.ModuleDict({str(i): layers[i] for i in range(args.n_layers)})

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    @property
    def freqs_cis(self) -> torch.Tensor:
        # We cache freqs_cis but need to take care that it is on the right device
        # and has the right dtype (complex64). The fact that the dtype is different
        # from the module's  dtype means we cannot register it as a buffer
        if self._precomputed_freqs_cis is None:
            theta = self.args.rope_theta or 1000000.0
            self._precomputed_freqs_cis = mistral_precompute_freqs_cis(self.args.head_dim, 2 * CTX, theta)
        if self._precomputed_freqs_cis.device != self.device:
            self._precomputed_freqs_cis = self._precomputed_freqs_cis.to(device=self.device)
        return self._precomputed_freqs_cis

    def forward(self, input_ids):
        (bsz, seqlen) = input_ids.shape
        positions = torch.arange(0, seqlen).to(input_ids.device)
        freqs_cis = self.freqs_cis[positions]

        h = self.tok_embeddings(input_ids)
        assert h.shape == (bsz, seqlen, self.args.dim)
        assert h.dtype == self.dtype

        mask = None
        if input_ids.shape[1] > 1:
            tensor = torch.full((seqlen, seqlen), dtype=h.dtype, fill_value=1, device=h.device)
            mask = torch.log(torch.tril(tensor, diagonal=0)).to(h.dtype)

        for layer in self.layers.values():
            h = layer(h, freqs_cis, positions, mask)

        outs = self.output(self.norm(h))
        return outs.float()


# =============================================================================== Llama-1 reference


class Llama1Attention(nn.Module):
    def __init__(self, dim=DIM, n_heads=HEADS):
        super().__init__()
        self.n_local_heads = n_heads
        self.head_dim = dim // n_heads
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)

    def forward(self, x, start_pos, freqs_cis, mask):
        bsz, seqlen, _ = x.shape
        xq, xk, xv = self.wq(x), self.wk(x), self.wv(x)

        xq = xq.view(bsz, seqlen, self.n_local_heads, self.head_dim)
        xk = xk.view(bsz, seqlen, self.n_local_heads, self.head_dim)
        xv = xv.view(bsz, seqlen, self.n_local_heads, self.head_dim)

        xq, xk = titan_apply_rotary_emb(xq, xk, freqs_cis=freqs_cis)

        keys, values = xk, xv

        xq = xq.transpose(1, 2)
        keys = keys.transpose(1, 2)
        values = values.transpose(1, 2)
        scores = torch.matmul(xq, keys.transpose(2, 3)) / math.sqrt(self.head_dim)
        if mask is not None:
            scores = scores + mask  # (bs, n_local_heads, slen, cache_len + slen)
        scores = F.softmax(scores.float(), dim=-1).type_as(xq)
        output = torch.matmul(scores, values)  # (bs, n_local_heads, slen, head_dim)
        output = output.transpose(1, 2).contiguous().view(bsz, seqlen, -1)

        return self.wo(output)


class Llama1Block(nn.Module):
    def __init__(self, dim=DIM, multiple_of=16):
        super().__init__()
        self.attention = Llama1Attention(dim)
        self.feed_forward = TitanFeedForward(dim=dim, hidden_dim=4 * dim, multiple_of=multiple_of,
                                             ffn_dim_multiplier=None)
        self.attention_norm = MistralRMSNorm(dim, eps=1e-5)
        self.ffn_norm = MistralRMSNorm(dim, eps=1e-5)

    def forward(self, x, start_pos, freqs_cis, mask):
        h = x + self.attention.forward(self.attention_norm(x), start_pos, freqs_cis, mask)
        out = h + self.feed_forward.forward(self.ffn_norm(h))
        return out


class Llama1Reference(nn.Module):
    """meta-llama/llama llama/model.py (Llama-1 reference) ``Transformer``: ``freqs_cis``
    precomputed for ``max_seq_len * 2`` positions and kept as a plain attribute (complex64,
    not a buffer), re-assigned in the forward (``self.freqs_cis = self.freqs_cis.to(h.device)``)
    and sliced ``[start_pos : start_pos + seqlen]``; the mask ``torch.triu(torch.full((1, 1,
    seqlen, seqlen), -inf), diagonal=start_pos + 1).type_as(h)`` added to the scores;
    ``softmax(scores.float()).type_as(xq)``. Changed for training: no ``inference_mode``, no
    KV cache (its in-place cache writes would break backpropagation through several
    sequences), plain Linear/Embedding instead of fairscale's parallel layers, logits of
    every position (theirs: last)."""

    def __init__(self, max_seq_len=CTX):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = torch.nn.ModuleList([Llama1Block() for _ in range(LAYERS)])
        self.norm = MistralRMSNorm(DIM, eps=1e-5)
        self.output = nn.Linear(DIM, VOCAB, bias=False)
        self.freqs_cis = titan_precompute_freqs_cis(DIM // HEADS, max_seq_len * 2)

    def forward(self, tokens, start_pos: int = 0):
        _bsz, seqlen = tokens.shape
        h = self.tok_embeddings(tokens)
        self.freqs_cis = self.freqs_cis.to(h.device)
        freqs_cis = self.freqs_cis[start_pos : start_pos + seqlen]

        mask = None
        if seqlen > 1:
            mask = torch.full((1, 1, seqlen, seqlen), float("-inf"), device=tokens.device)
            mask = torch.triu(mask, diagonal=start_pos + 1).type_as(h)

        for layer in self.layers:
            h = layer(h, start_pos, freqs_cis, mask)
        h = self.norm(h)
        output = self.output(h)
        return output.float()


class Rope2TLM(Llama1Reference):
    """The Llama-1 reference with its ``max_seq_len * 2`` table built from the call's own
    length: ``precompute_freqs_cis(head_dim, seqlen * 2)[0:seqlen]`` in the forward (an
    ``arange(2 * T)`` sliced back to ``T`` rows)."""

    def forward(self, tokens, start_pos: int = 0):
        _bsz, seqlen = tokens.shape
        h = self.tok_embeddings(tokens)
        freqs_cis = titan_precompute_freqs_cis(DIM // HEADS, seqlen * 2).to(h.device)
        freqs_cis = freqs_cis[start_pos : start_pos + seqlen]
        mask = torch.full((1, 1, seqlen, seqlen), float("-inf"), device=tokens.device)
        mask = torch.triu(mask, diagonal=start_pos + 1).type_as(h)
        for layer in self.layers:
            h = layer(h, start_pos, freqs_cis, mask)
        return self.output(self.norm(h))
