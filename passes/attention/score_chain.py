"""The scores of a hand-written softmax attention: from the softmax back to ``q @ k^T``.

Model code writes what happens between the scores and the softmax in many ways. Each way
is one step in `STEPS`, a table of ``(matches, take)`` pairs: ``take`` reads one node,
records what it does (a scale, a mask, a soft-cap) and returns the node before it. The
walk ends at the scores product (``matmul``, ``bmm``, ``einsum``, ``baddbmm``).

Masks come in these spellings, each judged by evaluating its structural operand
(:mod:`treecompile.passes._mask_eval`): ``masked_fill(m, very negative)`` (also in place,
``masked_fill_``), ``+ bias`` (also ``+=`` and ``add_``), ``where(m, scores, very
negative)``, and the arithmetic ``scores * b - c * (1 - b)`` (GPT-2's first release),
judged as a whole: where ``b`` is 1 and ``c`` is 0 the score passes, where ``b`` is 0 and
``c`` is at least ``-BLOCKED`` it is blocked, and nothing else is allowed. An in-place
edit of the scores (``att.masked_fill_(...)`` without rebinding ``att``) before the
softmax reads them is part of the chain; any other in-place edit or a second reader stops
the rewrite (the rewrite would drop it).
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

from treecompile.passes._graph import MATMUL, PassContext, bind, is_call, mutated_args, same_size, value
from treecompile.passes._mask_eval import BLOCKED, depends_on_inputs, evaluate, reads_tokens
from treecompile.passes.attention.head_mix import HeadMix, head_mix
from treecompile.passes.attention.token_bias import AND, OR, masked_token_terms, side_of, split_key_masks, token_terms

__all__ = ["ScoreChain", "StopWalk", "walk_scores", "arithmetic_mask", "spell_softmax", "STEPS", "is_scalar"]


@dataclass
class ScoreChain:
    """What lies between the scores product and the softmax.

    Attributes:
        qk: the scores product node.
        scale: the product of the constant factors on the scores (before the soft-cap).
        softcap: ``c`` of ``c * tanh(x / c)``, or None.
        masks: ``(kind, node)``: ``masked_fill``, ``additive``, ``where``, ``multiply``,
            ``subtract`` (the last two judged together, see `arithmetic_mask`), ``relative`` (a
            bias over the pairs computed from parameters, `treecompile.passes.attention.relative_bias`).
        token_terms: ``(side, node, factor)``: a score bias read from the tokens that is a sum of
            terms each constant along one of the two sequence dims, ``node`` of shape ``[.., S, 1]``
            (``side`` "query": one value per query, which the softmax's row shift cancels) or
            ``[.., 1, S]`` ("key": one value per key), entering the scores times ``factor`` (its
            sign and the constant factors applied after it): the Forgetting Transformer's
            ``c_i - c_j`` of a running sum ``c``, a gate per key. Or ``side`` "key_blocked" /
            "key_allowed": a boolean mask per key ``[.., 1, S]`` read from the tokens (``ids !=
            pad``), True where it blocks / allows, and ``factor`` the very negative score it
            gives a blocked key. The softmax rewrite makes them
            features of the query and key (`treecompile.passes.attention.softmax`).
        factors: ``(side, node, power)``: a tensor multiplying (``power`` 1) or dividing (-1) the
            scores that is constant along the key dim (``side`` "query": ``[.., S, 1]``, or one
            per head ``[.., 1, 1]``) or the query dim ("key": ``[.., 1, S]``): a learned
            temperature per head, Scalable-Softmax's ``s * log(n)`` per query. The rewrite
            multiplies the query or key by it; nothing the walk meets after it (applied before
            it) may be a mask, a bias or a soft-cap, which it would scale.
        head_mix: the scores' heads mixed by a matrix (talking heads,
            `treecompile.passes.attention.head_mix`); only constant factors may come before it.
        nodes: the nodes the rewrite replaces.
    """

    qk: fx.Node | None = None
    scale: float = 1.0
    softcap: float | None = None
    masks: list[tuple[str, fx.Node]] = field(default_factory=list)
    nodes: list[fx.Node] = field(default_factory=list)
    after_cap: bool = False  # the walk has passed the soft-cap's tanh (no mask may follow)
    relative_scale: float = 1.0  # the factor on the scores after a ``relative`` bias is added
    token_terms: list[tuple[str, fx.Node, float]] = field(default_factory=list)
    factors: list[tuple[str, fx.Node, int]] = field(default_factory=list)
    head_mix: HeadMix | None = None


class StopWalk(Exception):
    """Not this attention: ``str(e)`` is why (a note for the refusal), or empty."""


_CASTS = ("float", "double", "to", "type", "type_as")
_VIEWS = ("view", "reshape", "contiguous")


def is_scalar(x) -> bool:
    """A Python number (not a bool)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _constant(ctx: PassContext, x) -> float | None:
    """``x`` as a number: a Python number, or a structural one-element tensor."""
    if is_scalar(x):
        return float(x)
    if not isinstance(x, fx.Node) or depends_on_inputs(ctx, x):
        return None
    v = value(x)
    if not isinstance(v, torch.Tensor) or v.numel() != 1:
        return None
    try:
        return float(evaluate(ctx, x))
    except Exception:
        return None


