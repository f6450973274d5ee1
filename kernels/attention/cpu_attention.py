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

Where the call is a plain softmax (no soft-capping, no model mods, no log-sum-exp gradient,
keys and values of one width), each block of queries runs on SDPA's fused CPU kernel instead
(flash attention, ``aten::_scaled_dot_product_flash_attention_for_cpu`` and its backward):
without a mask over the keys of full blocks, which every query of the block sees, and with the
tree rule as an additive mask over the rest, in pieces of at most 512 keys, the softmaxes merged
by their log-sum-exps: a mask is never over ``[512, 512]`` whatever the tree. Consecutive blocks
whose keys nearly agree (a long path's) share one call. On a path of
10,000 tokens this takes a step from 0.34x to 0.88x of the unmodified model's speed on the path
alone (docs/benchmarks.md, "Long paths").

Both directions are ``torch.library`` custom ops, so a captured graph holds one opaque node
per attention call (the Python loop over blocks is not traced). The mask rules are the
ones in `treecompile.kernels.attention.masks`; the reference is SDPA over the dense tree mask (tests).
"""

from __future__ import annotations

import torch

from treecompile.kernels.attention.flex_mods import score_vjp, tile_mask, tile_scores, user_mods
from treecompile.kernels.attention.masks import MASK_KINDS, tree_mask_mod

__all__ = ["tree_attention_cpu", "lse_dtype", "fused_ok", "fused_block", "fused_block_backward", "attention_scores",
           "row_terms", "seen"]

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


#: The fused kernel takes up to this many queries per call (several blocks whose keys are nearly
#: the same: a long path's blocks), when that adds at most ``_GROUP_SLACK`` masked-out work.
_GROUP_ROWS = 512
_GROUP_SLACK = 1.15
#: A masked call takes at most this many keys (the rest go to further calls, merged by their
#: log-sum-exps): its mask is at most ``[_GROUP_ROWS, _MASKED_KEYS]`` whatever the tree.
_MASKED_KEYS = 512


class _Keys:
    """Key rows (sorted) and, when they are one run, the same rows as a slice (no gather)."""

    def __init__(self, blocks: list[int], bs: int, s: int, device) -> None:
        self.blocks, self._shape = blocks, (bs, s, device)
        b = torch.tensor(blocks, dtype=torch.long, device=device)
        rows = (b[:, None] * bs + torch.arange(bs, device=device)[None, :]).flatten()
        self.rows = rows[rows < s]
        n, first = self.rows.numel(), blocks[0] * bs
        self.span = slice(first, first + n) if int(self.rows[-1]) - first + 1 == n else None

    def pieces(self, max_rows: int) -> list[_Keys]:
        """These keys in runs of at most ``max_rows`` rows (whole blocks), in order."""
        bs, s, device = self._shape
        per = max(1, max_rows // bs)
        if len(self.blocks) <= per:
            return [self]
        return [_Keys(self.blocks[i:i + per], bs, s, device) for i in range(0, len(self.blocks), per)]


def _groups(s: int, bs: int, nums: list[list[int]], idxs: list[Tensor], max_rows: int, device):
    """``(q0, q1, keys, full, partial)`` per call: queries ``q0:q1`` (whole blocks), the keys of
    their live blocks (the union over the blocks), and those keys split in two: ``full``, every
    query of the call sees every one of them (no mask needed), and ``partial``, the rest (either
    None when empty). Blocks with no live key are left out.

    Consecutive blocks share a call while it stays within ``max_rows`` queries and the union of
    their keys costs at most ``_GROUP_SLACK`` times the pairs the blocks see on their own.
    """
    lists = [idx.tolist() for idx in idxs]
    partial = [set(lists[0][i][: nums[0][i]]) for i in range(len(nums[0]))]
    full = [set(lists[1][i][: nums[1][i]]) for i in range(len(nums[1]))]

    def keys(blocks) -> int:
        return sum(min(bs, s - b * bs) for b in blocks)

    def queries(i: int) -> int:
        return min(bs, s - i * bs)

    i = 0
    while i < len(partial):
        live = partial[i] | full[i]
        if not live:
            i += 1
            continue
        union, full_g, own, j = live, set(full[i]), keys(live) * queries(i), i + 1
        while j < len(partial) and (partial[j] or full[j]) and (j + 1 - i) * bs <= max_rows:
            live_j = partial[j] | full[j]
            grown = union | live_j
            own_j = own + keys(live_j) * queries(j)
            if keys(grown) * (min(s, (j + 1) * bs) - i * bs) > _GROUP_SLACK * own_j:
                break
            union, full_g, own, j = grown, full_g & full[j], own_j, j + 1
        rest = union - full_g
        yield (i * bs, min(s, j * bs), _Keys(sorted(union), bs, s, device),
               _Keys(sorted(full_g), bs, s, device) if full_g else None,
               _Keys(sorted(rest), bs, s, device) if rest else None)
        i = j


def _take(x: Tensor, keys: _Keys) -> Tensor:
    """``x[0][:, keys.rows]``: a view when the rows are one run."""
    return x[0][:, keys.span] if keys.span is not None else x[0][:, keys.rows]


def _add_rows(acc: Tensor, keys: _Keys, value: Tensor) -> None:
    """``acc[0][:, keys.rows] += value`` (``value`` ``[H, L, D]``)."""
    if keys.span is not None:
        acc[0][:, keys.span] += value
    else:
        acc.index_add_(2, keys.rows, value[None])


# SDPA's fused CPU kernel (flash attention, online softmax) on one block of queries and its
# gathered keys, with the tree rule as an additive mask: it returns the log-sum-exp the backward
# needs, and its backward recomputes the probabilities from it as `attention_scores` would.
_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def lse_dtype(q: Tensor) -> torch.dtype:
    """The log-sum-exp's dtype: float32 (float64 for float64 queries), as FlexAttention returns
    it and the fused kernel computes it; the fused backward reads it back, so it is not rounded
    to a bfloat16 model's dtype."""
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def fused_ok(q: Tensor, v: Tensor, softcap: float, plain_scores: bool = True, dlse: Tensor | None = None) -> bool:
    """Whether a call can run on the fused kernel: a plain softmax over the visible keys (no
    soft-cap, scores a model's mods leave alone, no log-sum-exp gradient) and equal key and
    value widths."""
    return softcap == 0 and plain_scores and dlse is None and q.shape[-1] == v.shape[-1]


def _additive(ok: Tensor | None, bias: Tensor | None, hq: int, dtype: torch.dtype) -> Tensor | None:
    """``[1, 1 or Hq, Bq, L]``: 0 where visible (plus ``bias``), -inf elsewhere; None for
    neither (every key visible, no bias)."""
    if ok is None:
        return None if bias is None else bias.reshape(1, hq, *bias.shape[2:]).to(dtype)
    mask = torch.zeros(ok.shape, dtype=dtype, device=ok.device).masked_fill_(~ok, float("-inf"))
    if bias is None:
        return mask[None, None]
    return (bias.reshape(hq, *ok.shape).to(dtype) + mask)[None]


def _unit_last(*xs: Tensor) -> tuple[Tensor, ...]:
    """``xs`` with their last dim contiguous: torch's fused CPU kernel reads a last dim of
    another stride wrongly, without an error (a key ``[B, H, D, S]`` transposed, as a model
    that stores its keys ``'b s (h d) -> b h d s'`` passes them)."""
    return tuple(x if x.stride(-1) == 1 or x.shape[-1] == 1 else x.contiguous() for x in xs)


def fused_block(qb: Tensor, kb: Tensor, vb: Tensor, ok: Tensor | None, bias: Tensor | None, scale: float):
    """``(out [Hq, Bq, D], lse [Hq, Bq])`` of queries ``qb`` ``[1, Hq, Bq, D]`` over keys
    ``kb``/``vb`` ``[Hkv, L, D]``, seeing ``ok`` ``[Bq, L]`` (None: all of them), plus ``bias``
    ``[Hkv, g, Bq, L]``. A query that sees none of the keys gets 0 and -inf."""
    hq = qb.shape[1]
    qb, kb, vb = _unit_last(qb, kb, vb)
    o, m = _FLASH(qb, kb[None], vb[None], attn_mask=_additive(ok, bias, hq, qb.dtype), scale=scale)
    if ok is not None:  # the kernel gives such a query a log-sum-exp of 0 (its output is not relied on)
        none = ~ok.any(-1)
        m = m.masked_fill(none, float("-inf"))
        o = o.masked_fill(none[:, None], 0.0)
    return o[0], m[0]


def fused_block_backward(dob: Tensor, qb: Tensor, kb: Tensor, vb: Tensor, ob: Tensor, lseb: Tensor,
                         ok: Tensor | None, bias: Tensor | None, scale: float):
    """``(dq [Hq, Bq, D], dk [Hkv, L, D], dv [Hkv, L, D])`` of `fused_block` (``[1, Hq, Bq, .]``
    blocks of the output's gradient, the queries, the output and its log-sum-exp).

    ``ob`` and ``lseb`` may be those of a softmax over more keys than ``kb`` (the keys split in
    parts, `_merge`): the kernel's probabilities ``exp(s - lse)`` and row term ``sum(dO * O)``
    are then the whole softmax's, so each part's gradients are its share of the whole's."""
    hq = qb.shape[1]
    dob, qb, kb, vb, ob = _unit_last(dob, qb, kb, vb, ob)
    lseb = seen(lseb if lseb.dtype == torch.float64 else lseb.float())
    dq, dk, dv = _FLASH_BACKWARD(dob, qb, kb[None], vb[None], ob, lseb, 0.0, False,
                                 attn_mask=_additive(ok, bias, hq, qb.dtype), scale=scale)
    return dq[0], dk[0], dv[0]


def seen(lse: Tensor) -> Tensor:
    """``lse`` with +inf for -inf: a query that saw no key (its scores all -inf, a key mask read
    from the tokens can leave one none) gets probabilities ``exp(s - lse)`` of 0, not NaN, so its
    output's 0 passes back no gradient."""
    return lse.masked_fill(lse == float("-inf"), float("inf"))


def _merge(a: tuple[Tensor, Tensor], b: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
    """One softmax's ``(out, lse)`` from two over disjoint keys (``[Hq, Bq, D]``, ``[Hq, Bq]``)."""
    lse = torch.logaddexp(a[1], b[1])
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    out = torch.exp(a[1] - safe)[..., None] * a[0] + torch.exp(b[1] - safe)[..., None] * b[0]
    return out, lse


def _masked_parts(keys, full, partial, biased, split):
    """``(unmasked, masked)``: the keys a call takes without a mask (None for none) and those
    it takes masked, in pieces of at most `_MASKED_KEYS`. Without a mask only over the ``full``
    keys, and only with ``split`` and no bias (a sliding window hides keys of blocks the tree
    rule calls full; an ALiBi bias applies to every key)."""
    if biased or full is None or not split:
        return None, keys.pieces(_MASKED_KEYS)
    return full, partial.pieces(_MASKED_KEYS) if partial is not None else []


def _fused_forward(q, k, v, q0, q1, keys, full, partial, visible, bias_of, biased, scale, split):
    """``(out, lse)`` of queries ``q0:q1``: without a mask over the ``full`` keys (what the
    kernel does fastest) and masked over the rest, piece by piece, merged (`_masked_parts`);
    ``visible(piece)`` is the tree rule over a piece's keys, ``bias_of(piece)`` its ALiBi bias
    (None for none; ``biased`` says whether there is one)."""
    qb = q[:, :, q0:q1]
    unmasked, masked = _masked_parts(keys, full, partial, biased, split)
    res = None if unmasked is None else fused_block(qb, _take(k, unmasked), _take(v, unmasked), None, None, scale)
    for piece in masked:
        part = fused_block(qb, _take(k, piece), _take(v, piece), visible(piece), bias_of(piece), scale)
        res = part if res is None else _merge(res, part)
    return res


def _fused_backward(dout, q, k, v, out, lse, dq, dk, dv, q0, q1, keys, full, partial, visible, bias_of, biased,
                    scale, split):
    """`_fused_forward`'s gradients, written into ``dq`` and added into ``dk`` / ``dv``."""
    blocks = [a[:, :, q0:q1] for a in (dout, q, out, lse)]
    unmasked, masked = _masked_parts(keys, full, partial, biased, split)
    parts = ([(unmasked, False)] if unmasked is not None else []) + [(piece, True) for piece in masked]
    for n, (part, with_mask) in enumerate(parts):
        ok, b = (visible(part), bias_of(part)) if with_mask else (None, None)
        dqb, dkb, dvb = fused_block_backward(blocks[0], blocks[1], _take(k, part), _take(v, part), blocks[2],
                                             blocks[3], ok, b, scale)
        if n:
            dq[0, :, q0:q1] += dqb
        else:
            dq[0, :, q0:q1] = dqb
        _add_rows(dk, part, dkb)
        _add_rows(dv, part, dvb)


def row_terms(q: Tensor, dout: Tensor, out: Tensor, lse: Tensor, dlse: Tensor | None, hkv: int):
    """``(q, dout, lse, delta)`` per key head ``[Hkv, g, S, .]`` for the block-by-block softmax
    backward, in the model's dtype: ``delta = sum_d dO * O`` (minus ``dlse``, the gradient of the
    returned log-sum-exp), the row term of ``dS = P * (dO V^T - delta)``."""
    _, hq, s, d = q.shape
    g = hq // hkv
    delta = (dout[0] * out[0]).sum(-1).view(hkv, g, s)
    if dlse is not None:
        delta = delta - dlse[0].to(q.dtype).view(hkv, g, s)
    return (q[0].view(hkv, g, s, d), dout[0].view(hkv, g, s, dout.shape[-1]), lse[0].to(q.dtype).view(hkv, g, s),
            delta)


def attention_scores(qb: Tensor, kb: Tensor, scale: float, softcap: float, bias: Tensor | None = None):
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
    """A model's own score_mod / mask_mod on one call's tiles (see `treecompile.kernels.attention.flex_mods`)."""

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
            (`treecompile.kernels.attention.flex_mods.register_mods`), run on the rows' path positions;
            "" for none.

    Returns:
        ``(out [1, Hq, S, Dv], lse [1, Hq, S])``. A query that sees no key (a model's mask
        can leave none) gets 0 and a log-sum-exp of -inf, as FlexAttention gives.
    """
    _, hq, s, _ = q.shape
    hkv, dv = k.shape[1], v.shape[-1]
    g = hq // hkv
    out = q.new_zeros(1, hq, s, dv)
    lse = q.new_full((1, hq, s), float("-inf"), dtype=lse_dtype(q))
    nums, idxs = _plan(kv_num, kv_idx, full_num, full_idx)
    q4 = q[0].view(hkv, g, s, -1)
    own = _Mods(mods, kind, buffers, hq, q.device)
    fused = fused_ok(q, v, softcap, own.mods is None)
    # The unfused path holds [Hq, queries, keys] scores: one block of queries at a time.
    for q0, q1, keys, full, partial in _groups(s, block_size, nums, idxs, _GROUP_ROWS if fused else block_size,
                                               q.device):
        q_rows = torch.arange(q0, q1, device=q.device)
        if fused:
            out[0, :, q0:q1], lse[0, :, q0:q1] = _fused_forward(
                q, k, v, q0, q1, keys, full, partial,
                lambda part: _visible(kind, q_rows, part.rows, buffers, window, chunks),
                lambda part: _alibi_bias(alibi, kind, buffers, q_rows, part.rows, hkv, q), bool(alibi), scale,
                window == 0)
            continue
        rows = keys.rows
        bias = _alibi_bias(alibi, kind, buffers, q_rows, rows, hkv, q)
        sc, _ = attention_scores(q4[:, :, q0:q1], _take(k, keys), scale, softcap, bias)
        sc = own.scores(sc, q_rows, rows)
        ok = own.visible(_visible(kind, q_rows, rows, buffers, window, chunks), q_rows, rows, hkv)
        sc = sc.masked_fill(~ok, float("-inf"))
        m = torch.logsumexp(sc, dim=-1, keepdim=True)  # the tree rule alone: every query sees itself
        # A model's own mask may leave a query no key: output 0, log-sum-exp -inf.
        p = torch.exp(sc - torch.where(torch.isinf(m), torch.zeros_like(m), m))
        o = torch.einsum("hgql,hld->hgqd", p, _take(v, keys))
        out[0, :, q0:q1] = o.reshape(hq, q1 - q0, dv)
        lse[0, :, q0:q1] = m[..., 0].reshape(hq, q1 - q0)
    return out, lse


@tree_attention_cpu.register_fake
def _(q, k, v, buffers, kv_num, kv_idx, full_num, full_idx, kind, block_size, scale, softcap, window, chunks,
      alibi=None, mods=""):
    return q.new_empty(*q.shape[:-1], v.shape[-1]), q.new_empty(q.shape[:-1], dtype=lse_dtype(q))


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
    hkv = k.shape[1]
    dq = torch.zeros_like(q)
    dk = torch.zeros_like(k)
    dv = torch.zeros_like(v)
    nums, idxs = _plan(kv_num, kv_idx, full_num, full_idx)
    own = _Mods(mods, kind, buffers, hq, q.device)
    d_bufs = [torch.zeros_like(t) for t in own.buffers]
    fused = fused_ok(q, v, softcap, own.mods is None, dlse)
    if not fused:  # the fused kernel's backward computes its own row terms
        q4, do4, lse4, delta4 = row_terms(q, dout, out, lse, dlse, hkv)
    for q0, q1, keys, full, partial in _groups(s, block_size, nums, idxs, _GROUP_ROWS if fused else block_size,
                                               q.device):
        q_rows = torch.arange(q0, q1, device=q.device)
        if fused:
            _fused_backward(dout, q, k, v, out, lse, dq, dk, dv, q0, q1, keys, full, partial,
                            lambda part: _visible(kind, q_rows, part.rows, buffers, window, chunks),
                            lambda part: _alibi_bias(alibi, kind, buffers, q_rows, part.rows, hkv, q), bool(alibi),
                            scale, window == 0)
            continue
        rows = keys.rows
        kb, vb = _take(k, keys), _take(v, keys)
        qb, dob = q4[:, :, q0:q1], do4[:, :, q0:q1]
        bias = _alibi_bias(alibi, kind, buffers, q_rows, rows, hkv, q)
        sc, t = attention_scores(qb, kb, scale, softcap, bias)
        back = None
        if own.mods is not None and own.mods.score is not None:
            flat, back = score_vjp(own.mods, sc.reshape(hq, *sc.shape[2:]), own.heads, own.pos[q_rows],
                                   own.pos[rows], own.buffers)
            sc = flat.view(sc.shape)
        ok = own.visible(_visible(kind, q_rows, rows, buffers, window, chunks), q_rows, rows, hkv)
        p = torch.exp(sc - seen(lse4[:, :, q0:q1, None])).masked_fill(~ok, 0.0)
        _add_rows(dv, keys, torch.einsum("hgql,hgqd->hld", p, dob))
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
        _add_rows(dk, keys, torch.einsum("hgql,hgqd->hld", ds, qb) * scale)
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
    ctx.set_materialize_grads(False)  # an unused log-sum-exp gets None, not zeros to add


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, kv_num, kv_idx, full_num, full_idx, *buffers = ctx.saved_tensors
    static = dict(zip(_STATIC, ctx.static))  # a default left out is missing
    mods = static.get("mods") or ""
    if dout is None:
        dout = torch.zeros_like(out)
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
