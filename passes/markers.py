"""Custom ops that mark, in a captured graph, what the passes must find.

* ``treecompile::tree_inputs(input_ids, seq_tensors, other_tensors, structure)`` returns a
  copy of ``input_ids``. The wrapper routes the ids through it so that the tree tensors
  (positions, mask buffers, BlockMask tensors) become real inputs of the Dynamo graph:
  Dynamo drops inputs nothing uses, and a graph input cannot be added afterwards. Its
  fake implementation ties every ``seq_tensors`` length to S with ``torch._check``, so
  with dynamic shapes they share S's symbol. ``structure`` is empty, or, for a model with
  recurrent or conv layers, ``[pred_index [S], node_table [N, 3]]`` (the node table on the
  CPU; the conv context and SSM state passes read them). The pipeline removes it first.
* ``treecompile::causal_attention(q, k, v, scale, window, softcap, sinks)`` is what
  :func:`hf_causal_attention` emits for Hugging Face attention-interface calls: one
  opaque node carrying the call's semantics (scale, sliding window, soft-capping, attention
  sinks) instead
  of whichever kernel the model was configured with. The attention pass rewrites it; the
  verify pass refuses it if it survives. Its eager body is plain per-sequence causal
  attention, the reference semantics.
* ``treecompile::tree_logprobs(logits, rows, slot, target, dest)`` gives the per-target
  log-probabilities ``[S]``; the loss pass replaces it so that only needed rows reach the
  vocabulary projection. Its eager body and autograd formula are the reference.
* ``treecompile::experts_begin(hidden, top_k_index, top_k_weights)`` and
  ``treecompile::experts_end(out)`` bracket a mixture-of-experts block's expert
  computation (what :func:`hf_experts` emits for Hugging Face experts-interface calls).
  Everything between them is the experts' token-wise function (each output row from its
  own row's hidden state and routing); the MoE pass checks the region and removes both.
* ``treecompile::router_stats_begin(router_logits, row_weights)`` and
  ``treecompile::router_aux_end(aux)`` bracket the router auxiliary loss the wrapper
  computes with the model's own function from all layers' ``[S, E]`` router logits and
  the ``[S]`` row weights (``path_count``); the MoE pass checks that every reduction over
  the rows inside is weighted, then removes both.

All four are identities (copies, as custom ops may not alias their inputs); none is left
in a graph that is lowered.
"""

from __future__ import annotations

import functools
import inspect
import math
from typing import Any

import torch

from treecompile.errors import UnsupportedModelError
from treecompile.kernels.dtypes import compute_dtype

__all__ = [
    "tree_inputs",
    "causal_attention",
    "tree_logprobs",
    "experts_begin",
    "experts_end",
    "router_stats_begin",
    "router_aux_end",
    "hf_causal_attention",
    "hf_experts",
    "uses_attention_interface",
    "has_own_attention",
    "OPS",
    "is_marker",
]

Tensor = torch.Tensor


@torch.library.custom_op("treecompile::tree_inputs", mutates_args=())
def tree_inputs(
    input_ids: Tensor, seq_tensors: list[Tensor], other_tensors: list[Tensor], structure: list[Tensor]
) -> Tensor:
    """Identity on ``input_ids`` ``[B, S]``; makes the tree tensors graph inputs."""
    return input_ids.clone()


@tree_inputs.register_fake
def _tree_inputs_fake(input_ids, seq_tensors, other_tensors, structure):
    s = input_ids.shape[-1]
    for t in seq_tensors:
        torch._check(t.shape[0] == s)
    if structure:
        pred_index, _node_table = structure
        torch._check(pred_index.shape[0] == s)
    return torch.empty_like(input_ids)


def _reference_causal(q: Tensor, k: Tensor, v: Tensor, scale: float, window: int | None, softcap: float | None,
                      sinks: Tensor | None = None):
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    scores = (q @ k.transpose(-2, -1)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    s = q.shape[-2]
    idx = torch.arange(s, device=q.device)
    allowed = idx[None, :] <= idx[:, None]
    if window is not None:
        allowed &= idx[:, None] - idx[None, :] < window
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is None:
        return torch.softmax(scores, dim=-1) @ v
    sink = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1] @ v


@torch.library.custom_op("treecompile::causal_attention", mutates_args=())
def causal_attention(
    q: Tensor, k: Tensor, v: Tensor, scale: float, window: int | None, softcap: float | None,
    sinks: Tensor | None = None,
) -> Tensor:
    """Per-sequence causal attention ``[B, Hq, S, Dv]``; a marker the attention pass rewrites.

    ``sinks`` ``[Hq]``: a learned logit per head in every softmax denominator (gpt-oss).
    """
    return _reference_causal(q, k, v, scale, window, softcap, sinks)