def _before_factor(chain: ScoreChain, what: str) -> None:
    if chain.factors:
        raise StopWalk(f"{what} before a tensor factor on the scores (the factor would scale it)")


def _mask(ctx: PassContext, chain: ScoreChain, kind: str, m) -> None:
    _before_factor(chain, "a mask or bias")
    if chain.after_cap:
        raise StopWalk("a mask before the soft-cap's tanh (tanh of a very negative score is not very negative)")
    chain.masks.append((kind, m))


def _structural(ctx: PassContext, x) -> bool:
    return isinstance(x, fx.Node) and depends_on_inputs(ctx, x) is False


def _pair_shaped(ctx: PassContext, x: fx.Node) -> bool:
    """``[.., S, S]``: one entry per (query, key) pair."""
    v = value(x)
    return isinstance(v, torch.Tensor) and v.dim() >= 2 and all(same_size(d, ctx.seq_len) for d in v.shape[-2:])


# --------------------------------------------------------------------------- the steps


def _baddbmm(ctx, chain, cur):
    b = bind(cur, ["input", "batch1", "batch2"], {"beta": 1.0, "alpha": 1.0})
    alpha = b["alpha"] if is_scalar(b["alpha"]) else _constant(ctx, b["alpha"])
    # A one-element tensor alpha read from the model's tensors (transformers 4.2x GPT-NeoX:
    # ``alpha=tensor(1.0) / self.norm_factor``) scales the product alone, as a factor on it.
    side = _factor_side(ctx, b["alpha"], cur) if alpha is None else None
    if not is_scalar(b["beta"]) or (alpha is None and (side is None or value(b["alpha"]).numel() != 1)):
        raise StopWalk("")
    if b["beta"] != 0:
        if b["beta"] != 1 or not isinstance(b["input"], fx.Node):
            raise StopWalk("")
        _mask(ctx, chain, "additive", b["input"])
    if alpha is None:
        chain.factors.append((side, b["alpha"], 1))
    else:
        chain.scale *= alpha
    chain.qk = cur
    return None


def _mul(ctx, chain, cur):
    a, b = cur.args[:2]
    for x, other in ((b, a), (a, b)):
        c = _constant(ctx, x)
        if c is not None and isinstance(other, fx.Node):
            chain.scale *= c
            return other
    for x, other in ((b, a), (a, b)):
        side = _factor_side(ctx, x, other)
        if side is not None:
            chain.factors.append((side, x, 1))
            return other
    for x, other in ((b, a), (a, b)):
        if _structural(ctx, x) and isinstance(other, fx.Node) and not _structural(ctx, other):
            _mask(ctx, chain, "multiply", x)
            return other
    raise StopWalk("")


def _factor_side(ctx: PassContext, x, scores) -> str | None:
    """"query" or "key" if ``x`` is a tensor factor on ``scores`` (see `ScoreChain.factors`)."""
    if not (isinstance(x, fx.Node) and isinstance(scores, fx.Node) and _pair_shaped(ctx, scores)):
        return None
    v = value(x)
    if not isinstance(v, torch.Tensor) or not v.dtype.is_floating_point or v.dim() > value(scores).dim():
        return None
    return side_of(ctx, v, per_head=True)


