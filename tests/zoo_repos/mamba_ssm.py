"""Mamba written on mamba-ssm's public kernels (state-spaces/mamba), as custom models call them.

``selective_scan_ref`` (mamba_ssm/ops/selective_scan_interface.py, the reference the CUDA
``selective_scan_fn`` is tested against: a Python loop over the tokens) and a
``mamba_chunk_scan_combined`` listing (the length padded up to a multiple of the chunk, then
``ssd_minimal_discrete`` of mamba_ssm/modules/ssd_minimal.py on the chunks, as the repository's
tests check the Triton kernel), called by the slow paths of mamba_simple.py's ``Mamba`` and
mamba2.py's ``Mamba2`` (no fused kernels, no inference cache). ``einops.rearrange`` is written
out as view/permute. The reference's ``.float()`` casts are left out so that the float64 zoo
compares in float64 (they make the reference float32 inside a float64 model).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from zoo_repos.common import DIM, LAYERS, VOCAB

# =============================================================================== mamba_ssm/ops


def selective_scan_ref(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                       return_last_state=False):
    """
    u: r(B D L)
    delta: r(B D L)
    A: r(D N)
    B: r(B N L)
    C: r(B N L)
    D: r(D)
    z: r(B D L)
    delta_bias: r(D), fp32

    out: r(B D L)
    last_state (optional): r(B D dstate)
    """
    dtype_in = u.dtype
    if delta_bias is not None:
        delta = delta + delta_bias[..., None]
    if delta_softplus:
        delta = F.softplus(delta)
    batch, dim, dstate = u.shape[0], A.shape[0], A.shape[1]
    x = A.new_zeros((batch, dim, dstate))
    ys = []
    deltaA = torch.exp(torch.einsum('bdl,dn->bdln', delta, A))
    deltaB_u = torch.einsum('bdl,bnl,bdl->bdln', delta, B, u)
    last_state = None
    for i in range(u.shape[2]):
        x = deltaA[:, :, i] * x + deltaB_u[:, :, i]
        y = torch.einsum('bdn,bn->bd', x, C[:, :, i])
        if i == u.shape[2] - 1:
            last_state = x
        ys.append(y)
    y = torch.stack(ys, dim=2)  # (batch dim L)
    out = y if D is None else y + u * D[:, None]  # rearrange(D, "d -> d 1")
    if z is not None:
        out = out * F.silu(z)
    out = out.to(dtype=dtype_in)
    return out if not return_last_state else (out, last_state)


selective_scan_fn = selective_scan_ref  # the CUDA kernel is not built on a CPU


def segsum(x):
    """More stable segment sum calculation."""
    T = x.size(-1)
    x = x[..., None].repeat(*([1] * x.dim()), T)  # repeat(x, "... d -> ... d e", e=T)
    mask = torch.tril(torch.ones(T, T, device=x.device, dtype=torch.bool), diagonal=-1)
    x = x.masked_fill(~mask, 0)
    x_segsum = torch.cumsum(x, dim=-2)
    mask = torch.tril(torch.ones(T, T, device=x.device, dtype=torch.bool), diagonal=0)
    x_segsum = x_segsum.masked_fill(~mask, -torch.inf)
    return x_segsum


def ssd_minimal_discrete(X, A, B, C, block_len, initial_states=None):
    """
    Arguments:
        X: (batch, length, n_heads, d_head)
        A: (batch, length, n_heads)
        B: (batch, length, n_heads, d_state)
        C: (batch, length, n_heads, d_state)
    Return:
        Y: (batch, length, n_heads, d_head)
    """
    assert X.dtype == A.dtype == B.dtype == C.dtype
    assert X.shape[1] % block_len == 0
    # rearrange(x, "b (c l) ... -> b c l ...", l=block_len)
    X, A, B, C = [x.reshape(x.shape[0], -1, block_len, *x.shape[2:]) for x in (X, A, B, C)]
    A = A.permute(0, 3, 1, 2)  # "b c l h -> b h c l"
    A_cumsum = torch.cumsum(A, dim=-1)
    # 1. Compute the output for each intra-chunk (diagonal blocks)
    L = torch.exp(segsum(A))
    Y_diag = torch.einsum("bclhn,bcshn,bhcls,bcshp->bclhp", C, B, L, X)
    # 2. Compute the state for each intra-chunk
    decay_states = torch.exp((A_cumsum[:, :, :, -1:] - A_cumsum))
    states = torch.einsum("bclhn,bhcl,bclhp->bchpn", B, decay_states, X)
    # 3. Compute the inter-chunk SSM recurrence
    if initial_states is None:
        initial_states = torch.zeros_like(states[:, :1])
    states = torch.cat([initial_states, states], dim=1)
    decay_chunk = torch.exp(segsum(F.pad(A_cumsum[:, :, :, -1], (1, 0))))
    new_states = torch.einsum("bhzc,bchpn->bzhpn", decay_chunk, states)
    states, final_state = new_states[:, :-1], new_states[:, -1]
    # 4. Compute state -> output conversion per chunk
    state_decay_out = torch.exp(A_cumsum)
    Y_off = torch.einsum('bclhn,bchpn,bhcl->bclhp', C, states, state_decay_out)
    Y = (Y_diag + Y_off).reshape(Y_diag.shape[0], -1, *Y_diag.shape[3:])  # "b c l h p -> b (c l) h p"
    return Y, final_state


def mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None,
                              seq_idx=None, dt_softplus=False, dt_limit=(0.0, float("inf")),
                              return_final_states=False):
    """The Triton kernel's reference: dt discretised, the length padded to a multiple of the chunk."""
    batch, seqlen, nheads, headdim = x.shape
    if dt_bias is not None:
        dt = dt + dt_bias
    if dt_softplus:
        dt = F.softplus(dt)
    if dt_limit != (0.0, float("inf")):
        dt = dt.clamp(min=dt_limit[0], max=dt_limit[1])
    B = B.repeat_interleave(nheads // B.shape[2], dim=2)  # "b l g n -> b l (g h) n"
    C = C.repeat_interleave(nheads // C.shape[2], dim=2)
    pad = (chunk_size - seqlen % chunk_size) % chunk_size
    X = F.pad(x * dt.unsqueeze(-1), (0, 0, 0, 0, 0, pad))
    Adt = F.pad(A * dt, (0, 0, 0, pad))
    B = F.pad(B, (0, 0, 0, 0, 0, pad))
    C = F.pad(C, (0, 0, 0, 0, 0, pad))
    init = None if initial_states is None else initial_states[:, None]  # "b h p n -> b 1 h p n"
    y, final = ssd_minimal_discrete(X, Adt, B, C, chunk_size, initial_states=init)
    y = y[:, :seqlen]
    if D is not None:
        y = y + x * (D if D.dim() == 2 else D[:, None])  # "h -> h 1"
    if z is not None:
        y = y * F.silu(z)
    return (y, final) if return_final_states else y


# =============================================================================== mamba_ssm/modules


class Mamba(nn.Module):
    """mamba_simple.py's Mamba, the path without causal_conv1d and the fused kernel."""

    def __init__(self, d_model, d_state=8, d_conv=4, expand=2, dt_min=0.001, dt_max=0.1, dt_init_floor=1e-4):
        super().__init__()
        self.d_model, self.d_state, self.d_conv = d_model, d_state, d_conv
        self.d_inner = int(expand * d_model)
        self.dt_rank = math.ceil(d_model / 16)
        self.in_proj = nn.Linear(d_model, self.d_inner * 2, bias=False)
        self.conv1d = nn.Conv1d(self.d_inner, self.d_inner, bias=True, kernel_size=d_conv, groups=self.d_inner,
                                padding=d_conv - 1)
        self.act = nn.SiLU()
        self.x_proj = nn.Linear(self.d_inner, self.dt_rank + d_state * 2, bias=False)
        self.dt_proj = nn.Linear(self.dt_rank, self.d_inner, bias=True)
        dt = torch.exp(torch.rand(self.d_inner) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
        dt = dt.clamp(min=dt_init_floor)
        with torch.no_grad():
            self.dt_proj.bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse of softplus
        A = torch.arange(1, d_state + 1, dtype=torch.float32)[None, :].repeat(self.d_inner, 1)  # "n -> d n"
        self.A_log = nn.Parameter(torch.log(A))
        self.D = nn.Parameter(torch.ones(self.d_inner))
        self.out_proj = nn.Linear(self.d_inner, d_model, bias=False)

    def forward(self, hidden_states):
        batch, seqlen, dim = hidden_states.shape
        # rearrange(self.in_proj.weight @ rearrange(hidden_states, "b l d -> d (b l)"), "d (b l) -> b d l")
        xz = self.in_proj.weight @ hidden_states.permute(2, 0, 1).reshape(dim, batch * seqlen)
        xz = xz.view(-1, batch, seqlen).permute(1, 0, 2)
        A = -torch.exp(self.A_log)  # (d_inner, d_state)
        x, z = xz.chunk(2, dim=1)
        x = self.act(self.conv1d(x)[..., :seqlen])
        x_dbl = self.x_proj(x.permute(0, 2, 1).reshape(batch * seqlen, -1))  # "b d l -> (b l) d"
        dt, B, C = torch.split(x_dbl, [self.dt_rank, self.d_state, self.d_state], dim=-1)
        dt = self.dt_proj.weight @ dt.t()
        dt = dt.view(-1, batch, seqlen).permute(1, 0, 2)  # "d (b l) -> b d l"
        B = B.view(batch, seqlen, -1).permute(0, 2, 1).contiguous()  # "(b l) dstate -> b dstate l"
        C = C.view(batch, seqlen, -1).permute(0, 2, 1).contiguous()
        y = selective_scan_fn(x, dt, A, B, C, self.D, z=z, delta_bias=self.dt_proj.bias, delta_softplus=True,
                              return_last_state=False)
        return self.out_proj(y.permute(0, 2, 1))  # "b d l -> b l d"


class Mamba2(nn.Module):
    """mamba2.py's Mamba2, the path without the fused split-conv-scan kernel (rmsnorm off: z gates in the scan);
    learnable initial states as mamba2_simple.py has them."""

    def __init__(self, d_model, d_state=8, d_conv=4, expand=2, headdim=8, ngroups=2, chunk_size=8,
                 D_has_hdim=False, dt_limit=(0.0, float("inf")), learnable_init_states=False):
        super().__init__()
        self.d_inner = expand * d_model
        self.headdim, self.ngroups, self.d_state = headdim, ngroups, d_state
        self.nheads = self.d_inner // headdim
        self.chunk_size, self.D_has_hdim, self.dt_limit = chunk_size, D_has_hdim, dt_limit
        d_in_proj = 2 * self.d_inner + 2 * ngroups * d_state + self.nheads
        self.in_proj = nn.Linear(d_model, d_in_proj, bias=False)
        conv_dim = self.d_inner + 2 * ngroups * d_state
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, bias=True, kernel_size=d_conv, groups=conv_dim,
                                padding=d_conv - 1)
        self.act = nn.SiLU()
        dt = torch.exp(torch.rand(self.nheads) * (math.log(0.1) - math.log(0.001)) + math.log(0.001)).clamp(min=1e-4)
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))
        self.A_log = nn.Parameter(torch.log(torch.empty(self.nheads).uniform_(1, 16)))
        self.D = nn.Parameter(torch.ones(self.d_inner if D_has_hdim else self.nheads))
        self.out_proj = nn.Linear(self.d_inner, d_model, bias=False)
        self.learnable_init_states = learnable_init_states
        if learnable_init_states:  # mamba2_simple.py's
            self.init_states = nn.Parameter(torch.zeros(self.nheads, self.headdim, self.d_state))

    def forward(self, u):
        batch, seqlen, dim = u.shape
        zxbcdt = self.in_proj(u)
        A = -torch.exp(self.A_log)
        initial_states = self.init_states[None].repeat(batch, 1, 1, 1) if self.learnable_init_states else None
        z, xBC, dt = torch.split(zxbcdt, [self.d_inner, self.d_inner + 2 * self.ngroups * self.d_state, self.nheads],
                                 dim=-1)
        xBC = self.act(self.conv1d(xBC.transpose(1, 2)).transpose(1, 2))[:, :seqlen]
        x, B, C = torch.split(xBC, [self.d_inner, self.ngroups * self.d_state, self.ngroups * self.d_state], dim=-1)
        dt_limit_kwargs = {} if self.dt_limit == (0.0, float("inf")) else dict(dt_limit=self.dt_limit)
        y = mamba_chunk_scan_combined(
            x.view(batch, seqlen, -1, self.headdim), dt, A,
            B.view(batch, seqlen, self.ngroups, -1), C.view(batch, seqlen, self.ngroups, -1),
            chunk_size=self.chunk_size,
            D=self.D.view(-1, self.headdim) if self.D_has_hdim else self.D,
            z=z.view(batch, seqlen, -1, self.headdim),
            dt_bias=self.dt_bias, dt_softplus=True, seq_idx=None, initial_states=initial_states, **dt_limit_kwargs,
        )
        return self.out_proj(y.reshape(batch, seqlen, -1))


class MambaLM(nn.Module):
    """mixer_seq_simple.py's MambaLMHeadModel, cut down: embedding, prenorm residual blocks, norm_f, tied head."""

    def __init__(self, version: int = 1, **mixer):
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, DIM)
        self.norms = nn.ModuleList(nn.LayerNorm(DIM) for _ in range(LAYERS))
        self.mixers = nn.ModuleList((Mamba if version == 1 else Mamba2)(DIM, **mixer) for _ in range(LAYERS))
        self.norm_f = nn.LayerNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)
        self.lm_head.weight = self.embedding.weight

    def forward(self, idx):
        h = self.embedding(idx)
        residual = None
        for norm, mixer in zip(self.norms, self.mixers):
            residual = h if residual is None else h + residual
            h = mixer(norm(residual))
        return self.lm_head(self.norm_f(h + residual))
