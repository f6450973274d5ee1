"""Custom ops that mark, in a captured graph, what the passes must find.

* ``treecompile::tree_inputs(input_ids, seq_tensors, other_tensors, structure, path_count)`` returns a
  copy of ``input_ids``. The wrapper routes the ids through it so that the tree tensors
  (positions, mask buffers, BlockMask tensors) become real inputs of the Dynamo graph:
  Dynamo drops inputs nothing uses, and a graph input cannot be added afterwards. Its
  fake implementation ties every ``seq_tensors`` length to S with ``torch._check``, so
  with dynamic shapes they share S's symbol. ``structure`` is empty, or, for a model with
  recurrent or conv layers, ``[pred_index [S], node_table [N, 3]]`` (the node table on the
  CPU; the conv context and SSM state passes read them). ``path_count`` ``[S]`` is the number
  of paths through each row (0 on padding rows), which weights a counter the model keeps
  (`treecompile.passes.counters`). The pipeline removes it first.
* ``treecompile::causal_attention(q, k, v, scale, window, softcap, sinks, chunk)`` is what
  `treecompile.capture.hf_interfaces.hf_causal_attention` emits for Hugging Face attention-interface calls: one
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
  computation (what `treecompile.capture.hf_interfaces.hf_experts` emits for Hugging Face experts-interface calls).
  Everything between them is the experts' token-wise function (each output row from its
  own row's hidden state and routing); the MoE pass checks the region and removes both.
* ``treecompile::router_stats_begin(router_logits, row_weights)`` and
  ``treecompile::router_aux_end(aux)`` bracket the router auxiliary loss the wrapper
  computes with the model's own function from all layers' ``[S, E]`` router logits and
  the ``[S]`` row weights (``path_count``); the MoE pass checks that every reduction over
  the rows inside is weighted, then removes both.
* ``treecompile::call_output(x)`` marks each tensor a compiled call returns (`returned`): every
  other output of the captured graph is state the model keeps after the call (an attribute,
  a dict entry, a Python number), which :mod:`treecompile.passes.state` computes as the
  unmodified model would. The backend removes it before any pass.

All of them are identities (copies, as custom ops may not alias their inputs); none is left
in a graph that is lowered.
"""

from __future__ import annotations

from typing import Any

import torch

from treecompile.kernels.dtypes import compute_dtype

__all__ = [
    "tree_inputs",
    "causal_attention",
    "tree_logprobs",
    "experts_begin",
    "experts_end",
    "router_stats_begin",
    "router_aux_end",
    "call_output",
    "returned",
    "OPS",
    "is_marker",
]

Tensor = torch.Tensor


@torch.library.custom_op("treecompile::tree_inputs", mutates_args=())
def tree_inputs(
    input_ids: Tensor, seq_tensors: list[Tensor], other_tensors: list[Tensor], structure: list[Tensor],
    path_count: Tensor,
) -> Tensor:
    """Identity on ``input_ids`` ``[B, S]``; makes the tree tensors graph inputs."""
    return input_ids.clone()


@tree_inputs.register_fake
def _tree_inputs_fake(input_ids, seq_tensors, other_tensors, structure, path_count):
    s = input_ids.shape[-1]
    for t in [*seq_tensors, path_count]:
        torch._check(t.shape[0] == s)
    if structure:
        pred_index, _node_table = structure
        torch._check(pred_index.shape[0] == s)
    return torch.empty_like(input_ids)


def _reference_causal(q: Tensor, k: Tensor, v: Tensor, scale: float, window: int | None, softcap: float | None,
                      sinks: Tensor | None = None, chunk: int | None = None):
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
    if chunk is not None:
        allowed &= idx[:, None] // chunk == idx[None, :] // chunk
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is None:
        return torch.softmax(scores, dim=-1) @ v
    sink = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1] @ v


@torch.library.custom_op("treecompile::causal_attention", mutates_args=())
def causal_attention(
    q: Tensor, k: Tensor, v: Tensor, scale: float, window: int | None, softcap: float | None,
    sinks: Tensor | None = None, chunk: int | None = None,
) -> Tensor:
    """Per-sequence causal attention ``[B, Hq, S, Dv]``; a marker the attention pass rewrites.

    ``sinks`` ``[Hq]``: a learned logit per head in every softmax denominator (gpt-oss).
    ``chunk``: attention within chunks of that many tokens (Llama 4's ``attention_chunk_size``).
    """
    return _reference_causal(q, k, v, scale, window, softcap, sinks, chunk)


@causal_attention.register_fake
def _causal_attention_fake(q, k, v, scale, window, softcap, sinks=None, chunk=None):
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


@torch.library.custom_op("treecompile::call_output", mutates_args=())
def call_output(x: Tensor) -> Tensor:
    """Identity on a tensor the compiled call returns (see `returned`)."""
    return x.clone()


@call_output.register_fake
def _call_output_fake(x):
    return torch.empty_like(x)


def returned(value: Any) -> Any:
    """``value`` (a tensor, None, or lists and tuples of them) with each tensor passed through
    ``treecompile::call_output``: what a compiled call returns, told apart in the graph from
    the values Dynamo writes back into the model's state after the call."""
    if isinstance(value, torch.Tensor):
        return torch.ops.treecompile.call_output(value)
    if isinstance(value, (list, tuple)):
        return type(value)(returned(v) for v in value)
    return value


#: The marker ops, by the name the passes and error messages use.
OPS = {
    "tree_inputs": torch.ops.treecompile.tree_inputs,
    "causal_attention": torch.ops.treecompile.causal_attention,
    "tree_logprobs": torch.ops.treecompile.tree_logprobs,
    "experts_begin": torch.ops.treecompile.experts_begin,
    "experts_end": torch.ops.treecompile.experts_end,
    "router_stats_begin": torch.ops.treecompile.router_stats_begin,
    "router_aux_end": torch.ops.treecompile.router_aux_end,
    "call_output": torch.ops.treecompile.call_output,
}


def is_marker(node: torch.fx.Node, name: str) -> bool:
    """Whether ``node`` calls the marker op ``name`` (Dynamo records the overload packet)."""
    if node.op != "call_function":
        return False
    packet = OPS[name]
    return node.target is packet or node.target is packet.default

#: Attention-interface keyword arguments that carry no meaning for the result.
