"""``nn.MultiheadAttention`` (``F.multi_head_attention_forward``) for the attention pass.

``nn.MultiheadAttention``, ``nn.Transformer*Layer`` and fairseq call
``F.multi_head_attention_forward``: one node holding the projections, the attention and the
output projection. Over the rows (``[S, 1, E]``, sequence first) under a structural causal
``attn_mask`` (with an ALiBi bias or not: ofirpress's fairseq adds it to the future mask) it is written out as its projections, the tree attention (``replace``, the
attention pass's call builder) and its output projection; appended keys (``bias_k`` /
``bias_v``, ``add_zero_attn``) become the kernel's sinks with values; attention from the
rows to a memory without rows is written out as plain row-local ops.

Counters (``rewrite_attention_pass``): ``multihead_attention``, ``memory_attention``.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from treecompile.passes._graph import Emitter, PassContext, bind, row_dims, value
from treecompile.passes._mask_eval import reads_tokens, structural_causal
from treecompile.passes.attention.replace import replace
from treecompile.passes.attention.token_bias import can_blind, side_of, with_token_terms
from treecompile.passes.rows.random import attention_dropout

__all__ = ["rewrite_multihead"]


_MHA_ARGS = ["query", "key", "value", "embed_dim_to_check", "num_heads", "in_proj_weight", "in_proj_bias", "bias_k",
             "bias_v", "add_zero_attn", "dropout_p", "out_proj_weight", "out_proj_bias", "training",
             "key_padding_mask", "need_weights", "attn_mask", "use_separate_proj_weight", "q_proj_weight",
             "k_proj_weight", "v_proj_weight", "static_k", "static_v", "average_attn_weights", "is_causal"]
_MHA_DEFAULTS = {"training": True, "key_padding_mask": None, "need_weights": True, "attn_mask": None,
                 "use_separate_proj_weight": False, "q_proj_weight": None, "k_proj_weight": None,
                 "v_proj_weight": None, "static_k": None, "static_v": None, "average_attn_weights": True,
                 "is_causal": False, "bias_k": None, "bias_v": None, "add_zero_attn": False, "dropout_p": 0.0}


def rewrite_multihead(gm: fx.GraphModule, ctx: PassContext, node: fx.Node) -> None:
    """``F.multi_head_attention_forward`` (``nn.MultiheadAttention``, ``nn.Transformer*Layer``,
    fairseq) over the rows ``[S, 1, E]`` under a structural causal ``attn_mask``: its
    projections, split into heads, the tree attention, and the output projection, as the
    function computes them (the scale ``1 / sqrt(E / H)``). Keys and values may be other rows
    of the same sequence (a decoder layer's causal attention to its input). ``bias_k`` /
    ``bias_v`` (a key and value appended) and ``add_zero_attn`` (a zero key and value
    appended) are one more logit per query in the softmax, with its value: the kernel's
    attention sinks. Attention to a memory without rows (a learned prefix) is row-local as it
    stands."""
    a = bind(node, _MHA_ARGS, _MHA_DEFAULTS)
    query = a["query"]
    qv = value(query)
    if not isinstance(qv, torch.Tensor) or qv.dim() != 3 or 0 not in row_dims(query, ctx.seq_len, "seq") \
            or qv.shape[1] != 1:
        return  # not over the rows (sequence-first, batch of one), e.g. over the heads or a memory
    why = None
    rows_kv = [isinstance(value(a[x]), torch.Tensor) and 0 in row_dims(a[x], ctx.seq_len, "seq") and
               value(a[x]).shape[1] == 1 for x in ("key", "value")]
    if a["key"] is not query or a["value"] is not query:
        if not any(rows_kv) and a["attn_mask"] is None and a["key_padding_mask"] is None:
            _memory_attention(gm, ctx, node, a)
            return
        if not all(rows_kv):
            why = "attends to keys other than its queries' rows (cross-attention mixing the packed rows with another)"
    padding = _padding_terms(ctx, a) if why is None else []
    if why is None and (any(a[k] is not None for k in ("static_k", "static_v")) or padding is None):
        why = "uses static keys or a key padding mask that is not one per key read from the tokens"
    elif why is None and (a["bias_k"] is None) != (a["bias_v"] is None):
        why = "uses bias_k without bias_v"
    elif why is None and a["attn_mask"] is None:
        why = ("nn.MultiheadAttention without a causal mask (bidirectional: every token sees the whole packed row)"
               if not a["is_causal"] else "is_causal without the mask nn.MultiheadAttention needs")
    if a["dropout_p"] and a["training"]:
        raise attention_dropout(node, a["dropout_p"], "dropout=0")
    heads = a["num_heads"]
    window = alibi = None
    if why is None:
        # A 3-D attn_mask is [batch * heads, S, S]: with the packed row's batch of one, one per head.
        window, bad, alibi, causal = structural_causal(ctx, a["attn_mask"], kind="sdpa", heads=heads)
        why = f"attn_mask is {bad}" if bad else ("attn_mask is a bias without a causal mask" if not causal else None)
    if why is None and alibi is not None and (a["bias_k"] is not None or a["add_zero_attn"]):
        why = "attn_mask has an ALiBi bias beside appended keys (bias_k or add_zero_attn)"
    users = list(node.users)
    if why is None and not all(u.op == "call_function" and u.target is operator.getitem for u in users):
        why = "its result is used as a whole"
    if why is None and any(u.args[1] == 1 and u.users for u in users):
        why = "its attention weights are used (need_weights)"
    if why is not None:
        ctx.notes[node] = why
        return
    outputs = [u for u in users if u.args[1] == 0]
    if not outputs:
        return
    # With need_weights the function's own softmax gives NaN to a query that sees no key (SDPA's, 0);
    # appended keys are seen by every query.
    blind = "none" if a["bias_k"] is not None or a["add_zero_attn"] else \
        "nan" if a["need_weights"] is not False else "zero"
    if window is not None and any(can_blind(ctx, side, m, f, blind) for side, m, f in padding):
        ctx.notes[node] = ("a key_padding_mask under a windowed attn_mask: a query whose window holds only padded "
                           "keys is computed otherwise per path (NaN with need_weights, or a finite mask's weights)")
        return
    e = int(qv.shape[-1])
    hd = e // heads
    emit = Emitter(gm, ctx, node)
    q, k, v = _mha_projections(emit, a, e)
    # [S, 1, E] -> [1, H, S, hd]
    q, k, v = (emit.method("unsqueeze", emit.method("transpose", emit.method("view", x, -1, heads, hd), 0, 1), 0)
               for x in (q, k, v))
    sinks, sink_values = _mha_extra_keys(emit, a, q, heads, hd)
    if padding:
        qkv = with_token_terms(gm, ctx, node, (1, heads), q, k, v, [(side, emit.method("view", m, 1, 1, 1, -1), f)
                                                                    for side, m, f in padding], hd ** -0.5,
                               blind=blind)
        if isinstance(qkv, str):
            ctx.notes[node] = qkv
            return
        q, k, v = qkv
    out_w, out_b = a["out_proj_weight"], a["out_proj_bias"]

    def post(g: fx.Graph, y: fx.Node) -> fx.Node:  # [1, H, S, hd] -> [S, 1, E] -> out projection
        y = g.call_method("reshape", (g.call_method("transpose", (g.call_method("squeeze", (y, 0)), 0, 1)), -1, 1, e))
        ctx.mark(y.args[0], like=node)
        ctx.mark(y.args[0].args[0], like=node)
        ctx.mark(y, like=node)
        return g.call_function(torch.nn.functional.linear, (y, out_w, out_b))

    output = outputs[0]
    for extra in outputs[1:]:
        extra.replace_all_uses_with(output)
    if replace(gm, ctx, node, q, k, v, scale=hd ** -0.5, window=window, softcap=None, output=output, post=post,
               alibi=alibi, sinks=sinks, sink_values=sink_values):
        ctx.count("multihead_attention")


def _padding_terms(ctx: PassContext, a: dict) -> list | None:
    """The ``key_padding_mask`` as token terms (`treecompile.passes.attention.token_bias`): ``[]``
    without one; one ``[1, S]`` over the query's rows read from the tokens (``ids == pad``) as a
    "key_blocked" term (boolean: True blocks, as the function fills ``-inf``) or a "key" term
    (float: added to the scores); None for any other."""
    m = a["key_padding_mask"]
    if m is None:
        return []
    mv = value(m)
    if not (isinstance(mv, torch.Tensor) and mv.dim() == 2 and side_of(ctx, mv) == "key" and a["key"] is a["query"]
            and reads_tokens(ctx, m)):
        return None
    return [("key_blocked", m, float("-inf"))] if mv.dtype == torch.bool else [("key", m, 1.0)]


def _mha_projections(emit: Emitter, a: dict, e: int) -> tuple[fx.Node, fx.Node, fx.Node]:
    """q, k, v ``[S, 1, E]`` projected as ``F.multi_head_attention_forward`` projects them."""
    bias = a["in_proj_bias"]
    biases = [None] * 3 if bias is None else [emit.method("__getitem__", bias, slice(i * e, (i + 1) * e))
                                              for i in range(3)]
    if a["use_separate_proj_weight"]:
        weights = [a[f"{w}_proj_weight"] for w in "qkv"]
    else:
        weights = [emit.method("__getitem__", a["in_proj_weight"], slice(i * e, (i + 1) * e)) for i in range(3)]
    if a["key"] is a["query"] and a["value"] is a["query"] and not a["use_separate_proj_weight"]:
        qkv = emit.fn(torch.nn.functional.linear, a["query"], a["in_proj_weight"], bias)
        return tuple(emit.method("__getitem__", qkv, (Ellipsis, slice(i * e, (i + 1) * e))) for i in range(3))
    return tuple(emit.fn(torch.nn.functional.linear, x, w, b)
                 for x, w, b in zip((a["query"], a["key"], a["value"]), weights, biases))


def _mha_extra_keys(emit: Emitter, a: dict, q: fx.Node, heads: int, hd: int) -> tuple:
    """``(sinks [1, H, S], sink values [1, H, S, hd])`` for the keys ``F.multi_head_attention_forward``
    appends after the sequence's (``bias_k`` / ``bias_v``, then a zero key and value with
    ``add_zero_attn``), each visible to every query; ``(None, None)`` for none. Two appended
    keys are one: logit ``logaddexp(s_b, 0)``, value ``sigmoid(s_b) bias_v``."""
    if a["bias_k"] is None and not a["add_zero_attn"]:
        return None, None
    if a["bias_k"] is None:  # add_zero_attn alone: a logit of 0 with a zero value
        zero = emit.method("new_zeros", q, (1, heads, 1))
        return zero, None
    bk = emit.method("view", a["bias_k"], 1, heads, 1, hd)  # [1, 1, E] -> [1, H, 1, hd]
    bv = emit.method("view", a["bias_v"], 1, heads, 1, hd)
    # The logit of the appended key: q . bias_k, scaled as the function scales q.
    s_b = emit.fn(operator.mul, emit.method("sum", emit.fn(operator.mul, q, bk), -1), hd ** -0.5)
    if not a["add_zero_attn"]:
        return s_b, bv
    logit = emit.fn(torch.nn.functional.softplus, s_b)  # logaddexp(s_b, 0)
    val = emit.fn(operator.mul, emit.method("unsqueeze", emit.fn(torch.sigmoid, s_b), -1), bv)
    return logit, val


def _memory_attention(gm: fx.GraphModule, ctx: PassContext, node: fx.Node, a: dict) -> None:
    """``F.multi_head_attention_forward`` from the rows to keys and values without rows (a
    learned memory, a decoder layer's fixed prefix), unmasked: each query row reads only the
    memory, so the op is row-local as it stands; it is rewritten into its own ops (the
    projections, per-head softmax over the memory, the output projection) so that the rules
    see each of them."""
    users = list(node.users)
    if not all(u.op == "call_function" and u.target is operator.getitem for u in users) or \
            any(u.args[1] == 1 and u.users for u in users) or a["dropout_p"] and a["training"] or \
            a["bias_k"] is not None or a["add_zero_attn"] or a["static_k"] is not None or a["static_v"] is not None:
        ctx.notes[node] = ("attention to a memory with attention weights used, dropout, bias_k, add_zero_attn or "
                           "static keys")
        return
    outputs = [u for u in users if u.args[1] == 0]
    if not outputs:
        return
    heads = a["num_heads"]
    e = int(value(a["query"]).shape[-1])
    hd = e // heads
    emit = Emitter(gm, ctx, outputs[0])
    q, k, v = _mha_projections(emit, a, e)
    n_b = int(value(a["query"]).shape[1])

    def heads_first(x: fx.Node, length: int) -> fx.Node:  # [L, N, E] -> [N, H, L, hd]
        return emit.method("permute", emit.method("view", x, length, n_b, heads, hd), 1, 2, 0, 3)

    q = heads_first(q, -1)
    k, v = (heads_first(x, int(value(a[name]).shape[0])) for x, name in ((k, "key"), (v, "value")))
    att = emit.fn(torch.softmax, emit.fn(operator.mul, emit.fn(torch.matmul, q, emit.method("transpose", k, -2, -1)),
                                           hd ** -0.5), -1)
    y = emit.fn(torch.matmul, att, v)  # [N, H, S, hd]
    y = emit.method("reshape", emit.method("permute", y, 2, 0, 1, 3), -1, n_b, e)
    out = emit.fn(torch.nn.functional.linear, y, a["out_proj_weight"], a["out_proj_bias"])
    out.meta["example_value"] = value(outputs[0])
    for o in outputs:
        o.replace_all_uses_with(out)
    ctx.count("memory_attention")
