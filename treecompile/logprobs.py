"""Per-path log-probabilities and entropies from one tree pass (old- and reference-policy passes).

    lp = treecompile.logprobs(model, trees)      # no grad, through tree_compile
    lp.per_path[p]                               # [T_p] log p(x_t | x_<t) of path p, 0 at t = 0
    lp.entropy_per_path[p]                       # [T_p] entropy of the distribution predicting x_t

Each row of a tree batch computes its token's log-probability and the full next-token
distribution at its predicting row (``pred_index``) exactly as the path would alone, so
scattering the ``[S]`` row values back along each path's rows gives what running every path
separately gives.

The compiled graph of `treecompile.tree_compile` returns log-probs only. Entropies need the
vocabulary distribution of each predicting row; `tree_compile_with_entropy` is a
`TreeCompiledModel` whose traced function also returns the ``[S]`` per-target entropies,
computed row by row from the gathered logits of the ``R`` predicting rows (the verify pass
checks the added ops like the model's own: all act along the vocabulary dim). Like the
log-probs, the entropies are differentiable, so an entropy bonus can be trained on.
"""

from __future__ import annotations

import types
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from treecompile.batch import TreeBatch, pack
from treecompile.compile import TreeCompiledModel, TreeOutput, _logits_of, tree_compile
from treecompile.passes.markers import _upcast
from treecompile.passes.pipeline import make_backend
from treecompile.tree import TrajectoryTree

__all__ = ["PathLogprobs", "TreeEntropyOutput", "EntropyCompiledModel", "tree_compile_with_entropy", "logprobs",
           "scatter_to_paths"]


@dataclass
class TreeEntropyOutput:
    """What `EntropyCompiledModel` returns.

    Attributes:
        logprobs: ``[S]`` as `TreeOutput.logprobs`.
        entropy: ``[S]`` entropy of the next-token distribution at each row's predicting row
            (``pred_index``), 0 where there is none; in at least float32.
        loss: ``-(target_weight * logprobs).sum()`` (the SFT loss of the batch).
    """

    logprobs: torch.Tensor
    entropy: torch.Tensor
    loss: torch.Tensor


def _gathered_entropy(logits: torch.Tensor, rows: torch.Tensor, slot: torch.Tensor, dest: torch.Tensor,
                      like: torch.Tensor) -> torch.Tensor:
    """``[S]`` entropies of the ``R`` predicting rows, put at each target's row."""
    z = _upcast(logits[0].index_select(0, rows))
    logp = torch.log_softmax(z, dim=-1)
    ent = -(logp.exp() * logp).sum(dim=-1)
    out = ent.new_zeros(like.shape[0])
    return out.index_put((dest,), ent[slot])


class EntropyCompiledModel(TreeCompiledModel):
    """A tree-compiled model that also returns per-target entropies (see `tree_compile_with_entropy`).

    It reuses `TreeCompiledModel`'s capture, passes and batch handling; only the traced
    function differs, returning ``(entropy, logprobs)`` in the slots ``forward`` reads as
    ``(loss, logprobs)``. Call it to get a `TreeEntropyOutput`.
    """

    def _build(self, device: torch.device):
        lowering = self._backend_name or ("inductor" if device.type == "cuda" else "aot_eager")
        backend = make_backend(
            mask=self.mask,
            layout_of=lambda: self._layout,
            chunks_of=lambda: self._chunks,
            lowering=lowering,
            records=self.compile_records,
            passes=self._passes,
        )
        inner, kwargs_of = self._inner, self._call_kwargs

        # The same arguments as TreeCompiledModel's traced function (whose trailing ones,
        # e.g. path_count for router losses, are not needed here); the outputs fill the
        # (loss, logprobs, aux) slots its forward unpacks. A router auxiliary loss is not
        # computed in this mode (it is for log-prob/entropy passes and entropy bonuses).
        def tree_forward_entropy(ids, positions, mask_buffers, block_tensors, rows, slot, target, dest, *rest):
            ids = torch.ops.treecompile.tree_inputs(ids, [positions, *mask_buffers], list(block_tensors))
            logits = _logits_of(inner(ids, **kwargs_of(positions)))
            logprobs = torch.ops.treecompile.tree_logprobs(logits, rows, slot, target, dest)
            entropy = _gathered_entropy(logits, rows, slot, dest, positions)
            return entropy, logprobs, None

        code = tree_forward_entropy.__code__.replace(co_name=f"tree_forward_entropy_{id(self):x}")
        fn = types.FunctionType(code, tree_forward_entropy.__globals__, code.co_name, None,
                                tree_forward_entropy.__closure__)
        return torch.compile(fn, backend=backend, fullgraph=True)

    def forward(self, batch: TreeBatch) -> TreeEntropyOutput:  # type: ignore[override]
        """Runs the model on a packed tree batch; returns log-probs, entropies and the SFT loss."""
        out: TreeOutput = super().forward(batch)
        rows = batch.num_tokens
        entropy = out.loss[:rows]
        lp = out.logprobs
        loss = -(batch.target_weight.to(device=lp.device, dtype=lp.dtype) * lp).sum()
        return TreeEntropyOutput(logprobs=lp, entropy=entropy, loss=loss)


def tree_compile_with_entropy(model: nn.Module, *, mask: str = "interval", backend: str | None = None
                              ) -> EntropyCompiledModel:
    """Like `treecompile.tree_compile`, but the output also carries per-target entropies.

    The vocabulary projection runs on every row here (the entropy needs the distribution
    of each predicting row), so use it for entropy bonuses and logging; `tree_compile`
    stays the cheaper choice when only log-probs are needed.
    """
    base = tree_compile(model, mask=mask, backend=backend)  # validates the options
    return EntropyCompiledModel(model, mask=base.mask, backend=backend, verify=False)


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
    if isinstance(model, TreeCompiledModel) and (isinstance(model, EntropyCompiledModel) or not entropy):
        return model
    inner = model.model if isinstance(model, TreeCompiledModel) else model
    cache = _COMPILED.setdefault(inner, {})
    if entropy not in cache:
        cache[entropy] = tree_compile_with_entropy(inner) if entropy else tree_compile(inner)
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
        (`treecompile.reference.path_logprobs`).
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
