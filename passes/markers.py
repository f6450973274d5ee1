"""Custom ops that mark, in a captured graph, what the passes must find.

* ``treecompile::tree_inputs(input_ids, seq_tensors, other_tensors)`` returns a copy of
  ``input_ids``. The wrapper routes the ids through it so that the tree tensors
  (positions, mask buffers, BlockMask tensors) become real inputs of the Dynamo graph:
  Dynamo drops inputs nothing uses, and a graph input cannot be added afterwards. Its
  fake implementation ties every ``seq_tensors`` length to S with ``torch._check``, so
  with dynamic shapes they share S's symbol. The pipeline removes it first.
* ``treecompile::causal_attention(q, k, v, scale, window, softcap)`` is what
  :func:`hf_causal_attention` emits for Hugging Face attention-interface calls: one
  opaque node carrying the call's semantics (scale, sliding window, soft-capping) instead
  of whichever kernel the model was configured with. The attention pass rewrites it; the
  verify pass refuses it if it survives. Its eager body is plain per-sequence causal
  attention, the reference semantics.
* ``treecompile::tree_logprobs(logits, rows, slot, target, dest)`` gives the per-target
  log-probabilities ``[S]``; the loss pass replaces it so that only needed rows reach the
  vocabulary projection. Its eager body and autograd formula are the reference.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from treecompile.errors import UnsupportedModelError

__all__ = ["tree_inputs", "causal_attention", "tree_logprobs", "hf_causal_attention", "OPS", "is_marker"]

Tensor = torch.Tensor


@torch.library.custom_op("treecompile::tree_inputs", mutates_args=())
def tree_inputs(input_ids: Tensor, seq_tensors: list[Tensor], other_tensors: list[Tensor]) -> Tensor:
    """Identity on ``input_ids`` ``[B, S]``; makes the tree tensors graph inputs."""
    return input_ids.clone()


@tree_inputs.register_fake
def _tree_inputs_fake(input_ids, seq_tensors, other_tensors):
    s = input_ids.shape[-1]
    for t in seq_tensors:
        torch._check(t.shape[0] == s)
    return torch.empty_like(input_ids)


def _reference_causal(q: Tensor, k: Tensor, v: Tensor, scale: float, window: int | None, softcap: float | None):
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
    return torch.softmax(scores, dim=-1) @ v


@torch.library.custom_op("treecompile::causal_attention", mutates_args=())
def causal_attention(
    q: Tensor, k: Tensor, v: Tensor, scale: float, window: int | None, softcap: float | None
) -> Tensor:
    """Per-sequence causal attention ``[B, Hq, S, Dv]``; a marker the attention pass rewrites."""
    return _reference_causal(q, k, v, scale, window, softcap)


@causal_attention.register_fake
def _causal_attention_fake(q, k, v, scale, window, softcap):
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
    lp = torch.log_softmax(_upcast(logits[0].index_select(0, rows)), dim=-1)
    out = lp.new_zeros(logits.shape[1])
    return out.index_put((dest,), lp[slot, target])


@tree_logprobs.register_fake
def _tree_logprobs_fake(logits, rows, slot, target, dest):
    return logits.new_empty(logits.shape[1], dtype=_upcast_dtype(logits.dtype))


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


def _upcast_dtype(dtype: torch.dtype) -> torch.dtype:
    # Log-probabilities in at least float32, as the per-path reference computes them.
    return torch.promote_types(dtype, torch.float32)


def _upcast(x: Tensor) -> Tensor:
    return x.to(_upcast_dtype(x.dtype))


#: The marker ops, by the name the passes and error messages use.
OPS = {
    "tree_inputs": torch.ops.treecompile.tree_inputs,
    "causal_attention": torch.ops.treecompile.causal_attention,
    "tree_logprobs": torch.ops.treecompile.tree_logprobs,
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
    soft-cap", which is what the marker records. ``attention_mask`` is ignored: the
    wrapper never passes a mask, so any mask HF builds is structural (causal, window,
    packing) and the tree rule replaces all of it.

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
    for key_name, val in kwargs.items():
        if key_name in _IGNORED_HF_KWARGS or val is None:
            continue
        if key_name in ("s_aux", "sinks") or isinstance(val, Tensor):
            raise UnsupportedModelError(
                f"{name}: attention argument {key_name!r} is not supported by treecompile yet"
            )
    scale = scaling if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
    out = torch.ops.treecompile.causal_attention(query, key, value, float(scale), sliding_window, softcap)
    return out.transpose(1, 2).contiguous(), None
