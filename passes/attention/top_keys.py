"""The keys a query's top-k scores choose, on the tree: a sparse-attention indexer's selection (the op
the dense pair rule, `treecompile.passes.attention.dense_pairs`, puts at a ``topk`` exit).

DeepSeek-V3.2's indexer (and the models built on it) scores every key for each query, hides the
keys a query may not see with ``-inf``, and keeps the ``k`` best: ``scores.topk(k, -1).indices``.
On the packed row of a tree the hidden keys are those off the query's path (per path: its
future), so the keys kept among the visible ones are the path's own, exactly when the choice is
not left to the order ``torch.topk`` breaks ties in, which changes with the row's length (the
same path alone chooses differently among tied scores at another length). With ``h`` the hidden
entries' value (``-inf``, or the dtype's most negative number) the choice among visible keys is
the same on the path and on the tree when either

* more than ``k`` visible keys score above ``h`` and the ``k``-th and ``(k + 1)``-th best differ, or
* at most ``k`` do, and no visible key scores ``h`` or below (all visible keys above ``h`` are kept,
  none other).

`tree_top_keys` returns ``topk``'s indices and raises `treecompile.core.errors.BatchRefused`
for a batch where some query's choice is a tie: which tied key the unmodified model keeps is
``torch.topk``'s arbitrary order, which no tree can reproduce. Scores of a trained indexer tie
with probability zero; a tiny model with two index heads and a ReLU ties often. The check reads
the whole ``[.., S, S]`` scores once (as the model's own code does) and syncs with the device
once per call.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import fx

from treecompile.core.errors import BatchRefused
from treecompile.passes._graph import (SDPA_ARGS, SDPA_DEFAULTS, PassContext, bind, describe, is_call, is_op,
                                      location_of, same_size, value, writers_of)
from treecompile.passes.attention.pair_state import (FILL_ARGS, FILLS, INDEX_CASTS, UNKNOWN, Hidden, blocking,
                                                    fill_value, guarded, query_dim)
from treecompile.passes.rows.domain import op_key, split_inplace

__all__ = ["tree_top_keys", "ambiguous_queries", "scatter_keys", "marked_fill", "chosen_keys", "selected_keys",
           "top_keys_exit", "sdpa_exit", "rewrite_top_keys"]

Tensor = torch.Tensor


def ambiguous_queries(scores: Tensor, k: int, hidden: float, visible: Tensor) -> tuple[Tensor, Tensor]:
    """``(the top-k keys' indices, per query whether they depend on how ties are broken)``: per
    query (``scores``' dims but the last), among the visible keys (``visible``: ``[S, S]`` bool,
    True on its path). One ``topk`` of ``k + 1`` keys gives both."""
    n = scores.shape[-1]
    if k >= n:
        return scores.topk(k, dim=-1).indices, torch.zeros(scores.shape[:-1], dtype=torch.bool, device=scores.device)
    best = scores.topk(k + 1, dim=-1)  # sorted: its first k are the top k
    kth, after = best.values[..., k - 1], best.values[..., k]
    tied = (kth == after) & (after > hidden)
    low_visible = (visible & (scores <= hidden)).any(-1)
    return best.indices[..., :k], tied | ((kth <= hidden) & low_visible)


@torch.library.custom_op("treecompile::tree_top_keys", mutates_args=())
def tree_top_keys(scores: Tensor, k: int, hidden: float, visible: Tensor, where: str) -> Tensor:
    """``scores.topk(k, dim=-1).indices`` (int64), refusing a tie (module docstring); ``where``
    names the model's line in the refusal."""
    chosen, ambiguous = ambiguous_queries(scores, k, hidden, visible)
    found = int(ambiguous.sum())
    if found:
        queries = "1 query" if found == 1 else f"{found} queries"
        raise BatchRefused(
            f"treecompile cannot make this batch exact on a tree: the top-{k} keys of {queries} at "
            f"{where} are a choice among tied scores, which torch.topk breaks in an order that changes with the "
            "row's length (a path run alone may keep another of the tied keys)"
        )
    return chosen.contiguous()


@tree_top_keys.register_fake
def _(scores, k, hidden, visible, where):
    return scores.new_empty((*scores.shape[:-1], k), dtype=torch.long)


# ----------------------------------------------------------------------------- the rule's part


def scatter_keys(ctx: PassContext, n: fx.Node, state: dict, members: set, nd: int) -> str | None:
    """``mask.scatter(-1, keys, value)`` with ``keys`` the keys a top-k over the keys chose
    (`chosen_keys`): the chosen keys of each query marked. At visible entries the marks are the
    path's (the top-k exit proves the choice); off the path some keys may be marked, so the result
    there is unknown unless the mark is the value already there."""
    a = bind(n, ["input", "dim", "index", "value"], {})
    src, dim, index, mark = a.get("input"), a.get("dim"), a.get("index"), a.get("value", a.get("src"))
    if src not in members or dim not in (-1, nd - 1) or not isinstance(mark, (bool, int, float)) or \
            index in members or chosen_keys(index) is None or "reduce" in n.kwargs or len(n.args) > 4:
        return "writes into an [S, S] tensor other than marking the keys a top-k over the keys chose"
    iv, sv = value(index), value(src)
    if tuple(iv.shape[:-1]) != tuple(sv.shape[:-1]):
        return "marks keys chosen for other queries than its rows"
    before = state[src]
    same = before.const is not None and bool(before.const == torch.tensor(mark, dtype=before.const.dtype))
    state[n] = before if same else UNKNOWN
    return None


def marked_fill(leaf: fx.Node) -> tuple | None:
    """``(hidden value, writers)`` of a constant fill whose every in-place write marks chosen keys
    (``torch.full(.., -inf).scatter_(-1, idx, 0)``, DeepSeek's reference): at visible entries the
    fill, or the mark at the path's chosen keys; off the path the fill, or the mark where a key off
    the path was chosen (unknown unless the two are one value). Else None."""
    fill, writers = fill_value(leaf, written=True), writers_of(leaf)
    if fill is None or not writers:
        return None
    for w in writers:
        a = bind(w, ["input", "dim", "index", "value"], {})
        name, inplace = split_inplace(op_key(w))
        if not (name == "scatter" and inplace and a.get("input") is leaf and a.get("dim") in (-1, value(leaf).dim() - 1)
                and isinstance(a.get("value"), (bool, int, float)) and chosen_keys(a.get("index")) is not None
                and "reduce" not in w.kwargs and len(w.args) <= 4):
            return None
    marks = {bool(torch.tensor(bind(w, ["input", "dim", "index", "value"], {})["value"], dtype=fill.dtype) == fill)
             for w in writers}
    return (Hidden(fill) if marks == {True} else UNKNOWN), writers


def chosen_keys(index: fx.Node) -> fx.Node | None:
    """The ``topk`` (or `tree_top_keys`, once rewritten) whose chosen key indices ``index`` is,
    through casts; else None."""
    while isinstance(index, fx.Node) and index.op == "call_method" and index.target in INDEX_CASTS:
        index = index.args[0]
    if not isinstance(index, fx.Node):
        return None
    if is_op(index, torch.ops.treecompile.tree_top_keys):
        return index
    if index.op == "call_function" and index.target is operator.getitem and index.args[1] == 1 \
            and is_call(index.args[0], (torch.topk,), ("topk",)):
        return index.args[0]
    return None


def selected_keys(topk: fx.Node) -> list[fx.Node]:
    """The nodes holding the key indices ``topk`` (or `tree_top_keys`) chose: its indices output
    and their casts."""
    out, stack = [], ([topk] if is_op(topk, torch.ops.treecompile.tree_top_keys) else
                      [u for u in topk.users if u.target is operator.getitem and u.args[1] == 1])
    while stack:
        n = stack.pop()
        out.append(n)
        stack.extend(u for u in n.users if u.op == "call_method" and u.target in INDEX_CASTS)
    return out


def top_keys_exit(ctx: PassContext, e: fx.Node, state: dict, members: set) -> str | None:
    """``scores.topk(k, -1)`` whose indices only mark keys (`scatter_keys`), with ``k`` a number or
    ``min(number, S)``: at visible entries the scores are the path's, and where the hidden ones
    hold ``-inf`` (or the dtype's most negative number) no visible key loses to one, so the visible
    keys chosen are the path's, unless scores tie (checked at run time: `tree_top_keys`). ``min(c,
    S)`` keeps as many visible keys as the path's ``min(c, T)`` does: every one when ``T <= c``."""
    a = bind(e, ["input", "k", "dim", "largest", "sorted"], {"dim": -1, "largest": True, "sorted": True})
    x, k = a["input"], a["k"]
    if x not in members or a["dim"] not in (-1, value(x).dim() - 1) or a["largest"] is not True or \
            query_dim(x, ctx) != -2:
        return "chooses over other than the largest scores over the keys of [.., S, S] scores"
    if not (isinstance(k, int) or _capped_by_length(ctx, k)):
        return "chooses a number of keys that reads the sequence length"
    hidden = state[x].const
    lowest = torch.finfo(value(x).dtype).min if value(x).is_floating_point() else None
    if hidden is None or not (bool(hidden == float("-inf")) or bool(hidden == lowest)):
        return "chooses among keys it does not rank last off the path (it needs -inf there)"
    for u in e.users:
        if not (u.target is operator.getitem and u.args[1] in (0, 1)) or u.args[1] == 0 and u.users:
            return "reads the scores a top-k over the keys chose (only the chosen keys may be read)"
    for n in selected_keys(e):
        for u in n.users:
            if u.op == "call_method" and u.target in INDEX_CASTS:
                continue
            if u.op == "call_method" and u.target in {*FILLS, *FILL_ARGS} and u.args[0] is n:
                continue  # its dtype and device only
            if split_inplace(op_key(u))[0] == "scatter" and bind(u, ["input", "dim", "index"], {}).get("index") is n:
                continue
            return f"reads the keys a top-k over the keys chose other than to mark them ({describe(u)})"
    return None


def _capped_by_length(ctx: PassContext, k: Any) -> bool:
    """``min(c, S)`` for a number ``c``."""
    if not (isinstance(k, fx.Node) and k.op == "call_function" and k.target in (torch.sym_min, min)):
        return False
    ints = [a for a in k.args if isinstance(a, int)]
    sizes = [a for a in k.args if isinstance(a, fx.Node) and same_size(value(a), ctx.seq_len)]
    return len(k.args) == 2 and len(ints) == 1 and len(sizes) == 1


def sdpa_exit(ctx: PassContext, e: fx.Node, state: dict, members: set) -> str | None:
    """``scaled_dot_product_attention`` with the region as ``attn_mask``: the softmax of the row's
    visible scores, when the mask blocks every hidden entry (False, or a very negative number:
    the softmax gives them exactly 0 there, as per path on the future)."""
    a = bind(e, SDPA_ARGS, SDPA_DEFAULTS)
    mask = a["attn_mask"]
    if mask not in members or any(a[r] in members for r in ("query", "key", "value")):
        return "is scaled_dot_product_attention with [S, S] tensors other than its mask"
    if a["is_causal"] or a["dropout_p"] or query_dim(mask, ctx) != -2:
        return "is scaled_dot_product_attention with is_causal, dropout or a mask laid out other than [.., S, S]"
    if not all(same_size(value(a[r]).shape[-2], ctx.seq_len) for r in ("query", "key", "value")):
        return "is scaled_dot_product_attention over other than the sequence's rows"
    hidden = state[mask].const
    if hidden is not None and hidden.dtype == torch.bool:
        how = "exact" if not bool(hidden) else None
    else:
        how = blocking(state[mask], float("-inf"))
    if how is None:
        return "attends over keys it does not block off the path (its mask needs False or -inf there)"
    if how == "guarded":  # a finite blocked value: exact where the row sees a key (checked per batch)
        guarded(state, e, mask, ctx)
    return None


def rewrite_top_keys(gm: fx.GraphModule, ctx: PassContext, topk: fx.Node, hidden: torch.Tensor, anc: fx.Node) -> None:
    """``topk(..).indices`` becomes `tree_top_keys`, which refuses a batch whose choice is a tie."""
    a = bind(topk, ["input", "k", "dim", "largest", "sorted"], {})
    g = gm.graph
    with g.inserting_before(topk):
        chosen = ctx.mark(g.call_function(torch.ops.treecompile.tree_top_keys.default,
                                          (a["input"], a["k"], float(hidden), anc, location_of(topk))),
                          like=topk, rows=False)
    for u in list(topk.users):
        if u.args[1] == 1:
            chosen.meta["example_value"] = u.meta["example_value"]
            u.replace_all_uses_with(chosen)
    for n in selected_keys(chosen):
        ctx.mark(n, rows=False)  # key indices: columns of the packed row, not rows
