"""What the dense pair rule (`treecompile.passes.attention.dense_pairs`) knows of a region tensor:
its value off the query's path (`Hidden`), its query dim, and the constant fills it needs not read
at path positions; and the check (`treecompile::sees_a_key`) that a softmax over keys blocked off the
path by a very negative number rather than ``-inf`` gives them exactly 0, on the tree as per path.

A mask filled with ``torch.finfo(dtype).min`` (Hugging Face's convention) or ``-1e4`` leaves its
blocked entries finite: the softmax gives them ``exp(h - max)``, exactly 0 once the row's largest
visible entry is more than 1000 above ``h`` (per path the future's entries hold the same ``h``). A
query whose every visible key is blocked would weigh them all alike, per path over its ``T`` keys
and on the tree over ``S``: `sees_a_key` refuses such a batch (`BatchRefused`); a model that masks
a query's every key is degenerate, and causal attention never does (the diagonal is visible).
"""

from __future__ import annotations

from dataclasses import dataclass

import operator

import torch
from torch import fx

from treecompile.core.errors import BatchRefused
from treecompile.passes._graph import (SDPA, SDPA_ARGS, SDPA_DEFAULTS, PassContext, bind, is_call, location_of,
                                      same_size, storage_of, value, writers_of)
from treecompile.passes._mask_eval import BLOCKED
from treecompile.passes.rows.domain import op_key

__all__ = ["Hidden", "UNKNOWN", "query_dim", "is_pair", "FILLS", "FILL_ARGS", "fill_value", "written", "INDEX_CASTS",
           "blocking", "GUARDS", "sees_a_key", "guarded", "guard", "with_sink"]

#: Where a region's state lists the ``(node, argument)`` pairs whose argument's blocked entries are
#: finite: each gets a `sees_a_key` check before it.
GUARDS = "guards"


@dataclass(frozen=True)
class Hidden:
    """What a region tensor holds at hidden entries: one constant (a 0-dim tensor), or unknown."""

    const: torch.Tensor | None = None

    def is_(self, x: float) -> bool:
        return self.const is not None and bool(self.const.double() == x)


UNKNOWN = Hidden()


def query_dim(x, ctx: PassContext) -> int | None:
    """The query dim of an ``[S, S]`` tensor (-2: ``[.., S, S]``; -3: ``[.., S, h, S]``, scores per
    head of a sparse-attention indexer before it sums them), the key dim being -1; else None."""
    v = value(x) if isinstance(x, fx.Node) else None
    if not (isinstance(v, torch.Tensor) and v.dim() >= 2 and (same_size(v.shape[-1], ctx.seq_len)
                                                             or with_sink(x, ctx))):
        return None
    dims = [d - v.dim() for d in range(v.dim() - 1) if same_size(v.shape[d], ctx.seq_len)]
    return dims[0] if len(dims) == 1 and dims[0] in (-2, -3) else None


def with_sink(x, ctx: PassContext) -> bool:
    """Whether ``x``'s keys are the sequence's plus one last column (a sink logit per query,
    ``cat([scores, sinks], -1)`` as gpt-oss's eager attention writes it)."""
    v = value(x) if isinstance(x, fx.Node) else None
    if not (isinstance(v, torch.Tensor) and isinstance(v.shape[-1], torch.SymInt)
            and isinstance(ctx.seq_len, torch.SymInt)):
        return False
    return bool((v.shape[-1].node.expr - ctx.seq_len.node.expr) == 1)


def is_pair(x, ctx: PassContext) -> bool:
    return query_dim(x, ctx) is not None


#: Ops filling a new tensor with one value (``torch.zeros(size)``; ``x.new_ones(size)`` reads only
#: the shape and dtype of ``x``), and the value; `FILL_ARGS`: those taking it as an argument, and its position.
FILLS = {"new_ones": 1, "new_zeros": 0, "ones_like": 1, "zeros_like": 0, "ones": 1, "zeros": 0}
FILL_ARGS = {"new_full": 2, "full_like": 1, "full": 1}