def _div(ctx, chain, cur):
    a, b = cur.args[:2]
    c = _constant(ctx, b)
    side = _factor_side(ctx, b, a) if c is None else None
    if side is not None:
        chain.factors.append((side, b, -1))
        return a
    if c is None or not isinstance(a, fx.Node):
        raise StopWalk("")
    chain.scale /= c
    return a


def _masked_fill(ctx, chain, cur):
    t, m, fill = (list(cur.args) + [cur.kwargs.get("value")])[:3]
    c = _constant(ctx, fill)
    if c is None or c > BLOCKED or not isinstance(m, fx.Node):
        raise StopWalk("")
    for part in _key_masks(ctx, chain, m, OR, c, blocked=True):
        _mask(ctx, chain, "masked_fill", part)
    return t


def _add(ctx, chain, cur):
    a, b = cur.args[:2]
    # The scores branch is the one that comes from q @ k^T.
    for bias, scores in ((b, a), (a, b)):
        if _structural(ctx, bias) and isinstance(scores, fx.Node):
            _mask(ctx, chain, "additive", bias)
            return scores
    # A bias that is a sum of a structural mask and a learned pair bias (Hugging Face T5's
    # ``position_bias = compute_bias(..) + mask``, reused by the later layers): each part is a
    # term of its own.
    for bias, scores in ((b, a), (a, b)):
        parts = _sum_parts(bias)
        if len(parts) > 1 and isinstance(scores, fx.Node) and reads_tokens(ctx, scores) and not reads_tokens(
                ctx, bias) and all(_structural(ctx, p) or _pair_shaped(ctx, p) for p in parts):
            for part in parts:
                _mask(ctx, chain, "additive" if _structural(ctx, part) else "relative", part)
            chain.relative_scale = chain.scale
            return scores
    # A bias over (query, key) pairs computed from parameters, not the tokens (a learned
    # relative position bias): judged by the attention pass as a function of the distance.
    for bias, scores in ((b, a), (a, b)):
        if isinstance(bias, fx.Node) and isinstance(scores, fx.Node) and _pair_shaped(ctx, bias) \
                and not reads_tokens(ctx, bias) and reads_tokens(ctx, scores):
            _mask(ctx, chain, "relative", bias)
            chain.relative_scale = chain.scale
            return scores
    for bias, scores in ((b, a), (a, b)):
        if isinstance(scores, fx.Node) and _token_bias(ctx, chain, bias, 1.0, cur):
            return scores
    raise StopWalk("the scores get an additive bias computed from parameters or the inputs (e.g. a learned T5-style "
                "relative position bias), which treecompile cannot express in path positions yet")


def _sum_parts(x) -> list:
    """The terms of ``x`` if it is a sum of tensors (``a + b``, nested), else ``[x]``."""
    if isinstance(x, fx.Node) and is_call(x, (operator.add, torch.add), ("add",)) and len(x.args) == 2 \
            and not x.kwargs and all(isinstance(t, fx.Node) for t in x.args):
        return _sum_parts(x.args[0]) + _sum_parts(x.args[1])
    return [x]


def _sub(ctx, chain, cur):
    a, b = cur.args[:2]
    shift = _row_max(a, b)
    if shift is not None:
        # scores - scores.amax(-1, keepdim=True).detach() (lucidrains' "stable softmax"): a
        # constant per query, which the softmax cancels exactly, as it does its own maximum.
        if chain.softcap is not None or chain.head_mix is not None:
            raise StopWalk("the scores are shifted by their maximum before a soft-cap or a mix of the heads")
        chain.nodes.extend(shift)
        return a
    if isinstance(a, fx.Node) and _structural(ctx, b):
        _mask(ctx, chain, "subtract", b)
        return a
    if isinstance(a, fx.Node) and _token_bias(ctx, chain, b, -1.0, cur):
        return a
    raise StopWalk("")


