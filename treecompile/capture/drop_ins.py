"""The drop-ins the wrapper swaps in for a model's sequence kernels before capture.

Hugging Face's hybrid models (and flash-linear-attention's kernels they may call) run their
causal conv and their scans through module-level functions; `treecompile.capture.dynamo.SEQUENCE_KERNELS`
names them and swaps each, for one call, for the drop-in here. A drop-in takes the same
arguments and returns the same result, does the token-wise preparation itself (head repeat,
L2 norm, query scaling, ``dt`` discretisation) and runs the sequence part as one
treecompile op (:mod:`treecompile.kernels.conv`, :mod:`~treecompile.kernels.scans.gdn`,
:mod:`~treecompile.kernels.scans.mamba2`, :mod:`~treecompile.kernels.scans.mamba`), one node per layer for
the passes to find.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from treecompile.kernels import conv as _conv  # noqa: F401  (registers treecompile::causal_conv1d)
from treecompile.kernels.scans import gdn as _gdn  # noqa: F401  (registers treecompile::gated_delta_rule)
from treecompile.kernels.scans import mamba as _mamba  # noqa: F401  (registers treecompile::selective_scan)
from treecompile.kernels.scans import mamba2 as _mamba2  # noqa: F401  (registers treecompile::ssd_scan)
from treecompile.kernels.dtypes import compute_dtype

__all__ = ["dbrx_experts_forward", "experts_class_swaps", "hf_causal_conv1d_fn", "hf_chunk_gated_delta_rule", "fla_chunk_gated_delta_rule", "hf_mamba2_chunk_scan",
           "hf_mamba2_split_conv1d_scan_combined", "hf_mamba_selective_scan", "hf_mamba_inner_fn"]

Tensor = torch.Tensor


# --------------------------------------------------------------------------- the causal conv


def hf_causal_conv1d_fn(
    hidden_states: Tensor, weight: Tensor, bias: Tensor | None = None, activation: str | None = None, **kwargs: Any
) -> Tensor:
    """Drop-in for HF's ``causal_conv1d_fn(x [B, C, S], weight [C, K], bias, activation)``.

    The conv is ``treecompile::causal_conv1d``; the activation acts on each row alone.
    """
    if kwargs.get("seq_idx") is not None or kwargs.get("cu_seqlens") is not None:
        raise ValueError("treecompile's causal conv keeps packed sequences apart itself: pass no seq_idx / cu_seqlens")
    out = torch.ops.treecompile.causal_conv1d(hidden_states.to(weight.dtype), weight, bias)
    if activation is not None:
        from transformers.activations import ACT2FN

        out = ACT2FN[activation](out)
    return out.to(hidden_states.dtype)


# --------------------------------------------------------------------------- Gated DeltaNet


def _l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    # HF's (and fla's) l2norm: x / sqrt(sum(x^2) + eps), over the head dim only (token-wise).
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def hf_chunk_gated_delta_rule(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    g: Tensor,
    beta: Tensor,
    chunk_size: int = 64,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    **kwargs: Any,
) -> tuple[Tensor, Tensor | None]:
    """Drop-in for HF's ``torch_chunk_gated_delta_rule`` / ``torch_recurrent_gated_delta_rule``.

    Same arguments and result (``[B, S, Hv, Dv]`` and the final state or None); the chunk size
    only changes how HF's kernel sums, not what it computes. The token-wise preparation
    (head repeat, L2 norm, ``Dk^-0.5`` query scaling, in at least float32 as HF does) runs
    here, the recurrence in ``treecompile::gated_delta_rule``.
    """
    return _gated_delta_rule(query, key, value, g, beta, None, initial_state, output_final_state,
                             use_qk_l2norm_in_kernel, kwargs)


def fla_chunk_gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    **kwargs: Any,
) -> tuple[Tensor, Tensor | None]:
    """Drop-in for flash-linear-attention's ``chunk_gated_delta_rule`` / ``fused_recurrent_gated_delta_rule``.

    Same arguments and result: ``q, k`` ``[B, T, H, K]``, ``v`` ``[B, T, HV, V]`` (``HV`` a
    multiple of ``H``), ``g`` (log decay) and ``beta`` ``[B, T, HV]``; ``scale`` defaults to
    ``K^-0.5``. Returns ``o`` and the final state (None unless asked for).
    """
    return _gated_delta_rule(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                             kwargs)


def _gated_delta_rule(query, key, value, g, beta, scale, initial_state, output_final_state, l2norm, kwargs):
    """The token-wise preparation (head repeat, L2 norm, query scaling, in at least float32),
    then ``treecompile::gated_delta_rule``."""
    if kwargs.get("cu_seqlens") is not None:
        raise ValueError("treecompile's gated delta rule keeps packed sequences apart itself: pass no cu_seqlens")
    if kwargs.get("head_first"):
        raise ValueError("treecompile's gated delta rule takes [B, T, H, D] inputs: head_first=True is not supported")
    dtype = query.dtype
    ct = compute_dtype(dtype)
    hk, hv = key.shape[2], value.shape[2]
    if hk != hv:
        query = query.repeat_interleave(hv // hk, dim=2)
        key = key.repeat_interleave(hv // hk, dim=2)
    query, key, value, g, beta = (x.to(ct) for x in (query, key, value, g, beta))
    if l2norm:
        query, key = _l2norm(query), _l2norm(key)
    query = query * (query.shape[-1] ** -0.5 if scale is None else scale)
    out, final = torch.ops.treecompile.gated_delta_rule(query, key, value, g, beta, initial_state)
    return out.to(dtype), (final if output_final_state else None)


# --------------------------------------------------------------------------- Mamba2's SSD


def hf_mamba2_chunk_scan(
    hidden_states: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    chunk_size: int = 256,
    D: Tensor | None = None,
    dt_bias: Tensor | None = None,
    initial_states: Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    return_final_states: bool = False,
    **kwargs: Any,
) -> Tensor | tuple[Tensor, Tensor]:
    """Drop-in for HF's ``mamba2_chunk_scan``: same arguments and result.

    ``hidden_states`` ``[B, S, H, P]``, ``dt`` ``[B, S, H]``, ``A`` ``[H]``, ``B, C``
    ``[B, S, G, N]`` (``G`` groups shared by ``H / G`` heads each), ``D`` ``[H]``; states
    ``[B, H, P, N]``. Returns ``y`` in at least float32, as HF's does (and the final state
    when asked). The chunk size only changes how HF's kernel sums, not what it computes.
    """
    if kwargs.get("seq_idx") is not None or kwargs.get("cu_seqlens") is not None:
        raise ValueError("treecompile's Mamba2 scan keeps packed sequences apart itself: pass no seq_idx / cu_seqlens")
    if kwargs.get("z") is not None:
        raise ValueError("treecompile's Mamba2 scan does not gate inside the kernel: pass z=None")
    ct = compute_dtype(hidden_states.dtype)
    heads = hidden_states.shape[2]
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)
    if dt_softplus:
        dt = F.softplus(dt)
    dt = torch.clamp(dt, min=dt_limit[0], max=dt_limit[1]).to(ct)
    x = hidden_states.to(ct)
    groups = B.shape[2]
    k = B.to(ct).repeat_interleave(heads // groups, dim=2)
    q = C.to(ct).repeat_interleave(heads // groups, dim=2)
    init = None if initial_states is None else initial_states.transpose(-1, -2).to(ct)
    y, final = torch.ops.treecompile.ssd_scan(q, k, x, dt * A.to(ct), dt, init)
    if D is not None:
        y = y + D.to(ct)[:, None] * x
    return (y, final.transpose(-1, -2)) if return_final_states else y


def hf_mamba2_split_conv1d_scan_combined(*args: Any, **kwargs: Any) -> None:
    """Stands in for HF's fused ``mamba2_split_conv1d_scan_combined``: None, the unfused path."""
    return None


