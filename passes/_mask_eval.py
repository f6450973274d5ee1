"""A model's own attention mask, judged by evaluating it (the attention pass's helper).

A structural mask (built from sizes, constants and buffers, not from token ids or
parameters) is the same for every input of a length, so evaluating it once on the
example inputs shows what it is: causal, causal within a window, or an ALiBi bias. The
attention pass rewrites an attention only under a mask judged here.
"""

from __future__ import annotations

import contextlib

import torch
from torch import fx

from treecompile.passes._functorch_ops import functorch_state_nodes, uses_functorch_levels
from treecompile.passes._graph import (PassContext, ancestors, describe, inputs_by_memory, mutated_args, storage_of,
                                      value, writers_of)
from treecompile.passes._subgraph_run import evaluate_with_state, moved, run_subgraph

__all__ = ["depends_on_inputs", "moved_parameters", "value_inputs", "value_ancestors", "copy_node", "copy_values", "two_lengths",
           "changes_with_length", "CHANGES", "distance_pattern", "chunk_pattern", "NOT_PLAIN", "structural_causal",
           "causal_pattern", "evaluate", "BLOCKED"]

#: A score at or below this is a masked one: its softmax weight ``exp(score - max)`` underflows
#: to exactly 0 in every float dtype (float64 underflows below ``exp(-745)``) unless the scores
#: spread over more than 9000, which no softmax that is not already one-hot does. It covers
#: ``-inf``, any dtype's ``finfo.min`` (a float32 minimum inside a float64 model included),
#: GPT-2's ``-1e10`` and GPT-1's ``-1e4``.
BLOCKED = -1e4


def depends_on_inputs(ctx: PassContext, node: fx.Node) -> bool:
    """Whether ``node``'s values depend on the token ids or on a parameter (is not structural).

    A tensor that only lends its dtype, device or shape (``mask.type_as(h)``, ``mask.to(h)``,
    ``h.new_zeros(..)``, ``zeros_like(h)``, ``h.size(1)``) gives none of its values."""
    return _reaches(ctx, node, parameters=True)


def _reaches(ctx: PassContext, node: fx.Node, parameters: bool, writes: bool = True) -> bool:
    """Whether ``node``'s values come from the token ids (or, with ``parameters``, a tensor
    that requires grad), through the inputs that give values (`value_inputs`) and, with
    ``writes``, through every in-place write into the memory of ``node`` or of what it comes
    from (``mask = zeros(T, T).triu(1); mask.masked_fill_(ids == pad, -inf)`` reads the
    tokens), wherever the write stands in the graph."""
    stack, seen = [node], set()
    writers: dict[int, list[fx.Node]] = {}
    inputs: dict | None = None  # the graph inputs by their memory, once needed
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n is ctx.input_ids:
            return True
        if parameters and n.op == "placeholder":
            v = value(n)
            if isinstance(v, torch.Tensor) and v.requires_grad:
                return True
        stack.extend(value_inputs(n))
        if writes and (store := storage_of(n)) is not None:
            if store not in writers:
                inputs = inputs_by_memory(n.graph) if inputs is None else inputs
                writers[store] = writers_of(n, inputs)
            stack.extend(writers[store])
    return False


#: Methods (and functions) whose tensor arguments at these positions give only dtype, device or shape.
_SHAPE_SOURCES = {"type_as": (1,), "to": (1,), "new_zeros": (0,), "new_ones": (0,), "new_empty": (0,),
                  "new_full": (0,), "new_tensor": (0,), "zeros_like": (0,), "ones_like": (0,), "empty_like": (0,),
                  "full_like": (0,), "size": (0,), "dim": (0,), "numel": (0,), "expand_as": (1,), "view_as": (1,),
                  "reshape_as": (1,)}


@contextlib.contextmanager
def moved_parameters(ctx: PassContext):
    """Evaluations (`evaluate`) inside see every parameter moved (scaled and shifted at random):
    what holds for the example's parameters only (a learned value that is 0 now, not after a
    step) shows as different."""
    saved = ctx.example_inputs
    g = torch.Generator().manual_seed(0)
    out = []
    for x in saved:
        if isinstance(x, torch.Tensor) and x.requires_grad and x.is_floating_point():
            out.append(moved(x, g).requires_grad_())
        else:
            out.append(x)
    ctx.example_inputs = out
    try:
        yield
    finally:
        ctx.example_inputs = saved


