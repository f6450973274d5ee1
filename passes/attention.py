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

from treecompile.errors import UnsupportedModelError
from treecompile.kernels.flex import AttentionSpec, tree_attention_fn
from treecompile.passes._graph import (
    MATMUL,
    SDPA,
    SOFTMAX,
    PassContext,
    bind,
    describe,
    is_call,
    row_dims,
    source_of,
    value,
)
from treecompile.passes._mask_eval import depends_on_inputs, evaluate, structural_causal
from treecompile.passes.markers import is_marker

__all__ = ["rewrite_attention_pass"]

_SDPA_ARGS = ["query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa"]
_SDPA_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}


def rewrite_attention_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Replaces causal attention calls with tree FlexAttention; counts them by kind.

    Counters (``ctx.counters["rewrite_attention_pass"]``): ``hf_interface``, ``sdpa``,
    ``softmax_attention``. Calls that are not provably causal are left in place with a
    note; the verify pass refuses them.
    """
    for node in list(gm.graph.nodes):
        if is_marker(node, "causal_attention"):
            q, k, v, scale, window, softcap, *rest = node.args
            sinks = rest[0] if rest else node.kwargs.get("sinks")
            if sinks is not None:
                with gm.graph.inserting_before(node):  # [Hq] -> [1, Hq, 1], broadcast over the rows
                    sinks = ctx.mark(gm.graph.call_method("view", (sinks, 1, -1, 1)), like=node)
            if _replace(gm, ctx, node, q, k, v, scale=scale, window=window, softcap=softcap, sinks=sinks):
                ctx.count("hf_interface")
        elif is_call(node, SDPA):
            _rewrite_sdpa(gm, ctx, node)
        elif is_call(node, SOFTMAX, ("softmax",)):
            _rewrite_softmax_attention(gm, ctx, node)
    return gm


def _replace(gm, ctx, node, q, k, v, *, scale, window, softcap, output=None, post=None, alibi=None,
             sinks=None) -> bool:
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
    )
    fn = tree_attention_fn(spec)
    with gm.graph.inserting_before(output):
        kwargs = {} if sinks is None else {"sinks": sinks}
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
        raise UnsupportedModelError(
            f"{describe(node)} at {source_of(node)}: attention dropout {a['dropout_p']} cannot match "
            "per-path training (it is random per call); use model.eval() or dropout_p=0"
        )
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


# --------------------------------------------------------------------------- manual softmax


def _single_user(node: fx.Node) -> fx.Node | None:
    users = list(node.users)
    return users[0] if len(users) == 1 else None


def _is_scalar(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


_NEG = ("masked_fill",)


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
    sink = _sink_column(ctx, scores)
    if sink is not None:
        # softmax(cat([scores, sink], -1))[..., :-1]: a sink logit per query (gpt-oss).
        scores = scores.args[0][0]
    if len(row_dims(scores, ctx.seq_len, "seq")) < 2:
        return
    # Walk back from the softmax input to q @ k^T, collecting the scale and the masks.
    scale = 1.0
    masks: list[tuple[str, fx.Node]] = []
    cur = scores
    while True:
        if is_call(cur, MATMUL, ("matmul", "bmm")) or is_call(cur, (torch.einsum,)):
            break
        if is_call(cur, (torch.baddbmm,), ("baddbmm",)):
            b = bind(cur, ["input", "batch1", "batch2"], {"beta": 1.0, "alpha": 1.0})
            if not (_is_scalar(b["beta"]) and _is_scalar(b["alpha"])):
                return
            if b["beta"] != 0:
                if b["beta"] != 1 or not isinstance(b["input"], fx.Node):
                    return
                masks.append(("additive", b["input"]))
            scale *= b["alpha"]
            break
        if cur.op == "call_function" and cur.target in (operator.mul, torch.mul) or is_call(cur, (), ("mul",)):
            a, b = cur.args[:2]
            if _is_scalar(b) and isinstance(a, fx.Node):
                scale, cur = scale * b, a
            elif _is_scalar(a) and isinstance(b, fx.Node):
                scale, cur = scale * a, b
            else:
                return
        elif cur.op == "call_function" and cur.target in (operator.truediv, torch.div) or is_call(cur, (), ("div",)):
            a, b = cur.args[:2]
            if not (_is_scalar(b) and isinstance(a, fx.Node)):
                return
            scale, cur = scale / b, a
        elif is_call(cur, (torch.masked_fill,), _NEG):
            t, m, fill = (list(cur.args) + [cur.kwargs.get("value")])[:3]
            if not (_is_scalar(fill) and fill <= -1e30) or not isinstance(m, fx.Node):
                return
            masks.append(("masked_fill", m))
            cur = t
        elif cur.op == "call_function" and cur.target in (operator.add, torch.add) or is_call(cur, (), ("add",)):
            a, b = cur.args[:2]
            # The scores branch is the one that comes from q @ k^T.
            if isinstance(b, fx.Node) and depends_on_inputs(ctx, b) is False:
                masks.append(("additive", b))
                cur = a
            elif isinstance(a, fx.Node) and depends_on_inputs(ctx, a) is False:
                masks.append(("additive", a))
                cur = b
            else:
                ctx.notes[node] = (
                    "the scores get an additive bias computed from parameters or the inputs (e.g. a learned "
                    "T5-style relative position bias), which treecompile cannot express in path positions yet"
                )
                return
        elif is_call(cur, (torch.where,), ("where",)) and len(cur.args) == 3:
            # torch.where(mask, scores, very_negative) (GPT-Neo): the mask says what is allowed.
            cond, x, fill = cur.args
            if not (isinstance(cond, fx.Node) and isinstance(x, fx.Node) and _very_negative(ctx, fill)):
                return
            masks.append(("where", cond))
            cur = x
        elif is_call(cur, (torch.max, torch.maximum), ("max", "maximum")) and len(cur.args) == 2 \
                and _very_negative(ctx, cur.args[1]):
            cur = cur.args[0]  # clamping the scores to the dtype's minimum (XGLM): masked stays masked
        elif is_call(cur, (torch.reshape,), _CASTS + _VIEWS):
            cur = cur.args[0]
        else:
            return
        if not isinstance(cur, fx.Node):
            return
    qk = _scores_operands(cur)
    if qk is None:
        return
    q, k, q_layout = qk
    # Forward: softmax -> [dropout(p=0) | cast | view] -> @ v.
    out = _single_user(node)
    if sink is not None:
        if out is None or not _drops_last_column(out):
            return
        out = _single_user(out)
    while out is not None and is_call(out, (torch.nn.functional.dropout, torch.reshape), _CASTS + _VIEWS):
        if is_call(out, (torch.nn.functional.dropout,)):
            p = bind(out, ["input", "p", "training"], {"p": 0.5, "training": True})
            if p["p"] and p["training"]:
                raise UnsupportedModelError(
                    f"{describe(out)} at {source_of(out)}: attention dropout cannot match per-path training"
                )
        out = _single_user(out)
    if out is None or not (is_call(out, MATMUL, ("matmul", "bmm")) or is_call(out, (torch.einsum,))):
        return
    pv = _output_operands(out, q_layout)
    if pv is None:
        return
    p_arg, v, post = pv
    if p_arg is not _chain_end(node, out):
        return
    window, alibi, causal = None, None, False
    if not masks:
        ctx.notes[out] = "softmax attention without a causal mask (bidirectional)"
        return
    heads = _heads(node)
    for kind, m in masks:
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
    if not causal:
        ctx.notes[out] = "softmax attention without a causal mask (bidirectional)"
        return
    with gm.graph.inserting_before(out):
        q, k, v = (ctx.mark(x(gm.graph), like=out) if callable(x) else x for x in (q, k, v))
        if sink is not None:  # [.., S, 1] -> [.., S], broadcast against the kernel's log-sum-exp
            sink = ctx.mark(gm.graph.call_method("squeeze", (sink, -1)), like=out)
    if _replace(gm, ctx, node, q, k, v, scale=scale, window=window, softcap=None, output=out, post=post,
                alibi=alibi, sinks=sink):
        ctx.count("softmax_attention")


def _sink_column(ctx: PassContext, cat: fx.Node) -> fx.Node | None:
    """``sink`` if ``cat`` is ``torch.cat([scores, sink], dim=-1)`` with ``sink`` ``[.., S, 1]``."""
    if not is_call(cat, (torch.cat,), ()):
        return None
    b = bind(cat, ["tensors", "dim"], {"dim": 0})
    parts, dim = b["tensors"], b["dim"]
    if not isinstance(parts, (list, tuple)) or len(parts) != 2 or not all(isinstance(p, fx.Node) for p in parts):
        return None
    sv, kv = value(parts[0]), value(parts[1])
    if not (isinstance(sv, torch.Tensor) and isinstance(kv, torch.Tensor)) or sv.dim() != kv.dim():
        return None
    if dim not in (-1, sv.dim() - 1) or len(row_dims(parts[0], ctx.seq_len, "seq")) < 2 or kv.shape[-1] != 1:
        return None
    return parts[1]


def _drops_last_column(node: fx.Node) -> bool:
    """``x[..., :-1]``."""
    if not (node.op == "call_function" and node.target is operator.getitem):
        return False
    idx = node.args[1]
    return isinstance(idx, tuple) and len(idx) == 2 and idx[0] is Ellipsis and idx[1] == slice(None, -1, None)


def _very_negative(ctx: PassContext, x) -> bool:
    """Whether ``x`` is a constant (a number or a structural scalar tensor) <= -1e30."""
    if _is_scalar(x):
        return x <= -1e30
    if not isinstance(x, fx.Node) or depends_on_inputs(ctx, x):
        return False
    if is_call(x, (torch.full,), ()) and len(x.args) >= 2 and _is_scalar(x.args[1]):
        return x.args[1] <= -1e30  # torch.tensor(finfo(float64).min) is captured as full((), value)
    v = value(x)
    if not isinstance(v, torch.Tensor) or v.numel() != 1:
        return False
    try:
        return bool(evaluate(ctx, x).max() <= -1e30)
    except RuntimeError:  # e.g. torch.full((), float64 min) in float32: no constant to compare
        return False


def _einsum_spec(node: fx.Node) -> tuple[str, str, str] | None:
    """``(in0, in1, out)`` letters of a two-operand einsum without ellipsis, else None."""
    eq = node.args[0]
    if not isinstance(eq, str) or "..." in eq or "->" not in eq or len(node.args) != 3:
        return None
    ins, out = eq.replace(" ", "").split("->")
    parts = ins.split(",")
    if len(parts) != 2:
        return None
    return parts[0], parts[1], out


def _permute(spec_in: str, spec_out: str, x: fx.Node):
    """A graph builder for ``einsum('in->out', x)`` (a permutation), or ``x`` if none is needed."""
    if spec_in == spec_out:
        return x
    perm = [spec_in.index(c) for c in spec_out]

    def build(g: fx.Graph) -> fx.Node:
        n = g.call_function(torch.einsum, (f"{spec_in}->{spec_out}", x))
        n.meta["example_value"] = value(x).permute(perm)
        return n

    return build


def _scores_operands(qk: fx.Node):
    """``(q, k, layout)`` for a scores node ``q @ k^T``; q and k are ``[..., S, D]`` nodes (or
    graph builders of them) and ``layout`` the einsum letters of the scores (None for a matmul)."""
    if is_call(qk, (torch.einsum,)):
        spec = _einsum_spec(qk)
        if spec is None:
            return None
        a, b, out = spec
        contracted = [c for c in a if c in b and c not in out]
        ql = [c for c in a if c not in b and c in out]
        kl = [c for c in b if c not in a and c in out]
        batch = [c for c in out if c in a and c in b]
        if len(contracted) != 1 or len(ql) != 1 or len(kl) != 1 or out != "".join(batch) + ql[0] + kl[0]:
            return None
        if set(a) != set(batch + ql + contracted) or set(b) != set(batch + kl + contracted):
            return None
        d, bt = contracted[0], "".join(batch)
        return _permute(a, bt + ql[0] + d, qk.args[1]), _permute(b, bt + kl[0] + d, qk.args[2]), out
    if is_call(qk, (torch.baddbmm,), ("baddbmm",)):
        b = bind(qk, ["input", "batch1", "batch2"], {})
        q, kt = b["batch1"], b["batch2"]
    else:
        q, kt = qk.args[:2]
    k = _untranspose(kt)
    return None if k is None else (q, k, None)


def _output_operands(out: fx.Node, layout: str | None):
    """``(probs, v, post)`` for ``probs @ v``: ``v`` as ``[..., S, Dv]`` (or a builder) and
    ``post`` the layout change from the kernel's ``[..., S, Dv]`` to ``out``'s (or None)."""
    if not is_call(out, (torch.einsum,)):
        return out.args[0], out.args[1], None
    spec = _einsum_spec(out)
    if spec is None:
        return None
    a, b, res = spec
    contracted = [c for c in a if c in b and c not in res]
    if len(a) < 2 or len(contracted) != 1 or contracted[0] != a[-1]:
        return None
    batch, ql, kl = a[:-2], a[-2], a[-1]
    dl = [c for c in b if c not in a]
    if len(dl) != 1 or set(b) != set(batch + kl + dl[0]) or set(res) != set(batch + ql + dl[0]):
        return None
    canon = batch + ql + dl[0]
    post = None if res == canon else (lambda g, x: g.call_function(torch.einsum, (f"{canon}->{res}", x)))
    return out.args[1], _permute(b, batch + kl + dl[0], out.args[2]), post


def _chain_end(softmax: fx.Node, matmul: fx.Node) -> fx.Node:
    cur = softmax
    while True:
        nxt = _single_user(cur)
        if nxt is None or nxt is matmul:
            return cur
        cur = nxt


def _untranspose(kt) -> fx.Node | None:
    """``k`` if ``kt`` is ``k`` with its last two dims swapped."""
    if not isinstance(kt, fx.Node):
        return None
    kv = value(kt)
    if is_call(kt, (torch.transpose,), ("transpose",)):
        dims = [d % kv.dim() for d in kt.args[1:3]]
        if sorted(dims) == [kv.dim() - 2, kv.dim() - 1]:
            return kt.args[0]
    if kt.op == "call_function" and kt.target is getattr and kt.args[1] == "mT":
        return kt.args[0]
    return None
