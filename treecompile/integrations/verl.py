"""verl rollout batches to tree batches and back.

    tree = tree_from_verl(data)                                     # a DataProto or its .batch
    out = compiled(tree.batch)                                      # compiled = tree_compile(actor)
    log_probs = logprobs_to_verl(out.logprobs, tree)                # [B, response_len], verl's layout
    loss = policy_loss(out.logprobs, tree.rl, PolicyLossConfig()).loss   # verl's PPO loss, on the tree

The layout is verl's actor input (``DataProto.batch``): ``prompts`` ``[B, Tp]`` left-padded,
``responses`` ``[B, Tr]`` right-padded, ``attention_mask`` ``[B, Tp + Tr]`` (1 on every real
token), ``response_mask`` ``[B, Tr]`` (1 on the response tokens the loss counts; 0 on padding
and, in multi-turn rollouts, on tool outputs inside a response), ``advantages`` and
``old_log_probs`` ``[B, Tr]``, optionally ``ref_log_prob`` ``[B, Tr]``. Row ``b``'s sequence is
its real prompt tokens followed by its real response tokens; all ``B`` sequences become one
prefix tree, so a prompt shared by a GRPO group (or a system prompt shared by all) is computed
once. Position ids start at 0 on each row's first real token, as verl computes them from the
attention mask.

This module imports neither verl nor ray: it reads the tensors by their verl names, from a
``DataProto`` (its ``.batch``) or from any mapping of tensors.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from treecompile.core.batch import TreeBatch
from treecompile.core.errors import TreeInputError
from treecompile.rl.losses import RLBatch, build_rl_batch
from treecompile.core.tree import TrajectoryTree

__all__ = ["VerlTreeBatch", "tree_from_verl", "logprobs_to_verl"]


@dataclass
class VerlTreeBatch:
    """A verl batch as one tree batch, with what maps its rows back to verl's layout.

    Attributes:
        rl: the packed tree with the per-row advantages and log-probs, for
            `treecompile.rl.losses.policy_loss`; path ``b`` is row ``b`` of the verl batch.
        prompt_lengths: ``[B]`` real prompt tokens per row.
        response_lengths: ``[B]`` real response tokens per row.
        response_width: ``Tr``, the width of verl's response tensors.
    """

    rl: RLBatch
    prompt_lengths: list[int]
    response_lengths: list[int]
    response_width: int

    @property
    def batch(self) -> TreeBatch:
        """The packed tree batch, for ``tree_compile(model)(...)``."""
        return self.rl.batch


def tree_from_verl(
    data: Any,
    *,
    loss_agg_mode: str = "token-mean",
    max_len: float | None = None,
    denominator: float | None = None,
    device: torch.device | str | None = None,
) -> VerlTreeBatch:
    """One tree batch from a verl rollout batch (layout: the module docstring).

    Args:
        data: a verl ``DataProto`` or a mapping with its tensors.
        loss_agg_mode: verl's ``loss_agg_mode``, a key of `treecompile.rl.losses.LOSS_AGG_MODES`.
        max_len: ``L`` of ``seq-mean-token-sum-norm``.
        denominator: replaces the token or sequence count (global normalisation over
            micro-batches, as verl's ``global_batch_info``).
        device: where to put the tensors.

    Returns:
        `VerlTreeBatch`: the packed tree with advantages and old/reference log-probs.

    Raises:
        TreeInputError: a missing tensor, shapes that disagree, a prompt that is not left-padded
            or a response that is not right-padded, a row without prompt tokens.
    """
    tensors = getattr(data, "batch", data)
    if not isinstance(tensors, Mapping) and not hasattr(tensors, "get"):
        raise TreeInputError(f"expected a verl DataProto or a mapping of tensors, got {type(data).__name__}")

    def get(key: str, required: bool = True) -> np.ndarray | None:
        v = tensors.get(key, None)
        if v is None:
            if required:
                raise TreeInputError(f"the verl batch has no {key!r} (keys: {sorted(tensors.keys())})")
            return None
        return np.asarray(v.detach().cpu() if hasattr(v, "detach") else v)

    prompts, responses, attention = get("prompts"), get("responses"), get("attention_mask")
    if prompts.ndim != 2 or responses.ndim != 2 or prompts.shape[0] != responses.shape[0]:
        raise TreeInputError(f"prompts {prompts.shape} and responses {responses.shape} must be [B, Tp] and [B, Tr]")
    b, tp = prompts.shape
    tr = responses.shape[1]
    if attention.shape != (b, tp + tr):
        raise TreeInputError(f"attention_mask has shape {attention.shape}, expected {(b, tp + tr)}")
    response_mask = get("response_mask", required=False)
    if response_mask is None:
        response_mask = attention[:, tp:]
    advantages = get("advantages")
    per_token = {"advantages": advantages, "old_log_probs": get("old_log_probs", False),
                 "ref_log_prob": get("ref_log_prob", False), "response_mask": response_mask}
    for key, v in per_token.items():
        if v is not None and v.shape != (b, tr):
            raise TreeInputError(f"{key} has shape {v.shape}, expected [B, Tr] = {(b, tr)}")

    seqs, masks, prompt_lengths, response_lengths = [], [], [], []
    for i in range(b):
        pm, rm = attention[i, :tp].astype(bool), attention[i, tp:].astype(bool)
        n_p, n_r = int(pm.sum()), int(rm.sum())
        if not pm[tp - n_p:].all() or n_p == 0:
            raise TreeInputError(f"row {i}: the prompt is not left-padded (attention_mask[{i}, :{tp}]) or is empty")
        if not rm[:n_r].all():
            raise TreeInputError(f"row {i}: the response is not right-padded (attention_mask[{i}, {tp}:])")
        loss = response_mask[i, :n_r].astype(bool)
        if response_mask[i, n_r:].any():
            raise TreeInputError(f"row {i}: response_mask is 1 on padding (past the {n_r} real response tokens)")
        seqs.append(np.concatenate([prompts[i, tp - n_p:], responses[i, :n_r]]).astype(np.int64))
        masks.append(np.concatenate([np.zeros(n_p, dtype=np.int64), loss.astype(np.int64)]))
        prompt_lengths.append(n_p)
        response_lengths.append(n_r)
    tree = TrajectoryTree.from_sequences(seqs, loss_masks=masks)

    def along_paths(v: np.ndarray | None) -> list[np.ndarray] | None:
        """``[B, Tr]`` response values as per-path arrays over the whole path (0 on the prompt)."""
        if v is None:
            return None
        return [np.concatenate([np.zeros(n_p), v[i, :n_r].astype(np.float64)])
                for i, (n_p, n_r) in enumerate(zip(prompt_lengths, response_lengths))]

    rl = build_rl_batch(
        tree, advantages=along_paths(advantages), old_logprobs=along_paths(per_token["old_log_probs"]),
        ref_logprobs=along_paths(per_token["ref_log_prob"]), loss_agg_mode=loss_agg_mode, max_len=max_len,
        denominator=denominator, device=device,
    )
    return VerlTreeBatch(rl=rl, prompt_lengths=prompt_lengths, response_lengths=response_lengths, response_width=tr)


def logprobs_to_verl(logprobs: torch.Tensor, tree: VerlTreeBatch) -> torch.Tensor:
    """Per-token values of the tree's rows in verl's layout (differentiable).

    Args:
        logprobs: ``[S]`` per-row values, e.g. ``compiled(tree.batch).logprobs`` or its entropy.
        tree: from `tree_from_verl`.

    Returns:
        ``[B, Tr]``: entry ``[b, j]`` is the value of response token ``j`` of row ``b`` given its
        prompt and the response tokens before it (verl's ``log_probs``); 0 on padding.
    """
    batch = tree.batch
    if logprobs.shape != (batch.num_tokens,):
        raise ValueError(f"logprobs has shape {tuple(logprobs.shape)}, expected ({batch.num_tokens},)")
    b = len(tree.prompt_lengths)
    rows = torch.zeros(b, tree.response_width, dtype=torch.int64)
    valid = torch.zeros(b, tree.response_width, dtype=torch.bool)
    for i, (n_p, n_r) in enumerate(zip(tree.prompt_lengths, tree.response_lengths)):
        rows[i, :n_r] = batch.path_rows(i)[n_p:n_p + n_r].cpu()
        valid[i, :n_r] = True
    rows, valid = rows.to(logprobs.device), valid.to(logprobs.device)
    return torch.where(valid, logprobs[rows], logprobs.new_zeros(()))