def _row_max(a: Any, b: Any) -> list[fx.Node] | None:
    """The nodes of ``b`` if it is the maximum of ``a`` over its last dim, kept (``a.amax(-1,
    keepdim=True)``, ``a.max(-1, keepdim=True)[0]``), detached or not; else None."""
    nodes = []
    while isinstance(b, fx.Node) and is_call(b, (torch.detach,), ("detach",)):
        nodes.append(b)
        b = b.args[0]
    if not (isinstance(a, fx.Node) and isinstance(b, fx.Node) and isinstance(value(a), torch.Tensor)):
        return None
    if b.op == "call_function" and b.target is operator.getitem and b.args[1] == 0 and \
            isinstance(b.args[0], fx.Node) and is_call(b.args[0], (torch.max,), ("max",)):
        nodes.append(b)
        b = b.args[0]
    elif not is_call(b, (torch.amax,), ("amax",)):
        return None
    args = bind(b, ["input", "dim", "keepdim"], {"dim": None, "keepdim": False})
    dim = args["dim"][0] if isinstance(args["dim"], (tuple, list)) and len(args["dim"]) == 1 else args["dim"]
    last = value(a).dim() - 1
    if args["input"] is not a or args["keepdim"] is not True or not isinstance(dim, int) or dim % (last + 1) != last:
        return None
    return nodes + [b]


def _where(ctx, chain, cur):
    # torch.where(mask, scores, very_negative) (GPT-Neo): the mask says what is allowed.
    cond, x, fill = cur.args
    c = _constant(ctx, fill)
    if not (isinstance(cond, fx.Node) and isinstance(x, fx.Node)) or c is None or c > BLOCKED:
        raise StopWalk("")
    for part in _key_masks(ctx, chain, cond, AND, c, blocked=False):
        _mask(ctx, chain, "where", part)
    return x


def _key_masks(ctx: PassContext, chain: ScoreChain, m: fx.Node, combine: tuple, fill: float,
               blocked: bool) -> list[fx.Node]:
    """The parts of a score mask ``m`` (True where ``blocked``, else where allowed) that are not a
    mask per key read from the tokens (`split_key_masks`); those are recorded as key terms of
    ``fill`` where they block (a very negative bias on a key is the same block)."""
    rest, keys = split_key_masks(ctx, m, combine)
    if not keys:
        return [m]
    _before_factor(chain, "a mask per key")
    if chain.after_cap:
        raise StopWalk("a mask per key read from the tokens before the soft-cap's tanh")
    if chain.scale <= 0:
        raise StopWalk("a mask per key read from the tokens on scores scaled by a factor that is not positive")
    chain.token_terms.extend(("key_blocked" if blocked else "key_allowed", p, fill * chain.scale) for p in keys)
    if any(not isinstance(p, fx.Node) for p in rest):
        raise StopWalk("")
    return rest


def _token_bias(ctx: PassContext, chain: ScoreChain, bias, sign: float, at: fx.Node) -> bool:
    """Records ``bias`` as `ScoreChain.token_terms` if it is a sum of terms read from the tokens,
    each ``[.., S, 1]`` or ``[.., 1, S]`` (`token_terms`), or such terms filled where structural
    masks block (`masked_token_terms`, the masks recorded too); False (nothing recorded) otherwise."""
    terms = token_terms(ctx, bias, sign)
    if not terms:
        filled = masked_token_terms(ctx, bias, sign, at)
        if filled is None:
            return False
        blocked, terms = filled
        for m in blocked:
            _mask(ctx, chain, "masked_fill", m)
    _before_factor(chain, "a bias read from the tokens")
    if chain.after_cap:
        raise StopWalk("the scores get a bias read from the tokens inside the soft-cap's tanh")
    chain.token_terms.extend((side, node, factor * chain.scale) for side, node, factor in terms)
    return True


def _clamp_min(ctx, chain, cur):
    c = _constant(ctx, cur.args[1])
    if c is None or c > BLOCKED:
        raise StopWalk("")
    return cur.args[0]  # clamping the scores to the dtype's minimum (XGLM): masked stays masked


def _tanh(ctx, chain, cur):
    # c * tanh(x / c): the factors after the tanh are the cap, those before it the scale / cap.
    _before_factor(chain, "a soft-cap")
    if chain.softcap is not None:
        raise StopWalk("")
    chain.softcap, chain.scale, chain.after_cap = chain.scale, 1.0, True
    return cur.args[0]


def _through(ctx, chain, cur):
    return cur.args[0]


