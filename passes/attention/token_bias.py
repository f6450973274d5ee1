"""Score biases read from the tokens that the tree kernel can carry: terms constant along one of
the two sequence dims.

A bias on the scores ``[.., S, S]`` that is a sum of a term per query ``a[.., :, None]`` and a
term per key ``b[.., None, :]``, each read from the tokens (the Forgetting Transformer's
``c_i - c_j`` with ``c`` a running sum of log forget gates, a gate per key), and a boolean mask
per key read from the tokens (``ids != pad`` per key), are functions of one token each: on the
tree, the rows of a query's ancestors hold what the path holds. Each side becomes one more
feature of the query and the key the kernel multiplies (`with_token_terms`), so the bias rides
in the product over each query's ancestors, whole, streamed or split over a CP group, and gets
its gradient. `token_terms` and `split_key_masks` read such terms off the graph (the softmax
walk in `treecompile.passes.attention.score_chain` and the SDPA rewrite use them).

A query whose every visible key a key mask blocks is computed otherwise per path than on the
tree: a softmax over ``-inf`` alone is NaN per path (and NaN spreads along the path), where the
tree kernel gives 0 (as SDPA's own softmax does); over a finite fill (``finfo.min``) it weighs
alike every key holding the fill, which per path may include later keys whose causal mask is the
same finite fill. Under a causal mask such a query is on a path that starts with a blocked token:
`root_sees_a_key` refuses a batch with one (`BatchRefused`), except where the spelling gives what
the kernel gives (SDPA over ``-inf``) or no query can be blind (a sink every query sees).
"""

from __future__ import annotations

import math
import operator

import torch
from torch import fx

from treecompile.core.errors import BatchRefused
from treecompile.passes._graph import Emitter, PassContext, is_call, location_of, same_size, value
from treecompile.passes._mask_eval import BLOCKED, depends_on_inputs, reads_tokens
from treecompile.passes.rows.domain import op_key

__all__ = ["OR", "AND", "side_of", "token_terms", "masked_token_terms", "split_key_masks", "with_token_terms",
           "with_factors", "root_sees_a_key", "BLIND", "term_kind", "can_blind"]

#: ``(functions, methods)`` joining boolean masks: ``|`` of blocked parts, ``&`` of allowed ones.
OR = ((operator.or_, torch.logical_or, torch.bitwise_or), ("logical_or", "bitwise_or", "__or__"))
AND = ((operator.and_, torch.logical_and, torch.bitwise_and), ("logical_and", "bitwise_and", "__and__"))
_SUMS = ((operator.add, torch.add, operator.sub, torch.sub), ("add", "sub"))


def side_of(ctx: PassContext, v, per_head: bool = False) -> str | None:
    """Along which sequence dim a tensor ``v`` broadcast against the scores ``[.., S, S]``
    (right-aligned) varies: "query" (``[.., S, 1]``), "key" (``[.., 1, S]``), or None; with
    ``per_head``, one value per head or batch (``[.., 1, 1]``, a scalar) is "query" too."""
    if not isinstance(v, torch.Tensor):
        return None
    rows, cols = ((1, 1) + tuple(v.shape))[-2:]
    if cols == 1 and (same_size(rows, ctx.seq_len) or per_head and rows == 1):
        return "query"
    if rows == 1 and same_size(cols, ctx.seq_len):
        return "key"
    return None


def token_terms(ctx: PassContext, x, sign: float) -> list[tuple[str, fx.Node, float]] | None:
    """``x`` as ``[(side, term, sign)]``, or None: a sum or difference of terms, each read from
    the tokens and constant along the key dim (``side`` "query", ``[.., S, 1]``) or the query dim
    ("key", ``[.., 1, S]``)."""
    if not isinstance(x, fx.Node):
        return None
    if is_call(x, *_SUMS) and len(x.args) == 2 and not x.kwargs:
        a, b = x.args
        left = token_terms(ctx, a, sign)
        right = token_terms(ctx, b, -sign if is_call(x, (operator.sub, torch.sub), ("sub",)) else sign)
        return None if left is None or right is None else left + right
    v = value(x)
    if not isinstance(v, torch.Tensor) or v.dim() < 2 or not v.dtype.is_floating_point or not reads_tokens(ctx, x):
        return None
    side = side_of(ctx, v)
    if side is None and is_call(x, (torch.broadcast_to,), ("expand", "expand_as")) and isinstance(x.args[0], fx.Node):
        # A term expanded over the dim it is constant along ([.., 1, S] to [.., S, S]) is that term.
        src = value(x.args[0])
        if isinstance(src, torch.Tensor) and src.dim() == v.dim() and all(
                same_size(a, b) for a, b in zip(src.shape[:-2], v.shape[:-2])):
            return token_terms(ctx, x.args[0], sign)
    return None if side is None else [(side, x, sign)]