def fill_value(n: fx.Node, written: bool = False) -> torch.Tensor | None:
    """The one value a constant fill holds (a 0-dim tensor of its dtype), else None; None also for
    one some op writes in place (``m = zeros(S, S); m[...] = 1``: not one value any more), unless
    ``written`` (the value it was filled with)."""
    if not written and writers_of(n) != []:
        return None
    name = op_key(n) if n.op in ("call_function", "call_method") else None
    if name in FILL_ARGS:
        at = FILL_ARGS[name]
        c = n.args[at] if len(n.args) > at else n.kwargs.get("fill_value")
    else:
        c = FILLS.get(name)
    v = value(n)
    if not isinstance(c, (bool, int, float)) or not isinstance(v, torch.Tensor):
        return None
    return torch.tensor(c, dtype=v.dtype)


def written(n: fx.Node, state: dict, members: set) -> None:
    """After ``n`` wrote its first argument in place, every tensor of the region sharing that
    memory (the earlier names of these scores, views keeping the last two dims) holds ``n``'s
    values from here on."""
    target = storage_of(n.args[0])
    for m in members:
        if m is not n and target is not None and storage_of(m) == target and m in state:
            state[m] = state[n]


#: Casts of key indices (``topk(..).indices.to(torch.int32)``, ``.long()``).
INDEX_CASTS = {"to", "long", "int", "type"}


def blocking(h: Hidden, identity: float) -> str | None:
    """How ``h`` blocks entries for an op over the keys whose identity is ``identity`` (``-inf``:
    a softmax or a maximum): ``"exact"`` (it is the identity), ``"guarded"`` (a finite value at most
    -1e4, exact under `sees_a_key`), else None."""
    if h.is_(identity):
        return "exact"
    if identity == float("-inf") and h.const is not None and h.const.is_floating_point() and \
            bool(h.const <= BLOCKED):
        return "guarded"
    return None


@torch.library.custom_op("treecompile::sees_a_key", mutates_args=())
def sees_a_key(x: torch.Tensor, visible: torch.Tensor, hidden: float, where: str) -> torch.Tensor:
    """0 (a 0-dim tensor of ``x``'s dtype, added to ``x``), after checking that every query row of
    ``x`` has a visible entry (``visible``: ``[S, S]``, True on its path) more than 1000 above the
    blocked entries' ``hidden``; else raises `BatchRefused` naming ``where``."""
    best = x.masked_fill(~visible, float("-inf")).amax(-1)
    blind = int((best <= hidden + 1000.0).sum())
    if blind:
        queries = "1 query at {} sees" if blind == 1 else f"{blind} queries at {{}} see"
        raise BatchRefused(
            f"treecompile cannot make this batch exact on a tree: {queries.format(where)} no key above the mask's "
            f"blocked value {hidden:g}: its softmax weighs the blocked keys alike, per path the future's too"
        )
    return x.new_zeros(())


@sees_a_key.register_fake
def _(x, visible, hidden, where):
    return x.new_empty(())


def _no_gradient(ctx, grad):
    return None, None, None, None


sees_a_key.register_autograd(_no_gradient, setup_context=lambda ctx, inputs, output: None)


def guarded(state: dict, node: fx.Node, operand: fx.Node, ctx: PassContext) -> None:
    """Lists ``node`` for `guard`: its ``operand``'s blocked value and layout, as the proof saw them."""
    entry = (node, float(state[operand].const), query_dim(operand, ctx), with_sink(operand, ctx))
    state.setdefault(GUARDS, []).append(entry)


def guard(gm: fx.GraphModule, ctx: PassContext, node: fx.Node, hidden: float, qdim: int, sink: bool,
          anc: fx.Node) -> None:
    """``node``'s operand over the keys (its scores, or SDPA's mask) plus `sees_a_key`'s 0."""
    sdpa = is_call(node, SDPA)
    x = bind(node, SDPA_ARGS, SDPA_DEFAULTS)["attn_mask"] if sdpa else node.args[0]
    g = gm.graph
    with g.inserting_before(node):
        visible = anc if qdim == -2 else \
            ctx.mark(g.call_method("unsqueeze", (anc, 1)), like=node, rows=False)  # [S, 1, S] for [.., S, h, S]
        if sink:  # the sink's column is every query's own
            visible = ctx.mark(g.call_function(torch.nn.functional.pad, (visible, (0, 1)), {"value": True}),
                               like=node, rows=False)
        zero = ctx.mark(g.call_function(torch.ops.treecompile.sees_a_key.default,
                                        (x, visible, hidden, location_of(node))), like=node, rows=False)
        checked = ctx.mark(g.call_function(operator.add, (x, zero)), like=x, rows=False)
    checked.meta["example_value"] = value(x)
    node.replace_input_with(x, checked)