# --------------------------------------------------------------------------- Mamba's selective scan


def hf_mamba_selective_scan(
    hidden_states: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None = None,
    z: Tensor | None = None,
    delta_bias: Tensor | None = None,
    delta_softplus: bool = False,
    return_last_state: bool = False,
    use_mambapy: bool = False,
    use_associative_scan: bool = False,
    **kwargs: Any,
) -> Tensor | tuple[Tensor, Tensor]:
    """Drop-in for HF's ``mamba_selective_scan`` (mamba-ssm's ``selective_scan_fn`` signature;
    Mamba, Falcon-Mamba, Jamba, Zamba, transformers >= 5.15): same arguments and result.

    ``hidden_states`` (``x``) and ``dt`` ``[B, D, S]``, ``A`` ``[D, N]``, ``B, C`` ``[B, N, S]``,
    ``D`` ``[D]``, ``z`` ``[B, D, S]``, ``delta_bias`` ``[D]``. As HF's: ``dt`` gets its bias
    and softplus in its own dtype, the scan runs in the dtype of ``A * dt`` (at least
    float32), its output is read in ``x``'s dtype, then ``+ x * D`` and ``* silu(z)`` as HF
    writes them. The scan itself is ``treecompile::selective_scan`` with ``u = dt * x``. HF
    reads the state after casting it to ``x``'s dtype; here it is read in the scan's dtype
    and the result cast (the same in float32 and float64, one rounding apart in bfloat16).
    ``use_mambapy`` and ``use_associative_scan`` only choose how HF computes the scan.
    Returns ``y`` ``[B, D, S]`` (and the final state ``[B, D, N]`` with ``return_last_state``).
    """
    if kwargs.get("seq_idx") is not None or kwargs.get("cu_seqlens") is not None:
        raise ValueError("treecompile's selective scan keeps packed sequences apart itself: pass no seq_idx / "
                         "cu_seqlens")
    if B.dim() != 3 or C.dim() != 3 or A.dim() != 2:
        raise ValueError(f"treecompile's selective scan takes input-dependent B, C [batch, state, length] and A "
                         f"[channels, state]; got B {tuple(B.shape)}, C {tuple(C.shape)}, A {tuple(A.shape)} "
                         "(grouped or time-invariant B / C are not supported)")
    input_dtype = hidden_states.dtype
    if delta_bias is not None:
        dt = dt + delta_bias.to(dt.dtype)[..., None]
    if delta_softplus:
        dt = F.softplus(dt)
    ct = compute_dtype(torch.promote_types(torch.promote_types(A.dtype, dt.dtype), input_dtype))
    x = hidden_states.transpose(1, 2).to(ct)  # [B, S, D]
    step = dt.transpose(1, 2).to(ct)
    y, final = torch.ops.treecompile.selective_scan(step * x, step, A.to(ct), B.transpose(1, 2).to(ct),
                                                    C.transpose(1, 2).to(ct), None)
    out = y.transpose(1, 2).to(torch.promote_types(input_dtype, C.dtype))
    if D is not None:
        out = out + hidden_states * D[None, :, None]
    if z is not None:
        out = out * F.silu(z)
    return (out, final) if return_last_state else out


