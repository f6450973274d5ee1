"""ofirpress/attention_with_linear_biases (fairseq models/transformer.py, TransformerDecoder without
token positions) at a tiny size: ``get_slopes`` (with its branch for a head count that is not a
power of 2), ``alibi = slopes[:, None, None] * arange(maxpos)`` viewed ``[heads, 1, maxpos]`` and
repeated over the batch, ``buffered_future_mask`` = ``triu(fill_with_neg_inf(zeros), 1)[None] +
alibi`` kept on the module and cut ``[:bsz * heads, :T, :T]``; fairseq's MultiheadAttention fast
path ``F.multi_head_attention_forward(use_separate_proj_weight=True)`` with that 3-D attn_mask;
``T x B x C`` inside. Left out: dropout, incremental state, the adaptive softmax.
"""

import math
import torch
import torch.nn as nn
import torch.nn.functional as F


def get_slopes(n):
    def get_slopes_power_of_2(n):
        start = 2 ** (-2 ** -(math.log2(n) - 3))
        ratio = start
        return [start * ratio ** i for i in range(n)]

    if math.log2(n).is_integer():
        return get_slopes_power_of_2(n)
    closest_power_of_2 = 2 ** math.floor(math.log2(n))
    return get_slopes_power_of_2(closest_power_of_2) + get_slopes(2 * closest_power_of_2)[0::2][: n - closest_power_of_2]


def fill_with_neg_inf(t):
    return t.float().fill_(float("-inf")).type_as(t)


class MultiheadAttention(nn.Module):
    def __init__(self, embed_dim, num_heads):
        super().__init__()
        self.embed_dim, self.num_heads = embed_dim, num_heads
        self.k_proj = nn.Linear(embed_dim, embed_dim)
        self.v_proj = nn.Linear(embed_dim, embed_dim)
        self.q_proj = nn.Linear(embed_dim, embed_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)

    def forward(self, query, key, value, attn_mask=None):
        return F.multi_head_attention_forward(
            query, key, value, self.embed_dim, self.num_heads, torch.empty([0]),
            torch.cat((self.q_proj.bias, self.k_proj.bias, self.v_proj.bias)), None, None, False, 0.0,
            self.out_proj.weight, self.out_proj.bias, self.training, None, False, attn_mask,
            use_separate_proj_weight=True, q_proj_weight=self.q_proj.weight,
            k_proj_weight=self.k_proj.weight, v_proj_weight=self.v_proj.weight)


class TransformerDecoderLayer(nn.Module):
    def __init__(self, embed_dim=32, heads=4):
        super().__init__()
        self.self_attn = MultiheadAttention(embed_dim, heads)
        self.self_attn_layer_norm = nn.LayerNorm(embed_dim)
        self.fc1, self.fc2 = nn.Linear(embed_dim, 64), nn.Linear(64, embed_dim)
        self.final_layer_norm = nn.LayerNorm(embed_dim)

    def forward(self, x, self_attn_mask):
        residual = x
        x = self.self_attn_layer_norm(x)  # normalize_before
        x, _ = self.self_attn(query=x, key=x, value=x, attn_mask=self_attn_mask)
        x = residual + x
        residual = x
        x = self.fc2(F.relu(self.fc1(self.final_layer_norm(x))))
        return residual + x


class AlibiFairseqLM(nn.Module):
    def __init__(self, vocab=32, embed_dim=32, layers=2, attn_heads=4, tokens_per_sample=64, max_tokens=128):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, embed_dim)
        self.embed_scale = math.sqrt(embed_dim)
        self.layers = nn.ModuleList([TransformerDecoderLayer(embed_dim, attn_heads) for _ in range(layers)])
        self.layer_norm = nn.LayerNorm(embed_dim)
        self.output_projection = nn.Linear(embed_dim, vocab, bias=False)
        self.tokens_per_sample, self.attn_heads = tokens_per_sample, attn_heads
        maxpos = tokens_per_sample
        self.slopes = torch.Tensor(get_slopes(attn_heads))
        # the part after the * builds rows that are all identical; softmax is invariant to translation
        self.alibi = self.slopes.unsqueeze(1).unsqueeze(1) * torch.arange(maxpos).unsqueeze(0).unsqueeze(0).expand(attn_heads, -1, -1)
        self.alibi = self.alibi.view(attn_heads, 1, maxpos)
        self.alibi = self.alibi.repeat(max_tokens // maxpos, 1, 1)  # batch_size, 1, 1
        self._future_mask = torch.empty(0)

    def buffered_future_mask(self, tensor):
        dim = tensor.size(0)
        if (self._future_mask.size(0) == 0 or (not self._future_mask.device == tensor.device)
                or self._future_mask.size(1) < self.tokens_per_sample):
            self._future_mask = torch.triu(fill_with_neg_inf(torch.zeros([self.tokens_per_sample, self.tokens_per_sample])), 1)
            self._future_mask = self._future_mask.unsqueeze(0) + self.alibi
        self._future_mask = self._future_mask.to(tensor)
        return self._future_mask[: tensor.shape[1] * self.attn_heads, :dim, :dim]

    def forward(self, prev_output_tokens):
        x = self.embed_scale * self.embed_tokens(prev_output_tokens)
        x = x.transpose(0, 1)  # B x T x C -> T x B x C
        for layer in self.layers:
            self_attn_mask = self.buffered_future_mask(x)
            x = layer(x, self_attn_mask)
        x = self.layer_norm(x)
        return self.output_projection(x.transpose(0, 1))
