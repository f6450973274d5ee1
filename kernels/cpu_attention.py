"""Block-sparse tree attention on CPU, forward and backward, in O(S x live keys) memory.

FlexAttention's higher-order op has no sparse CPU kernel: run eagerly or under
AOTAutograd it evaluates the mask and the scores on all ``S x S`` pairs. This op walks the
``BlockMask`` instead: for each block of queries it gathers the keys of that block's live
key blocks (partial and full), evaluates the tree rule only there, and runs an exact
softmax over them. Memory is ``O(H x block x live keys)`` per query block, never
``S x S``, and the work is proportional to the live blocks.

The backward is the standard attention backward per query block, from the saved
log-sum-exp: ``P = exp(s - lse)``, ``dV += P^T dO``, ``dS = P * (dO V^T - rowsum(dO * O))``
(times ``1 - tanh^2`` under soft-capping), ``dQ = dS K * scale``, ``dK += dS^T Q * scale``.

Both directions are ``torch.library`` custom ops, so a captured graph holds one opaque node
per attention call (the Python loop over blocks is not traced). The mask rules are the
ones in `treecompile.kernels.masks`; the reference is SDPA over the dense tree mask (tests).
"""

from __future__ import annotations

import torch

from treecompile.kernels.flex_mods import score_vjp, tile_mask, tile_scores, user_mods
from treecompile.kernels.masks import MASK_KINDS, tree_mask_mod

__all__ = ["tree_attention_cpu"]

Tensor = torch.Tensor


def _visible(kind: str, q_rows: Tensor, kv_rows: Tensor, buffers: list[Tensor], window: int, chunks: int) -> Tensor:
    """``[Bq, L]`` bool: which of the gathered keys each query in the block may see."""
    # The rule's own tensors, then positions when a window reads them (ALiBi or a model's own
    # mods alone do not).
    used = len(MASK_KINDS[kind]) + (1 if window > 0 else 0)
    mask_mod = tree_mask_mod(kind, chunks=chunks, window=window if window > 0 else None)
    return mask_mod(None, None, q_rows[:, None], kv_rows[None, :], *buffers[:used])


def _positions(kind: str, buffers: list[Tensor]) -> Tensor:
    """The ``positions`` buffer, after the rule's own tensors."""
    return buffers[len(MASK_KINDS[kind])]


def _alibi_bias(alibi: list[float], kind: str, buffers: list[Tensor], q_rows: Tensor, kv_rows: Tensor, hkv: int,
                like: Tensor) -> Tensor | None:
    """``[Hkv, g, Bq, L]`` ALiBi bias ``slope[h] * (positions[kv] - positions[q])``, or None.

    A function of the two tokens' path positions, so it is the bias per-path training adds.
    """
    if not alibi:
        return None
    pos = _positions(kind, buffers)
    slopes = torch.tensor(alibi, dtype=like.dtype, device=like.device).view(hkv, -1, 1, 1)
    return slopes * (pos[kv_rows][None, :] - pos[q_rows][:, None]).to(like.dtype)


def _live_rows(i: int, bs: int, s: int, nums: list[list[int]], idxs: list[Tensor], device) -> Tensor:
    """Key rows of query block ``i``'s live blocks (partial and full), in block order."""
    blocks = torch.cat([idx[i, : num[i]] for num, idx in zip(nums, idxs)]).sort().values
    rows = (blocks[:, None] * bs + torch.arange(bs, device=device)[None, :]).flatten()
    return rows[rows < s]


def _scores(qb: Tensor, kb: Tensor, scale: float, softcap: float, bias: Tensor | None = None):
    """``[Hkv, g, Bq, L]`` scores (after soft-capping, plus ``bias``) and ``tanh`` for the
    soft-cap's derivative."""
    raw = torch.einsum("hgqd,hld->hgql", qb, kb) * scale
    t = None
    if softcap > 0:
        t = torch.tanh(raw / softcap)
        raw = t * softcap
    if bias is not None:
        raw = raw + bias
    return raw, t


