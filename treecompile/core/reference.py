"""The per-path baseline: the ground truth every tree result is checked against.

Each path runs through the *unmodified* model as its own sequence ``[1, T]``, and the
loss is formed straight from the definition of the loss mode. This module shares no
code with the tree side (weights, packing, masks) so that agreement between the two is
evidence, not an identity.

A mixture-of-experts model's router auxiliary (load-balancing) loss is defined over the
whole batch, not per path: per-path training puts all ``P`` paths through the model in one
padded batch and HF computes ``load_balancing_loss_func(router_logits, num_experts, top_k,
attention_mask)`` over every real token of every path. Running each path alone and
concatenating the paths' router logits (no padding, so no mask) gives the same value;
`per_path_loss` does that when asked for the term with ``router_aux_loss_coef``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from treecompile.kernels.dtypes import compute_dtype
from treecompile.core.loss import LOSS_MODES
from treecompile.core.tree import TrajectoryTree
from treecompile.core.errors import unknown_choice

__all__ = ["ReferenceOutput", "logits_of", "model_logits", "reference_model", "path_logprobs", "per_path_loss", "dense_mask_logits",
           "dense_mask_inputs"]

Forward = Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]


@dataclass
class ReferenceOutput:
    """Result of `per_path_loss`.

    Attributes:
        loss: scalar, differentiable.
        logprobs: per path, ``[T_p]`` log-probabilities of its tokens (0 at position 0).
        n_targets: per path, its number of target tokens.
        aux_loss: the router auxiliary loss over all paths' tokens (unscaled), when asked for.
    """

    loss: torch.Tensor
    logprobs: list[torch.Tensor]
    n_targets: list[int]
    aux_loss: torch.Tensor | None = None


def _is_hf(model: torch.nn.Module) -> bool:
    return hasattr(model, "config") and hasattr(model, "can_generate")


def model_logits(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """Runs a causal LM on ``input_ids`` ``[1, T]`` and returns logits ``[1, T, V]``.

    Hugging Face models run with ``use_cache=False`` (a cache changes nothing in the
    result but costs memory); other modules are called as ``model(input_ids)`` and may
    return a tensor, a tuple whose first item is the logits, or an object with ``.logits``.
    A tree-compiled model, or a model wrapping one (PEFT's ``get_peft_model`` of it), is run
    as the model it wraps (`reference_model`): its own call returns log-probabilities, not logits.
    """
    model = reference_model(model)
    out = model(input_ids=input_ids, use_cache=False) if _is_hf(model) else model(input_ids)
    return logits_of(out)


def reference_model(model: torch.nn.Module) -> torch.nn.Module:
    """The model a per-path run calls: ``model`` itself, or where ``model`` is a tree-compiled
    model or wraps one alone (a chain of modules with one child each: PEFT's wrappers, whose
    adapters live in the wrapped model's layers), the model that one wraps. A model that holds
    a tree-compiled module beside other layers is called as it is."""
    m, seen = model, set()
    while id(m) not in seen:
        seen.add(id(m))
        if getattr(type(m), "wraps_a_model_for_trees", False):
            return m.model
        children = list(vars(m).get("_modules", {}).values())
        if len(children) != 1 or children[0] is None:
            break
        m = children[0]
    return model


def model_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A deep copy of ``model`` to run per path without touching the model's own state; a tensor
    an attribute holds that autograd computed (the ``weight`` of ``torch.nn.utils.weight_norm``,
    which its hook recomputes at every call) is copied detached, as ``copy.deepcopy`` refuses it."""
    import copy

    memo = {id(v): v.detach().clone() for m in model.modules() for v in vars(m).values()
            if isinstance(v, torch.Tensor) and not v.is_leaf}
    return copy.deepcopy(model, memo)


def logits_of(out: Any) -> torch.Tensor:
    """The logits in a model's output: a tensor, ``out.logits``, or the first item of a tuple."""
    if isinstance(out, torch.Tensor):
        return out
    if hasattr(out, "logits"):
        return out.logits
    if isinstance(out, (tuple, list)):
        return out[0]
    raise TypeError(f"cannot find logits in the model's output of type {type(out).__name__}")


def path_logprobs(model: torch.nn.Module, tokens: Sequence[int], *, forward: Forward | None = None) -> torch.Tensor:
    """``[T]`` log-probabilities of a path's tokens under the model; entry 0 is 0.

    Computed in at least float32 from the model's logits, by the usual label shift.
    """
    device = next(model.parameters()).device
    ids = torch.as_tensor(np.asarray(tokens), dtype=torch.int64, device=device)[None]
    logits = (forward or model_logits)(model, ids)[0]
    dtype = compute_dtype(logits.dtype)
    logp = torch.log_softmax(logits[:-1].to(dtype), dim=-1)
    picked = logp.gather(-1, ids[0, 1:, None])[:, 0]
    return torch.cat([torch.zeros(1, dtype=dtype, device=device), picked])


def _paths_of(
    paths: TrajectoryTree | Sequence[TrajectoryTree] | Sequence[Sequence[int]],
    weights: Sequence[float] | None,
    loss_masks: Sequence[Any] | None,
) -> tuple[list[np.ndarray], np.ndarray, list[np.ndarray]]:
    if isinstance(paths, TrajectoryTree):
        paths = [paths]
    paths = list(paths)
    if paths and isinstance(paths[0], TrajectoryTree):
        if weights is not None or loss_masks is not None:
            raise ValueError("weights and loss_masks come from the trees; do not pass them with trees")
        all_paths = [p for t in paths for p in t.paths()]
        return (
            [p.tokens for p in all_paths],
            np.array([p.weight for p in all_paths], dtype=np.float64),
            [p.loss_mask for p in all_paths],
        )
    toks = [np.asarray(p, dtype=np.int64) for p in paths]
    w = np.ones(len(toks)) if weights is None else np.asarray(weights, dtype=np.float64)
    masks = [
        np.ones(len(t), dtype=bool) if loss_masks is None or loss_masks[i] is None else np.asarray(loss_masks[i], bool)
        for i, t in enumerate(toks)
    ]
    return toks, w, masks


def per_path_loss(
    model: torch.nn.Module,
    paths: TrajectoryTree | Sequence[TrajectoryTree] | Sequence[Sequence[int]],
    *,
    weights: Sequence[float] | None = None,
    loss_masks: Sequence[Any] | None = None,
    loss_mode: str = "token-mean",
    denominator: float | None = None,
    forward: Forward | None = None,
    router_aux_loss_coef: float | None = None,
) -> ReferenceOutput:
    """The loss of training on each path separately, in a given loss mode.

    Args:
        model: any causal LM (see `model_logits`), unmodified.
        paths: token sequences, or trees (their paths, weights and masks are used).
        weights: ``[P]`` path weights (sequences only).
        loss_masks: per path, 0/1 per token or None (sequences only). Position 0 is never a target.
        loss_mode: a key of `treecompile.core.loss.LOSS_MODES`.
        denominator: the same override `treecompile.pack` takes.
        forward: ``forward(model, ids[1, T]) -> logits[1, T, V]``, for models called differently.
        router_aux_loss_coef: for a Hugging Face mixture-of-experts model, add
            ``router_aux_loss_coef * aux``, where ``aux`` is the model's
            ``load_balancing_loss_func`` over the router logits of every token of every path
            (a token shared by several paths counts once per path, duplicate paths count
            twice), as HF computes it for one padded batch of all paths. None: no such term.

    Returns:
        The loss, per-path log-probabilities and target counts (and the auxiliary loss);
            ``loss.backward()`` gives the per-path gradients.
    """
    if loss_mode not in LOSS_MODES:
        raise ValueError(unknown_choice("loss mode", loss_mode, LOSS_MODES, "modes"))
    model = reference_model(model)
    toks, w, masks = _paths_of(paths, weights, loss_masks)
    router_logits: list[tuple[torch.Tensor, ...]] = []
    if router_aux_loss_coef is not None:
        if forward is not None or not _is_hf(model):
            raise ValueError("router_aux_loss_coef needs a Hugging Face model called in the usual way (no forward=)")
        forward = _recording_router_logits(router_logits)
    param = next(model.parameters())
    sums, counts, lps = [], [], []
    wt, live = [], []  # per path with tokens: its weight and target count (a path with none is in no mean)
    for tokens, mask, weight in zip(toks, masks, w):
        if not len(tokens):
            lps.append(torch.zeros(0, dtype=compute_dtype(param.dtype), device=param.device))
            counts.append(0)
            continue
        lp = path_logprobs(model, tokens, forward=forward)
        m = torch.as_tensor(mask, device=lp.device).clone()
        m[0] = False  # the first token has nothing to be predicted from
        sums.append((lp * m.to(lp.dtype)).sum())
        counts.append(int(m.sum()))
        lps.append(lp)
        wt.append(float(weight))
        live.append(counts[-1])
    if not sums:
        raise ValueError("every path is empty: there is nothing to train")
    n_paths = len(sums)
    if loss_mode == "token-mean":
        d = float(sum(counts)) if denominator is None else float(denominator)
        loss = -sum(wi * s for wi, s in zip(wt, sums)) / d if d > 0 else sums[0] * 0.0
    elif loss_mode == "sum":
        loss = -sum(wi * s for wi, s in zip(wt, sums)) / (1.0 if denominator is None else float(denominator))
    elif loss_mode == "seq-mean-token-sum":
        d = float(n_paths) if denominator is None else float(denominator)
        loss = -sum(wi * s for wi, s in zip(wt, sums)) / d
    else:  # seq-mean-token-mean
        d = float(n_paths) if denominator is None else float(denominator)
        loss = -sum(wi * s / c for wi, s, c in zip(wt, sums, live) if c > 0) / d
        if not torch.is_tensor(loss):
            loss = sums[0] * 0.0
    aux = None
    if router_aux_loss_coef is not None:
        aux = _router_aux_loss(model, router_logits)
        loss = loss + router_aux_loss_coef * aux.to(loss.dtype)
    return ReferenceOutput(loss=loss, logprobs=lps, n_targets=counts, aux_loss=aux)


def _recording_router_logits(store: list) -> Forward:
    """A ``forward`` that also keeps each call's per-layer router logits ``[T, E]``."""

    def forward(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
        out = model(input_ids=ids, use_cache=False, output_router_logits=True)
        if not out.router_logits:
            raise ValueError(f"{type(model).__name__} returned no router logits")
        store.append(tuple(t.reshape(-1, t.shape[-1]) for t in out.router_logits))
        return out.logits

    return forward


def _router_aux_loss(model: torch.nn.Module, router_logits: list[tuple[torch.Tensor, ...]]) -> torch.Tensor:
    """The model's ``load_balancing_loss_func`` over all paths' tokens: each layer's router
    logits of every path, concatenated along the tokens (no padding, so no mask)."""
    fn = None
    for klass in type(model).__mro__:
        fn = getattr(sys.modules.get(klass.__module__), "load_balancing_loss_func", None)
        if fn is not None:
            break
    if fn is None:
        raise ValueError(f"{type(model).__name__}: its module defines no load_balancing_loss_func")
    per_layer = tuple(torch.cat(layer, dim=0) for layer in zip(*router_logits))
    # The model's own counts, as it passes them (JetMoE keeps them on itself, not in its config).
    experts = getattr(model, "num_experts", None) or model.config.num_experts
    top_k = getattr(model, "num_experts_per_tok", None) or model.config.num_experts_per_tok
    return fn(per_layer, experts, top_k, None)


def dense_mask_logits(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    """``[S, V]`` logits of a Hugging Face model on a tree batch through a dense mask.

    A reference path only: it builds the ``[S, S]`` tree mask (O(S^2) memory) and hands
    it to the model as a 4-D additive mask, with the tree's ``position_ids``. It works
    for HF models whose attention reads ``attention_mask`` (sdpa or eager); for anything
    else use `treecompile.tree_compile`.
    """
    if not _is_hf(model):
        raise TypeError("dense_mask_logits needs a Hugging Face model; use tree_compile for other models")
    out = model(**dense_mask_inputs(batch, next(model.parameters()).dtype))
    return out.logits[0]


def dense_mask_inputs(batch: Any, dtype: torch.dtype) -> dict[str, Any]:
    """The keyword arguments `dense_mask_logits` gives a Hugging Face model (reference, O(S^2)).

    For callers that wrap the model (e.g. in DDP) and must call the wrapper themselves.
    """
    visible = batch.reference_attention_mask()
    additive = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
    additive.masked_fill_(~visible, torch.finfo(dtype).min)
    return {
        "input_ids": batch.input_ids[None],
        "position_ids": batch.position_ids[None],
        "attention_mask": additive[None, None],
        "use_cache": False,
    }
