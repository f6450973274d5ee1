"""rewrite_attention_pass: every causal attention becomes FlexAttention with the tree mask.

Three spellings of causal attention are matched, each once for all models:

* ``treecompile::causal_attention``: a Hugging Face attention-interface call (the wrapper
  routes HF's attention interface there, whatever kernel the model was configured with);
  it carries the call's scale, sliding window and soft-cap.
* ``scaled_dot_product_attention`` with ``is_causal=True``, or with an ``attn_mask`` that
  is structural (computed from no activation) and evaluates to the causal mask,
  optionally with a sliding window.
* manual softmax attention: ``softmax(scale * (q @ k^T) masked by a structural causal
  mask) @ v``, with scores by ``matmul``, ``bmm``, ``baddbmm`` or ``einsum``, casts and
  views in between, with or without a head dim.

A structural additive term that is linear in the key index per head is ALiBi: the kernel
adds ``slope * (positions[kv] - positions[q])``. A sink logit concatenated to the scores
(or HF's ``s_aux``) is one more term in each softmax denominator: the kernel output is
scaled by ``sigmoid(lse - sink)``.

Why the rewrite is exact: per-path training lets token ``q`` of a path attend to the
tokens before it on that path. In the packed row those are exactly the keys ``kv`` with
``kv <= q < subtree_end[kv]`` (the rows of ``q``'s ancestors' nodes and the earlier rows
of its own node), and the token at ``kv`` has the same key and value vectors as on the
path because everything before attention is computed from the path prefix alone
(by induction over layers). The softmax therefore runs over the same set of scores, so
the output row equals the per-path output row. Windows are measured in path positions
(``positions[q] - positions[kv]``), the distance per-path training sees, and soft-capping
acts on each score alone.

One module: the three spellings' matchers end in one rewrite (``_replace``: the FlexAttention
call with its scale, window, soft-cap, ALiBi and sink), and the manual matcher's helpers
(einsum specs, score and output operands, transposes) serve it alone.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from treecompile.kernels.attention.flex import AttentionSpec, tree_attention_fn
from treecompile.kernels.attention.flex_mods import chunk_mods, register_mods
from treecompile.passes._graph import (
    MATMUL,
    SDPA,
    SOFTMAX,
    PassContext,
    bind,
    describe,
    is_call,
    row_dims,
    same_size,
    source_of,
    value,
)
from treecompile.passes._mask_eval import causal_pattern, depends_on_inputs, evaluate, reads_tokens, structural_causal
from treecompile.passes.attention_operands import (
    chain_end,
    drops_last_column,
    forward_chain,
    output_operands,
    outside_use,
    scores_operands,
    single_user,
    sink_column,
)
from treecompile.passes.score_chain import StopWalk, arithmetic_mask, spell_softmax, walk_scores
from treecompile.passes.markers import is_marker
from treecompile.passes.attention_mha import rewrite_multihead
from treecompile.passes.relative_bias import relative_bias_mods
from treecompile.passes.rows.random import attention_dropout

__all__ = ["rewrite_attention_pass"]

_SDPA_ARGS = ["query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa"]
_SDPA_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}


def rewrite_attention_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Replaces causal attention calls with tree FlexAttention; counts them by kind.

    Counters (``ctx.counters["rewrite_attention_pass"]``): ``hf_interface``, ``sdpa``,
    ``softmax_attention``, ``multihead_attention``, ``flex_attention``. Calls that are not provably causal are
    left in place with a note; the verify pass refuses them.
    """
    for node in list(gm.graph.nodes):
        spell_softmax(gm, node)
    for node in list(gm.graph.nodes):
        if is_marker(node, "causal_attention"):
            q, k, v, scale, window, softcap, *rest = node.args
            sinks = rest[0] if rest else node.kwargs.get("sinks")
            chunk = rest[1] if len(rest) > 1 else node.kwargs.get("chunk")
            if sinks is not None:
                with gm.graph.inserting_before(node):  # [Hq] -> [1, Hq, 1], broadcast over the rows
                    sinks = ctx.mark(gm.graph.call_method("view", (sinks, 1, -1, 1)), like=node)
            # Attention within chunks of the path (Llama 4): the model's own mask on path positions.
            mods = chunk_mods(int(chunk)) if chunk is not None else None
            if _replace(gm, ctx, node, q, k, v, scale=scale, window=window, softcap=softcap, sinks=sinks, mods=mods):
                ctx.count("hf_interface")
        elif is_call(node, SDPA):
            _rewrite_sdpa(gm, ctx, node)
        elif is_call(node, SOFTMAX, ("softmax",)):
            _rewrite_softmax_attention(gm, ctx, node)
        elif is_call(node, (torch.nn.functional.multi_head_attention_forward,)):
            rewrite_multihead(gm, ctx, node, _replace)
        elif node.op == "call_function" and node.target is getattr(torch.ops.higher_order, "flex_attention", None):
            _rewrite_flex(gm, ctx, node)
    return gm