class _Mods:
    """A model's own score_mod / mask_mod on one call's tiles (see `treecompile.kernels.flex_mods`)."""

    def __init__(self, key: str, kind: str, buffers: list[Tensor], hq: int, device) -> None:
        self.mods = user_mods(key) if key else None
        # ``buffers``: the rule's tensors, ``positions``, then the functions' own tensors.
        self.first = len(MASK_KINDS[kind]) + 1
        self.buffers = list(buffers[self.first:]) if key else []
        self.pos = _positions(kind, buffers) if key else None
        self.heads = torch.arange(hq, device=device)

    def scores(self, sc: Tensor, q_rows: Tensor, kv_rows: Tensor) -> Tensor:
        """``sc`` ``[Hkv, g, Bq, L]`` after the model's score_mod."""
        if self.mods is None or self.mods.score is None:
            return sc
        flat = tile_scores(self.mods, sc.reshape(-1, *sc.shape[2:]), self.heads, self.pos[q_rows], self.pos[kv_rows],
                           self.buffers)
        return flat.view(sc.shape)

    def visible(self, ok: Tensor, q_rows: Tensor, kv_rows: Tensor, hkv: int) -> Tensor:
        """``ok`` ``[Bq, L]`` ANDed with the model's mask_mod: ``[Hkv, g, Bq, L]`` (or ``ok``)."""
        if self.mods is None or self.mods.mask is None:
            return ok
        m = tile_mask(self.mods, self.heads, self.pos[q_rows], self.pos[kv_rows], self.buffers)
        return ok & m.view(hkv, -1, *m.shape[1:])


def _plan(kv_num: Tensor, kv_idx: Tensor, full_num: Tensor, full_idx: Tensor):
    return [kv_num[0, 0].tolist(), full_num[0, 0].tolist()], [kv_idx[0, 0], full_idx[0, 0]]


