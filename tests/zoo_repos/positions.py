"""Positions counted from the token ids: RoBERTa-style and fairseq's."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import torch.onnx.operators  # noqa: F401  (fairseq's shape_as_tensor)
from torch import nn

from zoo_repos.attention import LinspacePosLM
from zoo_repos.common import CTX, DIM, HEADS, LAYERS, VOCAB
from zoo_repos.gpt import NanoBlock, NanoGPTConfig

# =============================================================================== RoBERTa-style


def create_position_ids_from_input_ids(input_ids, padding_idx, past_key_values_length=0):
    """
    Replace non-padding symbols with their position numbers. Position numbers begin at padding_idx+1. Padding symbols
    are ignored. This is modified from fairseq's `utils.make_positions`.
    """
    # The series of casts and type-conversions here are carefully balanced to both work with ONNX export and XLA.
    mask = input_ids.ne(padding_idx).int()
    incremental_indices = (torch.cumsum(mask, dim=1).type_as(mask) + past_key_values_length) * mask
    return incremental_indices.long() + padding_idx


class RobertaStyleLM(nn.Module):
    """A decoder whose positions are spelled as RoBERTa's (transformers
    models/roberta/modeling_roberta.py ``create_position_ids_from_input_ids``, from fairseq's
    ``make_positions``): ``cumsum(input_ids.ne(pad))`` times the mask, plus ``padding_idx``,
    into a position table with ``padding_idx``; word embeddings with ``padding_idx``, an
    embedding LayerNorm, then nanoGPT SDPA blocks. The pad id (1) is also a token of the
    zoo's trees, so positions do not advance at it."""

    def __init__(self, padding_idx=1, max_position_embeddings=80):
        super().__init__()
        self.padding_idx = padding_idx
        self.word_embeddings = nn.Embedding(VOCAB, DIM, padding_idx=padding_idx)
        self.position_embeddings = nn.Embedding(max_position_embeddings, DIM, padding_idx=padding_idx)
        self.LayerNorm = nn.LayerNorm(DIM, eps=1e-5)
        self.blocks = nn.ModuleList([NanoBlock(NanoGPTConfig(flash=True)) for _ in range(LAYERS)])
        self.ln_f = nn.LayerNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, idx):
        position_ids = create_position_ids_from_input_ids(idx, self.padding_idx, 0)
        x = self.word_embeddings(idx) + self.position_embeddings(position_ids)
        x = self.LayerNorm(x)
        for b in self.blocks:
            x = b(x)
        return self.lm_head(self.ln_f(x))


# =============================================================================== fairseq


def fairseq_make_positions(tensor, padding_idx: int, onnx_trace: bool = False):
    """Replace non-padding symbols with their position numbers.

    Position numbers begin at padding_idx+1. Padding symbols are ignored.
    """
    mask = tensor.ne(padding_idx).int()
    return (torch.cumsum(mask, dim=1).type_as(mask) * mask).long() + padding_idx


def fairseq_fill_with_neg_inf(t):
    """FP16-compatible function that fills a tensor with -inf."""
    return t.float().fill_(float("-inf")).type_as(t)


class FairseqSinusoidalPositionalEmbedding(nn.Module):
    """fairseq/modules/sinusoidal_positional_embedding.py (the non-incremental, non-ONNX path)."""

    def __init__(self, embedding_dim, padding_idx, init_size=1024, auto_expand=True):
        super().__init__()
        self.embedding_dim = embedding_dim
        self.padding_idx = padding_idx if padding_idx is not None else 0
        self.register_buffer("weights", self.get_embedding(init_size, embedding_dim, padding_idx), persistent=False)
        self.max_positions = int(1e5)
        self.auto_expand = auto_expand
        self.onnx_trace = False

    @staticmethod
    def get_embedding(num_embeddings: int, embedding_dim: int, padding_idx=None):
        half_dim = embedding_dim // 2
        emb = math.log(10000) / (half_dim - 1)
        emb = torch.exp(torch.arange(half_dim, dtype=torch.float) * -emb)
        emb = torch.arange(num_embeddings, dtype=torch.float).unsqueeze(1) * emb.unsqueeze(0)
        emb = torch.cat([torch.sin(emb), torch.cos(emb)], dim=1).view(num_embeddings, -1)
        if embedding_dim % 2 == 1:
            # zero pad
            emb = torch.cat([emb, torch.zeros(num_embeddings, 1)], dim=1)
        if padding_idx is not None:
            emb[padding_idx, :] = 0
        return emb

    def forward(self, input):
        """Input is expected to be of size [bsz x seqlen]."""
        bspair = torch.onnx.operators.shape_as_tensor(input)
        bsz, seq_len = bspair[0], bspair[1]
        max_pos = self.padding_idx + 1 + seq_len
        weights = self.weights

        if max_pos > self.weights.size(0):
            weights = self.get_embedding(max_pos, self.embedding_dim, self.padding_idx).to(self.weights)
            if self.auto_expand:
                self.weights = weights

        positions = fairseq_make_positions(input, self.padding_idx, onnx_trace=self.onnx_trace)
        return weights.index_select(0, positions.view(-1)).view(bsz, seq_len, -1).detach()