@causal_attention.register_fake
def _causal_attention_fake(q, k, v, scale, window, softcap, sinks=None):
    return q.new_empty((*q.shape[:-1], v.shape[-1]))


@torch.library.custom_op("treecompile::tree_logprobs", mutates_args=())
def tree_logprobs(logits: Tensor, rows: Tensor, slot: Tensor, target: Tensor, dest: Tensor) -> Tensor:
    """``[S]`` log-probability of each target token; 0 where a row predicts nothing.

    Args:
        logits: ``[1, S, V]``.
        rows: ``[R]`` distinct rows whose outputs predict some target.
        slot: ``[M]`` index into ``rows`` of each target's predicting row.
        target: ``[M]`` token id of each target.
        dest: ``[M]`` row of each target in the packed sequence.
    """
    return logprobs_at_rows(logits[0].index_select(0, rows), slot, target, dest, logits.shape[1])


@tree_logprobs.register_fake
def _tree_logprobs_fake(logits, rows, slot, target, dest):
    return logits.new_empty(logits.shape[1], dtype=compute_dtype(logits.dtype))


def _tree_logprobs_setup(ctx, inputs, output):
    logits, rows, slot, target, dest = inputs
    ctx.save_for_backward(logits, rows, slot, target, dest)


def _tree_logprobs_backward(ctx, grad):
    logits, rows, slot, target, dest = ctx.saved_tensors
    # d log_softmax(z)[t] / dz = onehot(t) - softmax(z), for each target's predicting row.
    probs = torch.softmax(_upcast(logits[0].index_select(0, rows)), dim=-1)
    g = grad[dest]
    per_target = -probs[slot] * g[:, None]
    per_target[torch.arange(slot.shape[0], device=slot.device), target] += g
    grad_logits = torch.zeros(logits.shape, dtype=per_target.dtype, device=logits.device)
    grad_logits[0].index_add_(0, rows[slot], per_target)
    return grad_logits.to(logits.dtype), None, None, None, None


tree_logprobs.register_autograd(_tree_logprobs_backward, setup_context=_tree_logprobs_setup)


def _upcast(x: Tensor) -> Tensor:
    return x.to(compute_dtype(x.dtype))


def scatter_to_rows(values: Tensor, dest: Tensor, length: Any) -> Tensor:
    """``[length]``: ``values[m]`` (``[M]``) at row ``dest[m]``, 0 at every other row."""
    return values.new_zeros(length).index_put((dest,), values)


def logprobs_at_rows(logits_rows: Tensor, slot: Tensor, target: Tensor, dest: Tensor, length: Any) -> Tensor:
    """``[length]`` target log-probabilities, 0 at rows that are no target.

    Args:
        logits_rows: ``[R, V]`` logits of the predicting rows; the log-softmax is taken in at
            least float32.
        slot, target, dest: ``[M]`` (see `tree_logprobs`).
        length: S.
    """
    lp = torch.log_softmax(_upcast(logits_rows), dim=-1)
    return scatter_to_rows(lp[slot, target], dest, length)


