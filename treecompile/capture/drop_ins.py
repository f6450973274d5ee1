"""The drop-ins the wrapper swaps in for a model's sequence kernels before capture.

Hugging Face's hybrid models (and flash-linear-attention's kernels they may call) run their
causal conv and their scans through module-level functions; `treecompile.capture.kernel_table.SEQUENCE_KERNELS`
names them and swaps each, for one call, for the drop-in here. A drop-in takes the same
arguments and returns the same result, does the token-wise preparation itself (head repeat,
L2 norm, query scaling, ``dt`` discretisation) and runs the sequence part as one
treecompile op (:mod:`treecompile.kernels.conv`, :mod:`~treecompile.kernels.scans.gdn`,
:mod:`~treecompile.kernels.scans.mamba2`, :mod:`~treecompile.kernels.scans.mamba`), one node per layer for
the passes to find.

Some model classes run code a capture cannot follow (a loop over the experts a batch hits,
group sizes read as Python numbers, a loop over blocks of the sequence): `CLASS_DROP_INS` swaps
their methods, for one call, for drop-ins computing the same function capturably (experts by
grouped products between the experts markers, blockwise linear attention in its parallel form),
each only where the class's code is the one it repeats (`class_swaps`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from treecompile.kernels import conv as _conv  # noqa: F401  (registers treecompile::causal_conv1d)
from treecompile.kernels.scans import gdn as _gdn  # noqa: F401  (registers treecompile::gated_delta_rule)
from treecompile.kernels.scans import kda as _kda  # noqa: F401  (registers treecompile::kimi_delta_rule)
from treecompile.kernels.scans import mamba as _mamba  # noqa: F401  (registers treecompile::selective_scan)
from treecompile.kernels.scans import mamba2 as _mamba2  # noqa: F401  (registers treecompile::ssd_scan)
from treecompile.kernels.dtypes import compute_dtype

__all__ = ["zaya_cca_forward", "minimax_lightning_forward", "dbrx_experts_forward", "longcat_experts_forward", "jetmoe_gating_forward",
           "jetmoe_moe_forward", "jetmoe_moa_map", "jetmoe_moa_reduce", "class_swaps", "hf_causal_conv1d_fn",
           "hf_chunk_gated_delta_rule", "fla_chunk_gated_delta_rule",
           "hf_mamba2_chunk_scan", "mamba2_ssd", "hf_mamba2_split_conv1d_scan_combined", "hf_mamba_selective_scan",
           "hf_mamba_inner_fn"]

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
    """Drop-in for HF's ``torch_chunk_gated_delta_rule`` / ``torch_recurrent_gated_delta_rule``, and
    for its Kimi Delta Attention twins (a decay per key channel, see `_gated_delta_rule`).

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
    then ``treecompile::gated_delta_rule``, or with a decay per key channel (``g`` ``[B, T, H, K]``,
    Kimi Delta Attention: HF's ``chunk_kimi_delta_attention`` / ``recurrent_kimi_delta_attention``
    take the same arguments) ``treecompile::kimi_delta_rule``."""
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
    op = torch.ops.treecompile.kimi_delta_rule if g.dim() == key.dim() else torch.ops.treecompile.gated_delta_rule
    out, final = op(query, key, value, g, beta, initial_state)
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
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)
    if dt_softplus:
        dt = F.softplus(dt)
    dt = torch.clamp(dt, min=dt_limit[0], max=dt_limit[1]).to(ct)
    y, final = mamba2_ssd(hidden_states, dt, A, B, C, D, initial_states)
    return (y, final) if return_final_states else y


def mamba2_ssd(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None,
               initial_states: Tensor | None) -> tuple[Tensor, Tensor]:
    """Mamba-2's scan from its discretised step ``dt`` (bias, softplus and limits applied; the
    compute dtype is ``dt``'s): ``x`` ``[b, l, h, p]``, ``B, C`` ``[b, l, g, n]`` (``g`` groups
    shared by ``h / g`` heads), ``D`` ``[h]`` or ``[h, p]``, states ``[b, h, p, n]``. Returns
    ``(y, final state)`` in the compute dtype, the scan being ``treecompile::ssd_scan``."""
    ct, heads, groups = dt.dtype, x.shape[2], B.shape[2]
    x = x.to(ct)
    k = B.to(ct).repeat_interleave(heads // groups, dim=2)
    q = C.to(ct).repeat_interleave(heads // groups, dim=2)
    init = None if initial_states is None else initial_states.transpose(-1, -2).to(ct)
    y, final = torch.ops.treecompile.ssd_scan(q, k, x, dt * A.to(ct), dt, init)
    if D is not None:
        y = y + (D.to(ct) if D.dim() == 2 else D.to(ct)[:, None]) * x
    return y, final.transpose(-1, -2)


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


def longcat_experts_forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
    """Drop-in for ``LongcatFlashExperts.forward``, which loops over the experts a batch hits: the
    routed experts by grouped products between the experts markers (as `dbrx_experts_forward`),
    the zero-compute experts (indices from ``num_routed_experts`` on) as the token itself; each
    (token, expert) pair weighted by its routing weight and added to its token's row in the
    experts' order, as the loop adds them: token-wise."""
    from treecompile.kernels import grouped_mm as _grouped_mm  # noqa: F401  (registers treecompile::grouped_mm)

    dim, routed = self.hidden_size, self.num_routed_experts
    h, idx, w = torch.ops.treecompile.experts_begin(hidden_states.reshape(-1, dim), top_k_index, top_k_weights)
    k = idx.shape[-1]
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    tokens = order // k
    x = h[tokens]
    if routed > 0 and self.gate_up_proj is not None:
        offs = F.one_hot(flat, self.total_experts).sum(0)[:routed].cumsum(0)
        gate, up = torch.ops.treecompile.grouped_mm(x, self.gate_up_proj[:routed].transpose(1, 2), offs).chunk(2, -1)
        y = torch.ops.treecompile.grouped_mm(self.act_fn(gate) * up, self.down_proj.transpose(1, 2), offs)
        y = torch.where((flat[order] < routed)[:, None], y, x)  # the zero-compute experts: the token itself
    else:
        y = x
    y = y * w.reshape(-1)[order, None]
    out = torch.zeros_like(h).index_add(0, tokens, y.to(h.dtype))
    return torch.ops.treecompile.experts_end(out).view(hidden_states.shape)