#: Ops that move a ``[.., S, S]`` tensor's batch and head dims and keep its last two (Hugging
#: Face's ``repeat_kv`` of a bias: ``x[:, :, None].expand(b, h, n, S, S).reshape(b, h * n, S, S)``),
#: and casts: replayed on a term ``[.., 1, S]`` or ``[.., S, 1]`` they give its share of the result.
_HEAD_VIEWS = ("expand", "reshape", "view", "contiguous", "to", "type_as", "float", "double")


def masked_token_terms(ctx: PassContext, x, sign: float, at: fx.Node) -> tuple[list[fx.Node], list] | None:
    """``x``, a float bias on the scores, as ``(blocked masks, token terms)``, or None: the terms
    read from the tokens (`token_terms`) of a tensor masked by structural masks
    (``t.masked_fill(m, very negative)``, True where ``m`` blocks), through ops that only move
    its batch and head dims (`_HEAD_VIEWS`, which are replayed on each term before ``at``):
    Doge's dynamic mask, a gate per key expanded over the queries, filled where the causal mask
    blocks and repeated over each group of query heads. The masks are the caller's to judge."""
    inner, views = _head_views(ctx, x)
    masks = []
    while isinstance(inner, fx.Node) and is_call(inner, (torch.masked_fill,), ("masked_fill",)):
        t, m, fill = (list(inner.args) + [inner.kwargs.get("value")])[:3]
        if not (isinstance(fill, (int, float)) and fill <= BLOCKED and isinstance(m, fx.Node)
                and depends_on_inputs(ctx, m) is False):
            return None
        masks.append(m)
        inner = t
    terms = token_terms(ctx, inner, sign)
    if not terms or not views and not masks:
        return None
    e = Emitter(at.graph.owning_module, ctx, at)
    return masks, [(side, _replay(e, term, side, views), f) for side, term, f in terms]


def _head_views(ctx: PassContext, x) -> tuple:
    """``(source, views)``: ``x`` is ``source`` through ``views`` (`_HEAD_VIEWS`, first first),
    each keeping the last two dims, both of the sequence's length."""
    views = []
    while isinstance(x, fx.Node) and x.args and isinstance(x.args[0], fx.Node) and (
            is_call(x, (), _HEAD_VIEWS) or is_call(x, (operator.getitem,)) and _keeps_pair(x.args[1])):
        v, src = value(x), value(x.args[0])
        if not (isinstance(v, torch.Tensor) and isinstance(src, torch.Tensor) and v.dim() >= 2 and src.dim() >= 2
                and all(same_size(a, ctx.seq_len) and same_size(b, ctx.seq_len)
                        for a, b in zip(v.shape[-2:], src.shape[-2:]))):
            break
        views.append(x)
        x = x.args[0]
    return x, views[::-1]


def _keeps_pair(index) -> bool:
    """An index that keeps the last two dims whole: a tuple of ``None`` and full slices ending in
    two full slices."""
    full = slice(None, None, None)
    return isinstance(index, tuple) and len(index) >= 2 and index[-2:] == (full, full) and all(
        i is None or i == full for i in index)


def _replay(e: Emitter, term: fx.Node, side: str, views: list[fx.Node]) -> fx.Node:
    """``views`` applied to ``term`` (``[.., 1, S]`` for a key term, ``[.., S, 1]`` for a query one):
    sizes given for the last two dims are the term's (the sequence's size kept, the other 1)."""
    for view in views:
        args = list(view.args[1:])
        if view.target in ("expand", "reshape", "view") and args:
            sizes = list(args[0]) if len(args) == 1 and isinstance(args[0], (tuple, list)) else args
            length = sizes[-1] if side == "key" else sizes[-2]
            sizes[-2:] = [1, length] if side == "key" else [length, 1]
            if view.target == "expand":
                sizes[-2:] = [-1, -1]
            args = sizes
        name = "reshape" if view.target == "view" else view.target  # (an expanded term has no view)
        term = e.fn(operator.getitem, term, *args) if view.op == "call_function" else e.method(name, term, *args)
    return term


