"""Structural causal masks of other patterns than the plain one and a sliding window.

A mask the model builds from sizes alone (two aranges compared, a buffer) is judged by
evaluating it (`treecompile.passes._mask_eval.structural_causal`). Beside the causal pattern and
a sliding window, two more patterns have a meaning in path positions:

* a pattern of the distance alone (``allowed[i, j] == allowed[i - j, 0]``: OpenAI's Sparse
  Transformer's strided heads, a dilated window) keeps the keys at the distances its first
  column allows: a mask_mod reading that ``[S]`` table at ``positions[q] - positions[kv]``
  (`treecompile.kernels.attention.flex_mods.distance_mods`);
* the query's chunk of ``c`` tokens (``q // c == k // c``, causal: Llama 4's chunks written with
  two aranges) is the chunk mask_mod on path positions (`chunk_mods`).

Each is ANDed with the tree rule. The mask is evaluated again at half the example length and
must give the top-left corner of its pattern there (per path it is built at the path's length);
paths longer than the judged length compile again (``PassContext.max_rows``). Any other pattern
is refused.
"""

from __future__ import annotations

import torch
from torch import fx

from treecompile.kernels.attention.flex_mods import chunk_mods, distance_mods
from treecompile.passes._graph import PassContext, value
from treecompile.passes._mask_eval import BLOCKED, NOT_PLAIN, chunk_pattern, distance_pattern, evaluate

__all__ = ["allowed_at", "mask_pattern", "one_pattern", "pattern_mods", "with_pattern"]


def pattern_mods(gm: fx.GraphModule, ctx: PassContext, at: fx.Node, found,
                 beside: bool) -> tuple[str, list, str] | str:
    """``(mods key, mod buffers, counter)`` for a pattern `mask_pattern` found (a chunk or a table
    of the distance, the table built in the graph before ``at``); or why not (``beside``: a
    learned pair bias, ALiBi or, beside chunks, a window rides along, which the kernel does not
    combine)."""
    if beside:
        return "a pattern of the distance or chunks beside a learned pair bias, ALiBi or a window"
    if isinstance(found, int):  # the query's chunk of that many tokens
        return chunk_mods(found), [], "chunk_mask"
    dev = value(at).device
    with gm.graph.inserting_before(at):
        table = ctx.mark(gm.graph.call_function(torch.tensor, (list(found),), {"dtype": torch.bool, "device": dev}),
                         like=at, rows=False)
    table.meta["example_value"] = torch.tensor(list(found), dtype=torch.bool, device=dev)
    return distance_mods(len(found)), [table], "distance_mask"


def one_pattern(allowed) -> torch.Tensor | None:
    """The one ``[S, S]`` pattern of ``allowed`` (the same over its leading dims), or None."""
    if not isinstance(allowed, torch.Tensor) or allowed.dim() < 2:
        return None
    flat = allowed.reshape(-1, *allowed.shape[-2:])
    return flat[0] if all(torch.equal(flat[0], f) for f in flat[1:]) else None


def allowed_at(ctx: PassContext, kind: str, mask: fx.Node, rows: int | None) -> torch.Tensor | None:
    """What a structural mask of ``kind`` lets through at ``rows`` rows (the example's if None),
    or None for a mask that also adds a bias (its finite entries not all 0)."""
    v = evaluate(ctx, mask, rows=rows)
    if kind == "masked_fill":
        allowed = ~v.bool()
    elif v.is_floating_point():
        blocked = v <= BLOCKED
        if torch.any((v != 0) & ~blocked):
            return None
        allowed = ~blocked
    else:
        allowed = v.bool()
    return one_pattern(allowed)


def with_pattern(ctx: PassContext, found, allowed_at) -> tuple[bool, ...] | int | str:
    """``found`` (the pattern of the masks judged so far, or None) ANDed with `mask_pattern`'s
    of ``allowed_at``: tables of the distance entry by entry, a chunk alone; or why not."""
    more = mask_pattern(ctx, allowed_at)
    if isinstance(more, str) or found is None:
        return more
    if isinstance(found, tuple) and isinstance(more, tuple):
        return tuple(x and y for x, y in zip(found, more))
    return "two masks, one of them keeping chunks"


def mask_pattern(ctx: PassContext, allowed_at) -> tuple[bool, ...] | int | str:
    """The causal mask's pattern of the distance (`distance_pattern`), or the chunk whose keys it
    keeps (`chunk_pattern`), from ``allowed_at(rows)``, the same at half the example length on the
    shorter length's pairs; or why not."""
    try:
        long = allowed_at(None)
        short = None if long is None else allowed_at(max(2, long.shape[-1] // 2))
    except Exception as e:  # a mask that cannot be evaluated alone (or at another length)
        return f"{NOT_PLAIN} that cannot be evaluated at another length ({type(e).__name__})"
    if long is None or short is None:
        return f"{NOT_PLAIN}, nor a function of the distance alone"
    if not torch.equal(long[: short.shape[0], : short.shape[1]], short):
        return f"{NOT_PLAIN} that changes with the sequence length"
    ctx.max_rows = long.shape[-1] if ctx.max_rows is None else min(ctx.max_rows, long.shape[-1])
    found = distance_pattern(long)
    if found is None:
        found = chunk_pattern(long)
    if found is None:
        return f"{NOT_PLAIN}, nor a function of the distance alone, nor chunks of the positions"
    return found
