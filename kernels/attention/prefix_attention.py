"""Tree attention of one streamed part over its ancestors' keys and values and its own.

A streamed part (see :mod:`treecompile.stream.options`) holds ``S`` consecutive rows of the packed
tree. Its queries attend to ``L = P + S`` keys: the ``P`` rows of earlier parts on the
root path of the part's first row (the KV stack, in any order), then its own ``S`` rows.
Query ``i`` sits at concatenated index ``c_i = P + i``; key ``j`` is visible to it iff

    j <= c_i < kv_end[j]        (and, with a window, q_pos[i] - kv_pos[j] < window)

where ``kv_end`` is each key's subtree end in the concatenated coordinates: for a prefix
row, ``P`` plus how far its subtree reaches into the part (0 for a row no query of the
part sees, e.g. padding); for an own row, ``P`` plus its subtree end inside the part. This
is the interval rule of `treecompile.masks` with the rows renumbered; a prefix row is
always earlier than every query, so ``j <= c_i`` holds for it.

Per query block the op gathers the keys that can still be visible (``kv_end > c_{q0}`` and
``j < c_{q1}``), so a finished sibling subtree costs nothing; memory is
``O(H x block x live keys)``, never ``S x L``. Forward and backward are custom ops (one
opaque node per call in a captured graph); the backward is the standard one from the saved
log-sum-exp, as in `treecompile.kernels.attention.cpu_attention` (on SDPA's fused CPU kernel where
that kernel can take the call). The plain reference is
`prefix_attention_reference` in :mod:`treecompile.kernels.attention.naive` (dense, O(S x L), for
tests).
"""

from __future__ import annotations

import torch

from treecompile.kernels.attention.cpu_attention import (attention_scores, fused_block, fused_block_backward, fused_ok,
                                                         lse_dtype, row_terms, seen)

__all__ = ["prefix_tree_attention"]

Tensor = torch.Tensor


def _visible(c_q: Tensor, keys: Tensor, q_rows: Tensor, kv_end: Tensor, kv_pos: Tensor, q_pos: Tensor,
             window: int) -> Tensor:
    """``[Bq, Lb]`` bool: which gathered keys each query of the block sees."""
    ok = (keys[None, :] <= c_q[:, None]) & (c_q[:, None] < kv_end[keys][None, :])
    if window > 0:
        ok = ok & (q_pos[q_rows][:, None] - kv_pos[keys][None, :] < window)
    return ok


def _live_keys(kv_end: Tensor, c0: int, c1: int) -> Tensor:
    """Keys a query in ``[c0, c1)`` may see: not later than ``c1 - 1``, subtree not ended by ``c0``."""
    idx = torch.arange(c1, device=kv_end.device)
    return idx[kv_end[:c1] > c0]


def _bias(alibi, kv_pos, q_pos, q_rows, keys, hkv, like):
    if not alibi:
        return None
    slopes = torch.tensor(alibi, dtype=like.dtype, device=like.device).view(hkv, -1, 1, 1)
    return slopes * (kv_pos[keys][None, :] - q_pos[q_rows][:, None]).to(like.dtype)


@torch.library.custom_op("treecompile::prefix_tree_attention", mutates_args=())
def prefix_tree_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    kv_end: Tensor,
    kv_pos: Tensor,
    q_pos: Tensor,
    block_size: int,
    scale: float,
    softcap: float,
    window: int,
    alibi: list[float] | None = None,
) -> tuple[Tensor, Tensor]:
    """Attention of a part's queries over ``[prefix ; own]`` keys.

    Args:
        q: ``[1, Hq, S, D]``; k: ``[1, Hkv, L, D]``; v: ``[1, Hkv, L, Dv]`` (``L = P + S``,
            the prefix rows first).
        kv_end: ``[L]`` int64 subtree end of each key in concatenated coordinates.
        kv_pos: ``[L]`` path positions of the keys; q_pos: ``[S]`` of the queries.
        block_size: queries per block.
        scale, softcap (0 for none), window (0 for none), alibi (slopes per query head or
            None): as in `treecompile.kernels.attention.cpu_attention.tree_attention_cpu`.

    Returns:
        ``(out [1, Hq, S, Dv], lse [1, Hq, S])``.
    """
    _, hq, s, d = q.shape
    hkv, total, dv = k.shape[1], k.shape[2], v.shape[-1]
    p, g = total - s, hq // hkv
    out = q.new_zeros(1, hq, s, dv)
    lse = q.new_full((1, hq, s), float("-inf"), dtype=lse_dtype(q))
    q4 = q[0].view(hkv, g, s, d)
    fused = fused_ok(q, v, softcap)
    for q0 in range(0, s, block_size):
        q1 = min(q0 + block_size, s)
        keys = _live_keys(kv_end, p + q0, p + q1)
        q_rows = torch.arange(q0, q1, device=q.device)
        bias = _bias(alibi, kv_pos, q_pos, q_rows, keys, hkv, q)
        ok = _visible(p + q_rows, keys, q_rows, kv_end, kv_pos, q_pos, window)
        if fused:
            out[0, :, q0:q1], lse[0, :, q0:q1] = fused_block(q[:, :, q0:q1], k[0][:, keys], v[0][:, keys], ok, bias,
                                                             scale)
            continue
        sc, _ = attention_scores(q4[:, :, q0:q1], k[0][:, keys], scale, softcap, bias)
        sc = sc.masked_fill(~ok, float("-inf"))
        # Every query sees itself; its score is -inf only where a key mask read from the tokens
        # blocks every key it sees (0 and a log-sum-exp of -inf, as the whole-tree kernel gives).
        m = torch.logsumexp(sc, dim=-1, keepdim=True)
        o = torch.einsum("hgql,hld->hgqd", torch.exp(sc - m.masked_fill(m == float("-inf"), 0.0)), v[0][:, keys])
        out[0, :, q0:q1] = o.reshape(hq, q1 - q0, dv)
        lse[0, :, q0:q1] = m[..., 0].reshape(hq, q1 - q0)
    return out, lse


