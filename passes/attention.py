"""rewrite_attention_pass: every causal attention becomes FlexAttention with the tree mask.

Three spellings of causal attention are matched, each once for all models:

* ``treecompile::causal_attention``: a Hugging Face attention-interface call (the wrapper
  routes HF's attention interface there, whatever kernel the model was configured with);
  it carries the call's scale, sliding window and soft-cap.
* ``scaled_dot_product_attention`` with ``is_causal=True``, or with an ``attn_mask`` that
  is structural (computed from no activation) and evaluates to the causal mask,
  optionally with a sliding window.
* manual softmax attention: ``softmax(scale * (q @ k^T) masked by a structural causal
  mask) @ v``.

Why the rewrite is exact: per-path training lets token ``q`` of a path attend to the
tokens before it on that path. In the packed row those are exactly the keys ``kv`` with
``kv <= q < subtree_end[kv]`` (the rows of ``q``'s ancestors' nodes and the earlier rows
of its own node), and the token at ``kv`` has the same key and value vectors as on the
path because everything before attention is computed from the path prefix alone
(by induction over layers). The softmax therefore runs over the same set of scores, so
the output row equals the per-path output row. Windows are measured in path positions
(``positions[q] - positions[kv]``), the distance per-path training sees, and soft-capping
acts on each score alone.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from treecompile.errors import UnsupportedModelError
from treecompile.kernels.flex import AttentionSpec, tree_attention_fn
from treecompile.passes._graph import (
    MATMUL,
    SDPA,
    SOFTMAX,
    PassContext,
    ancestors,
    bind,
    describe,
    is_call,
    seq_dims,
    source_of,
    value,
)
from treecompile.passes.markers import is_marker

__all__ = ["rewrite_attention_pass"]

NAME = "attention"

_SDPA_ARGS = ["query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa"]
_SDPA_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}


def rewrite_attention_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Replaces causal attention calls with tree FlexAttention; counts them by kind.

    Counters (``ctx.counters["attention"]``): ``hf_interface``, ``sdpa``,
    ``softmax_attention``. Calls that are not provably causal are left in place with a
    note; the verify pass refuses them.
    """
    for node in list(gm.graph.nodes):
        if is_marker(node, "causal_attention"):
            q, k, v, scale, window, softcap = node.args
            _replace(gm, ctx, node, q, k, v, scale=scale, window=window, softcap=softcap)
            ctx.count(NAME, "hf_interface")
        elif is_call(node, SDPA):
            _rewrite_sdpa(gm, ctx, node)
        elif is_call(node, SOFTMAX, ("softmax",)):
            _rewrite_softmax_attention(gm, ctx, node)
    return gm


def _replace(gm, ctx, node, q, k, v, *, scale, window, softcap, output=None) -> None:
    """Inserts the tree attention call and redirects the users of ``output`` (default ``node``)."""
    output = output or node
    spec = AttentionSpec(
        kind=ctx.mask,
        scale=None if scale is None else float(scale),
        window=None if window is None else int(window),
        softcap=None if softcap is None else float(softcap),
        chunks=ctx.chunks,
        layout=ctx.layout,
    )
    fn = tree_attention_fn(spec)
    with gm.graph.inserting_before(output):
        new = gm.graph.call_function(fn, (q, k, v, ctx.positions, *ctx.mask_buffers, *ctx.block_tensors))
    new.meta["example_value"] = value(output)
    ctx.mark(new, like=output)
    output.replace_all_uses_with(new)


# --------------------------------------------------------------------------- SDPA


def _rewrite_sdpa(gm: fx.GraphModule, ctx: PassContext, node: fx.Node) -> None:
    a = bind(node, _SDPA_ARGS, _SDPA_DEFAULTS)
    if a["dropout_p"]:
        raise UnsupportedModelError(
            f"{describe(node)} at {source_of(node)}: attention dropout {a['dropout_p']} cannot match "
            "per-path training (it is random per call); use model.eval() or dropout_p=0"
        )
    if not seq_dims(a["query"], ctx.seq_len):
        return  # attention over something other than the sequence (e.g. over heads or patches)
    mask = a["attn_mask"]
    if mask is None:
        if not a["is_causal"]:
            ctx.notes[node] = "non-causal attention over the sequence (is_causal=False, no mask)"
            return
        window = None
    else:
        window, why = _structural_causal(ctx, mask, kind="sdpa")
        if why:
            ctx.notes[node] = f"attn_mask is {why}"
            return
    _replace(gm, ctx, node, a["query"], a["key"], a["value"], scale=a["scale"], window=window, softcap=None)
    ctx.count(NAME, "sdpa")


