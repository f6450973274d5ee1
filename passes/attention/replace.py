"""The one rewrite every spelling of causal attention ends in: the tree kernel's call.

`replace` inserts the FlexAttention call (CPU kernels on CPU) with the call's scale, window,
soft-cap, ALiBi slopes, sinks and the model's own mods, and redirects the attention output's
users; `heads_of` reads the kernel's head count off an attention node.
"""

from __future__ import annotations

import torch
from torch import fx

from treecompile.kernels.attention.flex import AttentionSpec, tree_attention_fn
from treecompile.passes._graph import PassContext, recompute_value, row_dims, value

__all__ = ["replace", "heads_of"]


def replace(gm, ctx, node, q, k, v, *, scale, window, softcap, output=None, post=None, alibi=None,
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
    # A 4-D q whose leading dim is not 1 has two head dims (gpt-oss's token-major
    # ``[H_kv, q_mult, S, D]`` after its einsum): the kernel's batch is the wrapper's, 1, so both
    # fold into its heads, k's and v's alike (GQA where theirs divide q's second).
    folded = vals[0].dim() == 4 and vals[0].shape[0] != 1
    if folded:
        lead = [tuple(t.shape[:2]) for t in vals]
        if not all(isinstance(d, int) for d in lead[0]) or any(
                s[0] != lead[0][0] or not isinstance(s[1], int) or lead[0][1] % s[1] for s in lead[1:]):
            ctx.notes[output] = (f"attention over two head dims whose q, k and v shapes {lead} do not fold into "
                                 "one head dim alike")
            return False
        extras = [value(x) for x in (sinks, sink_values) if x is not None]
        if alibi is not None or mods is not None or any(
                not isinstance(t, torch.Tensor) or t.dim() < 3 or tuple(t.shape[:2]) != lead[0] for t in extras):
            ctx.notes[output] = "attention over two head dims with ALiBi, the model's own mods or sinks not per head"
            return False
    dtype = vals[0].dtype
    for t in vals[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    with gm.graph.inserting_before(output):
        args = []
        for x, t in zip((q, k, v), vals):
            # Each operand with its example value: later passes read the heads and head dim of
            # the keys and values (the streaming KV stack's shapes).
            if t.dtype != dtype:
                x = recompute_value(ctx.mark(gm.graph.call_method("to", (x, dtype)), like=output))
            if t.dim() == 3:  # [B * H, S, D] or [B, S, D] with B = 1: the leading dim is the heads
                x = recompute_value(ctx.mark(gm.graph.call_method("unsqueeze", (x, 0)), like=output))
            elif folded:
                x = recompute_value(ctx.mark(gm.graph.call_method("flatten", (x, 0, 1)), like=output))
                x = recompute_value(ctx.mark(gm.graph.call_method("unsqueeze", (x, 0)), like=output))
            args.append(x)
    q, k, v = args
    if folded:  # the sinks (``[H_kv, q_mult, S]``) and sink values fold like q
        with gm.graph.inserting_before(output):
            sinks, sink_values = (None if x is None else ctx.mark(gm.graph.call_method("unsqueeze", (
                ctx.mark(gm.graph.call_method("flatten", (x, 0, 1)), like=output), 0)), like=output)
                for x in (sinks, sink_values))
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
        elif folded:
            new = ctx.mark(gm.graph.call_method("squeeze", (new, 0)), like=output)
            new = ctx.mark(gm.graph.call_method("unflatten", (new, 0, lead[0])), like=output)
        if dtype != value(output).dtype:
            new = ctx.mark(gm.graph.call_method("to", (new, value(output).dtype)), like=output)
        if post is not None:
            new = ctx.mark(post(gm.graph, new), like=output)
        new = _laid_out_like(gm, ctx, new, output)
    new.meta["example_value"] = value(output)
    output.replace_all_uses_with(new)
    return True


def _laid_out_like(gm: fx.GraphModule, ctx: PassContext, new: fx.Node, output: fx.Node) -> fx.Node:
    """``new`` in the memory layout of the attention output it replaces: code after an attention
    may ``view`` its output, which works only in the layout the model's own kernel gave it (CPU
    SDPA on transposed inputs returns ``[B, H, S, D]`` laid out as ``[B, S, H, D]``:
    mistral-inference's ``out.transpose(1, 2).view(S, H * D)``)."""
    want = value(output)
    if not isinstance(want, torch.Tensor) or want.dim() == 0:
        return new
    hint = _stride_hints(want)
    have = _computed(new)
    if have is not None and have.shape == want.shape and _stride_hints(have) == hint:
        return new  # the same layout already
    order = sorted(range(want.dim()), key=lambda d: (-hint[d], d))
    if order == list(range(want.dim())):
        x = ctx.mark(gm.graph.call_method("contiguous", (new,)), like=output)
        return recompute_value(x) if have is not None else x
    inverse = [order.index(d) for d in range(want.dim())]
    x = ctx.mark(gm.graph.call_method("permute", (new, *order)), like=output)
    x = ctx.mark(gm.graph.call_method("contiguous", (x,)), like=output)
    x = ctx.mark(gm.graph.call_method("permute", (x, *inverse)), like=output)
    if have is not None:  # the example values of the copy, where the call's could be computed
        for n in (x.args[0].args[0], x.args[0], x):
            recompute_value(n)
    return x


def _stride_hints(t: torch.Tensor) -> list[int]:
    return [int(x.node.hint) if isinstance(x, torch.SymInt) else int(x) for x in t.stride()]


def _computed(node: fx.Node) -> torch.Tensor | None:
    """The example value of ``node``, a chain of ops over the new attention call (each on its
    first argument), computed on fake tensors; None where it cannot be."""
    chain = []
    while isinstance(node, fx.Node) and "example_value" not in node.meta:
        chain.append(node)
        node = node.args[0] if node.args else None
    try:
        for n in reversed(chain):
            recompute_value(n)
    except Exception:
        return None
    v = value(chain[0]) if chain else None
    return v if isinstance(v, torch.Tensor) else None


def heads_of(node: fx.Node) -> int | None:
    """The kernel's heads for an attention whose output (or scores) is ``node``: the product
    of its leading dims (the batch is 1), or None if one is symbolic."""
    v = value(node)
    n = 1
    for d in v.shape[:-2]:
        if not isinstance(d, int):
            return None
        n *= d
    return n