def split_key_masks(ctx: PassContext, m, combine: tuple) -> tuple[list, list[fx.Node]]:
    """``(other parts, key masks)`` of a boolean mask ``m`` joined by ``combine`` (`OR`, `AND`):
    the key masks are the parts that are ``[.., 1, S]`` and read from the tokens (the same for
    every query, one value per key)."""
    parts, stack = [], [m]
    while stack:
        x = stack.pop()
        if isinstance(x, fx.Node) and is_call(x, *combine) and len(x.args) == 2 and not x.kwargs:
            stack.extend(x.args)
        else:
            parts.append(x)
    keys = [p for p in parts if isinstance(p, fx.Node) and _is_key_mask(ctx, p)]
    return [p for p in parts if p not in keys], keys


def _is_key_mask(ctx: PassContext, x: fx.Node) -> bool:
    v = value(x)
    return (isinstance(v, torch.Tensor) and v.dtype == torch.bool and v.dim() >= 2 and side_of(ctx, v) == "key"
            and bool(reads_tokens(ctx, x)))


@torch.library.custom_op("treecompile::root_sees_a_key", mutates_args=())
def root_sees_a_key(blocks: torch.Tensor, positions: torch.Tensor, path_count: torch.Tensor, where: str) -> torch.Tensor:
    """0 (a 0-dim float32 tensor), after checking that no path starts with a token ``blocks``
    (``[.., 1, S]``, True where a key mask blocks the key, for any head) blocks: a row at position
    0 that some path goes through (``path_count``; padding rows have none); else raises
    `BatchRefused` naming ``where``."""
    blocked = blocks.reshape(-1, blocks.shape[-1]).any(0)
    blind = int((blocked & (positions == 0) & (path_count > 0)).sum())
    if blind:
        paths = "a path starts" if blind == 1 else f"paths from {blind} roots start"
        raise BatchRefused(
            f"treecompile cannot make this batch exact on a tree: {paths} with a token the key mask at {where} "
            "blocks: per path a query there sees only blocked keys, which the softmax gives NaN (a -inf fill) or "
            "weighs alike with the keys a finite causal fill hides; the tree kernel sees only the path's")
    return torch.zeros((), dtype=torch.float32, device=blocks.device)


@root_sees_a_key.register_fake
def _(blocks, positions, path_count, where):
    return torch.empty((), dtype=torch.float32, device=blocks.device)


root_sees_a_key.register_autograd(lambda ctx, grad: (None, None, None, None),
                                  setup_context=lambda ctx, inputs, output: None)


