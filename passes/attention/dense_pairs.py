"""Attention computed on ``[S, S]`` tensors beyond what a kernel takes, kept dense on the tree.

Some models work on the ``[T, T]`` scores with more than a mask and a softmax: CoPE counts
positions by a reverse cumulative sum of gates over the keys (``gates.flip(-1).cumsum(-1).flip(-1)``)
and gathers position logits at those counts. No kernel spelling matches such a chain; this rule
keeps the model's own ops on the packed row's ``[S, S]`` tensors and proves them exact.

**The region.** The connected ``[.., S, S]`` nodes (query at dim -2, key at dim -1) around a
product of scores with a row value, with their inputs (rows, the structural ``[S, S]`` tensors
they read: masks and tables built from the indices, sizes and parameters, no token) and their
exits (products with a row value, reductions over the keys).

**The rewrite.** Each structural ``[S, S]`` input ``f(i, j)`` (a copy of the model's own
construction at the row count) is read at the tokens' path positions, ``f(pos[q], pos[k])``,
where ``k`` is on ``q``'s path (the tree mask, dense), and elsewhere takes its value on the
future (``j > i``), which must be one constant, at two lengths, and the same corner at both (not
a function of ``T``). Every other node stays as the model wrote it.

**Why it is exact.** Call an entry ``(q, k)`` *visible* when ``k`` is on ``q``'s path (per path:
``j <= i``) and *hidden* otherwise (per path: the future). At a visible entry each structural
input is the path's value, a row input is the token's own (everything before is exact by
induction), and an element-wise op keeps both. At hidden entries the structural inputs are the
future's constants, so an element-wise op gives on the tree the value it gives on the future of
each path; the rule tracks it (`Hidden`): a constant where every input is one or the op's result
does not depend on the others (``-inf + x``, ``0 * x`` for finite ``x``, checked by evaluating
the op), else unknown. An op over the keys (a sum, a maximum, a softmax, a cumulative sum, a
product with values or with another ``[S, S]``) must see the identity of its reduction (0, or
-inf for max-like ones) at hidden entries: per path those are the future keys, which it then
ignores, and on the tree the keys off the path, which it ignores too; what remains, in the
packed order, is the path's keys in the path's order. A cumulative sum over the keys is exact at
visible entries only (unknown at hidden ones), and a reversed one (``flip``, ``cumsum``,
``flip``) sums the keys from ``k`` to ``q`` on the path. An op over the queries, one that moves
entries, or one that reads the length as a value is refused; so is any op the rule does not name.
Memory is ``S^2`` per tensor, as the model's own code costs on the packed row (a TreeWarning
says so). Counter ``dense_pairs``.
"""

from __future__ import annotations

import contextlib
import operator
import warnings

import torch
from torch import fx

from treecompile.core.advice import TreeWarning
from treecompile.kernels.attention.masks import dense_tree_mask
from treecompile.passes._graph import (MATMUL, SDPA, SDPA_ARGS, SDPA_DEFAULTS, PassContext, bind, describe, is_call,
                                      location_of, mutated_args, new_dims_only, same_size, value)
from treecompile.passes._mask_eval import (copy_values, depends_on_inputs, evaluate, judged_length,
                                          moved_parameters, reads_tokens, written_from_tokens)
from treecompile.passes._subgraph_run import equal_with_nans
from treecompile.passes.attention.pair_state import (GUARDS, UNKNOWN, Hidden, blocking, fill_value, guard, guarded,
                                                    is_pair, with_sink, written)
from treecompile.passes.attention.pair_tables import einsum_product, is_table, key_slice, table_einsum
from treecompile.passes.attention.pair_layouts import (einsum_per_head, head_mix, scores_per_head, sink_column,
                                                      weights_per_query)
from treecompile.passes.attention.top_keys import marked_fill, rewrite_top_keys, scatter_keys, sdpa_exit, top_keys_exit
from treecompile.passes.rows.domain import op_key, split_inplace
from treecompile.passes.rows.elementwise import POINTWISE

__all__ = ["is_pair_exit", "rewrite_dense_pairs"]

