"""``scaled_dot_product_attention`` with ``is_causal=True``, or with an ``attn_mask`` that is
structural (computed from no activation) and evaluates to the causal mask, optionally with a
sliding window or an ALiBi bias; that mask may be ANDed with masks per key read from the
tokens (``ids != pad``) or, as a float bias, plus terms per query and per key read from the
tokens, which ride in the kernel's product (`treecompile.passes.attention.token_bias`).
"""

from __future__ import annotations

import functools
import operator

import torch
from torch import fx

from treecompile.passes._graph import SDPA_ARGS, SDPA_DEFAULTS, Emitter, PassContext, bind, is_call, row_dims, value
from treecompile.passes._mask_eval import NOT_PLAIN, depends_on_inputs, reads_tokens, structural_causal
from treecompile.passes.attention.patterns import allowed_at, mask_pattern, pattern_mods
from treecompile.passes.attention.dense_pairs import is_pair_exit
from treecompile.passes.attention.memory import memory_keys, memory_masks, memory_sinks
from treecompile.passes.attention.replace import heads_of, replace
from treecompile.passes.attention.token_bias import (AND, can_blind, masked_token_terms, split_key_masks,
                                                     token_terms, with_token_terms)
from treecompile.passes.rows.random import attention_dropout

__all__ = ["rewrite_sdpa"]



def rewrite_sdpa(gm: fx.GraphModule, ctx: PassContext, node: fx.Node) -> bool | None:
    """Rewrites a causal call (or notes why not); False where it is not, and its ``attn_mask`` is
    an ``[S, S]`` tensor read from the tokens, which the dense pair rule judges next (a sparse
    attention's chosen keys)."""
    _rewrite_sdpa(gm, ctx, node)
    mask = bind(node, SDPA_ARGS, SDPA_DEFAULTS)["attn_mask"]
    if node in ctx.notes and node not in ctx.created and isinstance(mask, fx.Node) and reads_tokens(ctx, mask) \
            and is_pair_exit(node):
        return False
    return None