def with_token_terms(gm: fx.GraphModule, ctx: PassContext, at: fx.Node, lead: tuple, q: fx.Node, k: fx.Node,
                     v: fx.Node, terms: list[tuple[str, fx.Node, float]],
                     scale: float, blind: str = "nan") -> tuple[fx.Node, fx.Node, fx.Node] | str:
    """``(q', k', v)``: the terms as features of the query and key the tree kernel multiplies,
    so that ``scale * q' . k'`` is the scores with the bias: the sum of the key terms over
    ``scale`` on the key against a 1 on the query, the sum of the query terms likewise on the
    query against a 1 on the key. Or why the keys cannot take them.

    Args:
        at: the node the new ones go before (the attention's output).
        lead: the scores' dims before ``[S, S]``.
        terms: ``(side, node, factor)``: "query" / "key" terms entering the scores times
            ``factor``; "key_blocked" / "key_allowed" boolean key masks, True where they block /
            allow, ``factor`` the score a blocked key gets.
        scale: the kernel's scale.
        blind: what the spelling gives a query whose every visible key a mask blocks (`BLIND`):
            "nan" (a softmax over ``-inf`` alone), "zero" (SDPA's softmax, as the kernel), "none"
            (there is none: a sink or memory key every query sees). Each term `can_blind` names
            gets a `root_sees_a_key` check.

    A query term's gradient is rounding noise per path (a softmax is unchanged by a value added
    to its whole row); carried, it is a gradient on the tree too (not None, which an optimizer
    would skip). Keys broadcast over heads a bias has are expanded per head.
    """
    if scale == 0:
        return "the scores get a bias from the tokens but are scaled by 0"
    if blind not in BLIND:
        raise ValueError(f"treecompile internal error: blind={blind!r}; valid: {', '.join(BLIND)}")
    e = Emitter(gm, ctx, at)
    kv = value(k)
    lead = tuple(lead)
    cols: dict[str, fx.Node] = {}
    shapes: dict[str, list] = {"query": [], "key": []}
    for side, term, factor in terms:
        tv = value(term)
        try:
            wide = tv.dim() > len(lead) + 2 or torch.broadcast_shapes(lead, tuple(tv.shape[:-2])) != lead
        except RuntimeError:
            wide = True
        if wide:
            return "the scores get a bias from the tokens over more batch or head entries than the scores have"
        if side in ("key_blocked", "key_allowed"):  # a boolean mask per key: a very negative score where it blocks
            blocks = term if side == "key_blocked" else e.fn(torch.logical_not, term)
            checked = can_blind(ctx, side, term, factor, blind)
            t, side = e.fn(torch.where, e.method("transpose", blocks, -1, -2), factor / scale, 0.0), "key"
            if checked:
                t = e.fn(operator.add, t, _root_check(e, ctx, blocks, term))
        else:
            t = e.method("transpose", term, -1, -2) if side == "key" else term  # each [.., S, 1]
            if can_blind(ctx, side, term, factor, blind):
                scores = e.fn(operator.mul, term, factor)  # a float mask (MultiheadAttention's -inf)
                blocks = e.fn(operator.le, scores, BLOCKED)
                if blind == "zero":  # -inf: 0 per path as on the tree
                    blocks = e.fn(torch.logical_and, blocks, e.fn(torch.isfinite, scores))
                t = e.fn(operator.add, t, _root_check(e, ctx, blocks, term))
            t = e.fn(operator.mul, t, factor / scale)
        shapes[side].append(tuple(tv.shape[:-2]))
        cols[side] = e.fn(operator.add, cols[side], t) if side in cols else t
    keys = _broadcast(tuple(kv.shape[:-2]), shapes["key"])
    if keys is None or any(not isinstance(d, int) for d in keys) or len(keys) != kv.dim() - 2 \
            or _broadcast(tuple(value(q).shape[:-2]), shapes["query"]) != tuple(value(q).shape[:-2]):
        return "the scores get a bias from the tokens whose batch or head dims do not match the query's and keys'"
    if tuple(kv.shape[:-2]) != tuple(keys):  # keys broadcast over heads the bias has: one copy per head
        if tuple(value(v).shape[:-2]) != tuple(kv.shape[:-2]):
            return "the scores get a bias per key over heads the keys and values do not have alike"
        k, v = e.method("expand", k, *keys, -1, -1), e.method("expand", v, *keys, -1, -1)
    # One dtype for the product, the most precise of the query's, key's and terms' (a float32
    # running sum against bfloat16 keys keeps its float32: c_i - c_j is a difference of large
    # numbers); the kernel computes in it and casts the result back.
    dtype = value(q).dtype
    for x in (k, *cols.values()):
        dtype = torch.promote_types(dtype, value(x).dtype)
    q, k = (x if value(x).dtype == dtype else e.method("to", x, dtype) for x in (q, k))
    first = (Ellipsis, slice(None, 1, None))
    q_extra, k_extra = [], []
    if "key" in cols:
        k_zero = e.fn(torch.zeros_like, e.fn(operator.getitem, k, first))
        q_extra.append(e.fn(torch.ones_like, e.fn(operator.getitem, q, first)))
        k_extra.append(e.fn(operator.add, e.method("to", cols["key"], dtype), k_zero))
    if "query" in cols:
        q_zero = e.fn(torch.zeros_like, e.fn(operator.getitem, q, first))
        q_extra.append(e.fn(operator.add, e.method("to", cols["query"], dtype), q_zero))
        k_extra.append(e.fn(torch.ones_like, e.fn(operator.getitem, k, first)))
    return e.fn(torch.cat, [q, *q_extra], -1), e.fn(torch.cat, [k, *k_extra], -1), v


def with_factors(e: Emitter, factors: list, q: fx.Node, k: fx.Node) -> tuple[fx.Node, fx.Node] | str:
    """``(q', k')``: the query times the scores' factors per query (or per head), the key times
    those per key (`ScoreChain.factors`: ``(side, node, power)``, ``power`` -1 divides), so that
    ``q' . k'`` is the product the model scales. Or why they cannot take them."""
    sides = {"query": q, "key": k}
    for side, f, power in factors:
        t = f if power == 1 else e.fn(torch.reciprocal, f)
        if side == "key":  # [.., 1, S] (or [S]) -> [.., S, 1]
            t = e.method("transpose", t if value(f).dim() >= 2 else e.method("unsqueeze", t, 0), -1, -2)
        target, shape = value(sides[side]), tuple(value(t).shape)
        lead = tuple(target.shape[:-2])
        if len(shape) > target.dim() or _broadcast(lead, [shape[:-2]]) != lead:
            return f"the scores get a factor per {side} over batch or head entries the {side}s do not have"
        sides[side] = e.fn(operator.mul, sides[side], t)
    return sides["query"], sides["key"]