#: Ops whose result keeps the last two dims as they are, entry by entry.
_ELEMENTWISE = POINTWISE | {"add", "sub", "mul", "neg", "pow", "where", "masked_fill", "long", "int", "bool",
                            "detach", "clone", "contiguous", "iadd", "isub", "imul", "itruediv", "to", "type",
                            "type_as", "float", "double", "half", "bfloat16"}
_VIEWS = {"view", "reshape", "unsqueeze", "expand", "expand_as", "view_as", "squeeze"}  # keeping the last two dims
#: Reductions over the keys, and the identity each must see at hidden entries.
_REDUCE = {"sum": 0.0, "amax": float("-inf"), "max": float("-inf"), "logsumexp": float("-inf")}
#: Ops over the keys that keep ``[S, S]``: the identity, and the hidden value of the result.
_KEYWISE = {"softmax": (float("-inf"), 0.0), "log_softmax": (float("-inf"), float("-inf")),
            "cumsum": (0.0, None)}
_SAMPLES = (-7.25, -0.5, 0.0, 0.75, 3.0, 1e5, -1e5)
_DIVISIONS = {"div", "truediv", "true_divide", "divide", "itruediv"}


def is_pair_exit(node: fx.Node) -> bool:
    """A ``matmul`` / ``bmm`` whose first operand is ``[.., S, S]``-shaped (square in its last two
    dims), ``scaled_dot_product_attention`` with such an ``attn_mask``, or a ``topk`` over the last
    dim of one (a sparse-attention indexer choosing keys)."""
    x = _pair_operand(node)
    v = value(x) if isinstance(x, fx.Node) else None
    return isinstance(v, torch.Tensor) and v.dim() >= 2 and same_size(v.shape[-1], v.shape[-2])


def _pair_operand(node: fx.Node) -> fx.Node | None:
    """The operand of an exit that is the region's ``[S, S]`` tensor."""
    if is_call(node, MATMUL, ("matmul", "bmm")) or is_call(node, (torch.topk,), ("topk",)):
        return node.args[0] if node.args else None
    if is_call(node, (torch.einsum,)):  # ``bhij,bhjd->bhid``: the scores first
        found = einsum_product(node)
        return found[0] if found is not None and not found[2] else None
    if is_call(node, SDPA):
        return bind(node, SDPA_ARGS, SDPA_DEFAULTS)["attn_mask"]
    return None


def rewrite_dense_pairs(gm: fx.GraphModule, ctx: PassContext, exit_node: fx.Node) -> bool | None:
    """Proves the region around ``exit_node`` exact and reads its structural inputs on the tree;
    else leaves a note. False where the node is not a product of ``[S, S]`` scores."""
    start = _pair_operand(exit_node)
    if exit_node in ctx.created or not exit_node.users or not is_pair(start, ctx):
        return False  # made by a pass, or left dead by another spelling's rewrite
    region = _region(gm, ctx, start)
    if not isinstance(region, str) and not region[0]:
        # A matrix that reads no token: a learned one (gMLP's ``W[:T, :T]``, a random
        # Synthesizer's softmax) is one structural leaf times the rows; a fixed one is the
        # mixing rule's, which declines a product it is not.
        if not depends_on_inputs(ctx, start) and is_call(exit_node, MATMUL, ("matmul", "bmm")):
            return False
        region = ([], [start], [exit_node])
    why = (exit_node, region) if isinstance(region, str) else _prove(ctx, region)
    if isinstance(why, tuple):
        # Said after what an earlier spelling said about the region (the verify pass quotes the
        # first noted node it refuses), else on the region's first [S, S] tensor (which it refuses).
        at, reason = why
        said = f"as [S, S] tensors, {describe(at)} at {location_of(at)} {reason}"
        around = [exit_node] if isinstance(region, str) else [*region[0], *region[1], *region[2]]
        order = {n: i for i, n in enumerate(exit_node.graph.nodes)}
        noted = sorted((n for n in around if n in ctx.notes), key=order.get)
        target = noted[0] if noted else exit_node if isinstance(region, str) or not region[0] else region[0][0]
        ctx.notes[target] = f"{ctx.notes[target]}; {said}" if target in ctx.notes else said
        return None
    nodes, leaves, exits = region
    anc = _rewrite(gm, ctx, nodes, leaves, why, exit_node, exits)
    for node, hidden, qdim, sink in why.get(GUARDS, []):
        guard(gm, ctx, node, hidden, qdim, sink, anc)
    for n in nodes:
        ctx.mark(n, rows=False)
    for n in exits:
        if is_call(n, (torch.topk,), ("topk",)):
            rewrite_top_keys(gm, ctx, n, why[n.args[0]].const, anc)
        else:
            ctx.mark(n)
        ctx.notes.pop(n, None)  # what another spelling said of it (SDPA: "not provably causal")
    ctx.count("dense_pairs")
    warnings.warn(f"treecompile: the attention at {location_of(exit_node)} computes on [S, S] tensors of the packed "
                  "row beyond a kernel's reach; they are kept dense on the tree: S^2 memory per tensor",
                  TreeWarning, stacklevel=2)
    return None


