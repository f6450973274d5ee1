"""A model's own attention mask, judged by evaluating it (the attention pass's helper).

A structural mask (built from sizes, constants and buffers, not from token ids or
parameters) is the same for every input of a length, so evaluating it once on the
example inputs shows what it is: causal, causal within a window, or an ALiBi bias. The
attention pass rewrites an attention only under a mask judged here.
"""

from __future__ import annotations

import torch
from torch import fx

from treecompile.passes._graph import PassContext, ancestors, describe, functorch_state_nodes, uses_functorch_levels, value

__all__ = ["depends_on_inputs", "structural_causal", "evaluate"]


def depends_on_inputs(ctx: PassContext, node: fx.Node) -> bool:
    """Whether ``node`` depends on the token ids or on a parameter (is not structural)."""
    anc = ancestors(node) | {node}
    for n in anc:
        if n is ctx.input_ids:
            return True
        if n.op == "placeholder":
            v = value(n)
            if isinstance(v, torch.Tensor) and v.requires_grad:
                return True
    return False


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


def _structural_causal_bias(ctx, mask, kind, heads):
    if not isinstance(mask, fx.Node):
        return None, "not a tensor", None, False
    if depends_on_inputs(ctx, mask):
        return None, "computed from the inputs or parameters (a padding or data-dependent mask)", None, False
    m = None
    if ctx.probe_rows and _symbolic_length(ctx):
        # Judge the mask at the length the wrapper asks for (longer than this batch), so that
        # the judgement covers the paths it has seen; a mask that cannot be built that long
        # (a fixed-size buffer) is judged at the example length.
        try:
            m = evaluate(ctx, mask, rows=max(ctx.probe_rows, ctx.seq_len.node.hint))
        except Exception:
            m = None
    if m is None:
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
    if (kind == "additive" or (kind == "sdpa" and m.dtype != torch.bool)) and m.is_floating_point():
        blocked = flat <= torch.finfo(m.dtype).min / 2
        bias = flat.masked_fill(blocked, 0.0)
        if torch.any(bias != 0):
            if heads is None:
                return None, "an additive bias, not a 0/-inf mask", None, False
            slopes, why = _alibi_slopes(bias, blocked, heads)
            why = why or _uses_length(mask)
            if why:
                return None, why, None, False
        flat = blocked  # what is left is a 0/-inf mask, as "masked_fill" reads it
        kind = "masked_fill"
    if slopes is not None and not torch.any(flat):
        return None, None, slopes, False  # a bias and no mask: causality must come from elsewhere
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
            blocked = m <= torch.finfo(m.dtype).min / 2
            if not torch.all((m == 0) | blocked):
                return None, "an additive bias, not a 0/-inf mask", None, False
            allowed = ~blocked
        else:
            return None, f"of dtype {m.dtype}", None, False
    else:
        allowed = m.bool()
    causal = torch.ones(s, s, dtype=torch.bool, device=allowed.device).tril()
    if torch.equal(allowed, causal):
        return None, None, slopes, True
    if torch.any(allowed & ~causal):
        return None, "not causal (some token sees a later one)", None, False
    window = int(allowed.sum(-1).max())
    idx = torch.arange(s, device=allowed.device)
    if window >= 1 and torch.equal(allowed, causal & (idx[:, None] - idx[None, :] < window)):
        return window, None, slopes, True
    return None, "causal but not a plain causal or sliding-window pattern", None, False


# Ops that may take the sequence length as a size or bound (not as a value in the arithmetic).
# (torch.vmap's batch-dim calls take the batch size, which may be S, as a size.)
_SHAPE_OPS = {"arange", "full", "ones", "zeros", "empty", "new_ones", "new_zeros", "new_empty", "new_full", "view",
              "reshape", "expand", "getitem", "narrow", "repeat", "tril", "triu", "ones_like", "zeros_like",
              "_add_batch_dim", "_remove_batch_dim"}


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


def _symbolic_length(ctx: PassContext) -> bool:
    return isinstance(ctx.seq_len, torch.SymInt) and ctx.seq_len.node.hint is not None


def evaluate(ctx: PassContext, node: fx.Node, rows: int | None = None) -> torch.Tensor:
    """Runs the subgraph that computes ``node`` on the example inputs (with the sequence
    length taken as ``rows`` if given)."""
    needed = ancestors(node) | {node}
    if uses_functorch_levels(needed):
        # A mask built under torch.vmap: its batched ops need the levels the vmap calls open.
        for state in functorch_state_nodes(node.graph.nodes):
            needed |= ancestors(state) | {state}
    placeholders = [n for n in node.graph.nodes if n.op == "placeholder"]
    env: dict[fx.Node, object] = {}
    length = ctx.seq_len.node.expr if rows is not None else None
    for p, ex in zip(placeholders, ctx.example_inputs):
        # Symbolic sizes are evaluated at their example value without guarding on it
        # (a guard would specialize the whole graph to this S).
        if isinstance(ex, torch.SymInt):
            env[p] = rows if length is not None and ex.node.expr == length else ex.node.hint
        elif rows is not None and p in needed and isinstance(ex, torch.Tensor):
            raise ValueError("the mask reads a tensor input; it is judged at the example length")
        else:
            env[p] = ex
    sub = fx.Graph()
    remap: dict[fx.Node, fx.Node] = {}
    inputs = []
    for n in node.graph.nodes:
        if n not in needed:
            continue
        if n.op == "placeholder":
            remap[n] = sub.placeholder(n.name)
            inputs.append(env[n])
        else:
            remap[n] = sub.node_copy(n, lambda x: remap[x])
    sub.output(remap[node])
    owner = node.graph.owning_module
    level = torch._C._functorch.maybe_current_level()
    switches = _autograd_switches()
    try:
        with torch.no_grad():
            return fx.GraphModule(owner, sub)(*inputs)
    finally:
        # A failure inside a torch.func transform must leave neither its levels open nor the
        # switches it sets (saved-tensor hooks off, ...) set.
        while (torch._C._functorch.maybe_current_level() or 0) > (level or 0):
            _pop_functorch_level()
        if _autograd_switches() != switches:
            _set_autograd_switches(*switches)


def _autograd_switches() -> tuple[bool, bool, bool]:
    """(saved-tensor hooks enabled, in-place requires-grad allowed, forward grad enabled)."""
    return (torch._C._autograd._saved_tensors_hooks_is_enabled(),
            torch._C._functorch.get_inplace_requires_grad_allowed(), torch._C._is_fwd_grad_enabled())


def _set_autograd_switches(hooks: bool, inplace: bool, fwd: bool) -> None:
    if hooks:
        torch._C._autograd._saved_tensors_hooks_enable()
    torch._C._functorch.set_inplace_requires_grad_allowed(inplace)
    torch._C._set_fwd_grad_enabled(fwd)


def _pop_functorch_level() -> None:
    """Closes the innermost torch.func level (vmap, grad, jvp or functionalize)."""
    functorch = torch._C._functorch
    kind = functorch.peek_interpreter_stack().key()
    pop = {functorch.TransformType.Vmap: functorch._vmap_decrement_nesting,
           functorch.TransformType.Grad: functorch._grad_decrement_nesting,
           functorch.TransformType.Jvp: functorch._jvp_decrement_nesting,
           functorch.TransformType.Functionalize: functorch._func_decrement_nesting}[kind]
    pop()
