"""verify_graph_pass: refuse any sequence mixing that is not tree-aware.

On a packed tree row, an op that mixes tokens along the sequence is exact only if it
mixes each token with its own root path and nothing else. After the rewrite passes the
only such ops allowed are the ones they inserted. Anything else would train silently
wrong, so this pass raises :class:`~treecompile.UnsupportedModelError` naming the node
and the user source line. What it refuses:

* attention left in place: SDPA, the ``causal_attention`` marker, a FlexAttention call;
* any tensor with two sequence-length dims (attention scores, a mask built from S);
* ``arange(S)``-style index math that feeds a mask, ``tril``/``triu`` over S;
* scans and reductions over the sequence dim (``cumsum``, ``cumprod``, ``logcumsumexp``,
  ``sum``/``mean``/``max``/``softmax`` ... with that dim), ``flip``/``roll`` on it;
* convolutions with the sequence as a spatial dim, recurrent layers (GRU, LSTM, RNN);
* matmuls that contract over the sequence (linear attention, ``k^T @ v``);
* shifts: ``cat``/``pad``/``getitem`` that change the sequence length (token shift), and a
  ``pad`` on the sequence dim that keeps it (``pad(x, (0, 0, 1, -1))``);
* a graph in which the sequence length is a constant.

Sequence dims are recognised by size: the wrapper makes S dynamic, so it is a symbol and
the check is exact. A model that makes Dynamo specialise S to a number (a Python loop over
the tokens, ``for t in range(S)``, or a branch on the length) leaves per-token ops that no
size check can see, so such a graph is refused outright.
"""

from __future__ import annotations

import operator

import torch
import torch.nn.functional as F
from torch import fx

from treecompile.errors import UnsupportedModelError
from treecompile.passes._graph import (
    ARANGE,
    PADS,
    SDPA,
    PassContext,
    bind,
    describe,
    is_call,
    is_identity_row_index,
    location_of,
    multiple_of,
    op_name,
    row_dims,
    row_indices,
    is_op,
    same_size,
    source_of,
    value,
)
from treecompile.passes.markers import is_marker
from treecompile.passes.ssm_state import SCAN_OPS

__all__ = ["verify_graph_pass"]

_SCANS = {torch.cumsum, torch.cumprod, torch.logcumsumexp, torch.cummax, torch.cummin}
_SCAN_METHODS = {"cumsum", "cumprod", "logcumsumexp", "cummax", "cummin"}
_REDUCTIONS = {torch.sum, torch.mean, torch.amax, torch.amin, torch.max, torch.min, torch.prod, torch.logsumexp,
               torch.softmax, torch.log_softmax, F.softmax, F.log_softmax, torch.std, torch.var, torch.norm,
               torch.sort, torch.argsort, torch.topk, torch.argmax, torch.argmin, torch.flip, torch.roll,
               torch.median, torch.any, torch.all}
_REDUCTION_METHODS = {"sum", "mean", "amax", "amin", "max", "min", "prod", "logsumexp", "softmax", "log_softmax",
                      "std", "var", "norm", "sort", "argsort", "topk", "argmax", "argmin", "flip", "roll",
                      "median", "any", "all"}
_CONVS = {F.conv1d, F.conv2d, F.conv3d, F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d,
          torch.conv1d, torch.conv2d, torch.conv3d, torch.convolution, torch.ops.aten.convolution.default}
_RNNS = {torch.gru, torch.lstm, torch.rnn_tanh, torch.rnn_relu, torch._VF.gru, torch._VF.lstm, torch._VF.rnn_tanh,
         torch._VF.rnn_relu}
_MATMULS = {operator.matmul, torch.matmul, torch.bmm, torch.mm, torch.einsum}
_MASK_BUILDERS = {torch.tril, torch.triu}


