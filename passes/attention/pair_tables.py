"""Parts of the dense pair rule (`treecompile.passes.attention.dense_pairs`) that read tables and
products: tables of pairs ``[S, S, d]`` (Shaw et al.'s relative embeddings), a row value's first ``T``
entries read per key (a dense Synthesizer's scores), and the einsums of a table or an ``[S, S]``
matrix with a row value."""

from __future__ import annotations

import operator

import torch
from torch import fx

from treecompile.passes._graph import PassContext, same_size, value
from treecompile.passes.attention.pair_layouts import einsum_parts
from treecompile.passes.attention.pair_state import UNKNOWN

__all__ = ["is_table", "key_slice", "table_einsum", "einsum_product"]


def is_table(x, ctx: PassContext) -> bool:
    """``[S, S, ..]``: a tensor per (query, key) pair with features after them (Shaw et al.'s
    relative embeddings ``E[clamp(j - i)]``), no other dim of the length."""
    v = value(x) if isinstance(x, fx.Node) else None
    return isinstance(v, torch.Tensor) and v.dim() >= 3 and same_size(v.shape[0], ctx.seq_len) \
        and same_size(v.shape[1], ctx.seq_len) and not any(same_size(d, ctx.seq_len) for d in v.shape[2:])


def key_slice(n: fx.Node, ctx: PassContext) -> bool:
    """``x[..., :T]`` of a row value ``x [.., S, L]`` whose last dim is a fixed width (a dense
    Synthesizer's scores over the ``L`` positions a key may hold, cut to the length): per path
    entry ``(i, j)`` is ``x[i, j]``, on the tree ``x[q, positions[k]]``."""
    if n.target is not operator.getitem or not isinstance(n.args[0], fx.Node):
        return False
    x, index = n.args
    xv, nv = value(x), value(n)
    index = index if isinstance(index, tuple) else (index,)
    if not (isinstance(xv, torch.Tensor) and index and xv.dim() == nv.dim() >= 2):
        return False
    last = index[-1]
    lead = index[:-1]
    if lead and lead[0] is Ellipsis:
        lead = lead[1:]
    elif len(index) != xv.dim():
        return False

    def whole(i, rows):  # ``:`` (or ``:T`` along the rows, all of them)
        return i == slice(None) or rows and cut_to_length(i, ctx)

    return all(whole(i, k == len(lead) - 1) for k, i in enumerate(lead)) and cut_to_length(last, ctx) \
        and same_size(xv.shape[-2], ctx.seq_len) and not same_size(xv.shape[-1], ctx.seq_len)


def cut_to_length(i, ctx: PassContext) -> bool:
    """Whether index ``i`` is the slice ``[:T]``."""
    return isinstance(i, slice) and i.start in (None, 0) and i.step in (None, 1) and same_size(i.stop, ctx.seq_len)


def table_einsum(ctx: PassContext, n: fx.Node, state: dict, members: set, exit: bool) -> str | None:
    """An einsum with a table of pairs ``R [S, S, d]`` (letters ``ijd``): ``'...id,ijd->...ij'`` with a
    row value (scores ``x_i . R_ij``: the token's own at a visible pair, unknown off the path), or,
    leaving the region, ``'...ij,ijd->...id'`` with ``[S, S]`` weights that are 0 off the path (a sum
    over the path's keys of ``w_ij R_ij``; the table is finite)."""
    parts = einsum_parts(n)
    if parts is None:
        return "is an einsum with a table of pairs other than a product over its features"
    specs, out, ops = parts
    tables = [k for k, o in enumerate(ops) if is_table(o, ctx) and o in members]
    if len(specs) != 2 or len(tables) != 1 or any(len(sp) != value(o).dim() for sp, o in zip(specs, ops)):
        return "is an einsum with a table of pairs other than a product over its features"
    t = specs[tables[0]]
    other, o = specs[1 - tables[0]], ops[1 - tables[0]]
    i, j, feats = t[0], t[1], t[2:]
    if len(set(t)) != len(t) or len(set(other)) != len(other) or set(feats) & set(other[:-1]):
        return "is an einsum with a table of pairs other than a product over its features"
    if not exit and o not in members and other[-1:] == feats[-1:] and len(feats) == 1 and other[-2:-1] == i \
            and j not in other and out == other[:-1] + j and same_size(value(o).shape[-2], ctx.seq_len):
        state[n] = UNKNOWN
        return None
    if exit and o in members and other[-2:] == i + j and len(feats) == 1 and out == other[:-1] + feats:
        if not state[o].is_(0.0):
            return "sums a table of pairs over keys it does not ignore off the path (the weights are not 0 there)"
        return None
    return "is an einsum with a table of pairs other than a product over its features"


def einsum_product(n: fx.Node) -> tuple[fx.Node, fx.Node, bool] | None:
    """``(x, y, transposed)`` for an einsum of two operands that is ``x @ y`` (``...ij,...jk->...ik``,
    the shorter leading letters a suffix of the longer, as ``matmul`` broadcasts; either operand
    first: ``bhnd,hmn->bhmd`` is ``W @ x``) or ``x @ y^T`` (``...id,...jd->...ij``)."""
    eq, ops = n.args[0], n.args[1:]
    if len(ops) == 1 and isinstance(ops[0], (list, tuple)):
        ops = tuple(ops[0])
    if not isinstance(eq, str) or len(ops) != 2 or "->" not in eq or "." in eq:
        return None
    ins, out = eq.replace(" ", "").split("->")
    a, b = ins.split(",") if ins.count(",") == 1 else (None, None)
    if a is None or len(a) < 2 or len(b) < 2 or len(out) < 2 or len(set(a)) != len(a) or len(set(b)) != len(b):
        return None
    for (x, y), (ea, eb) in (((ops[0], ops[1]), (a, b)), ((ops[1], ops[0]), (b, a))):
        lead = max(ea[:-2], eb[:-2], key=len)
        if lead.endswith(ea[:-2]) and lead.endswith(eb[:-2]) and out == lead + ea[-2] + eb[-1] \
                and ea[-1] == eb[-2] and ea[-1] not in out:
            return x, y, False
    lead = a[:-2]
    if out == lead + a[-2] + b[-2] and a[-1] == b[-1] and a[-1] not in out and b[:-2] == lead:
        return ops[0], ops[1], True
    return None