class FairseqDecoderLayer(nn.Module):
    """fairseq ``TransformerDecoderLayerBase`` (post-norm, ``normalize_before=False``) whose
    self-attention takes fairseq ``MultiheadAttention``'s default training path:
    ``F.multi_head_attention_forward(..., attn_mask, use_separate_proj_weight=True)``."""

    def __init__(self, embed_dim=DIM, num_heads=HEADS, ffn_dim=4 * DIM):
        super().__init__()
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.k_proj = nn.Linear(embed_dim, embed_dim)
        self.v_proj = nn.Linear(embed_dim, embed_dim)
        self.q_proj = nn.Linear(embed_dim, embed_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)
        self.self_attn_layer_norm = nn.LayerNorm(embed_dim)
        self.fc1 = nn.Linear(embed_dim, ffn_dim)
        self.fc2 = nn.Linear(ffn_dim, embed_dim)
        self.final_layer_norm = nn.LayerNorm(embed_dim)

    def self_attn(self, query, key, value, attn_mask):
        return F.multi_head_attention_forward(
            query, key, value, self.embed_dim, self.num_heads,
            torch.empty([0]),
            torch.cat((self.q_proj.bias, self.k_proj.bias, self.v_proj.bias)),
            None, None, False, 0.0,
            self.out_proj.weight, self.out_proj.bias,
            self.training,
            None,
            False,
            attn_mask,
            use_separate_proj_weight=True,
            q_proj_weight=self.q_proj.weight,
            k_proj_weight=self.k_proj.weight,
            v_proj_weight=self.v_proj.weight,
        )

    def forward(self, x, self_attn_mask):
        residual = x
        x, attn = self.self_attn(query=x, key=x, value=x, attn_mask=self_attn_mask)
        x = residual + x
        x = self.self_attn_layer_norm(x)
        residual = x
        x = F.relu(self.fc1(x))
        x = self.fc2(x)
        x = residual + x
        x = self.final_layer_norm(x)
        return x


class FairseqTransformerLM(nn.Module):
    """facebookresearch/fairseq ``TransformerDecoder`` (fairseq/models/transformer/
    transformer_decoder.py) as ``transformer_lm`` builds it: ``embed_scale * embed_tokens``,
    sinusoidal positions from ``utils.make_positions`` (a cumsum of non-pad tokens plus
    ``padding_idx``; the table grows itself, ``self.weights = ...``, when the length passes
    it, compared through ``torch.onnx.operators.shape_as_tensor``), ``x += positions`` in
    place, time-first layout, and ``buffered_future_mask``: a ``triu(fill_with_neg_inf(zeros
    (dim, dim)), 1)`` cached on the module (``self._future_mask``), rebuilt when too small,
    sliced ``[:dim, :dim]``. Post-norm layers through ``F.multi_head_attention_forward``."""

    def __init__(self, padding_idx=1):
        super().__init__()
        self.padding_idx = padding_idx
        self.embed_tokens = nn.Embedding(VOCAB, DIM, padding_idx=padding_idx)
        self.embed_scale = math.sqrt(DIM)
        self.embed_positions = FairseqSinusoidalPositionalEmbedding(DIM, padding_idx, init_size=CTX + padding_idx + 1)
        self.layers = nn.ModuleList([FairseqDecoderLayer() for _ in range(LAYERS)])
        self.output_projection = nn.Linear(DIM, VOCAB, bias=False)
        self._future_mask = torch.empty(0)

    def buffered_future_mask(self, tensor):
        dim = tensor.size(0)
        # self._future_mask.device != tensor.device is not working in TorchScript. This is a workaround.
        if (
            self._future_mask.size(0) == 0
            or (not self._future_mask.device == tensor.device)
            or self._future_mask.size(0) < dim
        ):
            self._future_mask = torch.triu(fairseq_fill_with_neg_inf(torch.zeros([dim, dim])), 1)
        self._future_mask = self._future_mask.to(tensor)
        return self._future_mask[:dim, :dim]

    def forward(self, prev_output_tokens):
        positions = self.embed_positions(prev_output_tokens)
        x = self.embed_scale * self.embed_tokens(prev_output_tokens)
        x += positions
        # B x T x C -> T x B x C
        x = x.transpose(0, 1)
        for layer in self.layers:
            self_attn_mask = self.buffered_future_mask(x)
            x = layer(x, self_attn_mask)
        # T x B x C -> B x T x C
        x = x.transpose(0, 1)
        return self.output_projection(x)


