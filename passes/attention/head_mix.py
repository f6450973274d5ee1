"""Scores mixed across heads before the softmax ("talking heads").

Talking-heads attention (Shazeer et al. 2020; x-transformers' ``pre_softmax_talking_heads``, a
``Conv2d(heads, heads, 1, bias=False)`` on the scores, or ``einsum('b h i j, h g -> b g i j')``)
replaces each head's scores by a learned linear combination of every head's: ``s'_g = sum_h
M[g, h] q_h . k_h``. That is one product of longer vectors, ``q'_g . k'`` with ``q'_g = [M[g, 0]
q_0, ..., M[g, H-1] q_{H-1}]`` and ``k' = [k_0, ..., k_{H-1}]`` (one key for every head): the tree
kernel runs it as it is, on head dims ``H`` times as long (a single key head, or one query head's
combination when the keys have one head already). Only constant factors may be applied to the
scores before the mix (a mask or bias mixed across heads is refused by the walk); what is applied
after it is per mixed head, as for any scores.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx

from treecompile.passes._graph import Emitter, PassContext, is_call, row_dims, value
from treecompile.passes._mask_eval import reads_tokens

__all__ = ["HeadMix", "head_mix", "mixed_heads", "mix_matrix", "mixed_values", "unmix"]


@dataclass(frozen=True)
class HeadMix:
    """A mix of the scores' heads: ``weight`` read as ``M[out head, in head]`` through ``layout``:
    ``"conv"`` (a 1x1 convolution's ``[out, in, 1, 1]``), ``"out_in"`` or ``"in_out"`` (an einsum's
    matrix)."""

    weight: fx.Node
    layout: str


def head_mix(ctx: PassContext, node: fx.Node) -> tuple[fx.Node, HeadMix] | None:
    """``(the scores before the mix, the mix)`` if ``node`` mixes the heads of ``[B, H, S, S]``
    scores by a matrix that reads no token: a 1x1 ``conv2d`` without bias, stride, padding,
    dilation or groups, or a two-operand ``einsum`` contracting the head dim with a matrix."""
    if is_call(node, (torch.conv2d, torch.nn.functional.conv2d)):
        args = list(node.args) + [None] * (7 - len(node.args))
        x, w, bias, stride, padding, dilation, groups = args[:7]
        kw = node.kwargs
        bias = kw.get("bias", bias)
        plain = (_ones(kw.get("stride", stride)) and _zeros(kw.get("padding", padding))
                 and _ones(kw.get("dilation", dilation)) and kw.get("groups", groups) in (None, 1))
        wv = value(w) if isinstance(w, fx.Node) else None
        if bias is None and plain and isinstance(wv, torch.Tensor) and wv.dim() == 4 \
                and tuple(wv.shape[2:]) == (1, 1) and _scores(ctx, x) and _matrix(ctx, w):
            return x, HeadMix(w, "conv")
        return None
    if not is_call(node, (torch.einsum, torch.functional.einsum)) or len(node.args) != 3 or node.kwargs:
        return None
    eq, a, b = node.args
    if not isinstance(eq, str) or "..." in eq or "->" not in eq:
        return None
    ins, out = eq.replace(" ", "").split("->")
    parts = ins.split(",")
    if len(parts) != 2:
        return None
    for (sx, x), (sw, w) in (((parts[0], a), (parts[1], b)), ((parts[1], b), (parts[0], a))):
        if len(sx) != 4 or len(sw) != 2 or len(out) != 4 or len(set(sx)) != 4 or len(set(sw)) != 2:
            continue
        h, g = sx[1], out[1]
        if out != sx[0] + g + sx[2:] or h == g or set(sw) != {h, g} or not _scores(ctx, x) or not _matrix(ctx, w):
            continue
        return x, HeadMix(w, "out_in" if sw == g + h else "in_out")
    return None


def _ones(x) -> bool:
    return x is None or x == 1 or isinstance(x, (tuple, list)) and all(v == 1 for v in x)


def _zeros(x) -> bool:
    return x is None or x == 0 or isinstance(x, (tuple, list)) and all(v == 0 for v in x)


def _scores(ctx: PassContext, x) -> bool:
    """``[B, H, S, S]``."""
    v = value(x) if isinstance(x, fx.Node) else None
    return isinstance(v, torch.Tensor) and v.dim() == 4 and row_dims(x, ctx.seq_len, "seq") == [2, 3]


def _matrix(ctx: PassContext, w) -> bool:
    """A weight with no dim of the sequence that reads no token (a parameter, or built from one)."""
    return isinstance(w, fx.Node) and isinstance(value(w), torch.Tensor) and value(w).dtype.is_floating_point \
        and not row_dims(w, ctx.seq_len, "seq") and not reads_tokens(ctx, w)


def mixed_heads(e: Emitter, mix: HeadMix, q: fx.Node, k: fx.Node, v: fx.Node) -> tuple[fx.Node, fx.Node] | str:
    """``(q', k')`` for the kernel, ``q'`` ``[B, H_out, S, D']`` and ``k'`` one key for every head
    (expanded to the values' heads, as the kernel pairs keys and values), such that ``q'_g . k'``
    is the mixed scores (see the module's text); or why the heads do not match."""
    qv, kv = value(q), value(k)
    if qv.dim() != 4 or kv.dim() != 4:
        return "mixed heads of scores without a [B, H, S, D] query and key"
    heads, kheads = qv.shape[1], kv.shape[1]
    m = mix_matrix(e, mix)
    if value(m).shape[1] != heads or not isinstance(kheads, int) or heads % kheads:
        return f"scores of {heads} heads mixed by a matrix over {value(m).shape[1]} heads"
    m = e.method("to", m, torch.promote_types(qv.dtype, value(m).dtype))
    q = e.method("to", q, value(m).dtype) if qv.dtype != value(m).dtype else q
    if kheads == 1:  # one key for every head: the mix is on the queries alone
        return e.fn(torch.einsum, "bhsd,gh->bgsd", q, m), _as_values(e, k, v)
    if kheads != heads:
        k = e.method("repeat_interleave", k, heads // kheads, 1)
    q = e.method("reshape", e.fn(torch.einsum, "bhsd,gh->bgshd", q, m), qv.shape[0], value(m).shape[0], -1,
                 heads * qv.shape[-1])
    k = e.method("unsqueeze", e.method("reshape", e.method("transpose", k, 1, 2), kv.shape[0], -1,
                                       heads * kv.shape[-1]), 1)
    k = _as_values(e, k, v)
    return q, e.method("to", k, value(q).dtype) if value(k).dtype != value(q).dtype else k


def _as_values(e: Emitter, k: fx.Node, v: fx.Node) -> fx.Node:
    """One key head expanded to the values' heads (the kernel pairs key and value heads)."""
    heads = value(v).shape[1]
    return k if value(k).shape[1] == heads else e.method("expand", k, -1, heads, -1, -1)


def mix_matrix(e: Emitter, mix: HeadMix) -> fx.Node:
    """The mix as ``M[out head, in head]``."""
    m = mix.weight
    if mix.layout == "conv":
        return e.method("reshape", m, value(m).shape[0], value(m).shape[1])
    return e.method("t", m) if mix.layout == "in_out" else m


def mixed_values(e: Emitter, v: fx.Node) -> fx.Node | str:
    """For probabilities mixed across heads after the softmax (``p'_g = sum_h M[g, h] p_h``, then
    ``p'_g @ v_g``): every head's values side by side, ``[B, H, S, H * Dv]``, so that each head's
    attention computes ``p_h @ v_g`` for every ``g`` (`unmix` then combines them)."""
    vv = value(v)
    if vv.dim() != 4 or not isinstance(vv.shape[1], int):
        return "probabilities mixed across heads without [B, H, S, Dv] values"
    heads = vv.shape[1]
    side = e.method("reshape", e.method("transpose", v, 1, 2), vv.shape[0], -1, heads * vv.shape[-1])
    return e.method("expand", e.method("unsqueeze", side, 1), -1, heads, -1, -1)


def unmix(g: fx.Graph, y: fx.Node, m: fx.Node, heads: int, dv: int, mark) -> fx.Node:
    """``out_g = sum_h M[g, h] y_h[.., g's block]`` from the kernel's ``y`` ``[B, H, S, H * Dv]``
    (`mixed_values`): ``[B, H, S, Dv]`` (each new node passed through ``mark``)."""
    parts = mark(g.call_method("unflatten", (y, -1, (heads, dv))))
    return mark(g.call_function(torch.einsum, ("bhsgd,gh->bgsd", parts, mark(g.call_method("type_as", (m, y))))))