def _by_expert(idx: Tensor, experts: int) -> tuple[Tensor, Tensor]:
    """``(order, offs)``: the ``T * k`` (token, slot) pairs sorted by expert (stable: each token's
    pairs in the experts' order) and the end of each expert's group."""
    flat = idx.reshape(-1)
    return torch.argsort(flat, stable=True), F.one_hot(flat, experts).sum(0).cumsum(0)


def _jetmoe_experts(experts: torch.nn.Module, x: Tensor, offs: Tensor) -> Tensor:
    """``JetMoeParallelExperts`` on rows sorted by expert: ``F.linear(rows, weight[e])`` per group."""
    from treecompile.kernels import grouped_mm as _grouped_mm  # noqa: F401  (registers treecompile::grouped_mm)

    return torch.ops.treecompile.grouped_mm(x, experts.weight.transpose(1, 2), offs)


def jetmoe_gating_forward(self, hidden_states: Tensor) -> tuple:
    """Drop-in for ``JetMoeTopKGating.forward`` (with `jetmoe_moe_forward` and the MoA's, which
    read it): the routing, token-wise, ``(top-k experts, their gates, None, None, logits)``; the
    logits stay output 4, which Hugging Face records for the router's auxiliary loss."""
    logits = self.layer(hidden_states).float()
    top_logits, idx = logits.topk(self.top_k, dim=1)
    return idx, torch.softmax(top_logits, dim=1).type_as(hidden_states), None, None, logits