@torch.library.custom_op("treecompile::experts_begin", mutates_args=())
def experts_begin(hidden: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Identity on an experts call's inputs ``[T, D]``, ``[T, k]``, ``[T, k]``: opens the region."""
    return hidden.clone(), top_k_index.clone(), top_k_weights.clone()


@experts_begin.register_fake
def _experts_begin_fake(hidden, top_k_index, top_k_weights):
    return torch.empty_like(hidden), torch.empty_like(top_k_index), torch.empty_like(top_k_weights)


@torch.library.custom_op("treecompile::experts_end", mutates_args=())
def experts_end(out: Tensor) -> Tensor:
    """Identity on the experts' output ``[T, D]``: closes the region."""
    return out.clone()


@experts_end.register_fake
def _experts_end_fake(out):
    return torch.empty_like(out)


@torch.library.custom_op("treecompile::router_stats_begin", mutates_args=())
def router_stats_begin(router_logits: list[Tensor], row_weights: Tensor) -> list[Tensor]:
    """Identity on every layer's router logits ``[S, E]`` and the row weights ``[S]``.

    Returns:
        The logits, then the weights, as one list.
    """
    return [t.clone() for t in (*router_logits, row_weights)]


@router_stats_begin.register_fake
def _router_stats_begin_fake(router_logits, row_weights):
    s = row_weights.shape[0]
    for t in router_logits:
        torch._check(t.shape[0] == s)
    return [torch.empty_like(t) for t in (*router_logits, row_weights)]


@torch.library.custom_op("treecompile::router_aux_end", mutates_args=())
def router_aux_end(aux: Tensor) -> Tensor:
    """Identity on the router auxiliary loss (a scalar): closes the region."""
    return aux.clone()


@router_aux_end.register_fake
def _router_aux_end_fake(aux):
    return torch.empty_like(aux)


#: The marker ops, by the name the passes and error messages use.
OPS = {
    "tree_inputs": torch.ops.treecompile.tree_inputs,
    "causal_attention": torch.ops.treecompile.causal_attention,
    "tree_logprobs": torch.ops.treecompile.tree_logprobs,
    "experts_begin": torch.ops.treecompile.experts_begin,
    "experts_end": torch.ops.treecompile.experts_end,
    "router_stats_begin": torch.ops.treecompile.router_stats_begin,
    "router_aux_end": torch.ops.treecompile.router_aux_end,
}


def is_marker(node: torch.fx.Node, name: str) -> bool:
    """Whether ``node`` calls the marker op ``name`` (Dynamo records the overload packet)."""
    if node.op != "call_function":
        return False
    packet = OPS[name]
    return node.target is packet or node.target is packet.default

#: Attention-interface keyword arguments that carry no meaning for the result.
_IGNORED_HF_KWARGS = {"position_ids", "cache_position", "output_attentions", "use_cache", "layer_idx", "is_causal"}


def hf_causal_attention(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """A Hugging Face attention-interface function that emits ``treecompile::causal_attention``.

    Registered under the name ``"treecompile"``; the wrapper selects it for the duration of
    each call. Whatever kernel the model was configured with (eager, sdpa, flex, flash),
    the call's meaning is "causal attention over the sequence with this scale, window and
    soft-cap", which is what the marker records. ``attention_mask`` is what the model's
    ``masking_utils`` builders returned during the call, a :class:`~treecompile.capture.TreeMask`
    (see :mod:`treecompile.capture`): causal, or a sliding window (its size is used when the
    call passes none); any other kind, and a mask tensor built by the model's own code,
    are refused, since the tree rule would drop them.

    Returns:
        ``([B, S, Hq, Dv], None)`` like HF's implementations.
    """
    name = type(module).__name__
    if dropout:
        raise UnsupportedModelError(
            f"{name}: attention dropout {dropout} is random per call and cannot match per-path "
            "training; call model.eval() or set the attention dropout to 0"
        )
    if not getattr(module, "is_causal", True):
        raise UnsupportedModelError(f"{name}: non-causal attention cannot be trained on a tree")
    sinks = None
    for key_name, val in kwargs.items():
        if key_name in _IGNORED_HF_KWARGS or val is None:
            continue
        if key_name in ("s_aux", "sinks") and isinstance(val, Tensor) and val.dim() == 1:
            sinks = val  # one learned logit per head, in every softmax denominator
            continue
        if key_name in ("s_aux", "sinks") or isinstance(val, Tensor):
            raise UnsupportedModelError(
                f"{name}: attention argument {key_name!r} is not supported by treecompile yet"
            )
    _check_kept_by_the_model(module, softcap, sinks)
    sliding_window = _window_from_mask(name, attention_mask, sliding_window)
    scale = scaling if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
    out = torch.ops.treecompile.causal_attention(query, key, value, float(scale), sliding_window, softcap, sinks)
    return out.transpose(1, 2).contiguous(), None


def _check_kept_by_the_model(module: torch.nn.Module, softcap: float | None, sinks: Tensor | None) -> None:
    """Refuses a soft-cap or attention sinks that the model's own attention implementation
    would not apply: Hugging Face's ``sdpa`` attention has neither (transformers 5.10 drops a
    soft-cap without a word, later versions raise), so the model trained per path runs
    without them while the tree's attention would apply them."""
    routed_from = getattr(getattr(module, "config", None), "treecompile_routed_from", None)
    if not (isinstance(routed_from, str) and "sdpa" in routed_from):
        return
    what = [f"soft-capping (softcap={softcap})"] if softcap is not None else []
    what += ["attention sinks"] if sinks is not None else []
    if what:
        raise UnsupportedModelError(
            f"{type(module).__name__}: attention {' and '.join(what)} under attn_implementation={routed_from!r}, "
            "which does not apply it: the model trained per path runs without it, the tree would run with it. "
            "Load the model with attn_implementation='eager' (or another implementation that applies it, "
            "e.g. 'flex_attention')"
        )


def _window_from_mask(name: str, mask: Any, window: int | None) -> int | None:
    """The sliding window a Hugging Face attention call means, from its mask and its argument."""
    from treecompile.capture import TreeMask

    if mask is None:
        return window
    if isinstance(mask, TreeMask):
        if mask.kind == "causal":
            return window
        if mask.kind == "sliding" and mask.size is not None:
            if window is not None and window != mask.size:
                raise UnsupportedModelError(
                    f"{name}: the attention call's sliding_window={window} differs from the mask's "
                    f"{mask.builder} window {mask.size}"
                )
            return mask.size
        raise UnsupportedModelError(
            f"{name}: {mask.kind} attention mask ({mask.builder}"
            + (f", size {mask.size}" if mask.size else "")
            + ") is not reproduced on a tree; treecompile supports causal and sliding-window attention"
        )
    raise UnsupportedModelError(
        f"{name}: receives an attention mask {type(mask).__name__} built by the model's own code (a custom causal "
        "mask, or a bias such as ALiBi carried in the mask), not by transformers.masking_utils; treecompile cannot "
        "reproduce it on a tree"
    )


def hf_experts(module: torch.nn.Module, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
    """A Hugging Face experts-interface function that brackets the experts with markers.

    Registered under the name ``"treecompile"``; the wrapper selects it for the duration of
    each call. Between the markers it runs HF's ``grouped_mm`` implementation: tokens
    sorted by expert, one grouped matmul per projection, scattered back. That sort and
    scatter move rows around, but the result is token-wise (row ``t`` of the output is
    ``sum_j top_k_weights[t, j] * expert[top_k_index[t, j]](hidden[t])``; HF's experts have
    no capacity limit that would let one token's routing displace another's), which the
    MoE pass relies on. ``grouped_mm`` rather than the model's configured implementation:
    HF's ``eager`` experts loop over the experts present, a data-dependent loop that Dynamo
    cannot capture as one graph.

    Args:
        hidden_states: ``[T, D]``; top_k_index, top_k_weights: ``[T, k]``.

    Returns:
        ``[T, D]``.
    """
    from transformers.integrations.moe import grouped_mm_experts_forward

    h, idx, w = torch.ops.treecompile.experts_begin(hidden_states, top_k_index, top_k_weights)
    return torch.ops.treecompile.experts_end(grouped_mm_experts_forward(module, h, idx, w))


@functools.lru_cache(maxsize=None)
def _calls_attention_interface(cls: type) -> bool:
    try:
        src = inspect.getsource(cls.forward)
    except (OSError, TypeError, AttributeError):
        return False
    return "ALL_ATTENTION_FUNCTIONS" in src


@functools.lru_cache(maxsize=None)
def _computes_attention(cls: type) -> bool:
    try:
        src = inspect.getsource(cls)  # the whole class: GPT-J's forward calls its own _attn
    except (OSError, TypeError):
        return False
    src = src.lower()  # nn.Softmax(dim=-1)(scores) too (CodeGen)
    return "softmax(" in src or "scaled_dot_product_attention(" in src


def has_own_attention(model: torch.nn.Module) -> bool:
    """Whether the model computes attention in its own code and never through Hugging
    Face's attention interface (see `uses_attention_interface`): some module's class calls
    ``softmax`` or ``scaled_dot_product_attention`` itself. Models without attention
    (Mamba, RWKV) are neither."""
    modules = list(model.modules())
    return not any(_calls_attention_interface(type(m)) for m in modules) and any(
        _computes_attention(type(m)) for m in modules
    )


def uses_attention_interface(model: torch.nn.Module) -> bool:
    """Whether the model's attention goes through Hugging Face's attention interface.

    True if some module's ``forward`` looks its attention function up in
    ``ALL_ATTENTION_FUNCTIONS`` (most families since transformers 4.48). Older families
    (GPT-J, CodeGen, Falcon, MPT, Bloom, GPT-Neo, XGLM ...) compute attention in their own
    code from the mask HF builds; for them the wrapper leaves the attention implementation
    as it is and passes an all-ones ``attention_mask`` (so HF builds its plain causal mask
    from sizes alone, not a packed-sequence mask from the tree's position ids), and the
    attention pass recognises their attention like a custom model's.
    """
    return any(_calls_attention_interface(type(m)) for m in model.modules())
