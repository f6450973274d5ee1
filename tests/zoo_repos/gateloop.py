"""GateLoop written as lucidrains/gateloop-transformer writes it (``associative_scan.py``,
``gateloop_transformer.py``'s ``gate_loop_operator`` and ``GateLoopedAttention``) at a tiny size.

The scan is the repository's PyTorch port of JAX's ``lax.associative_scan`` "made specifically
for axis of 1": a recursion over ``elem[:, :-1:2]`` / ``elem[:, 1::2]``, the first element put
back with ``torch.cat`` and ``_interleave`` through ``pad_at_dim``, ``stack`` and ``flatten``. The
state transition is complex (``torch.polar`` of a sigmoid magnitude and a phase), the state
``einsum('b n d, b n e -> b n d e', k, v) + 0.j``. Left out: ``frac_gradient``, the checkpointed
scan and the rotary option. ``reverse`` scans from the end (a bidirectional variant).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from zoo_repos.common import DIM, HEADS, LAYERS, VOCAB


def pad_at_dim(t, pad, dim=-1, value=0.):
    dims_from_right = (- dim - 1) if dim < 0 else (t.ndim - dim - 1)
    zeros = ((0, 0) * dims_from_right)
    return F.pad(t, (*zeros, *pad), value=value)


def associative_scan(operator, elems):
    num_elems = int(elems[0].shape[1])

    if not all(int(elem.shape[1]) == num_elems for elem in elems[1:]):
        raise ValueError('Array inputs to associative_scan must have the same first dimension. (saw: {})'
                         .format([elem.shape for elem in elems]))

    def _scan(elems):
        """Perform scan on `elems`."""
        num_elems = elems[0].shape[1]
        if num_elems < 2:
            return elems
        # Combine adjacent pairs of elements.
        reduced_elems = operator([elem[:, :-1:2] for elem in elems], [elem[:, 1::2] for elem in elems])
        # Recursively compute scan for partially reduced tensors.
        odd_elems = _scan(reduced_elems)
        if num_elems % 2 == 0:
            even_elems = operator([e[:, :-1] for e in odd_elems], [e[:, 2::2] for e in elems])
        else:
            even_elems = operator(odd_elems, [e[:, 2::2] for e in elems])
        # The first element of a scan is the same as the first element of the original `elems`.
        even_elems = [torch.cat([elem[:, :1], result], dim=1) for (elem, result) in zip(elems, even_elems)]
        return list(map(_interleave, even_elems, odd_elems))

    return _scan(elems)


def _interleave(a, b):
    a_axis_len, b_axis_len = a.shape[1], b.shape[1]
    output_axis_len = a_axis_len + b_axis_len
    if a_axis_len == (b_axis_len + 1):
        b = pad_at_dim(b, (0, 1), dim=1)
    stacked = torch.stack([a, b], dim=2)
    interleaved = torch.flatten(stacked, start_dim=1, end_dim=2)
    return interleaved[:, :output_axis_len]


def gate_loop_operator(q, k, v, a, reverse=False):
    kv = torch.einsum('b n d, b n e -> b n d e', k, v)
    kv = kv + 0.j

    def binary_operator(a, b):
        a_i, kv_i = a
        a_j, kv_j = b
        return a_j * a_i, a_j * kv_i + kv_j

    if reverse:  # scans from the end, as the bidirectional variant does with flipped inputs
        _, kv = reverse_associative_scan(binary_operator, (a, kv))
    else:
        _, kv = associative_scan(binary_operator, (a, kv))
    return torch.einsum('b n d, b n d e -> b n e', q, kv.real)


def reverse_associative_scan(operator, elems, reverse=True):
    """A port with JAX's ``reverse`` flag: the scan of the flipped elements, flipped back."""
    flipped = [e.flip(1) for e in elems]
    return [e.flip(1) for e in associative_scan(operator, flipped)]


class GateLoopedAttention(nn.Module):
    def __init__(self, dim=DIM, heads=HEADS, reverse=False):
        super().__init__()
        self.heads, self.reverse = heads, reverse
        dim_inner = dim
        self.to_qkv = nn.Linear(dim, dim_inner * 3, bias=False)
        self.to_a = nn.Linear(dim, heads * 2)  # a complex number per head: magnitude and phase
        self.to_out = nn.Linear(dim_inner, dim, bias=False)

    def forward(self, x):
        b, n, _ = x.shape
        h = self.heads
        q, k, v = self.to_qkv(x).chunk(3, dim=-1)
        # rearrange 'b n (h d) -> (b h) n d'
        q, k, v = (t.view(b, n, h, -1).transpose(1, 2).reshape(b * h, n, -1) for t in (q, k, v))
        a = self.to_a(x)
        # rearrange 'b n (h c) -> (b h) n 1 1 c', c = 2
        a = a.view(b, n, h, 2).transpose(1, 2).reshape(b * h, n, 1, 1, 2)
        a = torch.view_as_complex(a.contiguous())
        magnitude, phase = a.abs(), a.angle()
        a = torch.polar(magnitude.sigmoid(), phase)
        out = gate_loop_operator(q, k, v, a, reverse=self.reverse)
        # rearrange '(b h) n d -> b n (h d)'
        out = out.view(b, h, n, -1).transpose(1, 2).reshape(b, n, -1)
        return self.to_out(out)


class RMSNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.scale = dim ** 0.5
        self.gamma = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return F.normalize(x, dim=-1) * self.scale * self.gamma


class GateLoopLM(nn.Module):
    def __init__(self, reverse=False):
        super().__init__()
        self.token_emb = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(nn.ModuleList([RMSNorm(DIM), GateLoopedAttention(reverse=reverse), RMSNorm(DIM),
                                                   nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(),
                                                                 nn.Linear(4 * DIM, DIM))])
                                    for _ in range(LAYERS))
        self.to_logits = nn.Sequential(RMSNorm(DIM), nn.Linear(DIM, VOCAB, bias=False))

    def forward(self, x):
        x = self.token_emb(x)
        for norm1, attn, norm2, ff in self.layers:
            x = attn(norm1(x)) + x
            x = ff(norm2(x)) + x
        return self.to_logits(x)