# --------------------------------------------------------------------------- manual softmax


def _single_user(node: fx.Node) -> fx.Node | None:
    users = list(node.users)
    return users[0] if len(users) == 1 else None


def _is_scalar(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


_NEG = ("masked_fill",)


def _rewrite_softmax_attention(gm: fx.GraphModule, ctx: PassContext, node: fx.Node) -> None:
    """Matches ``softmax(chain(q @ k^T), dim=-1) @ v`` where ``chain`` scales and masks."""
    args = bind(node, ["input", "dim"], {"dim": None})
    scores = args["input"]
    sv = value(scores)
    if not isinstance(sv, torch.Tensor) or sv.dim() < 2 or args["dim"] not in (-1, sv.dim() - 1):
        return
    if len(seq_dims(scores, ctx.seq_len)) < 2:
        return
    # Walk back from the softmax input to q @ k^T, collecting the scale and the masks.
    scale = 1.0
    masks: list[tuple[str, fx.Node]] = []
    cur = scores
    while True:
        if is_call(cur, MATMUL, ("matmul",)):
            break
        if cur.op == "call_function" and cur.target in (operator.mul, torch.mul) or is_call(cur, (), ("mul",)):
            a, b = cur.args[:2]
            if _is_scalar(b) and isinstance(a, fx.Node):
                scale, cur = scale * b, a
            elif _is_scalar(a) and isinstance(b, fx.Node):
                scale, cur = scale * a, b
            else:
                return
        elif cur.op == "call_function" and cur.target in (operator.truediv, torch.div) or is_call(cur, (), ("div",)):
            a, b = cur.args[:2]
            if not (_is_scalar(b) and isinstance(a, fx.Node)):
                return
            scale, cur = scale / b, a
        elif is_call(cur, (torch.masked_fill,), _NEG):
            t, m, fill = (list(cur.args) + [cur.kwargs.get("value")])[:3]
            if not (_is_scalar(fill) and fill <= -1e30) or not isinstance(m, fx.Node):
                return
            masks.append(("masked_fill", m))
            cur = t
        elif cur.op == "call_function" and cur.target in (operator.add, torch.add) or is_call(cur, (), ("add",)):
            a, b = cur.args[:2]
            # The scores branch is the one that comes from q @ k^T.
            if isinstance(b, fx.Node) and _depends_on_inputs(ctx, b) is False:
                masks.append(("additive", b))
                cur = a
            elif isinstance(a, fx.Node) and _depends_on_inputs(ctx, a) is False:
                masks.append(("additive", a))
                cur = b
            else:
                return
        elif is_call(cur, (), ("float", "double", "to")):
            cur = cur.args[0]
        else:
            return
        if not isinstance(cur, fx.Node):
            return
    qk = cur
    q, kt = qk.args[:2]
    k = _untranspose(kt)
    if k is None:
        return
    # Forward: softmax -> [dropout(p=0) | cast] -> @ v.
    out = _single_user(node)
    while out is not None and is_call(out, (torch.nn.functional.dropout,), ("to", "type", "float", "double")):
        if is_call(out, (torch.nn.functional.dropout,)):
            p = bind(out, ["input", "p", "training"], {"p": 0.5, "training": True})
            if p["p"] and p["training"]:
                raise UnsupportedModelError(
                    f"{describe(out)} at {source_of(out)}: attention dropout cannot match per-path training"
                )
        out = _single_user(out)
    if out is None or not is_call(out, MATMUL, ("matmul",)):
        return
    v = out.args[1]
    if out.args[0] is not _chain_end(node, out):
        return
    window = None
    if not masks:
        ctx.notes[out] = "softmax attention without a causal mask (bidirectional)"
        return
    for kind, m in masks:
        w, why = _structural_causal(ctx, m, kind=kind)
        if why:
            ctx.notes[node] = f"the attention mask is {why}"
            return
        if w is not None:
            window = w if window is None else min(window, w)
    _replace(gm, ctx, node, q, k, v, scale=scale, window=window, softcap=None, output=out)
    ctx.count(NAME, "softmax_attention")


def _chain_end(softmax: fx.Node, matmul: fx.Node) -> fx.Node:
    cur = softmax
    while True:
        nxt = _single_user(cur)
        if nxt is None or nxt is matmul:
            return cur
        cur = nxt


def _untranspose(kt) -> fx.Node | None:
    """``k`` if ``kt`` is ``k`` with its last two dims swapped."""
    if not isinstance(kt, fx.Node):
        return None
    kv = value(kt)
    if is_call(kt, (torch.transpose,), ("transpose",)):
        dims = [d % kv.dim() for d in kt.args[1:3]]
        if sorted(dims) == [kv.dim() - 2, kv.dim() - 1]:
            return kt.args[0]
    if kt.op == "call_function" and kt.target is getattr and kt.args[1] == "mT":
        return kt.args[0]
    return None


# --------------------------------------------------------------------------- mask evaluation


def _depends_on_inputs(ctx: PassContext, node: fx.Node) -> bool:
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


def _structural_causal(ctx: PassContext, mask: fx.Node, *, kind: str) -> tuple[int | None, str | None]:
    """Evaluates a structural mask on the example inputs; returns ``(window, None)`` if causal.

    A structural mask is computed only from sizes, constants and buffers (not from token
    ids or parameters), so the graph computes the same mask for every input of this
    length; evaluating it once on the example inputs shows what it is. It is accepted
    only if it allows exactly the causal pattern, optionally limited to a window.
    Costs one ``[S, S]`` evaluation per compile (the graph's own mask, not a new one).

    Returns:
        ``(window or None, None)`` on success, ``(None, reason)`` otherwise.
    """
    if not isinstance(mask, fx.Node):
        return None, "not a tensor"
    if _depends_on_inputs(ctx, mask):
        return None, "computed from the inputs or parameters (a padding or data-dependent mask)"
    m = None
    if ctx.probe_rows and _symbolic_length(ctx):
        # Judge the mask at the length the wrapper asks for (longer than this batch), so that
        # the judgement covers the paths it has seen; a mask that cannot be built that long
        # (a fixed-size buffer) is judged at the example length.
        try:
            m = _evaluate(ctx, mask, rows=max(ctx.probe_rows, ctx.seq_len.node.hint))
        except Exception:
            m = None
    if m is None:
        m = _evaluate(ctx, mask)
    s = m.shape[-1]
    # What the evaluation shows holds for sequences up to s long: a longer path (a window or
    # chunk wider than s) must be judged again (the wrapper recompiles, see PassContext.max_rows).
    ctx.max_rows = s if ctx.max_rows is None else min(ctx.max_rows, s)
    if m.dim() < 2 or m.shape[-2] != s:
        return None, f"of shape {tuple(m.shape)}, not [.., S, S]"
    flat = m.reshape(-1, s, s)
    if not all(torch.equal(flat[0], f) for f in flat[1:]):
        return None, "different across batch or heads"
    m = flat[0]
    if kind == "masked_fill":
        allowed = ~m.bool()
    elif kind == "additive" or (kind == "sdpa" and m.dtype != torch.bool):
        if m.is_floating_point():
            blocked = m <= torch.finfo(m.dtype).min / 2
            if not torch.all((m == 0) | blocked):
                return None, "an additive bias, not a 0/-inf mask"
            allowed = ~blocked
        else:
            return None, f"of dtype {m.dtype}"
    else:
        allowed = m.bool()
    causal = torch.ones(s, s, dtype=torch.bool, device=allowed.device).tril()
    if torch.equal(allowed, causal):
        return None, None
    if torch.any(allowed & ~causal):
        return None, "not causal (some token sees a later one)"
    window = int(allowed.sum(-1).max())
    idx = torch.arange(s, device=allowed.device)
    if window >= 1 and torch.equal(allowed, causal & (idx[:, None] - idx[None, :] < window)):
        return window, None
    return None, "causal but not a plain causal or sliding-window pattern"


def _symbolic_length(ctx: PassContext) -> bool:
    return isinstance(ctx.seq_len, torch.SymInt) and ctx.seq_len.node.hint is not None


def _evaluate(ctx: PassContext, node: fx.Node, rows: int | None = None) -> torch.Tensor:
    """Runs the subgraph that computes ``node`` on the example inputs (with the sequence
    length taken as ``rows`` if given)."""
    needed = ancestors(node) | {node}
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
    with torch.no_grad():
        return fx.GraphModule(owner, sub)(*inputs)