def verify_graph_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Raises on the first node that mixes the sequence without being tree-aware.

    Counters (``ctx.counters["verify_graph_pass"]``): ``nodes_checked``.
    """
    violations = []
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method", "call_module") or node in ctx.created:
            continue
        ctx.count("nodes_checked")
        why = _violation(node, ctx)
        if why:
            violations.append((node, why))
    if not violations and not _symbolic(ctx.seq_len):
        _refuse_static_length(gm, ctx)
    if violations:
        # Report an attention a pass looked at and left (it says why) before the first
        # violation in graph order, which is often just mask-building feeding it.
        noted = [(n, w) for n, w in violations if n in ctx.notes]
        node, why = (noted or violations)[0]
        note = ctx.notes.get(node)
        extra = f" ({note})" if note else ""
        raise UnsupportedModelError(
            f"treecompile cannot make this model exact on a tree: {describe(node)} at {location_of(node)} "
            f"{why}{extra}.\n"
            f"  at {source_of(node)}\n"
            "Every op that mixes tokens along the sequence must be rewritten to follow the tree; "
            "see passes/README.md for what is supported."
        )
    return gm


def _violation(node: fx.Node, ctx: PassContext) -> str | None:
    s = ctx.seq_len
    target = node.target
    if is_call(node, SDPA):
        return "is scaled_dot_product_attention that is not provably causal, so it was not rewritten"
    if is_marker(node, "causal_attention"):
        return "is a causal attention that was not rewritten"
    if _is_sequence_kernel(node):
        return "is a sequence kernel (causal conv or recurrent scan) over the packed row that was not rewritten"
    if is_marker(node, "tree_inputs"):
        return "is the tree input marker, which must have been removed"
    if node.op == "call_function" and target is torch.ops.higher_order.flex_attention:
        return "is a FlexAttention call with the model's own mask, which is not the tree mask"
    if node.op == "call_function" and target is getattr(torch.ops.higher_order, "autograd_function_apply", None):
        return _autograd_function_violation(node, ctx)
    if node.op == "call_function" and isinstance(target, torch._ops.HigherOrderOperator):
        return (f"is a higher-order op ({getattr(target, '__name__', target)}: torch.cond, a torch.autograd.Function, "
                "a loop or region with its own subgraph) whose body the passes do not rewrite or check")
    if node.op == "call_function" and target in _RNNS or node.op == "call_module":
        return "is a recurrent layer (or an opaque module) over the sequence"
    if is_call(node, _CONVS, ("conv1d", "conv2d")):
        x = node.args[0]
        if any(d >= 2 for d in row_dims(x, s, "seq")):
            return "is a convolution over the sequence"
    out_dims = row_dims(node, s, "seq")
    if len(out_dims) >= 2:
        return "produces a [.., S, S] tensor (attention scores or a mask built from the sequence length)"
    if is_call(node, _MASK_BUILDERS, ("tril", "triu")) and row_dims(node.args[0], s, "seq"):
        return "builds a triangular mask over the sequence"
    if is_call(node, ARANGE) and out_dims and not _only_identity_index(node, s):
        return "is an index over the packed row that is not a position (e.g. feeds a mask)"
    if is_call(node, _SCANS, _SCAN_METHODS):
        dim = bind(node, ["input", "dim"], {"dim": None})["dim"]
        if _is_seq_dim(node.args[0], dim, s):
            return f"is a scan ({(op_name(node) or str(node.target))}) along the sequence"
    if is_call(node, _REDUCTIONS, _REDUCTION_METHODS) and not _elementwise_min_max(node):
        x = node.args[0] if node.args else None
        dims = _dims_arg(node)
        in_dims = row_dims(x, s)
        if in_dims and (dims is None or any(_norm(d, x) in in_dims for d in dims)):
            return f"reduces or reorders ({(op_name(node) or str(node.target))}) along the sequence"
    if is_call(node, _MATMULS, ("matmul", "bmm", "mm")) and target is not torch.einsum:
        a = node.args[0]
        av = value(a)
        if isinstance(av, torch.Tensor) and av.dim() >= 1 and (av.dim() - 1) in row_dims(a, s):
            return "contracts over the sequence (a matmul whose inner dim is S)"
    if is_call(node, (torch.einsum,)):
        ins = [a for a in node.args[1:] if isinstance(a, fx.Node)]
        if any(row_dims(a, s) for a in ins) and not row_dims(node, s):
            return "contracts over the sequence (einsum)"
    if is_call(node, _NORMS, _NORM_METHODS) and _normalises_rows(node, s):
        return "normalises over the sequence (statistics shared by the tokens of the row)"
    gathered = _row_index_source(node, s)
    if gathered is not None:
        return (f"gathers or scatters rows of the sequence at indices computed from {gathered} (e.g. a token "
                "shift x[:, arange(T) - 1]): the row before a token in the packed row is not its predecessor on "
                "the path")
    length_use = _length_as_value(node, s)
    if length_use is not None:
        return (f"uses the sequence length as a value ({length_use}), e.g. arange(T) / T or a log(T) temperature: "
                "each path has its own length, which one packed row does not have")
    if _is_opaque_custom_op(node) and any(row_dims(a, s) for a in node.all_input_nodes):
        return "is a custom op treecompile does not know, applied to the sequence (it may mix tokens)"
    if _changes_length(node, s):
        return "changes the sequence length (a shift, pad or cat along the sequence)"
    if is_call(node, PADS) and _pads_rows(node, s):
        return "pads or shifts along the sequence"
    return None


def _elementwise_min_max(node: fx.Node) -> bool:
    """``torch.max(a, b)`` / ``a.min(b)`` with a tensor ``b``: element-wise, not a reduction."""
    if node.target not in (torch.max, torch.min, "max", "min"):
        return False
    other = node.args[1] if len(node.args) > 1 else node.kwargs.get("other")
    return isinstance(other, fx.Node) and isinstance(value(other), torch.Tensor)


def _autograd_function_violation(node: fx.Node, ctx: PassContext) -> str | None:
    """A ``torch.autograd.Function`` is accepted if neither its forward nor its backward body
    mixes rows (checked node by node like the main graph); a body op whose shapes Dynamo did
    not record cannot be checked and is refused."""
    gm = node.graph.owning_module
    bodies = [getattr(gm, a.target) for a in node.args if isinstance(a, fx.Node) and a.op == "get_attr"]
    if not bodies:
        return "is a torch.autograd.Function whose body treecompile cannot see"
    for body in bodies:
        for inner in body.graph.nodes:
            if inner.op not in ("call_function", "call_method", "call_module"):
                continue
            if value(inner) is None and not isinstance(inner.target, str):
                continue  # no value recorded: a non-tensor helper call (checked through its users)
            why = _violation(inner, ctx)
            if why:
                return f"is a torch.autograd.Function whose body has {describe(inner)} that {why}"
    return None


def _pads_rows(node: fx.Node, s) -> bool:
    """A pad whose amounts on a row dim are not both literally 0 (``(l, r)`` pairs from the last dim)."""
    x = node.args[0] if node.args else node.kwargs.get("input")
    pad = node.args[1] if len(node.args) > 1 else node.kwargs.get("pad")
    xv = value(x)
    if not (isinstance(xv, torch.Tensor) and isinstance(pad, (tuple, list))):
        return bool(row_dims(x, s))
    rows = set(row_dims(x, s))
    for i in range(0, len(pad) - 1, 2):
        dim = xv.dim() - 1 - i // 2
        if dim in rows and not (pad[i] == 0 and pad[i + 1] == 0):
            return True
    return False


def _symbolic(s) -> bool:
    """Whether the sequence length is a symbol (not a number, nor a SymInt specialised to one)."""
    return isinstance(s, torch.SymInt) and bool(s.node.expr.free_symbols)


def _refuse_static_length(gm: fx.GraphModule, ctx: PassContext) -> None:
    """Raises: the captured graph has a constant sequence length; names a per-token op if it finds one."""
    s = ctx.seq_len
    culprit = next((n for n in gm.graph.nodes if n not in ctx.created and _indexes_one_token(n, s)), None)
    where = (f" {describe(culprit)} takes one token of the row at a time.\n  at {source_of(culprit)}\n"
             if culprit is not None else "\n")
    raise UnsupportedModelError(
        f"treecompile cannot make this model exact on a tree: the model makes the sequence length a constant "
        f"({s}) in the captured graph, typically a Python loop over the tokens (for t in range(seq_len)) or a "
        f"branch on the length, so its per-token ops cannot be checked.{where}"
        "Write the recurrence as a scan kernel treecompile knows (see docs/hybrid.md), or as ops over the whole "
        "sequence."
    )


def _indexes_one_token(node: fx.Node, s) -> bool:
    """``x[:, t]`` / ``x.select(1, t)`` / ``x.unbind(1)`` on a dim of the row length."""
    x = node.args[0] if node.args else None
    xv = value(x)
    if not isinstance(xv, torch.Tensor):
        return False
    if node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[1], tuple):
        index = node.args[1]
        if Ellipsis in index:
            return False
        return any(isinstance(i, int) and d < xv.dim() and same_size(xv.shape[d], s) for d, i in enumerate(index))
    if is_call(node, (torch.select, torch.unbind), ("select", "unbind")):
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
        return isinstance(dim, int) and same_size(xv.shape[dim], s)
    return False


def _is_sequence_kernel(node: fx.Node) -> bool:
    """The linear-sequence kernel ops the wrapper swaps in (their tree forms are created nodes)."""
    ops = [getattr(torch.ops.treecompile, name, None) for name in ("causal_conv1d", *SCAN_OPS)]
    return any(op is not None and is_op(node, op) for op in ops)


def _norm(d: int, x) -> int:
    v = value(x)
    return d % v.dim() if isinstance(v, torch.Tensor) and v.dim() else d


def _is_seq_dim(x, dim, s) -> bool:
    if dim is None or not isinstance(dim, int):
        return bool(row_dims(x, s))
    return _norm(dim, x) in row_dims(x, s)


def _dims_arg(node: fx.Node):
    dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else None)
    if node.target in ("flip", torch.flip) or node.target in ("roll", torch.roll):
        dim = node.kwargs.get("dims", node.args[-1] if len(node.args) > 1 else None)
    if dim is None or isinstance(dim, fx.Node):
        return None
    return list(dim) if isinstance(dim, (tuple, list)) else [dim]


def _changes_length(node: fx.Node, s) -> bool:
    """An S-derived size other than S in the output (needs a symbolic S)."""
    if not isinstance(s, torch.SymInt):
        return False
    v = value(node)
    if not isinstance(v, torch.Tensor):
        return False
    sym = s.node.expr.free_symbols
    # A reshape that merges the rows with whole other dims ([B, S, H, D] -> [B*S*H, D], as
    # HF's gated norms do) moves no token: every S-derived size is a multiple of S; ops on
    # the merged tensor that keep that dim (casts, token-wise math) move none either.
    merges_rows = is_call(node, (torch.reshape, torch.flatten), _RESHAPE_METHODS)
    for size in v.shape:
        if isinstance(size, torch.SymInt) and size.node.expr.free_symbols & sym and not same_size(size, s):
            if multiple_of(size, s) and (merges_rows or _passes_through(node, size)):
                continue
            return True
    return False


_RESHAPE_METHODS = {"reshape", "view", "flatten"}


def _passes_through(node: fx.Node, size) -> bool:
    """Whether an input already has a dim of this size (the op keeps the merged rows as they are)."""
    for m in node.all_input_nodes:
        mv = value(m)
        if isinstance(mv, torch.Tensor) and any(same_size(d, size) for d in mv.shape):
            return True
    return False



# ----------------------------------------------------------------------------- row movement

_NORMS = {F.layer_norm, torch.layer_norm, F.group_norm, torch.group_norm, F.instance_norm, torch.instance_norm,
          F.batch_norm, torch.batch_norm}
_NORM_METHODS: set[str] = set()


def _normalises_rows(node: fx.Node, s) -> bool:
    """A norm whose statistics run over a row dim: ``layer_norm`` over a shape that includes
    the sequence, group / instance norm over a sequence spatial dim, batch norm in training."""
    x = node.args[0] if node.args else node.kwargs.get("input")
    rows = row_dims(x, s)
    if not rows:
        return False
    xv = value(x)
    if node.target in (F.layer_norm, torch.layer_norm):
        shape = node.args[1] if len(node.args) > 1 else node.kwargs.get("normalized_shape")
        shape = value(shape) if isinstance(shape, fx.Node) else shape
        n = len(shape) if isinstance(shape, (tuple, list, torch.Size)) else 1
        return any(d >= xv.dim() - n for d in rows)
    if node.target in (F.batch_norm, torch.batch_norm):
        training = bind(node, ["input", "running_mean", "running_var", "weight", "bias", "training"],
                        {"training": False, "running_mean": None})
        # Eval mode with running statistics is a per-channel affine map of each token.
        return bool(training["training"]) or training["running_mean"] is None
    return True


def _row_index_source(node: fx.Node, s) -> str | None:
    """For an op that indexes a row dim with a tensor: what positional quantity the index is
    computed from (``arange``, the positions, the sequence length), else None.

    Indices from the data (an MoE router's token lists) keep each token's row and are left to
    the other rules; an index that is the identity (``arange(S)`` over a dim of S rows) moves
    nothing; other indices built from the row index move a token's neighbour in the packed
    row into it, which is not its neighbour on the path.
    """
    for index, _dim in row_indices(node, s):
        if is_identity_row_index(index, s):
            continue
        source = _positional_source(index, s)
        if source:
            return source
    return None


def _only_identity_index(node: fx.Node, s) -> bool:
    """An ``arange(S)`` used only as the index along the rows of S-row tensors (the identity)."""
    return is_identity_row_index(node, s) and all(any(i is node for i, _ in row_indices(u, s)) for u in node.users)


def _positional_source(index: fx.Node, s) -> str | None:
    """``arange`` / ``the tree positions`` / ``the sequence length`` if ``index`` depends on one."""
    stack, seen = [index], set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if is_call(n, ARANGE):
            return "arange"
        if n.op == "placeholder" and "position" in str(n.target).lower():
            return "the positions"
        v = value(n)
        if isinstance(v, (torch.SymInt, torch.SymFloat)) and _mentions(v, s):
            return "the sequence length"
        stack.extend(n.all_input_nodes)
    return None


_VALUE_OPS = {operator.add, operator.sub, operator.mul, operator.truediv, operator.floordiv, operator.mod,
              operator.pow, operator.radd if hasattr(operator, "radd") else operator.add,
              torch.add, torch.sub, torch.mul, torch.div, torch.true_divide, torch.floor_divide, torch.pow,
              torch.rsub, torch.remainder, torch.fmod, torch.clamp, torch.clip, torch.clamp_min, torch.clamp_max,
              torch.minimum, torch.maximum, torch.where, torch.masked_fill, torch.lerp, torch.full_like,
              torch.tensor, torch.scalar_tensor, torch.as_tensor}
_VALUE_METHODS = {"add", "sub", "mul", "div", "true_divide", "floor_divide", "pow", "rsub", "remainder", "fmod",
                  "clamp", "clip", "clamp_min", "clamp_max", "masked_fill", "masked_fill_", "fill_", "lerp",
                  "add_", "sub_", "mul_", "div_", "pow_", "clamp_", "__radd__", "__rsub__", "__rmul__",
                  "__rtruediv__", "__truediv__", "__mul__", "__add__", "__sub__"}


def _length_as_value(node: fx.Node, s) -> str | None:
    """The argument through which the sequence length enters a tensor's values, if any.

    Sizes (``view(b, T, -1)``, ``new_zeros(T, d)``) are fine; a value is not: ``x / T``,
    ``full(.., fill_value=T)``, ``clamp(max=T - 1)``.
    """
    if not isinstance(value(node), torch.Tensor):
        return None
    if node.op == "call_function" and node.target in (torch.full, torch.Tensor.new_full) or op_name(node) == "new_full":
        fill = node.args[-1] if len(node.args) >= 2 else node.kwargs.get("fill_value")
        candidates = [fill]
    elif is_call(node, _VALUE_OPS, _VALUE_METHODS):
        candidates = list(node.args) + list(node.kwargs.values())
    else:
        return None
    for a in candidates:
        if isinstance(a, fx.Node):
            v = value(a)
            if isinstance(v, (torch.SymInt, torch.SymFloat)) and _mentions(v, s):
                return "the length S itself" if same_size(v, s) else f"{v}, computed from the length S"
    return None


def _mentions(v, s) -> bool:
    if not isinstance(s, torch.SymInt):
        return False
    try:
        return bool(v.node.expr.free_symbols & s.node.expr.free_symbols)
    except AttributeError:
        return False


def _is_opaque_custom_op(node: fx.Node) -> bool:
    """A call to a registered op outside torch's own namespaces and treecompile's."""
    if node.op != "call_function":
        return False
    t = node.target
    ns = getattr(t, "namespace", None)
    if ns is None and hasattr(t, "overloadpacket"):
        ns = getattr(t.overloadpacket, "namespace", None)
    if ns is None and type(t).__name__ in ("OpOverload", "OpOverloadPacket"):
        ns = str(t).split(".")[0]
    return ns is not None and ns not in ("aten", "prims", "treecompile", "higher_order", "_c10d_functional",
                                         "c10d_functional", "profiler", "inductor")