# ----------------------------------------------------------------------------- the region


def _region(gm: fx.GraphModule, ctx: PassContext, start: fx.Node) -> tuple[list, list, list] | str:
    """``(token nodes, structural leaves, exits)`` of the ``[S, S]`` component around ``start``."""
    seen, stack = set(), [start]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        n = _uncut_leading_row(gm, ctx, n) or n
        seen.add(n)
        if not _reads_tokens(ctx, n):
            continue  # a structural leaf: its own inputs are its construction
        stack.extend(a for a in n.all_input_nodes if is_pair(a, ctx) or is_table(a, ctx))
        stack.extend(u for u in n.users if is_pair(u, ctx))
    order = {n: i for i, n in enumerate(start.graph.nodes)}
    token = sorted((n for n in seen if _reads_tokens(ctx, n)), key=order.get)
    leaves = sorted((n for n in seen if not _reads_tokens(ctx, n)), key=order.get)
    if any(n in ctx.created for n in seen):
        return "is an [S, S] tensor another rewrite made"
    exits = sorted({u for n in token for u in n.users if u not in seen}, key=order.get)
    # A table of pairs the weights are summed with (``'...ij,ijd->...id'``): a leaf of the exit.
    leaves += sorted({a for e in exits for a in e.all_input_nodes
                      if a not in seen and is_table(a, ctx) and not _reads_tokens(ctx, a)}, key=order.get)
    return token, leaves, exits


def _reads_tokens(ctx: PassContext, n: fx.Node) -> bool:
    """Whether ``n``'s values come from the tokens, also through what was written in place into
    the memory it reads (a fill marked at chosen keys is a leaf: `marked_fill`)."""
    return reads_tokens(ctx, n, writes=False) or written_from_tokens(ctx, n) and marked_fill(n) is None


def _prove(ctx: PassContext, region: tuple[list, list, list]) -> dict | tuple[fx.Node, str]:
    """The hidden value of each structural leaf, or ``(node, why)`` the region is not exact there."""
    token, leaves, exits = region
    state: dict[fx.Node, Hidden] = {}
    for leaf in leaves:
        found = _leaf_hidden(ctx, leaf)
        if isinstance(found, str):
            return leaf, f"is {found}"
        state[leaf] = found
    members = set(token) | set(leaves)
    for n in token:
        why = _step(ctx, n, state, members)
        if why is not None:
            return n, why
    for e in exits:
        why = _exit(ctx, e, state, members)
        if why is not None:
            return e, why
    return state


