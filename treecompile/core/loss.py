"""The tree loss on a packed batch: per-target log-probabilities and their weighted sum.

The weights come from :mod:`treecompile.core.weights`, which turns each loss mode (`LOSS_MODES`)
into per-token weights ``W_t`` once, when a batch is packed; the loss of a batch is then
``-(W * logprobs).sum()``, equal to the per-path loss.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from treecompile.core.weights import LOSS_MODES, path_loss_coefficients, path_target_counts, tree_target_weights

if TYPE_CHECKING:
    import torch

    from treecompile.core.batch import TreeBatch

__all__ = [
    "LOSS_MODES",
    "path_loss_coefficients",
    "path_target_counts",
    "tree_target_weights",
    "gather_logprobs",
    "tree_loss",
]


def gather_logprobs(logits: torch.Tensor, batch: TreeBatch) -> torch.Tensor:
    """Per-target log-probabilities from per-row logits.

    Row ``j``'s token is predicted by the output at ``pred_index[j]``: at a branch
    point, the parent's last row predicts the first token of every child, which no
    label shift can express.

    Args:
        logits: ``[S, V]`` or ``[1, S, V]``, the output of every row.
        batch: the tree batch.

    Returns:
        ``[S]`` ``log p(input_ids[j] | output at pred_index[j])``, 0 where ``pred_index`` is -1,
            in at least float32. The ``[S, V]`` log-softmax is never formed.
    """
    import torch

    from treecompile.kernels.dtypes import compute_dtype

    if logits.dim() == 3:
        if logits.shape[0] != 1:
            raise ValueError(f"expected one packed row, got logits of shape {tuple(logits.shape)}")
        logits = logits[0]
    dtype = compute_dtype(logits.dtype)
    has_pred = batch.pred_index >= 0
    src = batch.pred_index.clamp(min=0)
    lse = torch.logsumexp(logits.to(dtype), dim=-1)
    picked = logits[src, batch.input_ids].to(dtype)
    return torch.where(has_pred, picked - lse[src], torch.zeros((), dtype=dtype, device=logits.device))


def tree_loss(logprobs: torch.Tensor, batch: TreeBatch) -> torch.Tensor:
    """The tree loss: ``-(target_weight * logprobs).sum()``, equal to the per-path loss.

    Args:
        logprobs: ``[S]`` per-target log-probabilities aligned with ``batch.target_weight``
            (from `gather_logprobs` or a compiled model's output).
        batch: the tree batch; its ``loss_mode`` was fixed by `treecompile.pack`.

    Returns:
        A scalar in at least float32.
    """
    import torch

    from treecompile.kernels.dtypes import compute_dtype

    if logprobs.shape != batch.target_weight.shape:
        raise ValueError(
            f"logprobs has shape {tuple(logprobs.shape)}, expected {tuple(batch.target_weight.shape)} (one per row)"
        )
    dtype = compute_dtype(logprobs.dtype)
    return -(batch.target_weight.to(dtype) * logprobs.to(dtype)).sum()
