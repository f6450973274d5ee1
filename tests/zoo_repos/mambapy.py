"""alxndrTL/mamba.py (``mambapy/pscan.py``, ``mambapy/mamba.py``): Mamba on a Blelloch parallel scan.

``pscan = PScan.apply`` is an autograd Function: its forward pads the length to a power of two
(or clones), runs the up and down sweeps in place on views of ``(B, D, L, N)`` transposes, and
its backward runs the same sweeps from the end on the gradient. ``MambaBlock.selective_scan``
calls ``pscan(deltaA, BX)`` on ``[B, L, ED, N]``. Left out: the sequential ``selective_scan_seq``,
the inference ``step``, the CUDA ``mamba_ssm`` switch, and the ``.float()`` casts of ``A_log``
and ``D`` (a float64 model compares in float64). The reverse sweep is the forward one on flipped
tensors (mamba.py writes it out).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from zoo_repos.common import DIM, LAYERS, VOCAB


def npo2(len):
    """Returns the next power of 2 above len."""
    return 2 ** math.ceil(math.log2(len))


def pad_npo2(X):
    """Pads input length dim to the next power of 2; X: (B, L, D, N)."""
    len_npo2 = npo2(X.size(1))
    pad_tuple = (0, 0, 0, 0, 0, len_npo2 - X.size(1))
    return F.pad(X, pad_tuple, "constant", 0)


class PScan(torch.autograd.Function):
    @staticmethod
    def pscan(A, X):
        # A : (B, D, L, N), X : (B, D, L, N); modifies X in place: X[t] <- A[t] * X[t-1] + X[t]
        B, D, L, _ = A.size()
        num_steps = int(math.log2(L))
        Aa, Xa = A, X
        for _ in range(num_steps):  # up sweep: each pair's right node takes the pair's sum
            T = Xa.size(2)
            Aa = Aa.view(B, D, T // 2, 2, -1)
            Xa = Xa.view(B, D, T // 2, 2, -1)
            Xa[:, :, :, 1].add_(Aa[:, :, :, 1].mul(Xa[:, :, :, 0]))
            Aa[:, :, :, 1].mul_(Aa[:, :, :, 0])
            Aa = Aa[:, :, :, 1]
            Xa = Xa[:, :, :, 1]
        for k in range(num_steps - 2, -1, -1):  # down sweep: the left node of each later pair
            Aa = A[:, :, 2 ** k - 1:L:2 ** k]
            Xa = X[:, :, 2 ** k - 1:L:2 ** k]
            T = Xa.size(2)
            Aa = Aa.view(B, D, T // 2, 2, -1)
            Xa = Xa.view(B, D, T // 2, 2, -1)
            Xa[:, :, 1:, 0].add_(Aa[:, :, 1:, 0].mul(Xa[:, :, :-1, 1]))
            Aa[:, :, 1:, 0].mul_(Aa[:, :, :-1, 1])

    @staticmethod
    def pscan_rev(A, X):
        # the same scan from the end: X[t] <- A[t] * X[t+1] + X[t]
        Ar, Xr = A.flip(2), X.flip(2)
        PScan.pscan(Ar, Xr)
        X.copy_(Xr.flip(2))

    @staticmethod
    def forward(ctx, A_in, X_in):
        """A_in, X_in: (B, L, D, N); returns H: (B, L, D, N)."""
        L = X_in.size(1)
        # cloning is required because of the in-place ops (mamba.py writes the if/else out per tensor)
        A, X = ((t.clone() if L == npo2(L) else pad_npo2(t)).transpose(2, 1) for t in (A_in, X_in))
        PScan.pscan(A, X)
        ctx.save_for_backward(A_in, X)
        return X.transpose(2, 1)[:, :L]

    @staticmethod
    def backward(ctx, grad_output_in):
        A_in, X = ctx.saved_tensors
        L = grad_output_in.size(1)
        if L == npo2(L):
            grad_output = grad_output_in.clone()
        else:
            grad_output = pad_npo2(grad_output_in)
            A_in = pad_npo2(A_in)
        grad_output = grad_output.transpose(2, 1)
        A_in = A_in.transpose(2, 1)
        A = torch.nn.functional.pad(A_in[:, :, 1:], (0, 0, 0, 1))  # shift 1 to the left
        PScan.pscan_rev(A, grad_output)
        Q = torch.zeros_like(X)
        Q[:, :, 1:].add_(X[:, :, :-1] * grad_output[:, :, 1:])
        return Q.transpose(2, 1)[:, :L], grad_output.transpose(2, 1)[:, :L]


pscan = PScan.apply


class RMSNorm(nn.Module):
    def __init__(self, d_model: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d_model))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class MambaBlock(nn.Module):
    def __init__(self, d_model: int, d_state: int = 8, expand_factor: int = 2, d_conv: int = 4):
        super().__init__()
        d_inner = expand_factor * d_model
        self.dt_rank = math.ceil(d_model / 16)
        self.d_state = d_state
        self.in_proj = nn.Linear(d_model, 2 * d_inner, bias=False)
        self.conv1d = nn.Conv1d(d_inner, d_inner, kernel_size=d_conv, bias=True, groups=d_inner, padding=d_conv - 1)
        self.x_proj = nn.Linear(d_inner, self.dt_rank + 2 * d_state, bias=False)
        self.dt_proj = nn.Linear(self.dt_rank, d_inner, bias=True)
        A = torch.arange(1, d_state + 1, dtype=torch.float32).repeat(d_inner, 1)
        self.A_log = nn.Parameter(torch.log(A))
        self.D = nn.Parameter(torch.ones(d_inner))
        self.out_proj = nn.Linear(d_inner, d_model, bias=False)

    def forward(self, x):
        _, L, _ = x.shape
        xz = self.in_proj(x)  # (B, L, 2*ED)
        x, z = xz.chunk(2, dim=-1)
        x = x.transpose(1, 2)
        x = self.conv1d(x)[:, :, :L]  # depthwise convolution over time, with a short filter
        x = x.transpose(1, 2)
        x = F.silu(x)
        y = self.ssm(x, z)
        return self.out_proj(y * F.silu(z))

    def ssm(self, x, z):
        A = -torch.exp(self.A_log)  # (ED, N)
        D = self.D
        deltaBC = self.x_proj(x)
        delta, B, C = torch.split(deltaBC, [self.dt_rank, self.d_state, self.d_state], dim=-1)
        delta = self.dt_proj.weight @ delta.transpose(1, 2)
        delta = delta.transpose(1, 2)
        delta = F.softplus(delta + self.dt_proj.bias)
        return self.selective_scan(x, delta, A, B, C, D)

    def selective_scan(self, x, delta, A, B, C, D):
        deltaA = torch.exp(delta.unsqueeze(-1) * A)  # (B, L, ED, N)
        deltaB = delta.unsqueeze(-1) * B.unsqueeze(2)
        BX = deltaB * (x.unsqueeze(-1))
        hs = pscan(deltaA, BX)
        y = (hs @ C.unsqueeze(-1)).squeeze(3)  # (B, L, ED, N) @ (B, L, N, 1) -> (B, L, ED, 1)
        return y + D * x


class ResidualBlock(nn.Module):
    def __init__(self, d_model: int):
        super().__init__()
        self.mixer = MambaBlock(d_model)
        self.norm = RMSNorm(d_model)

    def forward(self, x):
        return self.mixer(self.norm(x)) + x


class MambaPyLM(nn.Module):
    """``MambaLM``: the embedding, the residual blocks, a final RMSNorm and the tied head."""

    def __init__(self, vocab_size: int = VOCAB, d_model: int = DIM, n_layers: int = LAYERS):
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, d_model)
        self.layers = nn.ModuleList([ResidualBlock(d_model) for _ in range(n_layers)])
        self.norm_f = RMSNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        self.lm_head.weight = self.embedding.weight

    def forward(self, tokens):
        x = self.embedding(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm_f(x))
