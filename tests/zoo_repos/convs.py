"""Convolutions and shifts along the sequence: Hyena (safari), S4D (state-spaces/s4), H3
(HazyResearch/H3) and RWKV's token shift."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from zoo_repos.common import CTX, DIM, LAYERS, VOCAB
from zoo_repos.gpt import NanoBlock, NanoCausalSelfAttention, NanoGPTConfig

# =============================================================================== Hyena (safari)


def fftconv(u, k, D):
    seqlen = u.shape[-1]
    fft_size = 2 * seqlen

    k_f = torch.fft.rfft(k, n=fft_size) / fft_size
    u_f = torch.fft.rfft(u.to(dtype=k.dtype), n=fft_size)

    if len(u.shape) > 3:
        k_f = k_f.unsqueeze(1)
    y = torch.fft.irfft(u_f * k_f, n=fft_size, norm='forward')[..., :seqlen]

    out = y + u * D.unsqueeze(-1)
    return out.to(dtype=u.dtype)


class OptimModule(nn.Module):
    """ Interface for Module that allows registering buffers/parameters with configurable optimizer hyperparameters """

    def register(self, name, tensor, lr=None, wd=0.0):
        """Register a tensor with a configurable learning rate and 0 weight decay"""

        if lr == 0.0:
            self.register_buffer(name, tensor)
        else:
            self.register_parameter(name, nn.Parameter(tensor))

            optim = {}
            if lr is not None:
                optim["lr"] = lr
            if wd is not None:
                optim["weight_decay"] = wd
            setattr(getattr(self, name), "_optim", optim)


class HyenaSin(nn.Module):
    def __init__(self, dim, w=10, train_freq=True):
        super().__init__()
        self.freq = nn.Parameter(w * torch.ones(1, dim)) if train_freq else w * torch.ones(1, dim)

    def forward(self, x):
        return torch.sin(self.freq * x)


class HyenaPositionalEmbedding(OptimModule):
    def __init__(self, emb_dim: int, seq_len: int, lr_pos_emb: float = 1e-5, **kwargs):
        """Complex exponential positional embeddings for Hyena filters."""
        super().__init__()

        self.seq_len = seq_len
        # The time embedding fed to the filteres is normalized so that t_f = 1
        t = torch.linspace(0, 1, self.seq_len)[None, :, None]  # 1, L, 1

        if emb_dim > 1:
            bands = (emb_dim - 1) // 2
        # To compute the right embeddings we use the "proper" linspace
        t_rescaled = torch.linspace(0, seq_len - 1, seq_len)[None, :, None]
        w = 2 * math.pi * t_rescaled / seq_len  # 1, L, 1

        f = torch.linspace(1e-4, bands - 1, bands)[None, None]
        z = torch.exp(-1j * f * w)
        z = torch.cat([t, z.real, z.imag], dim=-1)
        self.register("z", z, lr=lr_pos_emb)
        self.register("t", t, lr=0.0)

    def forward(self, L):
        return self.z[:, :L], self.t[:, :L]


class HyenaExponentialModulation(OptimModule):
    def __init__(self, d_model, fast_decay_pct=0.3, slow_decay_pct=1.5, target=1e-2, modulation_lr=0.0,
                 modulate: bool = True, shift: float = 0.0, **kwargs):
        super().__init__()
        self.modulate = modulate
        self.shift = shift
        max_decay = math.log(target) / fast_decay_pct
        min_decay = math.log(target) / slow_decay_pct
        deltas = torch.linspace(min_decay, max_decay, d_model)[None, None]
        self.register("deltas", deltas, lr=modulation_lr)

    def forward(self, t, x):
        if self.modulate:
            decay = torch.exp(-t * self.deltas.abs())
            x = x * (decay + self.shift)
        return x


class HyenaFilter(OptimModule):
    def __init__(self, d_model, emb_dim=3, order=16, fused_fft_conv=False, seq_len=1024, lr=1e-3, lr_pos_emb=1e-5,
                 dropout=0.0, w=1, wd=0, bias=True, num_inner_mlps=2, normalized=False, **kwargs):
        super().__init__()
        self.d_model = d_model
        self.use_bias = bias
        self.fused_fft_conv = fused_fft_conv
        self.bias = nn.Parameter(torch.randn(self.d_model))
        self.dropout = nn.Dropout(dropout)

        act = HyenaSin(dim=order, w=w)
        self.emb_dim = emb_dim
        assert emb_dim % 2 != 0 and emb_dim >= 3, \
            "emb_dim must be odd and greater or equal to 3 (time, sine and cosine)"
        self.seq_len = seq_len

        self.pos_emb = HyenaPositionalEmbedding(emb_dim, seq_len, lr_pos_emb)

        self.implicit_filter = nn.Sequential(
            nn.Linear(emb_dim, order),
            act,
        )
        for i in range(num_inner_mlps):
            self.implicit_filter.append(nn.Linear(order, order))
            self.implicit_filter.append(act)

        self.implicit_filter.append(nn.Linear(order, d_model, bias=False))

        self.modulation = HyenaExponentialModulation(d_model, **kwargs)

        self.normalized = normalized

    def filter(self, L, *args, **kwargs):
        z, t = self.pos_emb(L)
        h = self.implicit_filter(z)
        h = self.modulation(t, h)
        return h

    def forward(self, x, L, k=None, bias=None, *args, **kwargs):
        if k is None:
            k = self.filter(L)

        # Ensure compatibility with filters that return a tuple
        k = k[0] if type(k) is tuple else k

        y = fftconv(x, k, bias)
        return y


class HyenaOperator(nn.Module):
    """HazyResearch/safari standalone_hyena.py ``HyenaOperator``: ``in_proj``, the short
    depthwise ``nn.Conv1d(inner, inner, 3, padding=2, groups=inner)`` sliced
    ``[..., :l_filter]``, the implicit long filter (positional features ``z[:, :L]`` through
    a Sin MLP, exponential modulation) applied by ``fftconv`` (``torch.fft.rfft`` over
    ``2 * L``), gating, ``out_proj``. ``rearrange`` spelled as ``transpose``/``view``.
    ``long_filter=False`` keeps the short conv and the gating only (an H3-style short-conv
    operator with no FFT)."""

    def __init__(self, d_model, l_max, order=2, filter_order=64, dropout=0.0, filter_dropout=0.0,
                 long_filter=True, **filter_args):
        super().__init__()
        self.d_model = d_model
        self.l_max = l_max
        self.order = order
        self.long_filter = long_filter
        inner_width = d_model * (order + 1)
        self.dropout = nn.Dropout(dropout)
        self.in_proj = nn.Linear(d_model, inner_width)
        self.out_proj = nn.Linear(d_model, d_model)

        self.short_filter = nn.Conv1d(
            inner_width,
            inner_width,
            3,
            padding=2,
            groups=inner_width
        )
        if long_filter:
            self.filter_fn = HyenaFilter(
                d_model * (order - 1),
                order=filter_order,
                seq_len=l_max,
                channels=1,
                dropout=filter_dropout,
                **filter_args
            )

    def forward(self, u, *args, **kwargs):
        l = u.size(-2)
        l_filter = min(l, self.l_max)
        u = self.in_proj(u)
        u = u.transpose(1, 2)  # rearrange(u, 'b l d -> b d l')

        uc = self.short_filter(u)[..., :l_filter]
        *x, v = uc.split(self.d_model, dim=1)

        if self.long_filter:
            k = self.filter_fn.filter(l_filter)[0]
            # rearrange(k, 'l (o d) -> o d l', o=self.order - 1)
            k = k.view(l_filter, self.order - 1, self.d_model).permute(1, 2, 0)
            bias = self.filter_fn.bias.view(self.order - 1, self.d_model)  # rearrange(bias, '(o d) -> o d')

        for o, x_i in enumerate(reversed(x[1:])):
            v = self.dropout(v * x_i)
            if self.long_filter:
                v = self.filter_fn(v, l_filter, k=k[o], bias=bias[o])

        y = (v * x[0]).transpose(1, 2)  # rearrange(v * x[0], 'b d l -> b l d')

        y = self.out_proj(y)
        return y


class HyenaBlock(nn.Module):
    def __init__(self, long_filter):
        super().__init__()
        self.ln_1 = nn.LayerNorm(DIM)
        self.mixer = HyenaOperator(DIM, l_max=CTX, order=2, filter_order=16, long_filter=long_filter)
        self.ln_2 = nn.LayerNorm(DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

    def forward(self, x):
        x = x + self.mixer(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class HyenaShortConvLM(nn.Module):
    """A short causal depthwise conv with gating (safari's ``HyenaOperator`` with its long
    filter left out: ``Conv1d(3d, 3d, 3, padding=2, groups=3d)`` on ``x.transpose(1, 2)``
    sliced ``[..., :l_filter]``, then ``v * x1 * x0``) in the first layer, and a plain
    causal attention layer (nanoGPT's SDPA block) in the second."""

    def __init__(self):
        super().__init__()
        cfg = NanoGPTConfig(flash=True)
        self.wte = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([HyenaBlock(long_filter=False), NanoBlock(cfg)])
        self.ln_f = nn.LayerNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, idx):
        x = self.wte(idx)
        for b in self.blocks:
            x = b(x)
        return self.lm_head(self.ln_f(x))