def reads_tokens(ctx: PassContext, node: fx.Node, writes: bool = True) -> bool:
    """Whether ``node``'s values depend on the token ids (through values, not shapes), also
    through what is written in place into its memory (not with ``writes=False``)."""
    return _reaches(ctx, node, parameters=False, writes=writes)


def token_readers(ctx: PassContext, graph: fx.Graph) -> set[fx.Node]:
    """The nodes of ``graph`` whose values depend on the token ids (`reads_tokens` of each, in
    one pass over the graph in its order): a read of memory that a write reading the tokens
    wrote before it counts."""
    out: set[fx.Node] = set()
    written: set[int] = set()  # memory a write that reads the tokens has written so far
    for n in graph.nodes:
        if n is ctx.input_ids or any(a in out or storage_of(a) in written for a in value_inputs(n)):
            out.add(n)
            if n.op in ("call_function", "call_method"):
                written |= {storage_of(t) for t in mutated_args(n)} - {None}
    return out


def shape_sources(n: fx.Node) -> list[fx.Node]:
    """The tensor inputs of ``n`` that lend it only their dtype, device or shape (see
    `depends_on_inputs`)."""
    name = n.target if n.op == "call_method" else getattr(n.target, "__name__", None) if n.op == "call_function" else None
    return [a for i, a in enumerate(n.args) if i in _SHAPE_SOURCES.get(name, ()) and isinstance(a, fx.Node)
            and isinstance(value(a), torch.Tensor)]


def value_inputs(n: fx.Node) -> list[fx.Node]:
    """The inputs of ``n`` that give it values (see `depends_on_inputs`)."""
    name = n.target if n.op == "call_method" else getattr(n.target, "__name__", None) if n.op == "call_function" else None
    skip = _SHAPE_SOURCES.get(name, ())
    if not skip:
        return n.all_input_nodes
    kept = [a for i, a in enumerate(n.args) if i not in skip]
    return _nodes((kept, n.kwargs))


def value_ancestors(node: fx.Node) -> set[fx.Node]:
    """The nodes ``node``'s values come from (`value_inputs`, transitively), itself excluded: not
    those that lend only a dtype, device or shape (``bias.type_as(scores)`` does not read the
    scores)."""
    seen: set[fx.Node] = set()
    stack = list(value_inputs(node))
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(value_inputs(n))
    return seen


def copy_node(g: fx.Graph, node: fx.Node, env: dict) -> fx.Node:
    """A copy of ``node`` (inserted where ``g`` inserts) reading ``env``'s copies of its inputs.
    A ``type_as`` or ``to`` whose other tensor has no copy becomes ``.to(dtype)``: that tensor
    lends only its dtype, and the copy does not keep it (the scores a bias is cast to) alive."""
    if node.op == "call_method" and node.target in ("type_as", "to") and len(node.args) == 2 \
            and isinstance(node.args[1], fx.Node) and node.args[1] not in env \
            and isinstance(value(node), torch.Tensor):
        return g.call_method("to", (env.get(node.args[0], node.args[0]), value(node).dtype))
    return g.node_copy(node, lambda x: env.get(x, x))


def copy_values(ctx: PassContext, g: fx.Graph, node: fx.Node) -> fx.Node:
    """A copy of what ``node``'s values come from (`value_ancestors`, and the in-place writes into
    it before it is read, as `evaluate` runs them; placeholders and attributes read where they
    are), inserted where ``g`` inserts: the pass's nodes, off the rows (a table or kernel over
    distances, which the positions pass and the row rules leave alone)."""
    sub = value_ancestors(node) | {node}
    sub |= _writes_before_read(node, sub, fresh_only=True)  # ``m = zeros(T, T); m[tril] = 1``: written too
    env: dict[fx.Node, fx.Node] = {}
    for n in [n for n in g.nodes if n in sub and n.op not in ("placeholder", "get_attr")]:
        env[n] = ctx.mark(copy_node(g, n, env), like=n, rows=False)
    return env.get(node, node)