def _nan_to_num(ctx, chain, cur):
    # The Differential Transformer's reference cleans its scores: the kernel's scores are the
    # same where they are finite; where not, its result is NaN (loud), not a value.
    if len(cur.args) > 1 or cur.kwargs:
        raise StopWalk("")
    return cur.args[0]


def _calls(functions=(), methods=()) -> Callable[[fx.Node], bool]:
    return lambda n: is_call(n, functions, methods)


def _binary(*ops) -> Callable[[fx.Node], bool]:
    names = tuple(op.__name__.strip("_") for op in ops if hasattr(op, "__name__"))
    return lambda n: (n.op == "call_function" and n.target in ops) or (n.op == "call_method" and n.target in names)


#: ``(matches(node), take(ctx, chain, node) -> the node before it, or None at the scores)``.
STEPS: list[tuple[Callable[[fx.Node], bool], Callable]] = [
    (_calls((torch.baddbmm,), ("baddbmm",)), _baddbmm),
    (_binary(operator.mul, torch.mul, operator.imul), _mul),
    (_binary(operator.truediv, torch.div, operator.itruediv), _div),
    (_calls((torch.masked_fill,), ("masked_fill", "masked_fill_")), _masked_fill),
    (_binary(operator.add, torch.add, operator.iadd), _add),
    (_binary(operator.sub, torch.sub), _sub),
    (lambda n: is_call(n, (torch.where,), ("where",)) and len(n.args) == 3, _where),
    (lambda n: is_call(n, (torch.max, torch.maximum), ("max", "maximum")) and len(n.args) == 2, _clamp_min),
    (_calls((torch.tanh,), ("tanh",)), _tanh),
    (_calls((torch.reshape,), _CASTS + _VIEWS), _through),
    (_calls((torch.nan_to_num,), ("nan_to_num",)), _nan_to_num),
]

#: In-place edits of the scores, read back before the softmax: ``(method, step)``.
_IN_PLACE = {"masked_fill_": _masked_fill, "add_": _add, "mul_": _mul, "div_": _div}


def walk_scores(ctx: PassContext, softmax: fx.Node, scores: fx.Node) -> ScoreChain:
    """Walks from the softmax's input ``scores`` to the scores product.

    Raises:
        StopWalk: not a softmax attention the rewrite can take (``str`` says why, or is empty).
    """
    chain = ScoreChain(nodes=[softmax])
    order = {n: i for i, n in enumerate(softmax.graph.nodes)}
    cur, reader = scores, softmax
    mixed = None  # what the walk had recorded when it met a mix of the heads
    while True:
        chain.nodes.append(cur)
        _in_place_edits(ctx, chain, cur, reader, order)
        if mixed is not None and _recorded(chain) != mixed:
            raise StopWalk("a mask, bias, factor or soft-cap applied to the scores before their heads are mixed")
        mix = head_mix(ctx, cur)
        if mix is not None:
            if chain.head_mix is not None:
                raise StopWalk("")
            cur, chain.head_mix = mix
            mixed = _recorded(chain)
            continue
        if is_call(cur, MATMUL, ("matmul", "bmm")) or is_call(cur, (torch.einsum,)):
            chain.qk = cur
            return chain
        step = next((take for matches, take in STEPS if matches(cur)), None)
        if step is None:
            raise StopWalk("")
        before = step(ctx, chain, cur)
        if mixed is not None and _recorded(chain) != mixed:
            raise StopWalk("a mask, bias, factor or soft-cap applied to the scores before their heads are mixed")
        if before is None:
            return chain
        if not isinstance(before, fx.Node):
            raise StopWalk("")
        cur, reader = before, cur


def _recorded(chain: ScoreChain) -> tuple:
    """What a step may add that a mix of the heads would mix too."""
    return len(chain.masks), len(chain.token_terms), len(chain.factors), chain.softcap