def _rewrite_sdpa(gm: fx.GraphModule, ctx: PassContext, node: fx.Node) -> None:
    a = bind(node, SDPA_ARGS, SDPA_DEFAULTS)
    if a["dropout_p"]:
        raise attention_dropout(node, a["dropout_p"], "dropout_p=0")
    if not row_dims(a["query"], ctx.seq_len, "seq"):
        return  # attention over something other than the sequence (e.g. over heads or patches)
    memory = memory_keys(ctx, a["key"], a["value"])
    if memory is not None:  # learned keys and values before the sequence's: the kernel's sinks
        if a["is_causal"] or not isinstance(a["attn_mask"], fx.Node):
            ctx.notes[node] = "attention over memory keys and the sequence's without a mask padded for the memory"
            return
        kind = "where" if value(a["attn_mask"]).dtype == torch.bool else "additive"
        masks = memory_masks(gm, ctx, node, [(kind, a["attn_mask"])], memory.size)
        if isinstance(masks, str):
            ctx.notes[node] = f"attention over memory keys and the sequence's with {masks}"
            return
        a["attn_mask"], a["key"], a["value"] = masks[0][1], memory.k, memory.v
    mask, terms, kind = _token_parts(ctx, a["attn_mask"], node)
    if isinstance(terms, str):
        ctx.notes[node] = terms
        return
    if memory is not None and (terms or a["scale"] is not None and not isinstance(a["scale"], (int, float))):
        ctx.notes[node] = "attention over memory keys and the sequence's with a bias read from the tokens"
        return
    alibi, mods, mod_buffers, mods_kind = None, None, [], ""
    if terms and mask is None and not a["is_causal"]:
        ctx.notes[node] = "non-causal attention over the sequence (attn_mask is read from the tokens alone)"
        return
    if mask is None:
        if not a["is_causal"]:
            ctx.notes[node] = "non-causal attention over the sequence (is_causal=False, no mask)"
            return
        window = None
    else:
        window, why, alibi, causal = structural_causal(ctx, mask, kind=kind, heads=heads_of(node))
        if why == NOT_PLAIN:  # a pattern of the distance, or chunks (`patterns`)
            pattern = mask_pattern(ctx, functools.partial(allowed_at, ctx, kind, mask))
            found = pattern if isinstance(pattern, str) else pattern_mods(gm, ctx, node, pattern, beside=bool(terms))
            if isinstance(found, str):
                ctx.notes[node] = f"attn_mask is {found}"
                return
            (mods, mod_buffers, mods_kind), why, causal = found, None, True
        if why:
            ctx.notes[node] = f"attn_mask is {why}"
            return
        if not causal and not a["is_causal"]:
            ctx.notes[node] = "non-causal attention over the sequence (attn_mask is a bias without a causal mask)"
            return
    q, k, v, scale = a["query"], a["key"], a["value"], a["scale"]
    if terms:
        scale = scale if scale is not None else value(q).shape[-1] ** -0.5  # of the head dim before it grows
        if not isinstance(scale, (int, float)):
            ctx.notes[node] = "scaled_dot_product_attention with a traced scale and a bias read from the tokens"
            return
        if (window is not None or mods is not None) and any(can_blind(ctx, side, t, f, "zero") for side, t, f in terms):
            ctx.notes[node] = ("attn_mask holds a float mask per key read from the tokens under a window or a mask "
                               "of another pattern: a query whose window it blocks whole weighs otherwise per path")
            return
        lead = torch.broadcast_shapes(tuple(value(q).shape[:-2]), tuple(value(k).shape[:-2]))
        qkv = with_token_terms(gm, ctx, node, lead, q, k, v, terms, float(scale), blind="zero")
        if isinstance(qkv, str):
            ctx.notes[node] = qkv
            return
        q, k, v = qkv
    sinks = sink_values = None
    if memory is not None:
        if alibi is not None:
            ctx.notes[node] = "attention over memory keys and the sequence's with an ALiBi bias"
            return
        scale = scale if scale is not None else value(q).shape[-1] ** -0.5
        sinks, sink_values = memory_sinks(Emitter(gm, ctx, node), q, memory, float(scale))
    if mods is not None and memory is not None:
        ctx.notes[node] = "attention over memory keys and the sequence's with a mask of another pattern"
        return
    if replace(gm, ctx, node, q, k, v, scale=scale, window=window, softcap=None, alibi=alibi, sinks=sinks,
               sink_values=sink_values, mods=mods, mod_buffers=mod_buffers):
        ctx.count("sdpa")
        if mods is not None:
            ctx.count(mods_kind)


def _token_parts(ctx: PassContext, mask, at: fx.Node) -> tuple:
    """``(the rest of attn_mask or None, token terms, how the rest reads)``: a boolean ``attn_mask``
    ANDed with masks per key read from the tokens (``ids != pad``), or a float one plus a sum of
    terms per query and per key read from the tokens, or such terms filled where a structural
    mask blocks (`treecompile.passes.attention.token_bias`), split into those terms and the
    rest, judged as before. ``(mask, why, kind)`` where the rest is not one mask."""
    if not isinstance(mask, fx.Node) or depends_on_inputs(ctx, mask) is False:
        return mask, [], "sdpa"
    mv = value(mask)
    if mv.dtype == torch.bool:
        rest, keys = split_key_masks(ctx, mask, AND)
        if not keys:
            return mask, [], "sdpa"
        if len(rest) > 1 or any(not isinstance(r, fx.Node) for r in rest):
            return mask, "attn_mask joins masks per key read from the tokens with several other masks", "sdpa"
        return (rest[0] if rest else None), [("key_allowed", p, float("-inf")) for p in keys], "sdpa"
    whole = token_terms(ctx, mask, 1.0)
    if whole:
        return None, whole, "sdpa"
    if is_call(mask, (operator.add, torch.add), ("add",)) and len(mask.args) == 2 and not mask.kwargs:
        for rest, bias in (mask.args, mask.args[::-1]):
            terms = token_terms(ctx, bias, 1.0)
            if terms and isinstance(rest, fx.Node) and depends_on_inputs(ctx, rest) is False:
                return rest, terms, "sdpa"
    filled = masked_token_terms(ctx, mask, 1.0, at)
    if filled is not None:
        blocked, terms = filled
        if not blocked:
            return None, terms, "sdpa"
        if len(blocked) != 1:
            return mask, "attn_mask fills a bias read from the tokens where several masks block", "sdpa"
        return blocked[0], terms, "masked_fill"
    return mask, [], "sdpa"
