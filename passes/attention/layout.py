"""Scores laid out with the query and key dims first: moved to the end before matching.

labml's annotated implementations keep attention sequence-first: scores
``einsum('ibhd,jbhd->ijbh', q, k)`` (``[seq_q, seq_k, batch, heads]``), masks of that layout,
``softmax(dim=1)`` over the keys, ``einsum('ijbh,jbhd->ibhd', attn, v)``. The softmax spelling
reads scores whose last two dims are (query, key). This step rewrites such a chain in place to
that layout: the score ``einsum`` writes ``'bhij'``, every other tensor on the way to the
softmax (a mask, a bias) is permuted the same way (after gaining the leading dims it broadcast
over), the softmax runs over the last dim, and the output ``einsum`` reads ``'bhij'``. The
values are the same numbers in another order, so the attention is the same; whether it is
causal is then judged as for any other.

The chain from the score ``einsum`` to the softmax may hold element-wise ops (a scale, in
place or not; ``masked_fill``; ``where``; a sum with a bias) and casts, each read only by the
next; the softmax must be read only by ``einsum``s. Anything else leaves the graph as it was
(and the verify pass refuses the ``[.., S, S]`` scores by name).

A pointwise convolution whose channels are the sequence (gMLP's spatial gating unit as
lucidrains writes it: ``F.conv1d(x, W[:T, :T] (tril), b[:T])`` on ``x [B, T, d]``) is the matrix
product ``W[..., 0] @ x + b[:, None]``, and a linear layer over the sequence (a causal MLP-Mixer's
token mixing: ``F.linear(x^T, W[:T, :T] * tril, b[:T])`` on ``x^T [B, d, T]``) is
``(W @ x) ^ T + b``: identities of the ops (a kernel of size 1 without stride, padding, dilation
or groups). `sequence_channel_conv` writes them so, and the mixing and dense pair rules judge
the product as any other.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

from treecompile.passes._graph import SOFTMAX, PassContext, emit, is_call, op_name, same_size, value

__all__ = ["canonical_layout", "sequence_channel_conv"]

_CHAIN = {"mul", "mul_", "div", "div_", "truediv", "itruediv", "imul", "masked_fill", "masked_fill_", "where", "add",
          "add_", "sub", "sub_", "iadd", "isub", "float", "double", "to", "type_as", "contiguous"}


def _letters(spec: str) -> tuple[list[str], str]:
    ins, out = spec.replace(" ", "").split("->")
    return ins.split(","), out


def _fake(v: Any, perm: list[int]) -> Any:
    mode = getattr(v, "fake_mode", None)
    if mode is None:
        return v.permute(perm)
    with mode:
        return v.permute(perm)


def _before(n: fx.Node) -> fx.Node | None:
    """The scores ``n`` (an op of the chain) is computed from: its one tensor input of its own
    shape that is not boolean (``masked_fill(s, m, v)``'s ``s``, ``where(m, s, v)``'s ``s``)."""
    shape = tuple(value(n).shape)
    found = [a for a in n.all_input_nodes if isinstance(value(a), torch.Tensor) and tuple(value(a).shape) == shape
             and value(a).dtype != torch.bool]
    return found[0] if len(found) == 1 else None


def _chain(x: fx.Node, softmax: fx.Node) -> tuple[list[fx.Node], fx.Node] | None:
    """The ops from the score ``einsum`` to ``x`` (nearest the softmax first), and the einsum;
    each read only by the next (or the softmax)."""
    chain, cur = [], x
    while not is_call(cur, (torch.einsum,)):
        before = _before(cur) if op_name(cur) in _CHAIN else None
        if before is None:
            return None
        chain.append(cur)
        cur = before
    if not (isinstance(cur.args[0], str) and len(cur.args) == 3):
        return None
    nxt = [softmax, *chain]
    if any(list(n.users) != [after] for n, after in zip([*chain, cur], nxt)):
        return None
    return chain, cur


def _permuted(gm: fx.GraphModule, ctx: PassContext, at: fx.Node, a: Any, nd: int, perm: list[int], skip) -> Any:
    """A tensor operand of a chain op in the new order (after gaining the leading dims it
    broadcast over)."""
    av = value(a)
    if a in skip or not isinstance(a, fx.Node) or not isinstance(av, torch.Tensor) or av.dim() == 0:
        return a
    for _ in range(nd - av.dim()):  # unmarked: the row rules judge them as the model's own ops
        a = emit(gm, ctx, at, "call_method", "unsqueeze", (a, 0), mark=False)
    return emit(gm, ctx, at, "call_method", "permute", (a, perm), mark=False)


def canonical_layout(gm: fx.GraphModule, ctx: PassContext, node: fx.Node) -> None:
    """Rewrites the chain ending in ``node`` (a softmax over a dim other than the last) to
    scores ``[.., query, key]`` (module docstring), or leaves it."""
    if not is_call(node, SOFTMAX, ("softmax",)):
        return
    x = node.args[0]
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    xv = value(x)
    if not (isinstance(x, fx.Node) and isinstance(xv, torch.Tensor) and isinstance(dim, int)):
        return
    nd = xv.dim()
    j = dim % nd
    rows = [d for d in range(nd) if same_size(xv.shape[d], ctx.seq_len)]
    if j == nd - 1 or len(rows) != 2 or j not in rows:
        return
    found = _chain(x, node)
    if found is None or any(not (is_call(u, (torch.einsum,)) and isinstance(u.args[0], str) and len(u.args) == 3
                                 and u.args[1] is node) for u in node.users):
        return
    chain, scores = found
    (qs, ks), out = _letters(scores.args[0])
    if len(out) != nd or any(isinstance(value(a), torch.Tensor) and value(a).dim() > nd
                             for n in chain for a in n.all_input_nodes):
        return
    i = rows[0] if rows[1] == j else rows[1]
    perm = [d for d in range(nd) if d not in (i, j)] + [i, j]
    new_out = "".join(out[p] for p in perm)
    scores.args = (f"{qs},{ks}->{new_out}", *scores.args[1:])
    scores.meta["example_value"] = _fake(value(scores), perm)
    skip = {scores, *chain}
    for n in reversed(chain):
        n.args = fx.node.map_arg(n.args, lambda a, n=n: _permuted(gm, ctx, n, a, nd, perm, skip))
        n.kwargs = fx.node.map_arg(n.kwargs, lambda a, n=n: _permuted(gm, ctx, n, a, nd, perm, skip))
        n.meta["example_value"] = _fake(value(n), perm)
    node.args = (x, nd - 1, *node.args[2:]) if len(node.args) > 1 else (x,)
    if "dim" in node.kwargs:
        node.kwargs = {**node.kwargs, "dim": nd - 1}
    node.meta["example_value"] = _fake(value(node), perm)
    for u in list(node.users):
        (_, v), res = _letters(u.args[0])
        u.args = (f"{new_out},{v}->{res}", *u.args[1:])
    ctx.count("layout")


_CONV1D = (torch.conv1d, torch.nn.functional.conv1d)


def sequence_channel_conv(gm: fx.GraphModule, ctx: PassContext, node: fx.Node) -> None:
    """Rewrites ``conv1d(x, w, b)`` with ``x [.., S, d]`` (the rows as channels) and ``w [S, S, 1]``,
    stride 1, no padding, dilation 1, one group, to ``w.squeeze(-1) @ x (+ b.unsqueeze(-1))``,
    and ``linear(x, w, b)`` with ``x [.., d, S]`` and ``w [S, S]`` to ``(w @ x^T)^T (+ b)`` (module
    docstring); leaves any other node."""
    if is_call(node, (torch.nn.functional.linear, torch._C._nn.linear)) and len(node.args) >= 2:
        x, w = node.args[0], node.args[1]
        b = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        xv, wv = value(x), value(w) if isinstance(w, fx.Node) else None
        if not (isinstance(xv, torch.Tensor) and isinstance(wv, torch.Tensor) and xv.dim() >= 2 and wv.dim() == 2
                and all(same_size(d, ctx.seq_len) for d in (xv.shape[-1], *wv.shape))):
            return
        xt = emit(gm, ctx, node, "call_method", "transpose", (x, -1, -2), mark=False)
        m = emit(gm, ctx, node, "call_function", torch.matmul, (w, xt), mark=False)
        new = emit(gm, ctx, node, "call_method", "transpose", (m, -1, -2), mark=False)
    elif is_call(node, _CONV1D) and len(node.args) >= 2:
        names = ["input", "weight", "bias", "stride", "padding", "dilation", "groups"]
        bound = dict(zip(names, node.args)) | dict(node.kwargs)
        x, w, b = bound["input"], bound["weight"], bound.get("bias")
        xv, wv = value(x), value(w) if isinstance(w, fx.Node) else None
        if not (isinstance(xv, torch.Tensor) and isinstance(wv, torch.Tensor) and xv.dim() in (2, 3)
                and wv.dim() == 3):
            return
        plain = all(bound.get(k, d) in (d, [d], (d,)) for k, d in (("stride", 1), ("padding", 0), ("dilation", 1),
                                                                    ("groups", 1)))
        if not (plain and wv.shape[-1] == 1 and same_size(xv.shape[-2], ctx.seq_len)
                and same_size(wv.shape[0], ctx.seq_len) and same_size(wv.shape[1], ctx.seq_len)):
            return
        m = emit(gm, ctx, node, "call_method", "squeeze", (w, -1), mark=False)
        new = emit(gm, ctx, node, "call_function", torch.matmul, (m, x), mark=False)
        if isinstance(b, fx.Node):
            b = emit(gm, ctx, node, "call_method", "unsqueeze", (b, -1), mark=False)
    else:
        return
    if isinstance(b, fx.Node):
        new = emit(gm, ctx, node, "call_function", torch.add, (new, b), mark=False)
    node.replace_all_uses_with(new)
    gm.graph.erase_node(node)
    ctx.count("layout")