def _in_place_edits(ctx: PassContext, chain: ScoreChain, cur: fx.Node, reader: fx.Node, order: dict) -> None:
    """Takes the in-place edits of ``cur`` made before ``reader`` reads it (latest first)."""
    edits = [u for u in cur.users if u is not reader and order[u] < order[reader] and cur in mutated_args(u)]
    for u in sorted(edits, key=order.get, reverse=True):
        step = _IN_PLACE.get(u.target) if u.op == "call_method" else None
        if step is None:
            raise StopWalk(f"the scores are edited in place by {u.format_node()}, which the rewrite cannot express")
        chain.nodes.append(u)
        step(ctx, chain, u)


def arithmetic_mask(ctx: PassContext, chain: ScoreChain, rows: int | None = None) -> torch.Tensor | str | None:
    """The allowed pattern of masks written as arithmetic, ``scores * b - c`` or ``scores * b +
    a`` (a ``multiply`` term with ``subtract`` or ``additive`` ones), evaluated as a whole: True
    where the score passes (``b`` is 1, the sum of the other terms 0), False where it is blocked
    (that sum at most `BLOCKED`, ``b`` 0 or 1); a reason if another entry exists; None if the
    chain has no ``multiply`` or ``subtract`` term (its other masks are judged one by one).
    ``rows``: evaluated at that length instead of the example's."""
    kinds = {k for k, _ in chain.masks}
    if not kinds & {"multiply", "subtract"}:
        return None
    b, c = 1.0, 0.0
    try:
        for kind, m in chain.masks:
            if kind == "multiply":
                b = b * evaluate(ctx, m, rows=rows).double()
            elif kind == "subtract":
                c = c - evaluate(ctx, m, rows=rows).double()
            elif kind == "additive":
                c = c + evaluate(ctx, m, rows=rows).double()
            else:
                return f"a {kind} mask mixed with an arithmetic one"
    except Exception as e:  # an operand that cannot be evaluated alone
        return f"a score mask that cannot be evaluated ({type(e).__name__})"
    b, c = torch.broadcast_tensors(torch.as_tensor(b), torch.as_tensor(c))
    allowed = (b == 1) & (c == 0)
    blocked = ((b == 0) | (b == 1)) & (c <= BLOCKED)
    if not torch.all(allowed | blocked):
        return "an arithmetic score mask (scores * b - c) that does not only pass or block scores"
    return allowed


def spell_softmax(gm: fx.GraphModule, node: fx.Node) -> None:
    """A softmax written out, ``e = exp(x - x.amax(d, keepdim=True)); e / e.sum(d, keepdim=True)``
    (GPT-2's first release), becomes ``softmax(x, d)``: the same values (torch subtracts the
    same maximum), so the matchers below see one spelling. Only when its parts have no other use."""
    if not (node.op == "call_function" and node.target in (operator.truediv, torch.div)) or len(node.args) != 2:
        return
    e, total = node.args
    if not (isinstance(e, fx.Node) and isinstance(total, fx.Node) and is_call(e, (torch.exp,), ("exp",))):
        return
    s = bind(total, ["input", "dim", "keepdim"], {"dim": None, "keepdim": False})
    if not (is_call(total, (torch.sum,), ("sum",)) and s["input"] is e and s["keepdim"] and isinstance(s["dim"], int)):
        return
    dim = s["dim"]
    shifted = e.args[0]
    x = shifted
    if isinstance(shifted, fx.Node) and is_call(shifted, (operator.sub, torch.sub), ("sub",)):
        x, top = shifted.args[:2]
        t = bind(top, ["input", "dim", "keepdim"], {"dim": None, "keepdim": False}) if isinstance(top, fx.Node) else {}
        if not (isinstance(top, fx.Node) and is_call(top, (torch.amax,), ("amax",)) and t.get("input") is x
                and t.get("keepdim") and t.get("dim") in (dim, [dim], (dim,))):
            return
    if not isinstance(x, fx.Node) or len(e.users) != 2 or len(total.users) != 1:
        return
    xv = value(x)
    if not isinstance(xv, torch.Tensor) or dim % max(xv.dim(), 1) != xv.dim() - 1:
        return
    with gm.graph.inserting_before(node):
        new = gm.graph.call_function(torch.softmax, (x, -1))
    new.meta.update(node.meta)
    node.replace_all_uses_with(new)
    for dead in (node, total, e, shifted, shifted.args[1] if shifted is not x else None):
        if isinstance(dead, fx.Node) and not dead.users:
            gm.graph.erase_node(dead)
