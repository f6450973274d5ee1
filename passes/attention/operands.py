"""The operands of an attention written out by hand: which nodes a softmax chain spans.

`passes.attention` rewrites ``softmax(q @ k^T * scale [+ mask]) @ v`` however a model spells
it; these helpers read the spelling off the graph, without changing it: the query and key of
the scores matmul (through einsums, transposes and permutes), the value and output layout of
the output matmul, a sink column concatenated to the scores, and the chain of nodes between
the softmax and the output with any use outside it (which the rewrite must not drop).
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from treecompile.passes._graph import PassContext, bind, is_call, row_dims, value
from treecompile.passes._mask_eval import value_inputs

__all__ = ["chain_end", "drops_last_column", "forward_chain", "output_operands", "outside_use", "scores_operands",
           "single_user", "sink_column"]


def single_user(node: fx.Node) -> fx.Node | None:
    users = list(node.users)
    return users[0] if len(users) == 1 else None


def nan_guard(node: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """``(where, isnan)`` if ``node``'s only readers are ``where(isnan(node), zeros_like(node) or 0,
    node)`` (TransformerLens zeroes the NaN a softmax over no visible key gives); else None. On a
    tree the attention kernel gives such a query 0 itself, so the guard changes nothing there
    (NaN scores, which it would also hide, stay NaN on the tree: a NaN loss, not a silent one)."""
    isnans = [u for u in node.users if is_call(u, (torch.isnan,), ("isnan",)) and u.args[0] is node]
    wheres = [u for u in node.users if is_call(u, (torch.where,), ("where",)) and len(u.args) == 3]
    zeros = [u for u in node.users if is_call(u, (torch.zeros_like,), ("new_zeros",)) and u.args[0] is node]
    if len(isnans) != 1 or len(wheres) != 1 or set(node.users) != {*isnans, *wheres, *zeros}:
        return None
    cond, other, kept = wheres[0].args
    zero = other in zeros if isinstance(other, fx.Node) else other == 0
    if cond is not isnans[0] or kept is not node or not zero or len(isnans[0].users) != 1:
        return None
    return wheres[0], isnans[0]


def next_op(node: fx.Node) -> fx.Node | None:
    """The one op that reads ``node`` (`single_user`), passing over a `nan_guard`."""
    guard = nan_guard(node)
    return single_user(node) if guard is None else guard[0]


def sink_column(ctx: PassContext, cat: fx.Node) -> fx.Node | None:
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


def drops_last_column(node: fx.Node) -> bool:
    """``x[..., :-1]``."""
    if not (node.op == "call_function" and node.target is operator.getitem):
        return False
    idx = node.args[1]
    return isinstance(idx, tuple) and len(idx) == 2 and idx[0] is Ellipsis and idx[1] == slice(None, -1, None)


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


def _arrange(spec_in: str, spec_out: str, x: fx.Node):
    """`_permute` to ``spec_out`` where the letters of ``spec_out`` missing from ``spec_in`` (head
    dims a multi-query key or value does not have) become dims of size 1 (a builder)."""
    present = "".join(c for c in spec_out if c in spec_in)
    missing = [i for i, c in enumerate(spec_out) if c not in spec_in]
    if not missing:
        return _permute(spec_in, spec_out, x)
    inner = _permute(spec_in, present, x)

    def build(g: fx.Graph) -> fx.Node:
        n = inner(g) if callable(inner) else inner
        v = value(n)
        for i in missing:
            n = g.call_method("unsqueeze", (n, i))
            v = v.unsqueeze(i)
            n.meta["example_value"] = v
        return n

    return build


def scores_operands(qk: fx.Node):
    """``(q, k, layout)`` for a scores node ``q @ k^T``; q and k are ``[..., S, D]`` nodes (or
    graph builders of them) and ``layout`` the einsum letters of the scores (None for a matmul)."""
    if is_call(qk, (torch.einsum,)):
        spec = _einsum_spec(qk)
        if spec is None:
            return None
        a, b, out = spec
        contracted = [c for c in a if c in b and c not in out]
        # The query's and key's own sequence letters are the last two of the scores; the
        # letters before them are batch and heads, of both, or of the query alone (a multi-query
        # key without a head dim: ``'b h i d, b j d -> b h i j'``), which the key gets as size 1.
        if len(contracted) != 1 or len(out) < 2 or out[-2] not in a or out[-2] in b or out[-1] not in b \
                or out[-1] in a:
            return None
        ql, kl, batch = out[-2], out[-1], out[:-2]
        if set(a) != set(batch + ql + contracted[0]) or not set(b) - {kl} <= set(batch + contracted[0]) \
                or contracted[0] not in b or len(set(out)) != len(out):
            return None
        d = contracted[0]
        return _permute(a, batch + ql + d, qk.args[1]), _arrange(b, batch + kl + d, qk.args[2]), out
    if is_call(qk, (torch.baddbmm,), ("baddbmm",)):
        b = bind(qk, ["input", "batch1", "batch2"], {})
        q, kt = b["batch1"], b["batch2"]
    else:
        q, kt = qk.args[:2]
    k = _untranspose(kt)
    return None if k is None else (q, k, None)


def output_operands(out: fx.Node, layout: str | None):
    """``(probs, v, post)`` for ``probs @ v``: ``v`` as ``[..., S, Dv]`` (or a builder) and
    ``post`` the layout change from the kernel's ``[..., S, Dv]`` to ``out``'s (or None)."""
    if not is_call(out, (torch.einsum,)):
        return out.args[0], out.args[1], None
    spec = _einsum_spec(out)
    if spec is None:
        return None
    a, b, res = spec
    found = _einsum_output(a, b, res, out.args[1], out.args[2])
    # The values may come first (TransformerLens: ``einsum('bkhd,bhqk->bqhd', v, pattern)``).
    return found if found is not None else _einsum_output(b, a, res, out.args[2], out.args[1])


def _einsum_output(a: str, b: str, res: str, probs: fx.Node, values: fx.Node):
    """`output_operands` of ``einsum('a,b->res', probs, values)``, or None."""
    contracted = [c for c in a if c in b and c not in res]
    if len(a) < 2 or len(contracted) != 1 or contracted[0] != a[-1]:
        return None
    batch, ql, kl = a[:-2], a[-2], a[-1]
    dl = [c for c in b if c not in a]
    # A multi-query value lacks the head letters: it gets them as size 1 (`_arrange`).
    if len(dl) != 1 or kl not in b or not set(b) <= set(batch + kl + dl[0]) or set(res) != set(batch + ql + dl[0]):
        return None
    canon = batch + ql + dl[0]
    post = None if res == canon else (lambda g, x: g.call_function(torch.einsum, (f"{canon}->{res}", x)))
    return probs, _arrange(b, batch + kl + dl[0], values), post


def forward_chain(softmax: fx.Node, out: fx.Node) -> list[fx.Node]:
    """The single-user nodes from the softmax to the ``probs @ v`` node, excluded (with what a
    `nan_guard` on the way reads)."""
    nodes, cur = [], softmax
    while True:
        guard = nan_guard(cur)
        if guard is not None:
            nodes.extend(u for u in cur.users if u is not guard[0])  # the isnan (and zeros_like) it reads
        cur = next_op(cur)
        if cur is None or cur is out:
            return nodes
        nodes.append(cur)


def outside_use(chain: list[fx.Node], out: fx.Node) -> fx.Node | None:
    """A user of a node the rewrite replaces that is not itself replaced (``att.masked_fill_(...)``
    between the scores and the softmax, or the probabilities returned as attention weights).
    Replacing the chain would leave it reading or writing scores nobody computes any more."""
    members = set(chain) | {out}
    for n in chain:
        if not isinstance(n, fx.Node):
            continue
        for u in n.users:
            # A user that takes only the scores' shape or dtype (mask.expand_as(scores)) reads none of them.
            if u not in members and n in value_inputs(u):
                return u
    return None


def chain_end(softmax: fx.Node, matmul: fx.Node) -> fx.Node:
    cur = softmax
    while True:
        nxt = next_op(cur)
        if nxt is None or nxt is matmul:
            return cur
        cur = nxt


#: ``x.mT`` and ``x.mH`` as torch >= 2.14 records them (2.13 records ``getattr(x, "mT")``); ``x.T``
#: and ``x.H`` (``numpy_T``, ``matrix_H``) swap the last two dims of a matrix only.
_MATRIX_TRANSPOSES = {"mT", "mH", "adjoint"}
_TRANSPOSES_2D = {"numpy_T", "matrix_H"}


def _swaps_last_two(node: fx.Node) -> bool:
    """Whether ``node`` is an aten ``mT`` / ``mH`` / ``adjoint`` (or ``numpy_T`` /
    ``matrix_H`` of a matrix): a view with the last two dims swapped."""
    t = node.target
    packet = getattr(t, "overloadpacket", t)
    if not isinstance(packet, torch._ops.OpOverloadPacket) or getattr(packet, "_qualified_op_name", "").split(
            "::")[0] != "aten":
        return False
    name = packet.__name__
    x = value(node.args[0]) if node.args else None
    return name in _MATRIX_TRANSPOSES or name in _TRANSPOSES_2D and isinstance(x, torch.Tensor) and x.dim() == 2


def _untranspose(kt) -> fx.Node | None:
    """``k`` if ``kt`` is ``k`` with its last two dims swapped."""
    if not isinstance(kt, fx.Node):
        return None
    kv = value(kt)
    if is_call(kt, (torch.transpose,), ("transpose",)):
        dims = [d % kv.dim() for d in kt.args[1:3]]
        if sorted(dims) == [kv.dim() - 2, kv.dim() - 1]:
            return kt.args[0]
    if kt.op == "call_function" and (kt.target is getattr and kt.args[1] in ("mT", "mH") or _swaps_last_two(kt)):
        return kt.args[0]
    if isinstance(kv, torch.Tensor) and kv.dim() >= 2:
        # Keys made with their sequence dim last some other way (GPT-1's permute(0, 2, 3, 1)):
        # the kernel's [.., S, D] keys are their transpose.
        def build(g: fx.Graph) -> fx.Node:
            n = g.call_method("transpose", (kt, -2, -1))
            n.meta["example_value"] = kv.transpose(-2, -1)
            return n

        return build
    return None
