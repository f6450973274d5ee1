"""RetNet as Jamie-Stirling/RetNet writes it (src/retention.py, src/xpos_relative_position.py,
src/retnet.py): per head a ``SimpleRetention`` whose parallel form is ``(Q @ K^T * D) @ V`` with
``D = gamma ** (n - m) * (n >= m)`` (NaNs set to 0 in place), xPos on Q and K, heads run in a
Python loop, a GroupNorm over the concatenated heads and a swish gate. Left out: the recurrent
and chunkwise forms (inference), ``double_v_dim``; the weights are the repository's ``randn /
hidden`` parameters (the zoo perturbs them)."""

from __future__ import annotations

import math

import torch
from torch import nn

from zoo_repos.common import DIM, HEADS, LAYERS, VOCAB


def fixed_pos_embedding(x):
    seq_len, dim = x.shape
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim) / dim))
    sinusoid_inp = torch.einsum("i , j -> i j", torch.arange(0, seq_len, dtype=torch.float), inv_freq).to(x)
    return torch.sin(sinusoid_inp), torch.cos(sinusoid_inp)


def rotate_every_two(x):
    x1 = x[:, :, ::2]
    x2 = x[:, :, 1::2]
    x = torch.stack((-x2, x1), dim=-1)
    return x.flatten(-2)


def duplicate_interleave(m):
    dim0 = m.shape[0]
    m = m.view(-1, 1)
    m = m.repeat(1, 2)
    m = m.view(dim0, -1)
    return m


def apply_rotary_pos_emb(x, sin, cos, scale=1):
    sin, cos = map(lambda t: duplicate_interleave(t * scale), (sin, cos))
    return (x * cos) + (rotate_every_two(x) * sin)


class XPOS(nn.Module):
    def __init__(self, head_dim, scale_base=512):
        super().__init__()
        self.head_dim = head_dim
        self.scale_base = scale_base
        self.register_buffer("scale", (torch.arange(0, head_dim, 2) + 0.4 * head_dim) / (1.4 * head_dim))

    def forward(self, x, offset=0, downscale=False):
        length = x.shape[1]
        min_pos = 0
        max_pos = length + offset + min_pos
        scale = self.scale ** torch.arange(min_pos, max_pos, 1).to(self.scale).div(self.scale_base)[:, None]
        sin, cos = fixed_pos_embedding(scale)
        if scale.shape[0] > length:
            scale = scale[-length:]
            sin = sin[-length:]
            cos = cos[-length:]
        if downscale:
            scale = 1 / scale
        return apply_rotary_pos_emb(x, sin, cos, scale)


class SimpleRetention(nn.Module):
    def __init__(self, hidden_size, gamma, head_size):
        super().__init__()
        self.hidden_size = hidden_size
        self.head_size = head_size
        self.v_dim = head_size
        self.gamma = gamma
        self.W_Q = nn.Parameter(torch.randn(hidden_size, head_size) / hidden_size)
        self.W_K = nn.Parameter(torch.randn(hidden_size, head_size) / hidden_size)
        self.W_V = nn.Parameter(torch.randn(hidden_size, self.v_dim) / hidden_size)
        self.xpos = XPOS(head_size)

    def forward(self, X):
        sequence_length = X.shape[1]
        D = self._get_D(sequence_length).to(self.W_Q.device)
        Q = X @ self.W_Q
        K = X @ self.W_K
        Q = self.xpos(Q)
        K = self.xpos(K, downscale=True)
        V = X @ self.W_V
        ret = (Q @ K.permute(0, 2, 1)) * D.unsqueeze(0)
        return ret @ V

    def _get_D(self, sequence_length):
        n = torch.arange(sequence_length).unsqueeze(1)
        m = torch.arange(sequence_length).unsqueeze(0)
        # Broadcast self.gamma ** (n - m) with appropriate masking to set values where n < m to 0
        D = (self.gamma ** (n - m)) * (n >= m).float()  # this results in some NaN when n is much larger than m
        # fill the NaN with 0
        D[D != D] = 0
        return D


class MultiScaleRetention(nn.Module):
    def __init__(self, hidden_size, heads):
        super().__init__()
        self.hidden_size = hidden_size
        self.v_dim = hidden_size
        self.heads = heads
        self.head_size = hidden_size // heads
        self.head_v_dim = hidden_size // heads
        self.gammas = (1 - torch.exp(torch.linspace(math.log(1 / 32), math.log(1 / 512), heads))
                       ).detach().cpu().tolist()
        self.swish = lambda x: x * torch.sigmoid(x)
        self.W_G = nn.Parameter(torch.randn(hidden_size, self.v_dim) / hidden_size)
        self.W_O = nn.Parameter(torch.randn(self.v_dim, hidden_size) / hidden_size)
        self.group_norm = nn.GroupNorm(heads, self.v_dim)
        self.retentions = nn.ModuleList([SimpleRetention(self.hidden_size, gamma, self.head_size)
                                         for gamma in self.gammas])

    def forward(self, X):
        Y = []
        for i in range(self.heads):
            Y.append(self.retentions[i](X[:, :, :]))
        Y = torch.cat(Y, dim=2)
        Y_shape = Y.shape
        Y = self.group_norm(Y.reshape(-1, self.v_dim)).reshape(Y_shape)
        return (self.swish(X @ self.W_G) * Y) @ self.W_O


class RetNet(nn.Module):
    """src/retnet.py's ``RetNet`` (layers of retention and a GELU FFN, pre-norm), with an
    embedding and an LM head around it as the repository's CLM example adds them."""

    def __init__(self, layers=LAYERS, hidden_dim=DIM, ffn_size=2 * DIM, heads=HEADS):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, hidden_dim)
        self.retentions = nn.ModuleList([MultiScaleRetention(hidden_dim, heads) for _ in range(layers)])
        self.ffns = nn.ModuleList([nn.Sequential(nn.Linear(hidden_dim, ffn_size), nn.GELU(),
                                                 nn.Linear(ffn_size, hidden_dim)) for _ in range(layers)])
        self.layer_norms_1 = nn.ModuleList([nn.LayerNorm(hidden_dim) for _ in range(layers)])
        self.layer_norms_2 = nn.ModuleList([nn.LayerNorm(hidden_dim) for _ in range(layers)])
        self.head = nn.Linear(hidden_dim, VOCAB)

    def forward(self, idx):
        X = self.emb(idx)
        for i in range(len(self.retentions)):
            Y = self.retentions[i](self.layer_norms_1[i](X)) + X
            X = self.ffns[i](self.layer_norms_2[i](Y)) + Y
        return self.head(X)
