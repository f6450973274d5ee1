"""A model's own ``flex_attention`` call: its ``mask_mod`` and ``score_mod`` evaluated on path
positions and ANDed with the tree mask, or refused naming what they read.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from treecompile.kernels.attention.flex_mods import register_mods
from treecompile.passes._graph import PassContext, same_size, value
from treecompile.passes._mask_eval import causal_pattern, depends_on_inputs, evaluate, reads_tokens, two_lengths
from treecompile.passes.attention.replace import replace

__all__ = ["reads_length", "rewrite_flex"]


def rewrite_flex(gm: fx.GraphModule, ctx: PassContext, node: fx.Node) -> None:
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
    if outputs and replace(gm, ctx, node, q, k, v, scale=scale, window=window, softcap=None, output=outputs[0],
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
        if reads_length(ctx, b):
            return (f"a {what} that reads {b.name}, computed from the sequence length (per path it is the path's "
                    "length, on the tree the packed row's)")
        bv = value(b)
        if isinstance(bv, torch.Tensor) and any(same_size(d, ctx.seq_len) for d in bv.shape):
            return (f"a {what} that reads {b.name}, a tensor with one entry per token of the row (e.g. document ids): "
                    "indexed by something other than the token's position on its path")
        if reads_tokens(ctx, b) or not parameters and depends_on_inputs(ctx, b):
            return (f"a {what} that reads {b.name}, computed from the tokens"
                    + ("" if parameters else " or parameters") + ", not a structural tensor")
    return None


def reads_length(ctx: PassContext, b: fx.Node) -> bool:
    """Whether a value a model's mod closes over comes from the sequence length: a size of it
    (``t // 2``), or a tensor that is not the same when the graph is built at half the example
    length (one that cannot be built so is judged by its other checks)."""
    bv = value(b)
    if isinstance(bv, torch.SymInt):
        return bool(bv.node.expr.free_symbols)
    lengths = two_lengths(ctx)
    if not isinstance(bv, torch.Tensor) or lengths is None:
        return False
    try:
        long, short = (evaluate(ctx, b, rows=r) for r in lengths)
    except Exception:
        return False
    return long.shape != short.shape or not torch.equal(long, short)


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
    length = next((b for b in buffers if isinstance(b, fx.Node) and reads_length(ctx, b)), None)
    if length is not None:
        return (f"a mask_mod that reads {length.name}, computed from the sequence length (per path it is the "
                "path's length, on the tree the packed row's)")
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