def _leaf_hidden(ctx: PassContext, leaf: fx.Node) -> Hidden | str:
    """A structural ``[S, S]`` input judged at two lengths: the same corner at both, and its
    value on the future one constant (else unknown). A constant fill is that constant."""
    if mutated_args(leaf):
        return "written in place"
    marked = marked_fill(leaf)
    if marked is not None:
        return marked[0]
    if written_from_tokens(ctx, leaf):
        return "written in place with values read from the tokens"
    fill = fill_value(leaf)
    if fill is not None:
        return Hidden(fill)
    if not isinstance(ctx.seq_len, torch.SymInt):
        return "built at one length only (the sequence length is a constant)"
    long = judged_length(ctx) or int(ctx.seq_len.node.hint)
    short = max(2, long // 2)
    source = leaf
    while source.op == "call_method" and source.target in ("to", "type_as") and len(source.args) == 2 \
            and isinstance(source.args[1], fx.Node):
        source = source.args[0]  # ``table.to(scores)`` takes only the scores' dtype
    dtype = value(leaf).dtype
    try:
        a, b = (evaluate(ctx, source, rows=r).to(dtype) for r in (long, short))
    except Exception as e:  # not buildable at another length
        return f"not buildable at another length ({type(e).__name__})"
    if is_table(leaf, ctx):  # pairs first, features after: judged as one, UNKNOWN off the path
        if a.shape[:2] != (long, long) or b.shape[:2] != (short, short):
            return "not [S, S, ..] at another length"
        ctx.max_rows = long if ctx.max_rows is None else min(ctx.max_rows, long)
        if not equal_with_nans(a[:short, :short], b):
            return "a function of the sequence length (at half the length it is not the corner of the whole)"
        if not bool(torch.isfinite(a).all()):
            return "a table of pairs that is not finite (off the path a key reads another pair's entry)"
        return UNKNOWN
    if a.shape[-2:] != (long, long) or b.shape[-2:] != (short, short):
        return "not [.., S, S] at another length"
    ctx.max_rows = long if ctx.max_rows is None else min(ctx.max_rows, long)
    if not equal_with_nans(a[..., :short, :short], b):
        return "a function of the sequence length (at half the length it is not the corner of the whole)"
    upper = torch.ones(long, long, dtype=torch.bool).triu(1)
    future = a[..., upper]
    if not future.numel() or future.isnan().any() or not bool((future == future.reshape(-1)[0]).all()):
        return UNKNOWN
    c = future.reshape(-1)[0].clone()
    if depends_on_inputs(ctx, source) and not _same_with_other_parameters(ctx, source, long, upper, c):
        return UNKNOWN  # a learned value on the future (zero now, not after a step): not a constant
    return Hidden(c)


def _same_with_other_parameters(ctx: PassContext, node: fx.Node, rows: int, upper: torch.Tensor,
                                c: torch.Tensor) -> bool:
    """Whether ``node``, built with every parameter moved, still holds ``c`` on the future: its
    value there does not come from a parameter."""
    try:
        with moved_parameters(ctx):
            other = evaluate(ctx, node, rows=rows)
    except Exception:
        return False
    future = other.to(c.dtype)[..., upper]
    return not future.isnan().any() and bool((future == c).all())


def _uncut_leading_row(gm: fx.GraphModule, ctx: PassContext, n: fx.Node) -> fx.Node | None:
    """xLSTM's ``F = cat([0, c], -2)`` (``[.., S + 1, 1]``), ``R = F.repeat(.., S + 1)``,
    ``(R - R^T)[..., 1:, 1:]``: entry ``(i, j)`` is ``F[i + 1] - F[j + 1] = c[i] - c[j]``, so the node
    becomes ``c - c^T`` (an identity of tensors, whatever their values), an ``[S, S]`` op of rows."""
    if not (n.op == "call_function" and n.target is operator.getitem):
        return None
    x, idx = n.args
    if not isinstance(x, fx.Node) or not is_pair(n, ctx) or not isinstance(idx, tuple) or len(idx) < 2:
        return None
    full = slice(None, None, None)
    if idx[-2:] != (slice(1, None, None), slice(1, None, None)) or any(i != full for i in idx[:-2]):
        return None
    if not is_call(x, (operator.sub, torch.sub), ("sub",)) or len(x.args) != 2:
        return None
    left, right = x.args
    flipped = is_call(left, (), ("transpose",))
    rep, tr = (right, left) if flipped else (left, right)
    if not (is_call(tr, (), ("transpose",)) and tr.args[0] is rep and sorted(tr.args[1:]) in ([-2, -1],)):
        return None
    if not is_call(rep, (), ("repeat",)) or not isinstance(rep.args[0], fx.Node):
        return None
    reps = rep.args[1] if len(rep.args) == 2 and isinstance(rep.args[1], (tuple, list)) else rep.args[1:]
    cat = rep.args[0]
    if not all(r == 1 for r in reps[:-1]) or not is_call(cat, (torch.cat,)):
        return None
    parts, dim = cat.args[0], cat.kwargs.get("dim", cat.args[1] if len(cat.args) > 1 else 0)
    if not (isinstance(parts, (list, tuple)) and len(parts) == 2 and all(isinstance(p, fx.Node) for p in parts)):
        return None
    zero, c = parts
    cv, zv = value(c), value(zero)
    if not (isinstance(cv, torch.Tensor) and isinstance(zv, torch.Tensor) and dim in (-2, cv.dim() - 2)
            and cv.shape[-1] == 1 and same_size(cv.shape[-2], ctx.seq_len) and zv.shape[-2] == 1
            and is_call(zero, (torch.zeros,), ("new_zeros",)) and not reads_tokens(ctx, zero)):
        return None
    g = gm.graph
    with g.inserting_before(n):
        ct = g.call_method("transpose", (c, -2, -1))
        with cv.fake_mode if hasattr(cv, "fake_mode") else contextlib.nullcontext():
            ct.meta["example_value"] = cv.transpose(-2, -1)
        d = g.call_function(operator.sub, (ct, c) if flipped else (c, ct))
        d.meta = dict(n.meta)
    n.replace_all_uses_with(d)
    return d


# ----------------------------------------------------------------------------- the steps


def _sampled(n: fx.Node, state: dict, members: set) -> list[fx.Node]:
    """The tensor inputs of ``n`` with no one hidden value: rows, and region tensors unknown there."""
    return [a for a in n.all_input_nodes if isinstance(value(a), torch.Tensor)
            and (a not in members or state[a].const is None)]


def _evaluate_hidden(n: fx.Node, state: dict, members: set) -> Hidden:
    """Runs ``n`` on 0-dim stand-ins: the region's tensors at their hidden constants, every other
    tensor at sample values; a constant if every sample gives the same result."""
    others = _sampled(n, state, members)
    # A divisor read from the rows is sampled away from 0: where a row's own divisor is 0 the
    # unmodified model divides by it on the future as well (NaN there, and in its reductions).
    name = split_inplace(op_key(n))[0]
    divisor = n.args[1] if name in _DIVISIONS and len(n.args) > 1 else None
    results = []
    for i in range(len(_SAMPLES)):
        env = {}
        for j, a in enumerate(others):
            v = value(a)
            s = _SAMPLES[(i + 3 * j) % len(_SAMPLES)]
            s = s if a is not divisor or s != 0.0 else 1.5
            env[a] = torch.tensor(bool(s > 0) if v.dtype == torch.bool else s, dtype=v.dtype) \
                if v.is_floating_point() or v.dtype == torch.bool else torch.tensor(int(s) % 5, dtype=v.dtype)
        for a in n.all_input_nodes:
            if a in members and a not in env:
                env[a] = state[a].const.clone()
        args = fx.node.map_arg(n.args, lambda x: env.get(x, x))
        kwargs = fx.node.map_arg(n.kwargs, lambda x: env.get(x, x))
        try:
            out = getattr(args[0], n.target)(*args[1:], **kwargs) if n.op == "call_method" else n.target(*args, **kwargs)
        except Exception:
            return UNKNOWN
        if not isinstance(out, torch.Tensor) or out.numel() != 1:
            return UNKNOWN
        results.append(out.reshape(()))
    first = results[0]
    if all(r.dtype == first.dtype and (torch.equal(r, first) or (r.isnan() & first.isnan()).all()) for r in results):
        return Hidden(first.clone())
    return UNKNOWN


def _reads_length(n: fx.Node, ctx: PassContext) -> bool:
    """A non-tensor argument that is a symbolic size (the length as a value)."""
    flat = []
    fx.node.map_aggregate((n.args, n.kwargs), flat.append)
    return any(isinstance(a, (torch.SymInt, torch.SymFloat)) for a in flat) or \
        any(isinstance(a, fx.Node) and isinstance(value(a), (torch.SymInt, torch.SymFloat)) for a in flat)


def _key_dim(n: fx.Node, nd: int, default=None) -> bool:
    dim = n.kwargs.get("dim", n.args[1] if len(n.args) > 1 else default)
    if isinstance(dim, (list, tuple)) and len(dim) == 1:
        dim = dim[0]
    return isinstance(dim, int) and dim in (-1, nd - 1)


def _step(ctx: PassContext, n: fx.Node, state: dict, members: set) -> str | None:
    """Sets ``state[n]`` for a token ``[S, S]`` node; a reason where its op is not exact."""
    if n in state:  # the cumulative sum and closing flip of a reversed sum, judged with its opening flip
        return None
    name, inplace = split_inplace(op_key(n))
    nd = value(n).dim()
    if n.op not in ("call_function", "call_method"):
        return "is not an op the dense pair rule knows"
    if fill_value(n, written=True) is not None:  # a fill among the tokens' nodes: written from them
        return "is written in place with values read from the tokens"
    if name in _VIEWS or n.target is operator.getitem and new_dims_only(n.args[1]):
        if not (is_pair(n, ctx) and is_pair(n.args[0], ctx)):
            return "moves the query or key dim"
        state[n] = state.get(n.args[0], UNKNOWN)
        return None
    if key_slice(n, ctx):  # a row value's first T entries, one per key: read at the key's position
        state[n] = UNKNOWN
        return None
    if _reads_length(n, ctx):
        return "reads the sequence length as a value"
    if name == "cdist":  # distances of two row values, as a product of them: the token's own off the path
        x, y = n.args[0], n.args[1]
        if x in members or y in members or not (same_size(value(x).shape[-2], ctx.seq_len)
                                                and same_size(value(y).shape[-2], ctx.seq_len)):
            return "is a cdist of other than two row values"
        state[n] = UNKNOWN
        return None
    if is_call(n, MATMUL, ("matmul", "bmm")) or is_call(n, (torch.baddbmm,), ("baddbmm",)) or \
            is_call(n, (torch.einsum,)):
        return _pair_product(ctx, n, state, members)
    if name in _KEYWISE:
        if not _key_dim(n, nd):
            return "runs over the queries, not the keys"
        identity, after = _KEYWISE[name]
        how = blocking(state.get(n.args[0], UNKNOWN), identity)
        if how is None:
            return f"runs over the keys on entries it does not ignore off the path (it needs {identity} there)"
        if how == "guarded":  # a finite blocked value: exact where the row sees a key (checked per batch)
            guarded(state, n, n.args[0], ctx)
            after = after if name == "softmax" else None
        state[n] = Hidden(torch.tensor(after, dtype=value(n).dtype)) if after is not None else UNKNOWN
        return None
    if name == "conv2d":
        return head_mix(ctx, n, state, members)
    if name == "cat" or n.target is operator.getitem and with_sink(n.args[0], ctx):
        return sink_column(ctx, n, state, members)
    if name == "dropout":  # Hugging Face's eager attention: p=0 outside training, the identity
        a = bind(n, ["input", "p", "training", "inplace"], {"p": 0.5, "training": True, "inplace": False})
        if a["p"] and a["training"]:
            return "is dropout on [S, S] tensors, random per call (per path it draws other numbers)"
        state[n] = state.get(a["input"], UNKNOWN)
        return None
    if name == "flip":
        return _reverse_cumsum(ctx, n, state, members, nd)
    if name == "scatter":
        why = scatter_keys(ctx, n, state, members, nd)
        if why is None and inplace:
            written(n, state, members)
        return why
    if name == "gather":
        src, dim, index = n.args[0], n.args[1] if len(n.args) > 1 else n.kwargs.get("dim"), \
            n.args[2] if len(n.args) > 2 else n.kwargs.get("index")
        sv = value(src)
        if src in members or dim not in (-1, nd - 1) or index not in members or sv.dim() != nd or \
                not same_size(sv.shape[-2], ctx.seq_len) or same_size(sv.shape[-1], ctx.seq_len):
            return "gathers other than each query row's own values at [S, S] indices"
        state[n] = UNKNOWN
        return None
    if name in _ELEMENTWISE:
        for a in n.all_input_nodes:
            v = value(a)
            if a not in members and isinstance(v, torch.Tensor) and v.dim() >= 2 and \
                    same_size(v.shape[-1], ctx.seq_len) and same_size(v.shape[-2], ctx.seq_len):
                return "reads an [S, S] tensor outside the region"
        state[n] = _evaluate_hidden(n, state, members)
        if inplace or name in ("iadd", "isub", "imul", "itruediv"):
            written(n, state, members)
        return None
    return f"is {name or n.target}, an op on [S, S] tensors the dense pair rule does not know"


def _pair_product(ctx: PassContext, n: fx.Node, state: dict, members: set) -> str | None:
    """``q @ k^T`` (two row values: a token's own entries, unknown off the path), ``baddbmm`` of
    one, or ``a @ b`` of two ``[S, S]`` (keys of ``a`` meeting queries of ``b``)."""
    if is_call(n, (torch.baddbmm,), ("baddbmm",)):
        x, y = n.args[1], n.args[2]
    elif is_call(n, (torch.einsum,)):
        if any(is_table(a, ctx) for a in n.all_input_nodes):
            return table_einsum(ctx, n, state, members, exit=False)
        found = einsum_product(n)
        if found is None:
            return einsum_per_head(ctx, n, state, members)
        x, y, y_transposed = found
        if y_transposed:  # ``...id,...jd->...ij``: scores of two row values
            if x in members or y in members or not (same_size(value(x).shape[-2], ctx.seq_len)
                                                    and same_size(value(y).shape[-2], ctx.seq_len)):
                return "is an einsum of other than two row values into scores"
            state[n] = UNKNOWN
            return None
    else:
        x, y = n.args[0], n.args[1]
    if x in members and y in members:
        if not state[x].is_(0.0):
            return "multiplies [S, S] tensors whose first is not 0 off the path"
        state[n] = Hidden(torch.tensor(0.0, dtype=value(n).dtype)) if state[y].is_(0.0) else UNKNOWN
        return None
    if y in members and x not in members and weights_per_query(ctx, n, x, y):
        state[n] = UNKNOWN
        return None
    if x in members or y in members:
        return "multiplies an [S, S] tensor with a row value"
    xv, yv = value(x), value(y)
    if not (same_size(xv.shape[-2], ctx.seq_len) and same_size(yv.shape[-1], ctx.seq_len)
            and not same_size(xv.shape[-1], ctx.seq_len)) and not scores_per_head(ctx, n, xv, yv):
        return "is a product that is not scores of two row values"
    state[n] = UNKNOWN
    return None


def _reverse_cumsum(ctx: PassContext, n: fx.Node, state: dict, members: set, nd: int) -> str | None:
    """``x.flip(-1).cumsum(-1).flip(-1)``: at a visible entry, the sum over the path's keys from
    ``k`` to ``q``; the first flip's hidden entries must be 0. The first flip stands for the
    three (the other two judged with it)."""
    def flips(m):
        dims = m.args[1] if len(m.args) > 1 else m.kwargs.get("dims")
        dims = list(dims) if isinstance(dims, (list, tuple)) else [dims]
        return split_inplace(op_key(m))[0] == "flip" and len(dims) == 1 and dims[0] in (-1, nd - 1)

    if n in state:  # the closing flip, judged with the opening one
        return None
    users = list(n.users)
    if not flips(n) or n.args[0] not in members or len(users) != 1:
        return "reorders the keys other than as a reversed cumulative sum"
    c = users[0]
    if split_inplace(op_key(c))[0] != "cumsum" or not _key_dim(c, nd) or len(c.users) != 1:
        return "reorders the keys other than as a reversed cumulative sum"
    close = next(iter(c.users))
    if not flips(close):
        return "reorders the keys other than as a reversed cumulative sum"
    if not state[n.args[0]].is_(0.0):
        return "sums over the keys from the end entries it does not ignore off the path (it needs 0 there)"
    state[n] = state[c] = state[close] = UNKNOWN
    return None


def _exit(ctx: PassContext, e: fx.Node, state: dict, members: set) -> str | None:
    """A node leaving the region: a reduction over the keys, or a product with a row value."""
    if e.op == "output":
        return "returns an [S, S] tensor"
    name = split_inplace(op_key(e))[0]
    if name == "topk":  # its number of keys may be min(c, S)
        return top_keys_exit(ctx, e, state, members)
    if _reads_length(e, ctx):
        return "reads the sequence length as a value"
    pair_args = [a for a in e.all_input_nodes if a in members]
    if is_call(e, (torch.einsum,)) and any(is_table(a, ctx) for a in e.all_input_nodes):
        return table_einsum(ctx, e, state, members, exit=True)
    product = einsum_product(e) if is_call(e, (torch.einsum,)) else None
    if product is not None and not product[2] and product[0] in members and product[1] not in members:
        x, y = product[0], product[1]
    elif is_call(e, MATMUL, ("matmul", "bmm")) and len(e.args) >= 2:
        x, y = e.args[0], e.args[1]
    else:
        x = y = None
    if x is not None and x in members and y not in members:
        v = value(y)
        if not (isinstance(v, torch.Tensor) and same_size(v.shape[-2], ctx.seq_len)):
            return "multiplies the scores with other than a row value"
        if not state[x].is_(0.0):
            return "sums values over keys it does not ignore off the path (the weights are not 0 there)"
        return None
    if is_call(e, SDPA):
        return sdpa_exit(ctx, e, state, members)
    if name in _REDUCE and len(pair_args) == 1 and e.args[0] in members:
        if not _key_dim(e, value(e.args[0]).dim()):
            return "reduces over other than the keys"
        how = blocking(state[e.args[0]], _REDUCE[name])
        if how is None:
            return f"reduces over keys it does not ignore off the path (it needs {_REDUCE[name]} there)"
        if how == "guarded":
            guarded(state, e, e.args[0], ctx)
        if name == "max" and any(not (u.target is operator.getitem and u.args[1] == 0) for u in e.users):
            return "reads the index of a maximum over the keys (a packed row index)"
        return None
    return f"takes an [S, S] tensor out of the region ({name or e.target})"


# ----------------------------------------------------------------------------- the rewrite


def _rewrite(gm: fx.GraphModule, ctx: PassContext, nodes: list, leaves: list, hidden: dict, at: fx.Node,
             exits: list) -> None:
    """Reads each structural leaf at path positions, its hidden value off the path (in the
    region's nodes and exits: a learned matrix times the rows is a leaf read by its exit)."""
    g = gm.graph
    inside = set(nodes) | set(exits)
    first = min(nodes or exits, key=list(g.nodes).index)
    # One dense tree mask per graph (built before the first region's nodes, so every later region can read it).
    anc = next((n for n in g.nodes if n.op == "call_function" and n.target is dense_tree_mask), None)
    with g.inserting_before(first):
        if anc is None:
            anc = ctx.mark(g.call_function(dense_tree_mask, (ctx.mask, ctx.chunks, *ctx.mask_buffers)), like=at,
                           rows=False)
        pq = ctx.mark(g.call_method("unsqueeze", (ctx.positions, -1)), like=at, rows=False)
        pk = ctx.mark(g.call_method("unsqueeze", (ctx.positions, 0)), like=at, rows=False)
    for n in nodes:
        if key_slice(n, ctx):
            with g.inserting_before(n):
                read = ctx.mark(g.call_function(torch.index_select, (n.args[0], -1, ctx.positions)), like=n,
                                rows=False)
            n.replace_all_uses_with(read)
    for leaf in leaves:
        marked = marked_fill(leaf)
        if fill_value(leaf) is not None or marked is not None:
            for n in [leaf, *(marked[1] if marked else [])]:
                ctx.mark(n, rows=False)  # one value, or the path's chosen keys marked in it: as it is
            continue
        order = {n: i for i, n in enumerate(g.nodes)}
        with g.inserting_before(min((u for u in leaf.users if u in inside), key=order.get)):
            built = copy_values(ctx, g, leaf)
            at = (pq, pk) if is_table(leaf, ctx) else (Ellipsis, pq, pk)
            read = ctx.mark(g.call_function(operator.getitem, (built, at)), like=leaf, rows=False)
            c = hidden[leaf].const
            tree = read if c is None else ctx.mark(g.call_function(torch.where, (anc, read, c.item())), like=leaf,
                                                   rows=False)
        for u in list(leaf.users):
            if u in inside:
                u.replace_input_with(leaf, tree)
    return anc

