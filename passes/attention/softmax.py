"""Manual softmax attention: ``softmax(scale * (q @ k^T) masked by a structural causal mask) @ v``,
with scores by ``matmul``, ``bmm``, ``baddbmm`` or ``einsum``, casts and views in between, with or
without a head dim (the walk from the softmax back to the scores is `score_chain`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from treecompile.passes._graph import (MATMUL, Emitter, PassContext, bind, describe, is_call, row_dims, same_size,
                                      source_of, value)
from treecompile.passes._mask_eval import NOT_PLAIN, PAIR_BIAS, causal_pattern, changes_with_length, structural_causal
from treecompile.passes.attention.operands import (
    chain_end,
    drops_last_column,
    forward_chain,
    nan_guard,
    next_op,
    output_operands,
    outside_use,
    scores_operands,
    single_user,
    sink_column,
)
from treecompile.passes.attention.grouped import Grouped, combine, grouped_output, repeat_values
from treecompile.passes.attention.head_mix import HeadMix, head_mix, mix_matrix, mixed_heads, mixed_values, unmix
from treecompile.passes.attention.memory import Memory, memory_keys, memory_masks, memory_sinks
from treecompile.passes.attention.patterns import allowed_at, one_pattern, pattern_mods, with_pattern
from treecompile.passes.attention.relative_bias import relative_bias_mods
from treecompile.passes.attention.replace import heads_of, replace
from treecompile.passes.attention.score_chain import ScoreChain, StopWalk, arithmetic_mask, walk_scores
from treecompile.passes.attention.token_bias import can_blind, with_factors, with_token_terms
from treecompile.passes.rows.random import attention_dropout

__all__ = ["rewrite_softmax_attention"]


_VIEWS = ("view", "reshape", "contiguous")
_CASTS = ("float", "double", "to", "type", "type_as")


@dataclass
class _Match:
    """A manual softmax attention read off the graph: the softmax ``node``, the output product
    ``out`` (its ``post`` layout), the query, key and value operands, a sink column, and the
    walk from the softmax back to the scores (scale, masks, soft-cap)."""

    out: fx.Node
    q: Any
    k: Any
    v: Any
    post: Any
    sink: fx.Node | None
    walk: ScoreChain
    group: Grouped | None = None
    memory: Memory | None = None
    mix: HeadMix | None = None  # the probabilities mixed across heads before ``@ v``


def rewrite_softmax_attention(gm: fx.GraphModule, ctx: PassContext, node: fx.Node) -> None:
    """Matches ``softmax(chain(q @ k^T), dim=-1) @ v`` where ``chain`` scales, masks, casts
    and reshapes.

    Scores by ``matmul`` / ``@``, ``bmm``, ``baddbmm`` or a two-operand ``einsum``; the
    output by ``matmul``, ``bmm`` or ``einsum``; casts (``.float()``, ``.to(dtype)``,
    ``.type_as(q)``) and views anywhere in between. A match whose masks do not make it causal
    is left with a note (`_judge_masks`).
    """
    m = _match(ctx, node)
    if m is None:
        return
    if m.memory is not None:
        w = m.walk
        masks = "a bias read from the tokens, a tensor factor or a soft-cap" if (
            w.token_terms or w.factors or w.softcap is not None) else memory_masks(gm, ctx, m.out, w.masks,
                                                                                   m.memory.size)
        if isinstance(masks, str):
            ctx.notes[node] = f"attention over memory keys and the sequence's with {masks}"
            return
        w.masks = masks
    terms = _judge_masks(ctx, node, m.walk)
    if isinstance(terms, tuple) and isinstance(terms[0], str):
        why, at_out = terms
        ctx.notes[m.out if at_out else node] = why
        return
    window, alibi, relative, distances = terms
    mods, mod_buffers, mods_kind = None, [], "relative_bias"
    # What the softmax gives a query that sees only blocked keys (`with_token_terms`): NaN, unless
    # a sink or memory key is there for every query.
    blind = "nan" if m.sink is None and m.memory is None else "none"
    if isinstance(distances, tuple) and not distances[0] and blind == "nan":
        # A query sees no key of its own path at first (per path its softmax is NaN, or over a
        # finite fill weighs every key alike, the later ones too): the kernel would give it 0.
        ctx.notes[node] = "the attention mask hides each query's own key, which leaves the first queries no key"
        return
    if distances is not None:
        found = pattern_mods(gm, ctx, m.out, distances, beside=bool(relative) or alibi is not None
                             or isinstance(distances, int) and window is not None)
        if isinstance(found, str):
            ctx.notes[node] = f"the attention mask is {found}"
            return
        mods, mod_buffers, mods_kind = found
    if relative:
        if alibi is not None or m.walk.softcap is not None:
            ctx.notes[node] = "the scores get a learned pair bias beside ALiBi or a soft-cap"
            return
        found = relative_bias_mods(gm, ctx, relative[0], m.out, m.walk.relative_scale, heads_of(node))
        if isinstance(found, str):
            ctx.notes[node] = f"the scores get {found}"
            return
        mods, table = found
        mod_buffers = [table]
    if m.walk.token_terms and m.walk.softcap is not None:
        ctx.notes[node] = "the scores get a bias read from the tokens beside a soft-cap (outside its tanh)"
        return
    if (window is not None or mods is not None) and any(can_blind(ctx, side, t, f, blind)
                                                        for side, t, f in m.walk.token_terms):
        ctx.notes[node] = ("the scores get a mask per key read from the tokens under a window or a mask of the "
                           "model's own: a query whose window it blocks whole is computed otherwise per path "
                           "(NaN, or weights over the keys the fill hides alike)")
        return
    scale = m.walk.scale * (m.walk.softcap or 1.0)
    sink, sink_values = m.sink, None
    if m.memory is not None:
        if alibi is not None:
            ctx.notes[node] = "attention over memory keys and the sequence's with an ALiBi bias"
            return
        sink, sink_values = memory_sinks(Emitter(gm, ctx, m.out), m.q, m.memory, scale)
    with gm.graph.inserting_before(m.out):
        q, k, v = (ctx.mark(x(gm.graph), like=m.out) if callable(x) else x for x in (m.q, m.k, m.v))
        if m.sink is not None:  # [.., S, 1] -> [.., S], broadcast against the kernel's log-sum-exp
            sink = ctx.mark(gm.graph.call_method("squeeze", (sink, -1)), like=m.out)
            sink.meta["example_value"] = value(m.sink).squeeze(-1)
    if m.walk.head_mix is not None or m.mix is not None:
        if m.group is not None or m.memory is not None or m.sink is not None:
            ctx.notes[node] = "scores mixed across heads beside maps combined across heads, memory keys or a sink"
            return
    if m.walk.head_mix is not None:
        qk = mixed_heads(Emitter(gm, ctx, m.out), m.walk.head_mix, q, k, v)
        if isinstance(qk, str):
            ctx.notes[node] = qk
            return
        q, k = qk
    post = m.post
    if m.mix is not None:  # each head's map times every head's values; the mix after
        e = Emitter(gm, ctx, m.out)
        matrix, wide = mix_matrix(e, m.mix), mixed_values(e, v)
        if isinstance(wide, str) or tuple(value(matrix).shape) != (value(v).shape[1],) * 2:
            ctx.notes[node] = wide if isinstance(wide, str) else \
                "probabilities mixed by a matrix that is not over the heads"
            return
        heads, dv = value(v).shape[1], value(v).shape[-1]
        v, inner = wide, post
        mark = functools.partial(_mark_like, ctx, m.out)

        def post(g, y):
            y = unmix(g, y, matrix, heads, dv, mark)
            return y if inner is None else inner(g, y)
    if m.group is not None:  # each head with its group's value; the group's combination after
        v = repeat_values(Emitter(gm, ctx, m.out), m.group)
        post = functools.partial(combine, grouped=m.group, mark=lambda n: ctx.mark(n, like=m.out))
    if m.walk.factors:
        qk = with_factors(Emitter(gm, ctx, m.out), m.walk.factors, q, k)
        if isinstance(qk, str):
            ctx.notes[node] = qk
            return
        q, k = qk
    with gm.graph.inserting_before(m.out):
        if m.walk.token_terms:
            qkv = with_token_terms(gm, ctx, m.out, value(m.walk.qk).shape[:-2], q, k, v, m.walk.token_terms, scale,
                                   blind=blind)
            if isinstance(qkv, str):
                ctx.notes[node] = qkv
                return
            q, k, v = qkv
    if replace(gm, ctx, node, q, k, v, scale=scale, window=window,
               softcap=m.walk.softcap, output=m.out, post=post, alibi=alibi, sinks=sink, sink_values=sink_values,
               mods=mods,
               mod_buffers=mod_buffers):
        ctx.count("softmax_attention")
        if mods is not None:
            ctx.count(mods_kind)


def _match(ctx: PassContext, node: fx.Node) -> _Match | None:
    """The attention around the softmax ``node``, or None where it is not one (or a note says why
    it cannot be rewritten)."""
    args = bind(node, ["input", "dim"], {"dim": None})
    scores = args["input"]
    sv = value(scores)
    if not isinstance(sv, torch.Tensor) or sv.dim() < 2 or args["dim"] not in (-1, sv.dim() - 1):
        return None
    sink = sink_column(ctx, scores)
    if sink is not None:
        # softmax(cat([scores, sink], -1))[..., :-1]: a sink logit per query (gpt-oss).
        scores = scores.args[0][0]
    paired = len(row_dims(scores, ctx.seq_len, "seq")) >= 2
    if not paired and not (sink is None and same_size(value(scores).shape[-2], ctx.seq_len)):
        return None  # (scores over memory keys and the rows: `memory_keys` below)
    try:
        walk = walk_scores(ctx, node, scores)
    except StopWalk as e:
        if str(e):
            ctx.notes[node] = str(e)
        return None
    qk = scores_operands(walk.qk)
    if qk is None:
        return None
    q, k, q_layout = qk
    out, mix = _output_product(ctx, node, sink)
    if out is None and sink is None and q_layout is None and paired:
        group = grouped_output(ctx, node)
        if group is not None:
            other = outside_use(walk.nodes + [args["input"]] + group.nodes, group.out)
            if other is not None:
                ctx.notes[group.out] = (f"the attention scores are also used by {describe(other)} at "
                                        f"{source_of(other)}, which rewriting the attention would drop")
                return None
            return _Match(group.out, q, k, group.v, None, None, walk, group)
    pv = None if out is None else output_operands(out, q_layout)
    if pv is None:
        return None
    p_arg, v, post = pv
    if p_arg is not chain_end(node, out):
        return None
    memory = None
    if not paired:
        memory = memory_keys(ctx, k, v) if q_layout is None and post is None and not callable(k) else None
        if memory is None:
            return None
        k, v = memory.k, memory.v
    other = outside_use(walk.nodes + [args["input"]] + forward_chain(node, out), out)
    if other is not None:
        ctx.notes[out] = (f"the attention scores are also used by {describe(other)} at {source_of(other)} (an in-place "
                          "edit or a second reader), which rewriting the attention would drop")
        return None
    return _Match(out, q, k, v, post, sink, walk, memory=memory, mix=mix)


def _output_product(ctx: PassContext, node: fx.Node, sink: fx.Node | None) -> tuple[fx.Node | None, HeadMix | None]:
    """Forward from the softmax: [drop the sink column] -> [dropout(p=0) | cast | view | a mix
    of the heads (talking heads, once)] -> @ v; ``(the product, the mix or None)``."""
    prev, out, mix = node, next_op(node), None
    if sink is not None:
        if out is None or not drops_last_column(out):
            return None, None
        prev, out = out, single_user(out)
    while out is not None:
        if (guard := nan_guard(prev)) is not None and guard[0] is out:
            pass  # where(isnan(p), 0, p): p itself (see `nan_guard`)
        elif is_call(out, (torch.nn.functional.dropout, torch.reshape), _CASTS + _VIEWS):
            if is_call(out, (torch.nn.functional.dropout,)):
                p = bind(out, ["input", "p", "training"], {"p": 0.5, "training": True})
                if p["p"] and p["training"]:
                    raise attention_dropout(out, p["p"], "dropout p=0")
        elif mix is None and (found := head_mix(ctx, out)) is not None:
            mix = found[1]
        else:
            break
        prev, out = out, next_op(out)
    if out is None or not (is_call(out, MATMUL, ("matmul", "bmm")) or is_call(out, (torch.einsum,))):
        return None, None
    return out, mix


def _mark_like(ctx: PassContext, like: fx.Node, n: fx.Node) -> fx.Node:
    return ctx.mark(n, like=like)


def _judge_masks(ctx: PassContext, node: fx.Node, walk: ScoreChain) -> tuple:
    """``(window, alibi slopes, relative biases)`` of a causal attention's masks, or ``(why,
    at_out)``: why they do not make it causal (noted on the output product if ``at_out``)."""
    bidirectional = ("softmax attention without a causal mask (bidirectional)", True)
    if not walk.masks:
        return bidirectional
    heads = heads_of(node)
    window, alibi, causal = None, None, False
    arithmetic = any(kind in ("multiply", "subtract") for kind, _ in walk.masks)
    relative = [m for kind, m in walk.masks if kind == "relative"]
    masks = [(kind, m) for kind, m in walk.masks if kind != "relative"]
    if relative and (arithmetic or len(relative) > 1):
        return "the scores get a learned pair bias beside another bias or an arithmetic mask", False
    distances = None
    for kind, m in [] if arithmetic else masks:  # an arithmetic mask is judged as a whole, below
        w, why, slopes, is_mask = structural_causal(ctx, m, kind=kind, heads=heads)
        if why == NOT_PLAIN:
            distances = with_pattern(ctx, distances, functools.partial(allowed_at, ctx, kind, m))
            if isinstance(distances, str):
                return f"the attention mask is {distances}", False
            why, is_mask = None, True
        if why and why.startswith(PAIR_BIAS) and not relative:
            relative = [m]  # judged as a function of the distance, as a learned pair bias is
            continue
        if why:
            return f"the attention mask is {why}", False
        if slopes is not None:
            if alibi is not None:
                return "the scores get two ALiBi biases", False
            alibi = slopes
        causal = causal or is_mask
        if w is not None:
            window = w if window is None else min(window, w)
    allowed = arithmetic_mask(ctx, walk)
    if isinstance(allowed, str):
        return f"the attention mask is {allowed}", False
    if allowed is not None:
        flat = allowed.reshape(-1, *allowed.shape[-2:])
        w, why = causal_pattern(flat[0]) if all(torch.equal(flat[0], f) for f in flat[1:]) else \
            (None, "different across batch or heads")
        pattern_at = functools.partial(_arithmetic_pattern, ctx, walk)
        if why == NOT_PLAIN:
            distances = with_pattern(ctx, distances, pattern_at)
            if isinstance(distances, str):
                return f"the attention mask is {distances}", False
            why = None
        elif not why:
            # A mask that reads an input of the row count (Hugging Face's attention mask beside
            # GPT-1's buffer) cannot be built at another length: judged as it is, as a structural one.
            why = changes_with_length(pattern_at, flat[0], unjudged_ok=True)
        if why:
            return f"the attention mask is {why}", False
        ctx.max_rows = flat.shape[-1] if ctx.max_rows is None else min(ctx.max_rows, flat.shape[-1])
        causal = True
        if w is not None:
            window = w if window is None else min(window, w)
    if not causal:
        return bidirectional
    if isinstance(distances, tuple) and window is not None:  # the window is one more pattern of the distance
        distances, window = tuple(a and d < window for d, a in enumerate(distances)), None
    return window, alibi, relative, distances


def _arithmetic_pattern(ctx: PassContext, walk: ScoreChain, rows: int | None) -> torch.Tensor | None:
    """The one pattern the chain's arithmetic mask lets through at ``rows`` rows, or None."""
    return one_pattern(arithmetic_mask(ctx, walk, rows))