def hf_mamba_inner_fn(*args: Any, **kwargs: Any) -> None:
    """Stands in for HF's fused ``mamba_inner_fn`` (mamba-ssm's training kernel, conv and scan in
    one): None, which makes the mixer take its unfused path (conv and scan kernels apart)."""
    return None


# --------------------------------------------------------------------------- experts a loop runs


def dbrx_experts_forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
    """Drop-in for ``DbrxExperts.forward``, which loops over the experts a batch hits (a count read
    from the routing, which a capture cannot follow) and does not take Hugging Face's experts
    interface: the same experts between the experts markers as the interface's ``grouped_mm``
    runs them. The ``T * k`` (token, expert) pairs sorted by expert (stable), one grouped product
    per projection (``treecompile::grouped_mm``), each pair weighted by its routing weight and
    added to its token's row in the experts' order, as the loop adds them: token-wise."""
    from treecompile.kernels import grouped_mm as _grouped_mm  # noqa: F401  (registers treecompile::grouped_mm)

    batch, dim, experts, inner = hidden_states.shape[0], self.hidden_size, self.num_experts, self.ffn_hidden_size
    h, idx, w = torch.ops.treecompile.experts_begin(hidden_states.reshape(-1, dim), top_k_index, top_k_weights)
    k = idx.shape[-1]
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    tokens = order // k
    offs = F.one_hot(flat, experts).sum(0).cumsum(0)
    x = h[tokens]
    w1, v1, w2 = (p.view(experts, inner, dim) for p in (self.mlp.w1, self.mlp.v1, self.mlp.w2))
    gate = self.mlp.activation_fn(torch.ops.treecompile.grouped_mm(x, w1.transpose(1, 2), offs))
    up = torch.ops.treecompile.grouped_mm(x, v1.transpose(1, 2), offs)
    y = torch.ops.treecompile.grouped_mm(gate * up, w2, offs) * w.reshape(-1)[order, None]
    out = torch.zeros_like(h).index_add(0, tokens, y.to(h.dtype))
    return torch.ops.treecompile.experts_end(out).view(batch, -1, dim)


#: Experts classes that loop over the experts hit and have no experts interface: ``(module,
#: class name) -> (attributes it must have, lines its forward must have, drop-in forward)``. The
#: lines pin the computation the drop-in repeats (transformers before 5.15 reshaped DBRX's
#: hidden states by the experts' inner size: a forward without them is left alone, and refused).
EXPERTS_CLASSES = {
    ("transformers.models.dbrx.modeling_dbrx", "DbrxExperts"): (
        ("mlp", "num_experts", "hidden_size", "ffn_hidden_size"),
        ("hidden_states = hidden_states.reshape(-1, self.hidden_size)", "for expert_idx in expert_hit:",
         "states = self.mlp(hidden_states[token_idx], w1, v1, w2)",
         "states = states.view(-1, self.hidden_size) * top_k_weights[token_idx, idx, None]",
         "next_states.index_add_(0, token_idx, states)"),
        dbrx_experts_forward),
}


def experts_class_swaps(model: torch.nn.Module) -> list[tuple[Any, str, Any]]:
    """``(class, "forward", drop-in)`` for each experts class of `EXPERTS_CLASSES` among the
    model's modules whose forward is the one the drop-in repeats, swapped for each call like
    the sequence kernels."""
    import inspect

    found = {}
    for m in model.modules():
        cls = type(m)
        known = EXPERTS_CLASSES.get((cls.__module__, cls.__name__))
        if known is None or cls in found or not all(hasattr(m, a) for a in known[0]):
            continue
        try:
            source = inspect.getsource(cls.forward)
        except (OSError, TypeError):
            continue
        if all(line in source for line in known[1]):
            found[cls] = (cls, "forward", known[2])
    return list(found.values())
