"""Per-path log-probabilities and entropies from one tree pass (old- and reference-policy passes).

    lp = treecompile.logprobs(model, trees)      # no grad, through tree_compile
    lp.per_path[p]                               # [T_p] log p(x_t | x_<t) of path p, 0 at t = 0
    lp.entropy_per_path[p]                       # [T_p] entropy of the distribution predicting x_t

Each row of a tree batch computes its token's log-probability and the full next-token
distribution at its predicting row (``pred_index``) exactly as the path would alone, so
scattering the ``[S]`` row values back along each path's rows gives what running every path
separately gives.

Entropies need the vocabulary distribution of each predicting row:
``tree_compile(model, outputs=("entropy",))`` adds them to the output, computed row by row
from the logits of the ``R`` predicting rows. Like the log-probs they are differentiable, so
an entropy bonus can be trained on.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from treecompile.core.batch import TreeBatch, pack
from treecompile.compile.wrapper import TreeCompiledModel, tree_compile
from treecompile.core.tree import TrajectoryTree

__all__ = ["PathLogprobs", "logprobs", "scatter_to_paths"]


def scatter_to_paths(values: torch.Tensor, batch: TreeBatch) -> list[torch.Tensor]:
    """Per path, ``values[path_rows(p)]``: the ``[S]`` row values along each path, ``[T_p]`` each."""
    return [values[batch.path_rows(p)] for p in range(batch.num_paths)]


@dataclass
class PathLogprobs:
    """Result of `logprobs`.

    Attributes:
        batch: the batch the values were computed on.
        row_logprobs: ``[S]`` per row.
        row_entropy: ``[S]`` per row, or None if not asked for.
        per_path: per path ``[T_p]`` log-probs, 0 at position 0 (path order of ``pack``).
        entropy_per_path: per path ``[T_p]`` entropies, 0 at position 0, or None.
    """

    batch: TreeBatch
    row_logprobs: torch.Tensor
    row_entropy: torch.Tensor | None
    per_path: list[torch.Tensor]
    entropy_per_path: list[torch.Tensor] | None


_COMPILED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _compiled_for(model: nn.Module, entropy: bool) -> TreeCompiledModel:
    if isinstance(model, TreeCompiledModel) and ("entropy" in model._outputs or not entropy):
        return model
    inner = model.model if isinstance(model, TreeCompiledModel) else model
    cache = _COMPILED.setdefault(inner, {})
    if entropy not in cache:
        cache[entropy] = tree_compile(inner, outputs=("entropy",) if entropy else ())
    return cache[entropy]


def logprobs(
    model: nn.Module,
    batch: TreeBatch | TrajectoryTree | Sequence[TrajectoryTree],
    *,
    entropy: bool = True,
) -> PathLogprobs:
    """Per-path, per-token log-probs (and entropies) of a model, from one tree pass, without grad.

    Args:
        model: a causal LM (compiled once per model and cached), or a `TreeCompiledModel`.
        batch: a `TreeBatch`, or trees to pack.
        entropy: also compute entropies of the full next-token distribution.

    Returns:
        `PathLogprobs`; ``per_path[p]`` equals running path ``p`` alone
        (`treecompile.core.reference.path_logprobs`).
    """
    if not isinstance(batch, TreeBatch):
        batch = pack(batch)
    compiled = _compiled_for(model, entropy)
    with torch.no_grad():
        out = compiled(batch)
    lp = out.logprobs.detach()
    ent = out.entropy.detach() if entropy else None
    return PathLogprobs(
        batch=batch,
        row_logprobs=lp,
        row_entropy=ent,
        per_path=scatter_to_paths(lp, batch),
        entropy_per_path=scatter_to_paths(ent, batch) if ent is not None else None,
    )