def _jetmoe_route(router: torch.nn.Module, h: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(top-k experts, their gates, logits)`` from the (swapped) router module."""
    idx, gates, _, _, logits = router(h)
    return idx, gates, logits


def jetmoe_moe_forward(self, layer_input: Tensor) -> Tensor:
    """Drop-in for ``JetMoeMoE.forward``, whose router reads the experts' group sizes as Python
    numbers (``expert_size.tolist()``, which a capture cannot follow): the same experts by
    grouped products between the experts markers, each token's results added in the experts'
    order as its ``index_add`` adds them."""
    bsz, length, dim = layer_input.shape
    idx, gates, _ = _jetmoe_route(self.router, layer_input.reshape(-1, dim))
    h, idx, w = torch.ops.treecompile.experts_begin(layer_input.reshape(-1, dim), idx, gates)
    order, offs = _by_expert(idx, self.input_linear.num_experts)
    tokens = order // idx.shape[-1]
    gate, up = _jetmoe_experts(self.input_linear, h[tokens], offs).chunk(2, dim=-1)
    y = _jetmoe_experts(self.output_linear, self.activation(gate) * up, offs) * w.reshape(-1)[order, None]
    out = torch.ops.treecompile.experts_end(torch.zeros_like(h[:, :1]).expand(-1, self.input_size).index_add(
        0, tokens, y))
    return out.view(bsz, length, self.input_size) + self.bias


def jetmoe_moa_map(self, layer_input: Tensor) -> tuple[Tensor, Tensor, tuple]:
    """Drop-in for ``JetMoeMoA.map`` (see `jetmoe_moe_forward`): each (token, slot)'s query
    projection by its expert, in slot order; the routing is handed to `jetmoe_moa_reduce`."""
    bsz, length, dim = layer_input.shape
    idx, gates, logits = _jetmoe_route(self.router, layer_input.reshape(-1, dim))
    h, idx_m, _ = torch.ops.treecompile.experts_begin(layer_input.reshape(-1, dim), idx, gates)
    order, offs = _by_expert(idx_m, self.num_experts)
    x = _jetmoe_experts(self.input_linear, h[order // self.top_k], offs)
    slots = x.new_zeros(x.shape).index_add(0, order, x).view(bsz * length, -1)  # a row per token
    return torch.ops.treecompile.experts_end(slots).view(bsz, length, self.top_k, -1), logits, (idx, gates)


def jetmoe_moa_reduce(self, layer_input: Tensor, topo_info: tuple) -> Tensor:
    """Drop-in for ``JetMoeMoA.reduce``: each (token, slot)'s output projection by its expert,
    times its gate, added to its token in the experts' order."""
    bsz, length, k, hidden = layer_input.shape
    idx, gates = topo_info
    rows, idx, w = torch.ops.treecompile.experts_begin(layer_input.reshape(bsz * length, -1), idx, gates)
    order, offs = _by_expert(idx, self.num_experts)
    y = _jetmoe_experts(self.output_linear, rows.reshape(-1, hidden)[order], offs) * w.reshape(-1)[order, None]
    out = y.new_zeros(bsz * length, self.input_size).index_add(0, order // k, y)
    return torch.ops.treecompile.experts_end(out).view(bsz, length, self.input_size) + self.bias


# --------------------------------------------------------------------------- blockwise linear attention


def minimax_lightning_forward(self, hidden_states: Tensor, position_embeddings: Any = None, attention_mask: Any = None,
                              cache: Any = None, **kwargs: Any) -> tuple[Tensor, None]:
    """Drop-in for ``MiniMaxLightningAttention.forward`` without a cache: its lightning attention
    loops over blocks of the sequence (a count from the length, and decay tables sliced by it),
    computing ``out_i = sum_{j <= i} exp(-slope (i - j)) (q_i . k_j) v_j`` per head; written here
    in its parallel form, the scores times a decay of ``i - j`` (zero above the diagonal), which
    the attention pass runs as the pair sum over each query's ancestors. The layer's projections,
    norm and output gate as in its forward. A tree batch has no padding, so the padding mask a
    layer is handed (a `treecompile.capture.hf_interfaces.TreeMask`, or the ones the wrapper
    passes; transformers before 5.15 did not apply it) changes nothing. Exact to
    the rounding of the layer's decay tables, which the blocks multiply together (computed at
    its construction in the default dtype: float32 rounding in a model built in float32)."""
    if cache is not None:
        raise ValueError("a tree call runs without a cache")
    batch, length, _ = hidden_states.shape
    heads, dim = self.num_attention_heads, self.head_dim
    qkv = self.act_fn(self.qkv_proj(hidden_states))
    q, k, v = (x.transpose(1, 2) for x in torch.split(qkv.reshape(batch, length, heads, 3 * dim), dim, dim=3))
    index = torch.arange(length, device=hidden_states.device)
    distance = (index[:, None] - index[None, :]).to(self.slope_rate.dtype)
    decay = torch.exp(torch.where(distance >= 0, -self.slope_rate * distance, float("-inf")))  # [heads, S, S]
    out = torch.matmul(torch.matmul(q, k.transpose(-1, -2)) * decay, v)
    out = self.norm(out.transpose(1, 2).reshape(batch, length, heads * dim))
    return self.out_proj(F.sigmoid(self.output_gate(hidden_states)) * out), None


def zaya_cca_forward(self, hidden_states: Tensor, cache: Any, conv_mask: Tensor | None = None) -> tuple:
    """Drop-in for ``ZayaCCAProjection.forward`` without a cache. Its q/k mix runs two convs over
    one left padding of ``(Ka - 1) + (Kb - 1)``: the second reads ``Kb - 1`` outputs of the first
    computed over zeros alone, its bias ``c``, where a path starts; its delayed value reads, before
    the first token, the delayed projection of zeros. Both written here as the passes' causal forms
    with the same values: the second conv over ``first - c`` with zero history plus its response
    to ``c`` everywhere (it is linear), the value shifted by one as ``x - fill`` after a zero row
    plus ``fill``."""
    if cache is not None:
        raise ValueError("a tree call runs without a cache")
    if conv_mask is not None:
        hidden_states = hidden_states * conv_mask[:, :, None].to(hidden_states.dtype)
    shape = hidden_states.shape[:-1]
    heads = (*shape, -1, self.head_dim)
    queries, keys = self.q_proj(hidden_states), self.k_proj(hidden_states)
    groups = self.num_key_value_groups
    key_residual = keys.view(*heads).repeat_interleave(groups, dim=-2) if groups > 1 else keys.view(*heads)
    query_residual = (queries.view(*heads) + key_residual) * 0.5
    key_residual = query_residual.view(*shape, -1, groups, self.head_dim).mean(dim=-2)
    first, second = self.conv_qk_depthwise, self.conv_qk_grouped
    x = torch.cat([queries, keys], dim=-1).transpose(1, 2)
    y = first(F.pad(x, (first.kernel_size[0] - 1, 0)))
    c = first.bias if first.bias is not None else y.new_zeros(y.shape[1])
    kb = second.kernel_size[0]
    response = F.conv1d(c[None, :, None].expand(1, -1, kb), second.weight, second.bias, groups=second.groups)
    qk = (F.conv1d(F.pad(y - c[:, None], (kb - 1, 0)), second.weight, None, groups=second.groups) + response)
    qk = qk.transpose(1, 2)
    width = query_residual.shape[-2] * query_residual.shape[-1]
    query = qk[..., :width].view(*heads) + query_residual
    key = qk[..., width:].view(*heads) + key_residual
    delayed = self.v_proj_delayed(hidden_states)
    fill = self.v_proj_delayed(hidden_states.new_zeros(shape[0], 1, self.hidden_size))
    value_delayed = torch.cat([torch.zeros_like(fill), (delayed - fill)[:, :-1]], dim=1) + fill
    value = torch.cat([self.v_proj_current(hidden_states), value_delayed], dim=-1).view(*heads)
    return query, key, value


#: Classes whose code a capture cannot follow (a loop over the experts a batch hits, over blocks
#: of the sequence, sizes read as Python numbers): ``(module,
#: class name) -> (attributes it must have, lines its methods must have, drop-in forward or
#: {method: drop-in})``. The
#: lines pin the computation the drop-in repeats (transformers before 5.15 reshaped DBRX's
#: hidden states by the experts' inner size: a forward without them is left alone, and refused).
CLASS_DROP_INS = {
    ("transformers.models.dbrx.modeling_dbrx", "DbrxExperts"): (
        ("mlp", "num_experts", "hidden_size", "ffn_hidden_size"),
        ("hidden_states = hidden_states.reshape(-1, self.hidden_size)", "for expert_idx in expert_hit:",
         "states = self.mlp(hidden_states[token_idx], w1, v1, w2)",
         "states = states.view(-1, self.hidden_size) * top_k_weights[token_idx, idx, None]",
         "next_states.index_add_(0, token_idx, states)"),
        dbrx_experts_forward),
    ("transformers.models.longcat_flash.modeling_longcat_flash", "LongcatFlashExperts"): (
        ("gate_up_proj", "down_proj", "num_routed_experts", "total_experts", "act_fn", "hidden_size"),
        ("expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero(as_tuple=False)",
         "current_hidden_states = self.identity_expert(current_state)",
         "gate, up = F.linear(current_state, self.gate_up_proj[expert_idx]).chunk(2, dim=-1)",
         "current_hidden_states = F.linear(current_hidden_states, self.down_proj[expert_idx])",
         "current_hidden_states = current_hidden_states * top_k_weights[token_idx, selection_idx, None]",
         "final_hidden_states.index_add_(0, token_idx, current_hidden_states.to(hidden_states.dtype))"),
        longcat_experts_forward),
    ("transformers.models.jetmoe.modeling_jetmoe", "JetMoeMoE"): (
        ("router", "input_linear", "output_linear", "activation", "bias", "input_size"),
        ("_, batch_index, batch_gates, expert_size, router_logits = self.router(layer_input)",
         "hidden_states = self.activation(chunked_hidden_states[0]) * chunked_hidden_states[1]",
         "layer_output = zeros.index_add(0, batch_index, expert_outputs)", "layer_output = layer_output + self.bias"),
        jetmoe_moe_forward),
    ("transformers.models.jetmoe.modeling_jetmoe", "JetMoeMoA"): (
        ("router", "input_linear", "output_linear", "bias", "input_size", "num_experts", "top_k"),
        ("expert_outputs = self.input_linear(expert_inputs, expert_size)",
         "layer_output = zeros.index_add(0, index_sorted_experts, expert_outputs)",
         "expert_outputs = expert_outputs * batch_gates[:, None]",
         "layer_output = zeros.index_add(0, batch_index, expert_outputs)"),
        {"map": jetmoe_moa_map, "reduce": jetmoe_moa_reduce}),
    ("transformers.models.jetmoe.modeling_jetmoe", "JetMoeTopKGating"): (
        ("layer", "top_k"),
        ("logits = self.layer(hidden_states).float()", "top_k_logits, top_k_indices = logits.topk(self.top_k, dim=1)",
         "top_k_gates = torch.softmax(top_k_logits, dim=1).type_as(hidden_states)",
         "return index_sorted_experts, batch_index, batch_gates, expert_size, logits"),
        jetmoe_gating_forward),
    ("transformers.models.minimax.modeling_minimax", "MiniMaxLightningAttention"): (
        ("slope_rate", "qkv_proj", "out_proj", "output_gate", "norm", "act_fn", "num_attention_heads", "head_dim"),
        ("qkv_states = self.act_fn(self.qkv_proj(hidden_states))",
         "query_states, key_states, value_states = torch.split(qkv_states, self.head_dim, dim=3)",
         "attn_output_intra = torch.matmul(attn_weights_intra * current_diagonal_decay, current_value_states)",
         "attn_output_inter = torch.matmul(current_query_states * current_query_decay, attn_weights_inter)",
         "attn_weights_inter = attn_weights_inter * block_decay + next_attn_weights_inter",
         "attn_output = self.norm(attn_output)",
         "attn_output = F.sigmoid(self.output_gate(hidden_states)) * attn_output",
         "attn_output = self.out_proj(attn_output)"),
        minimax_lightning_forward),
    ("transformers.models.zaya.modeling_zaya", "ZayaCCAProjection"): (
        ("q_proj", "k_proj", "v_proj_current", "v_proj_delayed", "conv_qk_depthwise", "conv_qk_grouped", "head_dim",
         "num_key_value_groups", "hidden_size"),
        ("query_residual = (query_residual + key_residual) * 0.5",
         "key_residual = query_residual.view(*input_shape, -1, self.num_key_value_groups, self.head_dim).mean(dim=-2)",
         "qk_states = F.pad(qk_states, (self.conv_kernel_size, 0))",
         "qk_states = self.conv_qk_depthwise(qk_states)",
         "qk_states = self.conv_qk_grouped(qk_states).transpose(1, 2)",
         "query = qk_states[..., :query_hidden_size].view(*hidden_shape) + query_residual",
         "key = qk_states[..., query_hidden_size:].view(*hidden_shape) + key_residual",
         "recurrent_v_state = self.v_proj_delayed(hidden_states.new_zeros(input_shape[0], 1, self.hidden_size))",
         "value_delayed = torch.cat([recurrent_v_state, delayed_v_state[:, :-1]], dim=1)",
         "value = torch.cat([value_current, value_delayed], dim=-1).view(*hidden_shape)"),
        zaya_cca_forward),
}

#: Classes whose drop-ins read each other's results: swapped all together or not at all.
_TOGETHER = [{("transformers.models.jetmoe.modeling_jetmoe", c)
              for c in ("JetMoeMoE", "JetMoeMoA", "JetMoeTopKGating")}]


def class_swaps(model: torch.nn.Module) -> list[tuple[Any, str, Any]]:
    """``(class, method, drop-in)`` for each class of `CLASS_DROP_INS` among the
    model's modules whose forward is the one the drop-in repeats, swapped for each call like
    the sequence kernels."""
    import inspect

    found = {}
    for m in model.modules():
        cls = type(m)
        known = CLASS_DROP_INS.get((cls.__module__, cls.__name__))
        if known is None or cls in found or not all(hasattr(m, a) for a in known[0]):
            continue
        methods = known[2] if isinstance(known[2], dict) else {"forward": known[2]}
        try:
            source = "".join(inspect.getsource(getattr(cls, name)) for name in methods)
        except (OSError, TypeError):
            continue
        if all(line in source for line in known[1]):
            found[cls] = [(cls, name, fn) for name, fn in methods.items()]
    keys = {(c.__module__, c.__name__) for c in found}
    for group in _TOGETHER:
        if keys & group and not group <= keys:  # a part of the group is not the code its drop-in reads
            found = {c: v for c, v in found.items() if (c.__module__, c.__name__) not in group}
    return [swap for swaps in found.values() for swap in swaps]