@torch.library.custom_op("treecompile::tree_attention_cpu", mutates_args=())
def tree_attention_cpu(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    buffers: list[Tensor],
    kv_num: Tensor,
    kv_idx: Tensor,
    full_num: Tensor,
    full_idx: Tensor,
    kind: str,
    block_size: int,
    scale: float,
    softcap: float,
    window: int,
    chunks: int,
    alibi: list[float] | None = None,
    mods: str = "",
) -> tuple[Tensor, Tensor]:
    """Tree attention over live blocks.

    Args:
        q: ``[1, Hq, S, D]``; k: ``[1, Hkv, S, D]``; v: ``[1, Hkv, S, Dv]`` (``Hq % Hkv == 0``).
        buffers: the rule's tensors: ``[subtree_end]`` (interval) or ``[tree_ids, path_bits]``
            (bitmask), then ``positions`` if ``window > 0``, ``alibi`` or ``mods``, then the
            tensors a model's own score_mod and mask_mod read (``mods``).
        kv_num, kv_idx, full_num, full_idx: the BlockMask's kv tables ``[1, 1, nb]`` and
            ``[1, 1, nb, nb]``.
        kind: ``"interval"`` or ``"bitmask"``.
        block_size: rows per block.
        scale: multiplies ``q @ k^T``.
        softcap: logit soft-capping value, 0 for none.
        window: sliding window along the path, 0 for none.
        chunks: ``path_bits.shape[1]`` (bitmask).
        alibi: per query head, the ALiBi slope: ``slope * (positions[kv] - positions[q])``
            is added to each score (after soft-capping); empty or None for none.
        mods: the key of a model's own score_mod / mask_mod
            (`treecompile.kernels.flex_mods.register_mods`), run on the rows' path positions;
            "" for none.

    Returns:
        ``(out [1, Hq, S, Dv], lse [1, Hq, S])``. A query that sees no key (a model's mask
        can leave none) gets 0 and a log-sum-exp of -inf, as FlexAttention gives.
    """
    _, hq, s, _ = q.shape
    hkv, dv = k.shape[1], v.shape[-1]
    g = hq // hkv
    out = q.new_zeros(1, hq, s, dv)
    lse = q.new_full((1, hq, s), float("-inf"))
    nums, idxs = _plan(kv_num, kv_idx, full_num, full_idx)
    q4 = q[0].view(hkv, g, s, -1)
    own = _Mods(mods, kind, buffers, hq, q.device)
    for i in range(-(-s // block_size)):
        q0, q1 = i * block_size, min((i + 1) * block_size, s)
        rows = _live_rows(i, block_size, s, nums, idxs, q.device)
        if rows.numel() == 0:
            continue
        q_rows = torch.arange(q0, q1, device=q.device)
        bias = _alibi_bias(alibi, kind, buffers, q_rows, rows, hkv, q)
        sc, _ = _scores(q4[:, :, q0:q1], k[0][:, rows], scale, softcap, bias)
        sc = own.scores(sc, q_rows, rows)
        ok = own.visible(_visible(kind, q_rows, rows, buffers, window, chunks), q_rows, rows, hkv)
        sc = sc.masked_fill(~ok, float("-inf"))
        m = torch.logsumexp(sc, dim=-1, keepdim=True)  # the tree rule alone: every query sees itself
        # A model's own mask may leave a query no key: output 0, log-sum-exp -inf.
        p = torch.exp(sc - torch.where(torch.isinf(m), torch.zeros_like(m), m))
        o = torch.einsum("hgql,hld->hgqd", p, v[0][:, rows])
        out[0, :, q0:q1] = o.reshape(hq, q1 - q0, dv)
        lse[0, :, q0:q1] = m[..., 0].reshape(hq, q1 - q0)
    return out, lse


@tree_attention_cpu.register_fake
def _(q, k, v, buffers, kv_num, kv_idx, full_num, full_idx, kind, block_size, scale, softcap, window, chunks,
      alibi=None, mods=""):
    return q.new_empty(*q.shape[:-1], v.shape[-1]), q.new_empty(q.shape[:-1])


@torch.library.custom_op("treecompile::tree_attention_cpu_backward", mutates_args=())
def tree_attention_cpu_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    buffers: list[Tensor],
    kv_num: Tensor,
    kv_idx: Tensor,
    full_num: Tensor,
    full_idx: Tensor,
    kind: str,
    block_size: int,
    scale: float,
    softcap: float,
    window: int,
    chunks: int,
    alibi: list[float] | None = None,
    dlse: Tensor | None = None,
    mods: str = "",
) -> tuple[Tensor, Tensor, Tensor, list[Tensor]]:
    """Gradients ``(dq, dk, dv)`` of `tree_attention_cpu` from the saved ``out`` and ``lse``
    (the ALiBi bias is a constant of the positions: it changes the scores, not the formula).

    ``dlse`` ``[1, Hq, S]``, the gradient of the returned log-sum-exp (attention sinks use
    it), adds ``dlse * P`` to the scores' gradient (``d lse / d s = P``); None for none.

    The fourth result holds the gradients of the model's own mods' tensors in ``buffers``
    (zeros for those that get none): its score_mod is differentiated per block
    (``torch.func.vjp``), so a learned bias it reads gets its gradient."""
    _, hq, s, d = q.shape
    hkv, dv_ = k.shape[1], v.shape[-1]
    g = hq // hkv
    dq = torch.zeros_like(q)
    dk = torch.zeros_like(k)
    dv = torch.zeros_like(v)
    nums, idxs = _plan(kv_num, kv_idx, full_num, full_idx)
    q4 = q[0].view(hkv, g, s, d)
    do4 = dout[0].view(hkv, g, s, dv_)
    lse4 = lse[0].view(hkv, g, s)
    # delta_q = sum_d dO * O: the softmax backward's row term.
    delta4 = (dout[0] * out[0]).sum(-1).view(hkv, g, s)
    if dlse is not None:
        delta4 = delta4 - dlse[0].view(hkv, g, s)
    own = _Mods(mods, kind, buffers, hq, q.device)
    d_bufs = [torch.zeros_like(t) for t in own.buffers]
    for i in range(-(-s // block_size)):
        q0, q1 = i * block_size, min((i + 1) * block_size, s)
        rows = _live_rows(i, block_size, s, nums, idxs, q.device)
        if rows.numel() == 0:
            continue
        kb, vb = k[0][:, rows], v[0][:, rows]
        qb, dob = q4[:, :, q0:q1], do4[:, :, q0:q1]
        q_rows = torch.arange(q0, q1, device=q.device)
        sc, t = _scores(qb, kb, scale, softcap, _alibi_bias(alibi, kind, buffers, q_rows, rows, hkv, q))
        back = None
        if own.mods is not None and own.mods.score is not None:
            flat, back = score_vjp(own.mods, sc.reshape(hq, *sc.shape[2:]), own.heads, own.pos[q_rows],
                                   own.pos[rows], own.buffers)
            sc = flat.view(sc.shape)
        ok = own.visible(_visible(kind, q_rows, rows, buffers, window, chunks), q_rows, rows, hkv)
        p = torch.exp(sc - lse4[:, :, q0:q1, None]).masked_fill(~ok, 0.0)
        dv.index_add_(2, rows, torch.einsum("hgql,hgqd->hld", p, dob)[None])
        dp = torch.einsum("hgqd,hld->hgql", dob, vb)
        ds = p * (dp - delta4[:, :, q0:q1, None])
        if back is not None:
            d_raw, grads = back(ds.reshape(hq, *ds.shape[2:]))
            ds = d_raw.view(ds.shape)
            for acc, gb in zip(d_bufs, grads):
                if gb is not None:
                    acc.add_(gb)
        if t is not None:
            ds = ds * (1 - t * t)
        dq[0, :, q0:q1] = (torch.einsum("hgql,hld->hgqd", ds, kb) * scale).reshape(hq, q1 - q0, d)
        dk.index_add_(2, rows, (torch.einsum("hgql,hgqd->hld", ds, qb) * scale)[None])
    return dq, dk, dv, d_bufs


@tree_attention_cpu_backward.register_fake
def _(dout, q, k, v, out, lse, buffers, kv_num, kv_idx, full_num, full_idx, kind, block_size, scale, softcap,
      window, chunks, alibi=None, dlse=None, mods=""):
    n = len(MASK_KINDS[kind]) + 1 if mods else len(buffers)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), [torch.empty_like(t) for t in buffers[n:]]


_STATIC = ("kind", "block_size", "scale", "softcap", "window", "chunks", "alibi", "mods")
_TABLES = ("kv_num", "kv_idx", "full_num", "full_idx")


def _setup_context(ctx, inputs, output):
    q, k, v, buffers, kv_num, kv_idx, full_num, full_idx, *static = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, kv_num, kv_idx, full_num, full_idx, *buffers)
    ctx.n_buffers = len(buffers)
    ctx.static = static


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, kv_num, kv_idx, full_num, full_idx, *buffers = ctx.saved_tensors
    static = dict(zip(_STATIC, ctx.static))  # a default left out is missing
    mods = static.get("mods") or ""
    dq, dk, dv, d_mod = torch.ops.treecompile.tree_attention_cpu_backward(
        dout.contiguous(), q, k, v, out, lse, list(buffers), kv_num, kv_idx, full_num, full_idx,
        *(static[name] for name in _STATIC[:6]), static.get("alibi"), None if dlse is None else dlse.contiguous(),
        mods=mods,
    )
    # No gradient for the block tables and static arguments, nor for the rule's buffers, in
    # the structure of the call's arguments (``needs_input_grad`` has it: a default left out,
    # an empty list kept); the tensors of a model's own mods get theirs.
    rest = [[None] * len(x) if isinstance(x, list) else None for x in ctx.needs_input_grad[3:]]
    if d_mod:
        first = len(buffers) - len(d_mod)
        rest[0] = [None] * first + [g if need else None for g, need in zip(d_mod, ctx.needs_input_grad[3][first:])]
    return (dq, dk, dv, *rest)


tree_attention_cpu.register_autograd(_backward, setup_context=_setup_context)