def two_lengths(ctx: PassContext) -> tuple[int, int] | None:
    """``(example, half)``: the example length and half of it (at least 2), at which a structural
    value is built twice to see whether it changes with the length; None for a constant length."""
    s = value(ctx.input_ids).shape[-1]
    if not isinstance(s, torch.SymInt):
        return None
    example = int(s.node.hint)
    return example, max(2, example // 2)


def _nodes(a) -> list[fx.Node]:
    out: list[fx.Node] = []
    fx.node.map_arg(a, lambda x: out.append(x))
    return out


def structural_causal(
    ctx: PassContext, mask: fx.Node, *, kind: str, heads: int | None = None
) -> tuple:
    """Evaluates a structural mask on the example inputs; returns ``(window, None)`` if causal.

    A structural mask is computed only from sizes, constants and buffers (not from token
    ids or parameters), so the graph computes the same mask for every input of this
    length; evaluating it once on the example inputs shows what it is. It is accepted
    only if it allows exactly the causal pattern, optionally limited to a window.
    Costs one ``[S, S]`` evaluation per compile (the graph's own mask, not a new one).

    With ``heads`` (additive masks), the finite part may also be an ALiBi bias: per head
    ``slope * j`` plus anything constant along the keys (``slope * (j - i)``, or the
    key-only ``slope * j`` of Bloom and MPT, which differ by a per-query constant that
    softmax ignores), given ``[.., S, S]`` or broadcast over the queries ``[.., 1, S]``.
    The bias is a function of the key's and query's positions, so in path positions it is
    what per-path training adds; the kernel computes it from the tree positions.

    Returns:
        ``(window or None, None, slopes, causal)`` on success, ``(None, reason, None,
        False)`` otherwise: ``slopes`` the per-head ALiBi slopes or None (always None without
        ``heads``), ``causal`` whether the term masks causally (False for a bias alone).
    """
    return _structural_causal_bias(ctx, mask, kind, heads)


def _structural_causal_bias(ctx, mask, kind, heads, at_rows=None):
    """`structural_causal`; with ``at_rows``, the pattern the mask lets through at that length
    (or a reason), for `_same_pattern_shorter`."""
    if not isinstance(mask, fx.Node):
        return None, "not a tensor", None, False
    if depends_on_inputs(ctx, mask):
        return None, "computed from the inputs or parameters (a padding or data-dependent mask)", None, False
    m = None
    rows = judged_length(ctx) if at_rows is None else at_rows
    # A mask that cannot be built that long (a fixed-size buffer) is judged at the example length.
    if rows is not None:
        try:
            m = evaluate(ctx, mask, rows=rows)
        except Exception:
            m = None
    if m is None:
        if at_rows is not None:
            return None, "not evaluable at another length", None, False
        m = evaluate(ctx, mask)
    if not isinstance(m, torch.Tensor):
        return None, "not a tensor", None, False
    s = m.shape[-1]
    # What the evaluation shows holds for sequences up to s long: a longer path (a window or
    # chunk wider than s) must be judged again (the wrapper recompiles, see PassContext.max_rows).
    ctx.max_rows = s if ctx.max_rows is None else min(ctx.max_rows, s)
    if m.dim() < 2 or m.shape[-2] not in (1, s):
        return None, f"of shape {tuple(m.shape)}, not [.., S, S]", None, False
    rows = m.shape[-2]
    flat = m.reshape(-1, rows, s)
    slopes = None
    was_float = (kind == "additive" or (kind == "sdpa" and m.dtype != torch.bool)) and m.is_floating_point()
    if was_float:
        blocked = flat <= BLOCKED
        bias = flat.masked_fill(blocked, 0.0)
        if torch.any(bias != 0):
            if heads is None:
                return None, "an additive bias, not a 0/-inf mask", None, False
            slopes, why = _alibi_slopes(bias, blocked, heads)
            length = _uses_length(mask)
            if why and not length and not torch.any(blocked) and kind == "additive":
                # Not ALiBi, and no entry blocked: a bias that may be a function of the
                # distance (x-transformers' -|i - j| slopes), for the relative-bias rule.
                return None, f"{PAIR_BIAS} ({why})", None, False
            why = why or length
            if why:
                return None, why, None, False
        flat = blocked  # what is left is a 0/-inf mask, as "masked_fill" reads it
        kind = "masked_fill"
    if slopes is not None and not torch.any(flat):
        return None, None, slopes, False  # a bias and no mask: causality must come from elsewhere
    if slopes is None and kind == "masked_fill" and was_float and not torch.any(flat):
        # An additive term of zeros (baddbmm's zero input, GPT-NeoX-Japanese): it changes no score.
        return None, None, None, False
    if rows == 1 and slopes is None and not torch.any(flat.bool()):
        return None, None, None, False  # a term that changes no score (an all-zero padding mask)
    if rows == 1:
        if slopes is None or torch.any(flat.bool()):
            return None, f"of shape {tuple(m.shape)}, not [.., S, S]", None, False
        return None, None, slopes, False  # a bias over the keys and no mask: causality must come from elsewhere
    if not all(torch.equal(flat[0], f) for f in flat[1:]):
        return None, "different across batch or heads", None, False
    m = flat[0]
    if kind == "masked_fill":
        allowed = ~m.bool()
    elif kind == "additive" or (kind == "sdpa" and m.dtype != torch.bool):
        if m.is_floating_point():
            blocked = m <= BLOCKED
            if not torch.all((m == 0) | blocked):
                return None, "an additive bias, not a 0/-inf mask", None, False
            allowed = ~blocked
        else:
            return None, f"of dtype {m.dtype}", None, False
    else:
        allowed = m.bool()
    if at_rows is not None:
        return allowed
    window, why = causal_pattern(allowed)
    if why:
        return None, why, None, False
    why = _same_pattern_shorter(ctx, mask, kind, heads, allowed)
    if why:
        return None, why, None, False
    return window, None, slopes, True


def _same_pattern_shorter(ctx, mask, kind, heads, allowed: torch.Tensor) -> str | None:
    """`changes_with_length` for a structural mask judged by `structural_causal`. A mask that
    cannot be built or judged at another length (it reads a tensor input of the row count, as
    Hugging Face's masks read the attention mask) is left as judged."""
    saved = ctx.max_rows
    try:
        return changes_with_length(lambda r: _structural_causal_bias(ctx, mask, kind, heads, at_rows=r), allowed,
                                   unjudged_ok=True)
    finally:
        ctx.max_rows = saved


#: Why a mask is refused whose pattern at half the length is not the corner of its pattern.
CHANGES = "a mask whose pattern changes with the sequence length (per path it is the path's length)"


def changes_with_length(allowed_at, allowed: torch.Tensor, unjudged_ok: bool = False) -> str | None:
    """`CHANGES` if the pattern ``allowed_at(rows)`` at half the length of ``allowed`` is not its
    top-left corner (a window of ``T // 2``: per path it is the path's length that counts), else
    None; also None where ``allowed_at`` raises (a mask that cannot be built at another length,
    judged as it was) or, with ``unjudged_ok``, gives no pattern there."""
    r = max(2, allowed.shape[-1] // 2)
    try:
        short = allowed_at(r)
    except Exception:
        return None
    if not isinstance(short, torch.Tensor):
        return None if unjudged_ok else CHANGES
    return CHANGES if short.shape != (r, r) or not torch.equal(short, allowed[:r, :r]) else None


def causal_pattern(allowed: torch.Tensor) -> tuple[int | None, str | None]:
    """``(window or None, None)`` if ``allowed`` ``[S, S]`` (query, key) is the causal pattern,
    optionally within a sliding window; ``(None, reason)`` otherwise."""
    s = allowed.shape[-1]
    if allowed.dim() != 2 or allowed.shape[0] != s:
        return None, f"of shape {tuple(allowed.shape)}, not [S, S]"
    causal = torch.ones(s, s, dtype=torch.bool, device=allowed.device).tril()
    if torch.equal(allowed, causal):
        return None, None
    if torch.any(allowed & ~causal):
        return None, "not causal (some token sees a later one)"
    window = int(allowed.sum(-1).max())
    idx = torch.arange(s, device=allowed.device)
    if window >= 1 and torch.equal(allowed, causal & (idx[:, None] - idx[None, :] < window)):
        return window, None
    return None, NOT_PLAIN


#: `causal_pattern`'s reason for a causal mask of another pattern (`distance_pattern` may read it).
NOT_PLAIN = "causal but not a plain causal or sliding-window pattern"


def distance_pattern(allowed: torch.Tensor) -> tuple[bool, ...] | None:
    """Per distance ``d``, whether a causal ``allowed`` ``[S, S]`` lets a query see the key ``d``
    before it, if that is all it depends on (``allowed[i, j] == allowed[i - j, 0]`` on and below
    the diagonal, nothing above); else None."""
    s = allowed.shape[-1]
    if allowed.dim() != 2 or allowed.shape[0] != s or torch.any(allowed.triu(1)):
        return None
    i, j = torch.tril_indices(s, s)
    col = allowed[:, 0]
    if not torch.equal(allowed[i, j], col[i - j]):
        return None
    return tuple(bool(x) for x in col)


def chunk_pattern(allowed: torch.Tensor) -> int | None:
    """The chunk ``c`` if a causal ``allowed`` ``[S, S]`` keeps exactly the keys at or before the
    query in the query's chunk of ``c`` (``i // c == j // c``: Llama 4's chunked attention written
    with two aranges), with at least two chunks; else None."""
    s = allowed.shape[-1]
    if allowed.dim() != 2 or allowed.shape[0] != s:
        return None
    cut = (~allowed[1:, 0]).nonzero()
    if cut.numel() == 0:
        return None
    c = int(cut[0, 0]) + 1
    idx = torch.arange(s, device=allowed.device)
    chunked = (idx[:, None] >= idx[None, :]) & (idx[:, None] // c == idx[None, :] // c)
    return c if torch.equal(allowed, chunked) else None


# Ops that may take the sequence length as a size or bound (not as a value in the arithmetic).
# (torch.vmap's batch-dim calls take the batch size, which may be S, as a size.)
_SHAPE_OPS = {"arange", "full", "ones", "zeros", "empty", "new_ones", "new_zeros", "new_empty", "new_full", "view",
              "reshape", "expand", "getitem", "narrow", "repeat", "tril", "triu", "ones_like", "zeros_like",
              "_add_batch_dim", "_remove_batch_dim"}


#: The start of `structural_causal`'s reason for an additive bias with no blocked entry that is
#: not ALiBi: the softmax rewrite judges it as a function of the distance instead
#: (`treecompile.passes.attention.relative_bias`).
PAIR_BIAS = "an additive bias over (query, key) pairs that blocks nothing"


def _uses_length(mask: fx.Node) -> str | None:
    """A reason if the bias uses the sequence length as a value (``j / S``): its slope, read at
    the example length, would be wrong for any other."""
    for n in ancestors(mask) | {mask}:
        if n.op not in ("call_function", "call_method"):
            continue
        name = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", "")
        if name in _SHAPE_OPS or not isinstance(value(n), torch.Tensor):
            continue
        if any(isinstance(value(a), torch.SymInt) for a in n.args if isinstance(a, fx.Node)):
            return f"an additive score bias computed from the sequence length ({describe(n)})"
    return None


def _alibi_slopes(bias: torch.Tensor, blocked: torch.Tensor, heads: int) -> tuple[tuple[float, ...] | None, str | None]:
    """Per-head slopes if ``bias`` ``[L, R, S]`` is ``slope[l] * j`` plus a constant per query
    row on the entries not blocked (``L`` is 1 or ``heads``), else ``(None, reason)``."""
    n, _, s = bias.shape
    if n not in (1, heads) or s < 2:
        return None, "an additive score bias that is not ALiBi (not one slope per head)"
    b = bias.double()
    j = torch.arange(s, dtype=torch.float64, device=b.device)
    ok = ~blocked
    # The slope from the last query row, which sees keys 0 and 1 under a causal mask.
    slope = b[:, -1, 1] - b[:, -1, 0]
    if not torch.all(ok[:, -1, :2]):
        return None, "an additive score bias that is not ALiBi (keys 0 and 1 are not visible)"
    rest = b - slope[:, None, None] * j
    const = rest[:, :, :1]
    scale = max(b.abs().max().item(), 1.0)
    if not torch.all((~ok) | ((rest - const).abs() <= 1e-6 * scale)):
        return None, "an additive score bias that is not ALiBi (not linear in the key position)"
    vals = slope.tolist()
    return tuple(vals * heads if n == 1 else vals), None


def judged_length(ctx: PassContext) -> int | None:
    """The length at which to evaluate a structural tensor over the rows, or None for the
    example length: the length the wrapper asks for (longer than this batch), so that the
    judgement covers the paths it has seen; where a buffer was extended past its size for the
    call (its new entries hold no pattern), no longer than the buffer was (every path of the
    batch fits in it)."""
    if not _symbolic_length(ctx):
        return None
    rows = max(ctx.probe_rows, ctx.seq_len.node.hint) if ctx.probe_rows else None
    if ctx.judge_cap:
        rows = min(rows or ctx.seq_len.node.hint, ctx.judge_cap)
    return rows


def _symbolic_length(ctx: PassContext) -> bool:
    return isinstance(ctx.seq_len, torch.SymInt) and ctx.seq_len.node.hint is not None


def evaluate(ctx: PassContext, node: fx.Node, rows: int | None = None) -> torch.Tensor:
    """Runs the subgraph that computes ``node`` on the example inputs (with the sequence
    length taken as ``rows`` if given)."""
    needed = ancestors(node) | {node}
    needed |= _writes_before_read(node, needed)
    if uses_functorch_levels(needed):
        # A mask built under torch.vmap: its batched ops need the levels the vmap calls open.
        for state in functorch_state_nodes(node.graph.nodes):
            needed |= ancestors(state) | {state}
    placeholders = [n for n in node.graph.nodes if n.op == "placeholder"]
    ctx.judged |= {i for i, p in enumerate(placeholders) if p in needed}
    env: dict[fx.Node, object] = {}
    length = ctx.seq_len.node.expr if rows is not None else None
    for p, ex in zip(placeholders, ctx.example_inputs):
        # Symbolic sizes are evaluated at their example value without guarding on it
        # (a guard would specialize the whole graph to this S).
        if isinstance(ex, torch.SymInt):
            env[p] = rows if length is not None and ex.node.expr == length else ex.node.hint
        elif rows is not None and p in needed and isinstance(ex, torch.Tensor) and _mentions_length(ex, length):
            raise ValueError("the mask reads a tensor input of the row count; it is judged at the example length")
        else:
            env[p] = ex
    state = ctx.state
    written = [i for i, p in enumerate(placeholders) if state is not None and i in state.written and p in needed]
    if written:
        return evaluate_with_state(ctx, node, needed, placeholders, env, written)
    return run_subgraph(node, needed, placeholders, env)


def written_from_tokens(ctx: PassContext, node: fx.Node) -> bool:
    """Whether an in-place write into the memory ``node``'s values come from, before it is read
    (`evaluate` runs them), takes values read from the token ids: then ``node``'s values do,
    whatever its own inputs (a size it takes from a tensor written so does not count)."""
    return any(reads_tokens(ctx, w) for w in _writes_before_read(node, value_ancestors(node) | {node}))


def _writes_before_read(node: fx.Node, needed: set[fx.Node], fresh_only: bool = False) -> set[fx.Node]:
    """The in-place writes into the memory of ``needed`` made before ``node`` is read
    (``mask = ones(T, T).triu(1); mask.masked_fill_(mask.bool(), -inf)``), with what they read:
    the mask's value includes them. A read that only feeds such a write (``mask.bool()``
    above) is part of the write. ``fresh_only``: not those writing an input, a parameter or a
    buffer (a copy reads those where they are, after the writes)."""
    stores = {storage_of(n) for n in needed} - {None}
    writers = [n for n in node.graph.nodes if n not in needed and mutated_args(n)
               and {storage_of(t) for t in mutated_args(n)} & stores]
    if not writers:
        return set()
    feeding = set().union(*(ancestors(w) for w in writers))
    order = {n: i for i, n in enumerate(node.graph.nodes)}
    reads = [order[u] for u in node.users if u not in writers and u not in feeding]
    until = min(reads, default=len(order))
    external = {storage_of(n) for n in node.graph.nodes if n.op in ("placeholder", "get_attr")} - {None}
    writes: set[fx.Node] = set()
    for w in writers:
        if fresh_only and {storage_of(t) for t in mutated_args(w)} & external:
            continue
        if order[w] < until:
            writes |= ancestors(w) | {w}
    return writes


def _mentions_length(t: torch.Tensor, length) -> bool:
    """Whether a tensor input's shape involves the sequence length (a buffer's does not)."""
    return any(isinstance(d, torch.SymInt) and d.node.expr.free_symbols & length.free_symbols for d in t.shape)
