"""Layouts of the dense pair rule's tensors (`treecompile.passes.attention.dense_pairs`) beyond
``[.., S, S]``: scores per head ``[.., S, h, S]`` and their sum over the heads (a sparse-attention
indexer), the heads of ``[B, H, S, S]`` scores mixed (talking heads), a sink logit as one more key
column, and ``x[:, None]``."""

from __future__ import annotations

import operator

import torch
from torch import fx

from treecompile.passes._graph import PassContext, bind, new_dims_only, same_size, value
from treecompile.passes._mask_eval import reads_tokens
from treecompile.passes.attention.pair_state import UNKNOWN, is_pair, query_dim, with_sink

__all__ = ["scores_per_head", "weights_per_query", "einsum_per_head", "einsum_parts", "head_mix", "sink_column"]


def scores_per_head(ctx: PassContext, n: fx.Node, xv: torch.Tensor, yv: torch.Tensor) -> bool:
    """``q [.., S, h, d] @ k^T [.., 1, d, S]`` (DeepSeek-V3.2's indexer): ``[.., S, h, S]``, the
    scores of query row ``s`` and head ``h`` with key row ``t``."""
    return (xv.dim() >= 3 and yv.dim() >= 3 and _only_s_at(ctx, xv, (-3,)) and _only_s_at(ctx, yv, (-1,))
            and yv.shape[-3] == 1 and query_dim(n, ctx) == -3)


def weights_per_query(ctx: PassContext, n: fx.Node, x: fx.Node, y: fx.Node) -> bool:
    """``w [.., S, m, h] @ scores [.., S, h, S]``: each query's own weights summing its scores
    over a dim that is neither the queries nor the keys (the indexer's heads)."""
    xv, yv = value(x), value(y)
    return (isinstance(xv, torch.Tensor) and xv.dim() >= 3 and query_dim(y, ctx) == -3
            and _only_s_at(ctx, xv, (-3,)) and query_dim(n, ctx) == -3)


def _only_s_at(ctx: PassContext, v: torch.Tensor, dims: tuple[int, ...]) -> bool:
    """Whether ``v``'s dims of the sequence length are exactly ``dims`` (negative)."""
    return {d - v.dim() for d in range(v.dim()) if same_size(v.shape[d], ctx.seq_len)} == set(dims)


def head_mix(ctx: PassContext, n: fx.Node, state: dict, members: set) -> str | None:
    """Talking heads as x-transformers writes them: a 1 x 1 ``conv2d`` over the heads of ``[B, H, S, S]``
    scores, each entry's heads mixed alone; 0 off the path stays 0 without a bias."""
    a = bind(n, ["input", "weight", "bias", "stride", "padding", "dilation", "groups"],
             {"bias": None, "stride": 1, "padding": 0, "dilation": 1, "groups": 1})
    x, w = a["input"], value(a["weight"])
    ones = (1, (1, 1), [1, 1])
    if x not in members or a["weight"] in members or a["bias"] in members or value(x).dim() != 4 or \
            query_dim(x, ctx) != -2 or not isinstance(w, torch.Tensor) or tuple(w.shape[-2:]) != (1, 1) or \
            a["stride"] not in ones or a["dilation"] not in ones or a["padding"] not in (0, (0, 0), [0, 0], "valid"):
        return "is a convolution over [S, S] tensors other than a 1 x 1 mix of the heads"
    state[n] = state[x] if state[x].is_(0.0) and a["bias"] is None else UNKNOWN
    return None


def sink_column(ctx: PassContext, n: fx.Node, state: dict, members: set) -> str | None:
    """A sink logit per query as one more key (gpt-oss's eager attention: ``cat([scores, sinks],
    -1)``, the softmax, then ``[..., :-1]``): a column every query sees, the same on its path alone;
    off the path the scores' entries as they were."""
    if n.target is operator.getitem:
        index = n.args[1] if isinstance(n.args[1], tuple) else (n.args[1],)
        if index[-1] != slice(None, -1) or not new_dims_only(index[:-1]) or not is_pair(n, ctx):
            return "reads a sink column's scores other than dropping the column ([..., :-1])"
        state[n] = state.get(n.args[0], UNKNOWN)
        return None
    parts, dim = n.args[0], n.kwargs.get("dim", n.args[1] if len(n.args) > 1 else 0)
    nd = value(n).dim()
    if not (isinstance(parts, (list, tuple)) and len(parts) == 2 and parts[0] in members and parts[1] not in members
            and dim in (-1, nd - 1) and with_sink(n, ctx) and value(parts[1]).shape[-1] == 1
            and not reads_tokens(ctx, parts[1]) and query_dim(parts[0], ctx) == -2):
        return "concatenates [S, S] tensors other than with a sink column of parameters after the keys"
    state[n] = state[parts[0]]
    return None


def einsum_parts(n: fx.Node) -> tuple[list[str], str, tuple] | None:
    """``(operand letters, output letters, operands)`` of a two-operand einsum without ``...``, else None."""
    eq, ops = n.args[0], n.args[1:]
    if len(ops) == 1 and isinstance(ops[0], (list, tuple)):
        ops = tuple(ops[0])
    if not isinstance(eq, str) or "->" not in eq or "." in eq or len(ops) != 2:
        return None
    ins, out = eq.replace(" ", "").split("->")
    return ins.split(","), out, tuple(ops)


def einsum_per_head(ctx: PassContext, n: fx.Node, state: dict, members: set) -> str | None:
    """The sparse-attention indexer as DeepSeek's reference writes it: ``einsum("bshd,btd->bsht", q,
    k)`` (scores of two row values, one query letter and one key letter, the key's last) and
    ``einsum("bsht,bsh->bst", scores, w)`` (each query's own weights summing its scores over a
    letter that is neither the query nor the key)."""
    parts = einsum_parts(n)
    if parts is None:
        return "is an einsum that is not a product over one dim"
    specs, out, ops = parts
    if len(specs) != 2 or any(len(sp) != value(o).dim() or len(set(sp)) != len(sp) for sp, o in zip(specs, ops)):
        return "is an einsum that is not a product over one dim"
    seq = [{c for c, d in zip(sp, value(o).shape) if same_size(d, ctx.seq_len)} for sp, o in zip(specs, ops)]
    contracted = (set(specs[0]) | set(specs[1])) - set(out)
    qdim = query_dim(n, ctx)
    if qdim is None or contracted & (seq[0] | seq[1]) or not out or out[-1] not in seq[0] | seq[1]:
        return "is an einsum over [S, S] tensors other than scores per query and key"
    key, query = out[-1], out[qdim]
    x, y = ops
    if x not in members and y not in members and seq == [{query}, {key}] and query != key:
        state[n] = UNKNOWN  # scores of two row values
        return None
    if x in members and y not in members and seq[1] == {query} and query_dim(x, ctx) is not None \
            and specs[0][query_dim(x, ctx)] == query and specs[0][-1] == key:
        state[n] = UNKNOWN  # each query's weights over the heads
        return None
    return "is an einsum over [S, S] tensors other than scores per query and key"