# =============================================================================== tables over the rows


class DecayFromStartLM(nn.Module):
    """RWKV-5's matrix form (BlinkDL/RWKV-LM RWKV-v5 ``RUN_CUDA`` reference, ``jit_func`` /
    ``forward`` of the ``_matrix`` variant): the contribution of a learned initial state ``s``
    at token ``i`` decays as ``w ** i``, built as ``w.repeat(1, T).pow(arange(T - 1, -1, -1))``
    reshaped and flipped along the time axis (``wb``), then ``(r @ s) * wb``; nanoGPT SDPA blocks
    after. ``from_end`` keeps the table unflipped (``w ** (T - 1 - i)``: the decay to the end of
    the sequence, which per path depends on the path's length)."""

    def __init__(self, from_end=False):
        super().__init__()
        self.from_end = from_end
        self.wte = nn.Embedding(VOCAB, DIM)
        self.receptance = nn.Linear(DIM, DIM, bias=False)
        self.time_decay = nn.Parameter(torch.linspace(-1.0, 0.5, HEADS))
        self.state = nn.Parameter(torch.randn(HEADS, DIM // HEADS, DIM // HEADS) * 0.1)
        self.blocks = nn.ModuleList([NanoBlock(NanoGPTConfig(flash=True)) for _ in range(LAYERS)])
        self.ln_f = nn.LayerNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, idx):
        B, T = idx.shape
        H, N = HEADS, DIM // HEADS
        x = self.wte(idx)
        r = self.receptance(x).view(B, T, H, N).transpose(1, 2)  # B H T N
        w = torch.exp(-torch.exp(self.time_decay)).unsqueeze(-1)  # H 1
        ind = torch.arange(T - 1, -1, -1, device=idx.device).unsqueeze(0).repeat(H, 1)
        w = w.repeat(1, T).pow(ind)  # H T: w ** (T - 1 - t)
        wk = w.reshape(1, H, 1, T)
        wb = wk.transpose(-2, -1) if self.from_end else wk.transpose(-2, -1).flip(2)  # 1 H T 1
        x = x + ((r @ self.state) * wb).transpose(1, 2).reshape(B, T, DIM)
        for b in self.blocks:
            x = b(x)
        return self.lm_head(self.ln_f(x))


class CenteredPositionsLM(LinspacePosLM):
    """Sinusoidal positions over ``arange(-(T // 2), T - T // 2)`` (torchscale's XPOS centres
    its positions on the sequence: ``min_pos = -(length + offset) // 2``), added to the token
    embeddings: per path the table depends on the path's length."""

    def positions(self, T, device):
        min_pos = -T // 2
        return torch.arange(min_pos, T + min_pos, 1, device=device).to(self.div_term)


class _XformersLayoutAttention(nn.Module):
    """mistral-inference's attention: q, k, v as ``[S, H, D]`` of the packed row, xformers'
    ``(B=1, S, H, D)`` layout, SDPA on the transposes, ``out.transpose(1, 2).view(S, H * D)``
    (a view that works in the layout CPU SDPA gives its output)."""

    def __init__(self):
        super().__init__()
        self.wqkv, self.wo = nn.Linear(DIM, 3 * DIM, bias=False), nn.Linear(DIM, DIM, bias=False)
        self.norm, self.mlp = nn.LayerNorm(DIM), nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.SiLU(), nn.Linear(2 * DIM, DIM))

    def forward(self, x):
        seqlen_sum = x.shape[0]
        q, k, v = (t.view(seqlen_sum, HEADS, DIM // HEADS) for t in self.wqkv(self.norm(x)).split(DIM, dim=-1))
        q, k, v = q[None, ...], k[None, ...], v[None, ...]
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.wo(out.transpose(1, 2).view(seqlen_sum, DIM))
        return x + self.mlp(x)


class PackedSeqlensLM(nn.Module):
    """mistralai/mistral-inference ``SimpleInputMetadata.from_seqlens``: the batch flattened to
    one packed row, positions ``cat([arange(0, seqlen) for seqlen in seqlens])`` (one part for
    one sequence) gathering a learned table, and its attention's layout (`_XformersLayoutAttention`)."""

    def __init__(self):
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, DIM), nn.Embedding(CTX, DIM)
        self.blocks = nn.ModuleList(_XformersLayoutAttention() for _ in range(LAYERS))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, input_ids):
        b, t = input_ids.shape
        assert b == 1, "one packed row (seqlens of one sequence)"
        seqlens = [t] * b
        positions = torch.cat([torch.arange(0, seqlen) for seqlen in seqlens]).to(device=input_ids.device)
        x = self.tok(input_ids.reshape(-1)) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(x)[None]
