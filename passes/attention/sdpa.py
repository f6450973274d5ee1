"""``scaled_dot_product_attention`` with ``is_causal=True``, or with an ``attn_mask`` that is
structural (computed from no activation) and evaluates to the causal mask, optionally with a
sliding window or an ALiBi bias.
"""

from __future__ import annotations

from torch import fx

from treecompile.passes._graph import PassContext, bind, row_dims
from treecompile.passes._mask_eval import structural_causal
from treecompile.passes.attention.replace import heads_of, replace
from treecompile.passes.rows.random import attention_dropout

__all__ = ["rewrite_sdpa"]

_SDPA_ARGS = ["query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa"]
_SDPA_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}


def rewrite_sdpa(gm: fx.GraphModule, ctx: PassContext, node: fx.Node) -> None:
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
        window, why, alibi, causal = structural_causal(ctx, mask, kind="sdpa", heads=heads_of(node))
        if why:
            ctx.notes[node] = f"attn_mask is {why}"
            return
        if not causal and not a["is_causal"]:
            ctx.notes[node] = "non-causal attention over the sequence (attn_mask is a bias without a causal mask)"
            return
    if replace(gm, ctx, node, a["query"], a["key"], a["value"], scale=a["scale"], window=window, softcap=None,
                alibi=alibi):
        ctx.count("sdpa")