#: What a spelling gives a query whose every visible key is blocked (`with_token_terms`).
BLIND = ("nan", "zero", "none")

#: Ops that give finite values from finite ones, barring an overflow (no ``-inf`` without an
#: infinite operand; fills are judged by their constants): a float term computed by these alone
#: from the tokens and parameters, with small constants, cannot block a key.
_FINITE = frozenset({
    "add", "sub", "mul", "neg", "cumsum", "sigmoid", "logsigmoid", "log_sigmoid", "softplus", "tanh", "silu", "gelu",
    "relu", "exp", "layer_norm", "rms_norm", "rsqrt", "sqrt", "pow", "dropout", "masked_fill", "masked_fill_",
    "where", "zeros_like", "ones_like", "full_like", "new_zeros", "new_ones", "new_full", "zeros", "ones", "full",
    "linear", "embedding", "getitem", "transpose", "permute", "view", "reshape", "unsqueeze", "squeeze",
    "expand", "contiguous", "to", "float", "double", "half", "bfloat16", "type_as", "clone", "detach", "sum", "mean",
    "logical_not", "bitwise_not", "logical_and", "logical_or", "bitwise_and", "bitwise_or", "eq", "ne", "lt", "le",
    "gt", "ge", "long", "int", "bool", "size", "dim",
})


def term_kind(ctx: PassContext, term: fx.Node) -> str:
    """What the float ``term`` can hold where its inputs are finite: "small" (far above a blocking
    score, `BLOCKED`), "infinite" (that, or ``±inf``: a mask filled with ``-inf``) or "large" (a
    finite fill such as ``finfo.min`` or ``(1 - keep) * -10000``, or values no rule bounds). Small
    and infinite: every op computing it from the inputs, parameters and what the passes made (an
    earlier attention's output) is one of `_FINITE`, each constant smaller than ``-BLOCKED`` or
    infinite (a ``log``, a division are not)."""
    seen, stack, kind = set(), [term], "small"
    while stack:
        n = stack.pop()
        if n in seen or n.op in ("placeholder", "get_attr") or n in ctx.created and op_key(n) not in _FINITE:
            continue
        seen.add(n)
        if n.op not in ("call_function", "call_method") or op_key(n) not in _FINITE:
            return "large"
        for c in torch.utils._pytree.tree_leaves((n.args, n.kwargs)):
            if isinstance(c, float) and not abs(c) < -BLOCKED:
                if not math.isinf(c):
                    return "large"
                kind = "infinite"
        stack.extend(n.all_input_nodes)
    return kind


def can_blind(ctx: PassContext, side: str, term: fx.Node, factor: float, blind: str) -> bool:
    """Whether the token term ``(side, term, factor)`` of `with_token_terms` can leave a query only
    blocked keys where the spelling (``blind``, `BLIND`) computes that query otherwise than the
    kernel: a boolean key mask unless its ``-inf`` gives SDPA's 0, a float key term that can block
    (`term_kind`: "large", or "infinite" under a softmax that gives NaN). Such a term needs a
    `root_sees_a_key` check under a causal mask and is refused (or left dense) under a window."""
    if blind == "none":
        return False
    if side in ("key_blocked", "key_allowed"):
        return blind == "nan" or not math.isinf(factor)
    if side != "key":
        return False
    kind = term_kind(ctx, term)
    return kind == "large" or kind == "infinite" and blind == "nan"


def _root_check(e: Emitter, ctx: PassContext, blocks: fx.Node, term: fx.Node) -> fx.Node:
    """`root_sees_a_key`'s 0 for the key mask ``blocks`` ``[.., 1, S]`` (True where it blocks), made
    from ``term`` (whose line the refusal names)."""
    path_count = ctx.path_count if ctx.path_count is not None else e.fn(torch.ones_like, ctx.positions)
    return e.fn(torch.ops.treecompile.root_sees_a_key.default, blocks, ctx.positions, path_count, location_of(term))


def _broadcast(lead: tuple, shapes: list) -> tuple | None:
    """``lead`` broadcast with ``shapes``, or None where they do not broadcast."""
    try:
        return tuple(torch.broadcast_shapes(lead, *shapes))
    except RuntimeError:
        return None