def _replace(gm, ctx, node, q, k, v, *, scale, window, softcap, output=None, post=None, alibi=None,
             sinks=None, sink_values=None, mods=None, mod_buffers=()) -> bool:
    """Inserts the tree attention call and redirects the users of ``output`` (default ``node``).

    ``q``, ``k``, ``v`` are ``[B, H, S, D]`` or ``[B * H, S, D]`` (``[B, S, D]`` for attention
    without a head dim); the batch is 1 (the wrapper's), so a 3-D tensor's leading dim is the
    kernel's heads, and the result gets ``output``'s layout back. Inputs of different
    dtypes (scores in float32, values in float64, as GPT-J does) are promoted to one dtype
    (the most precise of them) for the kernel, and the result cast to ``output``'s dtype.
    """
    output = output or node
    vals = [value(x) for x in (q, k, v)]
    out_val = value(output)
    if any(not isinstance(t, torch.Tensor) for t in (*vals, out_val)):
        return False
    # The kernel's result has q's dims; ``post`` (an einsum layout) maps it to ``output``'s.
    out_dim = vals[0].dim() if post is not None else out_val.dim()
    dims = {t.dim() for t in vals} | {out_dim}
    if not dims <= {3, 4}:
        ctx.notes[output] = f"attention over tensors of {sorted(dims)} dims: the tree kernel takes [B, H, S, D]"
        return False
    if any(t.dim() - 2 not in row_dims(x, ctx.seq_len, "seq") for x, t in zip((q, k, v), vals) if not callable(x)):
        ctx.notes[output] = "attention whose q, k or v does not have the sequence as its second-to-last dim"
        return False
    traced = [name for name, x in (("scale", scale), ("window", window), ("softcap", softcap))
              if isinstance(x, fx.Node)]
    if traced:
        # The tree kernel takes them as constants; Dynamo traces a number as a variable when it
        # has seen it change between calls of the same function.
        ctx.notes[output] = f"attention whose {' and '.join(traced)} is a traced variable, not a constant"
        return False
    three_d = out_dim == 3
    dtype = vals[0].dtype
    for t in vals[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    with gm.graph.inserting_before(output):
        args = []
        for x, t in zip((q, k, v), vals):
            if t.dtype != dtype:
                x = ctx.mark(gm.graph.call_method("to", (x, dtype)), like=output)
            if t.dim() == 3:  # [B * H, S, D] or [B, S, D] with B = 1: the leading dim is the heads
                x = ctx.mark(gm.graph.call_method("unsqueeze", (x, 0)), like=output)
            args.append(x)
    q, k, v = args
    spec = AttentionSpec(
        kind=ctx.mask,
        scale=None if scale is None else float(scale),
        window=None if window is None else int(window),
        softcap=None if softcap is None else float(softcap),
        chunks=ctx.chunks,
        layout=ctx.layout,
        alibi=alibi,
        sinks=sinks is not None,
        mods=mods,
    )
    fn = tree_attention_fn(spec)
    with gm.graph.inserting_before(output):
        kwargs = {} if sinks is None else {"sinks": sinks}
        if sink_values is not None:
            kwargs["sink_values"] = sink_values
        if mods is not None:
            kwargs["mod_buffers"] = list(mod_buffers)
        new = ctx.mark(gm.graph.call_function(fn, (q, k, v, ctx.positions, *ctx.mask_buffers, *ctx.block_tensors),
                                              kwargs), like=output)
        if three_d:
            new = ctx.mark(gm.graph.call_method("squeeze", (new, 0)), like=output)
        if dtype != value(output).dtype:
            new = ctx.mark(gm.graph.call_method("to", (new, value(output).dtype)), like=output)
        if post is not None:
            new = ctx.mark(post(gm.graph, new), like=output)
    new.meta["example_value"] = value(output)
    output.replace_all_uses_with(new)
    return True


# --------------------------------------------------------------------------- SDPA


def _rewrite_sdpa(gm: fx.GraphModule, ctx: PassContext, node: fx.Node) -> None:
    a = bind(node, _SDPA_ARGS, _SDPA_DEFAULTS)
    if a["dropout_p"]:
        raise attention_dropout(node, a["dropout_p"], "dropout_p=0")
    if not row_dims(a["query"], ctx.seq_len, "seq"):
        return  # attention over something other than the sequence (e.g. over heads or patches)
    mask = a["attn_mask"]
    alibi = None
    if mask is None:
        if not a["is_causal"]:
            ctx.notes[node] = "non-causal attention over the sequence (is_causal=False, no mask)"
            return
        window = None
    else:
        window, why, alibi, causal = structural_causal(ctx, mask, kind="sdpa", heads=_heads(node))
        if why:
            ctx.notes[node] = f"attn_mask is {why}"
            return
        if not causal and not a["is_causal"]:
            ctx.notes[node] = "non-causal attention over the sequence (attn_mask is a bias without a causal mask)"
            return
    if _replace(gm, ctx, node, a["query"], a["key"], a["value"], scale=a["scale"], window=window, softcap=None,
                alibi=alibi):
        ctx.count("sdpa")


def _heads(node: fx.Node) -> int | None:
    """The kernel's heads for an attention whose output (or scores) is ``node``: the product
    of its leading dims (the batch is 1), or None if one is symbolic."""
    v = value(node)
    n = 1
    for d in v.shape[:-2]:
        if not isinstance(d, int):
            return None
        n *= d
    return n


# --------------------------------------------------------------------------- FlexAttention


def _rewrite_flex(gm: fx.GraphModule, ctx: PassContext, node: fx.Node) -> None:
    """A model's own ``flex_attention(q, k, v, score_mod=..., block_mask=...)``.

    Its ``mask_mod``, evaluated over the example length (its buffers structural), must keep
    only pairs with the key at or before the query; the causal pattern (optionally within a
    window) becomes the tree kernel's own rule, any other such pattern (chunks, dilation, a
    per-head mask) and any ``score_mod`` run in the tree kernel on the rows' path positions
    (`treecompile.kernels.attention.flex_mods`). The tensors they read may be parameters (a learned
    bias) or structural, never computed from the tokens, nor one entry per token of the row
    (document ids): those index by something other than the position. The model's
    ``BlockMask`` is then dead; the tree kernel builds its own."""
    q, k, v, score_mod, block, scale = node.args[:6]
    score_buffers = list(node.args[7]) if len(node.args) > 7 else []
    mask_buffers = list(node.args[8]) if len(node.args) > 8 else []
    score_gm = getattr(gm, score_mod.target, None) if isinstance(score_mod, fx.Node) else None
    mask_fn = block[-1] if isinstance(block, (tuple, list)) and block else None
    mask_gm = getattr(gm, mask_fn.target, None) if isinstance(mask_fn, fx.Node) else None
    why = None if score_gm is not None else "a score_mod treecompile cannot see"
    own_score = score_gm is not None and not _returns_first_input(score_gm)
    if why is None and own_score:
        why = _mod_buffers_refusal(ctx, score_buffers, "score_mod", parameters=True)
    window, own_mask = None, False
    if why is None:
        qv = value(q)
        heads = int(qv.shape[1]) if isinstance(qv, torch.Tensor) and qv.dim() == 4 else 1
        allowed = _mask_mod_pattern(ctx, mask_gm, mask_buffers, heads)
        if isinstance(allowed, str):
            why = allowed
        else:
            ctx.max_rows = allowed.shape[-1] if ctx.max_rows is None else min(ctx.max_rows, allowed.shape[-1])
            same = bool((allowed == allowed[:1]).all())
            # Heads that differ: every head must keep keys at or before the query (their union
            # is checked), and the model's own mask_mod then runs per head in the tree kernel.
            window, pattern = causal_pattern(allowed[0] if same else allowed.any(0))
            if not same and pattern is None:
                window, pattern = None, "a mask that differs between heads"
            if pattern is not None:
                if "not causal" in pattern:
                    why = f"the mask_mod is {pattern}"
                else:
                    own_mask = True  # causal, some other pattern: run the model's own mask_mod
                    why = _mod_buffers_refusal(ctx, mask_buffers, "mask_mod", parameters=False)
    users = list(node.users)
    if why is None and not all(u.op == "call_function" and u.target is operator.getitem for u in users):
        why = "its result is used as a whole"
    if why is None and any(u.args[1] != 0 and u.users for u in users):
        why = "its log-sum-exp is used"
    if why is not None:
        ctx.notes[node] = why
        return
    mods, mod_buffers = None, []
    if own_score or own_mask:
        mods = register_mods(score_gm if own_score else None, mask_gm if own_mask else None,
                             len(score_buffers) if own_score else 0, len(mask_buffers) if own_mask else 0)
        mod_buffers = (score_buffers if own_score else []) + (mask_buffers if own_mask else [])
    outputs = [u for u in users if u.args[1] == 0]
    for extra in outputs[1:]:
        extra.replace_all_uses_with(outputs[0])
    if outputs and _replace(gm, ctx, node, q, k, v, scale=scale, window=window, softcap=None, output=outputs[0],
                            mods=mods, mod_buffers=mod_buffers):
        ctx.count("flex_attention")
        if mods is not None:
            ctx.count("flex_mods")


def _mod_buffers_refusal(ctx: PassContext, buffers: list, what: str, *, parameters: bool) -> str | None:
    """Why the tensors a model's own ``score_mod`` / ``mask_mod`` reads cannot be read on the
    tree's positions, or None: computed from the tokens (or, for a mask, from parameters), or
    with one entry per token of the row (indexed by something other than the position)."""
    for b in buffers:
        if not isinstance(b, fx.Node):
            continue
        bv = value(b)
        if isinstance(bv, torch.Tensor) and any(same_size(d, ctx.seq_len) for d in bv.shape):
            return (f"a {what} that reads {b.name}, a tensor with one entry per token of the row (e.g. document ids): "
                    "indexed by something other than the token's position on its path")
        if reads_tokens(ctx, b) or not parameters and depends_on_inputs(ctx, b):
            return (f"a {what} that reads {b.name}, computed from the tokens"
                    + ("" if parameters else " or parameters") + ", not a structural tensor")
    return None


def _returns_first_input(sub: fx.GraphModule) -> bool:
    first = next((n for n in sub.graph.nodes if n.op == "placeholder"), None)
    out = next((n for n in sub.graph.nodes if n.op == "output"), None)
    result = out.args[0] if out is not None else None
    result = result[0] if isinstance(result, (tuple, list)) and len(result) == 1 else result
    return first is not None and result is first


def _mask_mod_pattern(ctx: PassContext, mask_gm, buffers, heads: int = 1) -> torch.Tensor | str:
    """The ``[heads, S, S]`` pattern a ``mask_mod`` allows at the example length (head, query,
    key), or why not."""
    if mask_gm is None:
        return "a block mask whose mask_mod treecompile cannot see"
    if any(isinstance(b, fx.Node) and depends_on_inputs(ctx, b) is not False for b in buffers):
        return "a mask_mod that reads the tokens or parameters (e.g. document ids), not a structural mask"
    try:
        values = [evaluate(ctx, b) if isinstance(b, fx.Node) else b for b in buffers]
        s = int(ctx.seq_len.node.hint if isinstance(ctx.seq_len, torch.SymInt) else ctx.seq_len)
        idx = torch.arange(s)
        zero = torch.zeros((), dtype=torch.int64)
        with torch.no_grad():
            return torch.stack([torch.broadcast_to(mask_gm(zero, torch.tensor(h), idx[:, None], idx[None, :], *values),
                                                   (s, s)).bool() for h in range(heads)])
    except Exception as e:
        return f"a mask_mod that cannot be evaluated over the sequence ({type(e).__name__})"


# --------------------------------------------------------------------------- manual softmax


def _is_scalar(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


_VIEWS = ("view", "reshape", "contiguous")
_CASTS = ("float", "double", "to", "type", "type_as")


def _rewrite_softmax_attention(gm: fx.GraphModule, ctx: PassContext, node: fx.Node) -> None:
    """Matches ``softmax(chain(q @ k^T), dim=-1) @ v`` where ``chain`` scales, masks, casts
    and reshapes.

    Scores by ``matmul`` / ``@``, ``bmm``, ``baddbmm`` or a two-operand ``einsum``; the
    output by ``matmul``, ``bmm`` or ``einsum``; casts (``.float()``, ``.to(dtype)``,
    ``.type_as(q)``) and views anywhere in between.
    """
    args = bind(node, ["input", "dim"], {"dim": None})
    scores = args["input"]
    sv = value(scores)
    if not isinstance(sv, torch.Tensor) or sv.dim() < 2 or args["dim"] not in (-1, sv.dim() - 1):
        return
    sink = sink_column(ctx, scores)
    if sink is not None:
        # softmax(cat([scores, sink], -1))[..., :-1]: a sink logit per query (gpt-oss).
        scores = scores.args[0][0]
    if len(row_dims(scores, ctx.seq_len, "seq")) < 2:
        return
    try:
        walk = walk_scores(ctx, node, scores)
    except StopWalk as e:
        if str(e):
            ctx.notes[node] = str(e)
        return
    chain, cur, scale, masks = walk.nodes + [args["input"]], walk.qk, walk.scale, walk.masks
    qk = scores_operands(cur)
    if qk is None:
        return
    q, k, q_layout = qk
    # Forward: softmax -> [dropout(p=0) | cast | view] -> @ v.
    out = single_user(node)
    if sink is not None:
        if out is None or not drops_last_column(out):
            return
        out = single_user(out)
    while out is not None and is_call(out, (torch.nn.functional.dropout, torch.reshape), _CASTS + _VIEWS):
        if is_call(out, (torch.nn.functional.dropout,)):
            p = bind(out, ["input", "p", "training"], {"p": 0.5, "training": True})
            if p["p"] and p["training"]:
                raise attention_dropout(out, p["p"], "dropout p=0")
        out = single_user(out)
    if out is None or not (is_call(out, MATMUL, ("matmul", "bmm")) or is_call(out, (torch.einsum,))):
        return
    pv = output_operands(out, q_layout)
    if pv is None:
        return
    p_arg, v, post = pv
    if p_arg is not chain_end(node, out):
        return
    chain += forward_chain(node, out)
    other = outside_use(chain, out)
    if other is not None:
        ctx.notes[out] = (f"the attention scores are also used by {describe(other)} at {source_of(other)} (an in-place "
                          "edit or a second reader), which rewriting the attention would drop")
        return
    window, alibi, causal = None, None, False
    if not masks:
        ctx.notes[out] = "softmax attention without a causal mask (bidirectional)"
        return
    heads = _heads(node)
    arithmetic = any(kind in ("multiply", "subtract") for kind, _ in masks)
    relative = [m for kind, m in masks if kind == "relative"]
    masks = [(kind, m) for kind, m in masks if kind != "relative"]
    if relative and (arithmetic or len(relative) > 1):
        ctx.notes[node] = "the scores get a learned pair bias beside another bias or an arithmetic mask"
        return
    for kind, m in masks:
        if arithmetic:
            break  # judged together below
        w, why, slopes, is_mask = structural_causal(ctx, m, kind=kind, heads=heads)
        if why:
            ctx.notes[node] = f"the attention mask is {why}"
            return
        if slopes is not None:
            if alibi is not None:
                ctx.notes[node] = "the scores get two ALiBi biases"
                return
            alibi = slopes
        causal = causal or is_mask
        if w is not None:
            window = w if window is None else min(window, w)
    allowed = arithmetic_mask(ctx, walk)
    if isinstance(allowed, str):
        ctx.notes[node] = f"the attention mask is {allowed}"
        return
    if allowed is not None:
        flat = allowed.reshape(-1, *allowed.shape[-2:])
        w, why = causal_pattern(flat[0]) if all(torch.equal(flat[0], f) for f in flat[1:]) else \
            (None, "different across batch or heads")
        if why:
            ctx.notes[node] = f"the attention mask is {why}"
            return
        ctx.max_rows = flat.shape[-1] if ctx.max_rows is None else min(ctx.max_rows, flat.shape[-1])
        causal = True
        if w is not None:
            window = w if window is None else min(window, w)
    if not causal:
        ctx.notes[out] = "softmax attention without a causal mask (bidirectional)"
        return
    mods, mod_buffers = None, []
    if relative:
        if alibi is not None or walk.softcap is not None:
            ctx.notes[node] = "the scores get a learned pair bias beside ALiBi or a soft-cap"
            return
        found = relative_bias_mods(gm, ctx, relative[0], out, walk.relative_scale, heads)
        if isinstance(found, str):
            ctx.notes[node] = f"the scores get {found}"
            return
        mods, table = found
        mod_buffers = [table]
    with gm.graph.inserting_before(out):
        q, k, v = (ctx.mark(x(gm.graph), like=out) if callable(x) else x for x in (q, k, v))
        if sink is not None:  # [.., S, 1] -> [.., S], broadcast against the kernel's log-sum-exp
            sink = ctx.mark(gm.graph.call_method("squeeze", (sink, -1)), like=out)
    if _replace(gm, ctx, node, q, k, v, scale=scale * (walk.softcap or 1.0), window=window, softcap=walk.softcap,
                output=out, post=post, alibi=alibi, sinks=sink, mods=mods, mod_buffers=mod_buffers):
        ctx.count("softmax_attention")
        if mods is not None:
            ctx.count("relative_bias")
