"""Learned memory keys and values prepended to a softmax attention's keys.

x-transformers' ``num_mem_kv`` (and persistent-memory attention) concatenates ``M`` learned
keys and values before the sequence's, ``k = cat([mem_k, k], dim=-2)``, and pads the causal
mask with ``M`` columns every query may read. Per path, each query attends to the memory and
to the keys before it; on the tree, to the memory and its ancestors. The memory is the same for
every row, so its ``M`` logits and values fold into one more logit per query with its value,
the tree kernel's sinks: ``logsumexp_m(s_m)`` and ``softmax_m(s_m) @ mem_v`` with ``s_m =
scale * q . mem_k[m]`` (`memory_keys`, `memory_masks`, `memory_sinks`).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch import fx

from treecompile.passes._graph import CATS, Emitter, PassContext, is_call, row_dims, same_size, value
from treecompile.passes._mask_eval import depends_on_inputs, evaluate

__all__ = ["Memory", "memory_keys", "memory_masks", "memory_sinks"]


@dataclass
class Memory:
    """Keys and values ``cat([memory, rows], dim=-2)``: the rows' parts, the memory's, its size."""

    k: fx.Node
    v: fx.Node
    mem_k: fx.Node
    mem_v: fx.Node
    size: int


def _split(ctx: PassContext, x) -> tuple[fx.Node, fx.Node, int] | None:
    """``(memory, rows, M)`` if ``x`` is ``cat([memory, rows], -2)`` with ``M`` memory entries
    that have no row of the sequence."""
    if not (isinstance(x, fx.Node) and is_call(x, CATS)):
        return None
    parts, dim = x.args[0], (x.args[1] if len(x.args) > 1 else x.kwargs.get("dim", 0))
    xv = value(x)
    if not (isinstance(parts, (list, tuple)) and len(parts) == 2 and isinstance(xv, torch.Tensor)
            and isinstance(dim, int) and dim % xv.dim() == xv.dim() - 2):
        return None
    mem, rows = parts
    mv, rv = value(mem), value(rows)
    if not (isinstance(mv, torch.Tensor) and isinstance(rv, torch.Tensor) and isinstance(mv.shape[-2], int)
            and same_size(rv.shape[-2], ctx.seq_len) and not row_dims(mem, ctx.seq_len, "seq")
            and rv.dim() - 2 in row_dims(rows, ctx.seq_len, "seq")):
        return None
    return mem, rows, int(mv.shape[-2])


def memory_keys(ctx: PassContext, k, v) -> Memory | None:
    """The memory of keys ``k`` and values ``v`` (both ``cat([memory, rows], -2)``, one size), or None."""
    ks, vs = _split(ctx, k), _split(ctx, v)
    if ks is None or vs is None or ks[2] != vs[2]:
        return None
    return Memory(ks[1], vs[1], ks[0], vs[0], ks[2])


def memory_masks(gm: fx.GraphModule, ctx: PassContext, at: fx.Node, masks: list, size: int) -> list | str:
    """The masks without their ``size`` memory columns (each evaluated: every query must read
    every memory entry, unbiased), or why not."""
    e = Emitter(gm, ctx, at)
    out = []
    for kind, m in masks:
        mv = value(m)
        if kind not in ("masked_fill", "where", "additive") or not isinstance(mv, torch.Tensor) or mv.dim() < 2 \
                or not same_size(mv.shape[-1] - size, ctx.seq_len) or depends_on_inputs(ctx, m) is not False:
            return "a mask or bias over the memory keys and the sequence's that is not a structural mask"
        memory = evaluate(ctx, m)[..., :size]
        free = {"masked_fill": lambda t: not t.any(), "where": lambda t: bool(t.all()),
                "additive": lambda t: bool((t == 0).all())}[kind]
        if not free(memory):
            return "a mask or bias on the memory keys (every query must read every memory entry, unbiased)"
        out.append((kind, e.fn(operator.getitem, m, (Ellipsis, slice(size, None)))))
    return out


def memory_sinks(e: Emitter, q: fx.Node, memory: Memory, scale: float) -> tuple[fx.Node, fx.Node]:
    """``(logit [.., S], value [.., S, Dv])`` of the memory for each query: its logits' log-sum-exp
    and their softmax times the memory values."""
    s = e.fn(operator.mul, e.fn(torch.matmul, q, e.method("transpose", memory.mem_k, -1, -2)), scale)
    logit = e.fn(torch.logsumexp, s, -1)
    return logit, e.fn(torch.matmul, e.fn(torch.softmax, s, -1), memory.mem_v)