class HyenaFFTLM(nn.Module):
    """Two safari ``HyenaOperator`` layers with their FFT long convolution (``fftconv``: an
    implicit filter of length L evaluated at ``z[:, :L]`` and convolved through
    ``torch.fft.rfft`` / ``irfft``). Causal as a model (the FFT is padded to ``2 L`` and
    truncated), but the filter is a function of the sequence length and the convolution
    reads every earlier row of the packed sequence."""

    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([HyenaBlock(long_filter=True) for _ in range(LAYERS)])
        self.ln_f = nn.LayerNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, idx):
        x = self.wte(idx)
        for b in self.blocks:
            x = b(x)
        return self.lm_head(self.ln_f(x))


# =============================================================================== S4D (state-spaces/s4)


class S4DKernel(nn.Module):
    """state-spaces/s4 models/s4/s4d.py: complex diagonal ``A``, ``C`` stored through
    ``view_as_real``, ZOH discretisation and the Vandermonde kernel over ``arange(L)``."""

    def __init__(self, d_model, N=16, dt_min=0.001, dt_max=0.1):
        super().__init__()
        H = d_model
        self.log_dt = nn.Parameter(torch.rand(H) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
        self.C = nn.Parameter(torch.view_as_real(torch.randn(H, N // 2, dtype=torch.cfloat)))
        self.log_A_real = nn.Parameter(torch.log(0.5 * torch.ones(H, N // 2)))
        self.A_imag = nn.Parameter(math.pi * torch.arange(N // 2).float().repeat(H, 1))

    def forward(self, L):
        dt = torch.exp(self.log_dt)  # (H)
        C = torch.view_as_complex(self.C)  # (H N)
        A = -torch.exp(self.log_A_real) + 1j * self.A_imag  # (H N)
        dtA = A * dt.unsqueeze(-1)  # (H N)
        K = dtA.unsqueeze(-1) * torch.arange(L, device=A.device)  # (H N L)
        C = C * (torch.exp(dtA) - 1.) / A
        K = 2 * torch.einsum('hn, hnl -> hl', C, torch.exp(K)).real
        return K


class S4D(nn.Module):
    def __init__(self, d_model, d_state=16):
        super().__init__()
        self.h = d_model
        self.D = nn.Parameter(torch.randn(self.h))
        self.kernel = S4DKernel(self.h, N=d_state)
        self.activation = nn.GELU()
        self.output_linear = nn.Sequential(nn.Conv1d(self.h, 2 * self.h, kernel_size=1), nn.GLU(dim=-2))

    def forward(self, u):
        """Input and output shape (B, H, L)"""
        L = u.size(-1)
        k = self.kernel(L=L)  # (H L)
        k_f = torch.fft.rfft(k, n=2 * L)  # (H L)
        u_f = torch.fft.rfft(u, n=2 * L)  # (B H L)
        y = torch.fft.irfft(u_f * k_f, n=2 * L)[..., :L]  # (B H L)
        y = y + u * self.D.unsqueeze(-1)
        return self.output_linear(self.activation(y))


class S4DLM(nn.Module):
    """s4's example.py S4Model (prenorm, transposed layers) over token embeddings."""

    def __init__(self):
        super().__init__()
        self.encoder = nn.Embedding(VOCAB, DIM)
        self.s4_layers = nn.ModuleList([S4D(DIM) for _ in range(LAYERS)])
        self.norms = nn.ModuleList([nn.LayerNorm(DIM) for _ in range(LAYERS)])
        self.decoder = nn.Linear(DIM, VOCAB)

    def forward(self, x):
        x = self.encoder(x).transpose(-1, -2)  # (B, d_model, L)
        for layer, norm in zip(self.s4_layers, self.norms):
            z = norm(x.transpose(-1, -2)).transpose(-1, -2)
            x = layer(z) + x
        return self.decoder(x.transpose(-1, -2))


# =============================================================================== H3 (HazyResearch/H3)


class SSKernelShift(nn.Module):
    """The shift SSM's kernel: ``irfft(rfft(B) * rfft(C))[:N]`` padded to ``L``."""

    def __init__(self, H, N=8):
        super().__init__()
        self.N = N
        B = torch.zeros(H, N)
        B[..., 0] = 1.0  # shift matrix: B = e_0
        self.B = nn.Parameter(B)
        self.C = nn.Parameter(torch.randn(1, H, N))

    def forward(self, L):
        B, C = self.B, self.C
        k = torch.fft.irfft(torch.fft.rfft(B, n=2 * self.N) * torch.fft.rfft(C, n=2 * self.N),
                            n=2 * self.N)[..., :self.N]
        if k.size(-1) < L:
            k = F.pad(k, (0, L - k.size(-1)))
        return k[..., :L]


class SSKernelDiag(nn.Module):
    def __init__(self, H, N=8, dt_min=0.001, dt_max=0.1):
        super().__init__()
        self.log_dt = nn.Parameter(torch.rand(H) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
        self.inv_A_real = nn.Parameter(torch.log(torch.exp(0.5 * torch.ones(H, N // 2)) - 1))  # softplus^-1
        self.A_imag = nn.Parameter(math.pi * torch.arange(N // 2).float().repeat(H, 1))
        self.C = nn.Parameter(torch.view_as_real(torch.randn(1, H, N // 2, dtype=torch.cfloat)))

    def forward(self, L):
        dt = torch.exp(self.log_dt)
        A = -F.softplus(self.inv_A_real) + 1j * self.A_imag
        dtA = A * dt.unsqueeze(-1)
        C = torch.view_as_complex(self.C) * (torch.exp(dtA) - 1.0) / A
        K = dtA.unsqueeze(-1) * torch.arange(L, device=A.device)
        return 2 * torch.einsum("chn,hnl->chl", C, torch.exp(K)).real


class H3(nn.Module):
    """HazyResearch/H3 src/models/ssm/h3.py (head_dim 1): the shift SSM on ``k``, ``k * v``
    through the diagonal SSM, both as FFT convolutions of size ``L_kernel + L``, ``q *``."""

    def __init__(self, d_model=DIM, d_state=8):
        super().__init__()
        self.H = d_model
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(d_model, d_model) for _ in range(3))
        self.ssm_k_kernel = SSKernelShift(self.H, N=d_state)
        self.ssm_k_D = nn.Parameter(torch.randn(self.H))
        self.ssm_kernel = SSKernelDiag(self.H, N=d_state)
        self.D = nn.Parameter(torch.randn(self.H))
        self.out_proj = nn.Linear(d_model, d_model)

    def forward(self, u):
        L_og = u.size(-2)
        L_kernel = L_og
        ssm_kernel = self.ssm_kernel(L=L_kernel).squeeze(0)  # '1 h l -> h l'
        u = u.reshape(-1, u.size(-1))  # 'b l h -> (b l) h'
        q = self.q_proj.weight @ u.T + self.q_proj.bias.unsqueeze(-1)
        k = self.k_proj.weight @ u.T + self.k_proj.bias.unsqueeze(-1)
        v = self.v_proj.weight @ u.T + self.v_proj.bias.unsqueeze(-1)
        q, k, v = [x.view(x.size(0), -1, L_og).transpose(0, 1) for x in (q, k, v)]  # 'h (b l) -> b h l'
        ssm_k_kernel = self.ssm_k_kernel(L=L_kernel).squeeze(0)
        fft_size = L_kernel + L_og
        k_f = torch.fft.rfft(k, n=fft_size)
        ssm_k_kernel_f = torch.fft.rfft(ssm_k_kernel, n=fft_size)
        shift_k_out = torch.fft.irfft(k_f * ssm_k_kernel_f, n=fft_size)[..., :L_og]
        k = shift_k_out + self.ssm_k_D.unsqueeze(-1) * k
        kv = k * v
        kv_f = torch.fft.rfft(kv, n=fft_size)
        ssm_kernel_f = torch.fft.rfft(ssm_kernel, n=fft_size)
        y = torch.fft.irfft(kv_f * ssm_kernel_f, n=fft_size)[..., :L_og]
        y = y + kv * self.D.unsqueeze(-1)
        return self.out_proj((q * y).transpose(1, 2))  # 'b h l -> b l h'


class H3LM(nn.Module):
    """H3's prenorm residual blocks (mixer, then an MLP), tied embeddings."""

    def __init__(self):
        super().__init__()
        self.embeddings = nn.Embedding(VOCAB, DIM)
        self.mixers = nn.ModuleList([H3(DIM) for _ in range(LAYERS)])
        self.norms1 = nn.ModuleList([nn.LayerNorm(DIM) for _ in range(LAYERS)])
        self.norms2 = nn.ModuleList([nn.LayerNorm(DIM) for _ in range(LAYERS)])
        self.mlps = nn.ModuleList([nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(approximate="tanh"),
                                                 nn.Linear(4 * DIM, DIM)) for _ in range(LAYERS)])
        self.ln_f = nn.LayerNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)
        self.lm_head.weight = self.embeddings.weight

    def forward(self, input_ids):
        x = self.embeddings(input_ids)
        for mixer, n1, n2, mlp in zip(self.mixers, self.norms1, self.norms2, self.mlps):
            x = x + mixer(n1(x))
            x = x + mlp(n2(x))
        return self.lm_head(self.ln_f(x))


# =============================================================================== RWKV token shift


class RWKVChannelMix(nn.Module):
    """BlinkDL/RWKV-LM RWKV-v4neo src/model.py ``RWKV_ChannelMix``: the token shift
    ``nn.ZeroPad2d((0, 0, 1, -1))`` (each row reads the previous row), time-mix
    interpolation, squared ReLU key, sigmoid receptance gate."""

    def __init__(self, n_embd, n_layer, layer_id, dim_ffn):
        super().__init__()
        self.layer_id = layer_id
        self.time_shift = nn.ZeroPad2d((0, 0, 1, -1))
        with torch.no_grad():  # fancy init of time_mix
            ratio_1_to_almost0 = 1.0 - (layer_id / n_layer)  # 1 to ~0
            ddd = torch.ones(1, 1, n_embd)
            for i in range(n_embd):
                ddd[0, 0, i] = i / n_embd
            self.time_mix_k = nn.Parameter(torch.pow(ddd, ratio_1_to_almost0))
            self.time_mix_r = nn.Parameter(torch.pow(ddd, ratio_1_to_almost0))
        self.key = nn.Linear(n_embd, dim_ffn, bias=False)
        self.receptance = nn.Linear(n_embd, n_embd, bias=False)
        self.value = nn.Linear(dim_ffn, n_embd, bias=False)

    def forward(self, x):
        xx = self.time_shift(x)
        xk = x * self.time_mix_k + xx * (1 - self.time_mix_k)
        xr = x * self.time_mix_r + xx * (1 - self.time_mix_r)
        k = self.key(xk)
        k = torch.square(torch.relu(k))
        kv = self.value(k)
        return torch.sigmoid(self.receptance(xr)) * kv


class RWKVAttnBlock(nn.Module):
    def __init__(self, layer_id):
        super().__init__()
        self.layer_id = layer_id
        self.ln1 = nn.LayerNorm(DIM)
        self.ln2 = nn.LayerNorm(DIM)
        if self.layer_id == 0:
            self.ln0 = nn.LayerNorm(DIM)
        self.att = NanoCausalSelfAttention(NanoGPTConfig(flash=True))
        self.ffn = RWKVChannelMix(DIM, LAYERS, layer_id, 4 * DIM)

    def forward(self, x):
        if self.layer_id == 0:
            x = self.ln0(x)
        x = x + self.att(self.ln1(x))
        x = x + self.ffn(self.ln2(x))
        return x


class RWKVShiftLM(nn.Module):
    """RWKV-v4neo's ``Block`` layout (``ln0`` on layer 0, ``ln1``/``ln2``) with causal SDPA
    attention in place of its WKV time-mix, and its ``RWKV_ChannelMix`` (ZeroPad2d token
    shift) as the feed-forward."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([RWKVAttnBlock(i) for i in range(LAYERS)])
        self.ln_out = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, idx):
        x = self.emb(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_out(x))