@prefix_tree_attention.register_fake
def _(q, k, v, kv_end, kv_pos, q_pos, block_size, scale, softcap, window, alibi=None):
    return q.new_empty(*q.shape[:-1], v.shape[-1]), q.new_empty(q.shape[:-1], dtype=lse_dtype(q))


@torch.library.custom_op("treecompile::prefix_tree_attention_backward", mutates_args=())
def prefix_tree_attention_backward(
    dout: Tensor,
    dlse: Tensor | None,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    kv_end: Tensor,
    kv_pos: Tensor,
    q_pos: Tensor,
    block_size: int,
    scale: float,
    softcap: float,
    window: int,
    alibi: list[float] | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` of `prefix_tree_attention` from the saved ``out`` and ``lse``; ``dk``
    and ``dv`` cover all ``L`` keys, the prefix rows included (the stack's gradients)."""
    _, hq, s, d = q.shape
    hkv, total = k.shape[1], k.shape[2]
    p = total - s
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    fused = fused_ok(q, v, softcap, dlse=dlse)
    if not fused:  # the fused kernel's backward computes its own row terms
        q4, do4, lse4, delta4 = row_terms(q, dout, out, lse, dlse, hkv)
    for q0 in range(0, s, block_size):
        q1 = min(q0 + block_size, s)
        keys = _live_keys(kv_end, p + q0, p + q1)
        q_rows = torch.arange(q0, q1, device=q.device)
        kb, vb = k[0][:, keys], v[0][:, keys]
        bias = _bias(alibi, kv_pos, q_pos, q_rows, keys, hkv, q)
        ok = _visible(p + q_rows, keys, q_rows, kv_end, kv_pos, q_pos, window)
        if fused:
            dqb, dkb, dvb = fused_block_backward(dout[:, :, q0:q1], q[:, :, q0:q1], kb, vb, out[:, :, q0:q1],
                                                 lse[:, :, q0:q1], ok, bias, scale)
            dq[0, :, q0:q1] = dqb
            dk.index_add_(2, keys, dkb[None])
            dv.index_add_(2, keys, dvb[None])
            continue
        qb, dob = q4[:, :, q0:q1], do4[:, :, q0:q1]
        sc, t = attention_scores(qb, kb, scale, softcap, bias)
        pr = torch.exp(sc - seen(lse4[:, :, q0:q1, None])).masked_fill(~ok, 0.0)
        dv.index_add_(2, keys, torch.einsum("hgql,hgqd->hld", pr, dob)[None])
        ds = pr * (torch.einsum("hgqd,hld->hgql", dob, vb) - delta4[:, :, q0:q1, None])
        if t is not None:
            ds = ds * (1 - t * t)
        dq[0, :, q0:q1] = (torch.einsum("hgql,hld->hgqd", ds, kb) * scale).reshape(hq, q1 - q0, d)
        dk.index_add_(2, keys, (torch.einsum("hgql,hgqd->hld", ds, qb) * scale)[None])
    return dq, dk, dv


@prefix_tree_attention_backward.register_fake
def _(dout, dlse, q, k, v, out, lse, kv_end, kv_pos, q_pos, block_size, scale, softcap, window, alibi=None):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, kv_end, kv_pos, q_pos, *static = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, kv_end, kv_pos, q_pos)
    ctx.static = static
    ctx.set_materialize_grads(False)  # an unused log-sum-exp gets None, not zeros to add


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, kv_end, kv_pos, q_pos = ctx.saved_tensors
    static = list(ctx.static) + [None] * (5 - len(ctx.static))
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv = torch.ops.treecompile.prefix_tree_attention_backward(
        dout.contiguous(), None if dlse is None else dlse.contiguous(), q, k, v, out, lse, kv_end, kv_pos, q_pos,
        *static,
    )
    return (dq, dk, dv) + (None,) * (3 + len(ctx.static))


prefix_tree_attention.register_autograd(_backward, setup_context=_setup_context)
