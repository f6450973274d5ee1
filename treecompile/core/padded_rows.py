"""Padded rows as a tree: what ``compiled(input_ids=..., labels=...)`` accepts.

A Hugging Face-style batch of right- or left-padded rows (``attention_mask`` 0 on padding,
``labels`` -100 where nothing is trained) is one tree per row, merged into one batch.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from treecompile.core.batch import TreeBatch, pack
from treecompile.core.errors import TreeInputError
from treecompile.core.tree import TrajectoryTree

__all__ = ["IGNORE_INDEX", "as_int_list", "batch_from_rows", "normalised", "record_span", "rows_to_tree"]

#: The label of a position that is not trained (Hugging Face's and PyTorch's ignore index).
IGNORE_INDEX = -100


def as_int_list(values: Any) -> list[int]:
    return [int(v) for v in (values.tolist() if hasattr(values, "tolist") else values)]


def record_span(ids: list[int], labels: list[int] | None, attention_mask: list[int] | None, where: str) -> slice:
    """The columns of one Hugging Face-style record that hold its sequence: its padding
    (``attention_mask`` 0, at the start or end) dropped. What the record's ``labels`` and
    ``attention_mask`` mean is checked here, for every reader of such records (the collator,
    sequences files): refused naming ``where`` are lengths that differ from ``input_ids``,
    mask values other than 0 and 1, 0s between tokens, a label on a padding token and a label
    that is neither -100 nor the token itself (a tree trains each sequence on its own tokens)."""
    if labels is not None and len(labels) != len(ids):
        raise TreeInputError(f"{where}: {len(labels)} labels for {len(ids)} input_ids")
    span = slice(0, len(ids))
    if attention_mask is not None:
        if len(attention_mask) != len(ids):
            raise TreeInputError(f"{where}: {len(attention_mask)} attention_mask entries for {len(ids)} input_ids")
        odd = next((m for m in attention_mask if m not in (0, 1)), None)
        if odd is not None:
            raise TreeInputError(f"{where}: attention_mask holds {odd!r}; it marks tokens with 1 and padding with 0")
        cols = [c for c, m in enumerate(attention_mask) if m]
        if cols and cols[-1] - cols[0] + 1 != len(cols):
            raise TreeInputError(f"{where}: the attention mask has a hole (columns {cols[0]} to {cols[-1]} are not "
                                 "all 1); a record must be one sequence plus padding")
        span = slice(cols[0], cols[-1] + 1) if cols else slice(0, 0)
        pad = next((c for c, m in enumerate(attention_mask) if not m and labels is not None
                    and labels[c] != IGNORE_INDEX), None)
        if pad is not None:
            raise TreeInputError(f"{where}: labels[{pad}] = {labels[pad]} trains a padding token (attention_mask 0); "
                                 f"mask it with {IGNORE_INDEX}")
    if labels is not None:
        wrong = next((c for c in range(span.start, span.stop) if labels[c] not in (ids[c], IGNORE_INDEX)), None)
        if wrong is not None:
            raise TreeInputError(
                f"{where}: labels[{wrong}] = {labels[wrong]} is neither input_ids[{wrong}] = {ids[wrong]} nor "
                f"{IGNORE_INDEX}; a tree trains each sequence on its own tokens, so labels are read unshifted (the "
                f"token itself where it is trained): mask a token with {IGNORE_INDEX}")
    return span


# --------------------------------------------------------------------------- padded rows


def _row_spans(input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
               position_ids: torch.Tensor | None) -> list[tuple[int, torch.Tensor]]:
    """``(row, columns)`` of every sequence in a padded or padding-free batch."""
    if attention_mask is not None:
        if attention_mask.shape != input_ids.shape:
            raise TreeInputError(f"attention_mask has shape {tuple(attention_mask.shape)}, input_ids "
                                 f"{tuple(input_ids.shape)}")
        out = []
        for i in range(input_ids.shape[0]):
            cols = torch.nonzero(attention_mask[i]).flatten()
            if cols.numel() and int(cols[-1] - cols[0]) + 1 != cols.numel():
                raise TreeInputError(f"row {i}: the attention mask has a hole (columns {cols[0].item()} to "
                                     f"{cols[-1].item()} are not all 1); a row must be one sequence plus padding")
            out.append((i, cols))
        return out
    if position_ids is None:
        return [(i, torch.arange(input_ids.shape[1], device=input_ids.device)) for i in range(input_ids.shape[0])]
    # Padding-free: sequences concatenated in one row, each starting at position 0.
    out = []
    for i in range(input_ids.shape[0]):
        starts = torch.nonzero(position_ids[i] == 0).flatten().tolist() + [input_ids.shape[1]]
        if starts[0] != 0:
            raise TreeInputError(f"row {i}: padding-free position_ids must start at 0")
        for a, b in zip(starts[:-1], starts[1:]):
            out.append((i, torch.arange(a, b, device=input_ids.device)))
    return out


def rows_to_tree(
    input_ids: torch.Tensor,
    *,
    attention_mask: torch.Tensor | None = None,
    labels: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
) -> TrajectoryTree:
    """A trainer's padded (or padding-free) batch as one prefix tree, one path per sequence.

    Args:
        input_ids: ``[B, T]`` token ids.
        attention_mask: ``[B, T]`` 1 on real tokens (each row one contiguous run), or None.
        labels: ``[B, T]`` the trainer's labels: a token is a target iff its label is not
            -100 (HF's convention: ``labels[t]`` is the token predicted from position
            ``t - 1``); None: every token is a target.
        position_ids: ``[B, T]`` for a padding-free batch without an attention mask
            (sequences concatenated in a row, each starting at 0).

    Returns:
        The tree, paths in row order (in a padding-free row, in order along the row).

    Raises:
        TreeInputError: a label that is neither -100 nor the token itself (labels must not be
            shifted) or a row with a hole in its attention mask. A row of padding only is a path
            with no tokens (a warning names it).
    """
    spans = _row_spans(input_ids, attention_mask, position_ids)
    if labels is not None and labels.shape != input_ids.shape:
        raise TreeInputError(f"labels has shape {tuple(labels.shape)}, input_ids {tuple(input_ids.shape)}")
    ids_cpu = input_ids.detach().cpu()
    lab_cpu = None if labels is None else labels.detach().cpu()
    seqs, masks = [], []
    for k, (i, cols) in enumerate(spans):
        cols = cols.cpu()
        # An empty row (all padding) is a path with no tokens: from_sequences warns, it trains nothing.
        toks = ids_cpu[i, cols]
        seqs.append(toks.numpy())
        if lab_cpu is None:
            masks.append(None)
            continue
        lab = lab_cpu[i, cols]
        target = lab != IGNORE_INDEX
        wrong = target & (lab != toks)
        if bool(wrong.any()):
            j = int(torch.nonzero(wrong)[0])
            raise TreeInputError(
                f"sequence {k} (row {i}): label {int(lab[j])} at column {int(cols[j])} is neither -100 nor the "
                f"token there ({int(toks[j])}); tree packing reads unshifted HF labels (labels[t] = input_ids[t])"
            )
        masks.append(target.to(torch.int64).numpy())
    return TrajectoryTree.from_sequences(seqs, loss_masks=masks)


def batch_from_rows(
    input_ids: torch.Tensor,
    *,
    labels: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
) -> TreeBatch:
    """A stock collator's padded causal-LM batch as one ``token-mean`` tree batch.

    What a tree-compiled model runs when it is called the Hugging Face way,
    ``model(input_ids=..., labels=..., attention_mask=...)``: the rows merged into one prefix
    tree (`rows_to_tree`), packed on ``input_ids``' device. Its loss is the stock causal-LM
    loss: the mean negative log-likelihood of the tokens whose label is not -100 (every token
    after the first without ``labels``).

    Args:
        input_ids: ``[B, T]`` token ids.
        labels: ``[B, T]`` unshifted labels, -100 where a token is not trained, or None.
        attention_mask: ``[B, T]`` 1 on tokens, 0 on padding (each row one run of ones), or None.

    Returns:
        The packed `TreeBatch`.

    Raises:
        TreeInputError: ``input_ids`` not a ``[B, T]`` tensor, a trained label on padding (the
            stock loss would train it), or what `rows_to_tree` refuses.
    """
    if not (isinstance(input_ids, torch.Tensor) and input_ids.dim() == 2):
        got = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise TreeInputError(f"input_ids must be a [batch, tokens] tensor, got {got}; or pass batch= from "
                             "treecompile.pack or TreeCollator")
    if labels is not None and attention_mask is not None and labels.shape == attention_mask.shape:
        trained_pad = (attention_mask == 0) & (labels != IGNORE_INDEX)
        if bool(trained_pad.any()):
            i, t = (int(v) for v in torch.nonzero(trained_pad)[0])
            raise TreeInputError(f"labels[{i}, {t}] = {int(labels[i, t])} trains a padding token (attention_mask 0); "
                                 f"mask it with {IGNORE_INDEX}")
    tree = rows_to_tree(input_ids, attention_mask=attention_mask, labels=labels)
    return pack(tree, loss_mode="token-mean", device=input_ids.device)


#: How many frames above the model's ``forward`` the ``Trainer``'s ``compute_loss`` may be
#: (``nn.Module.__call__``, accelerate's autocast wrappers, DDP's forward in between).


def normalised(batch: TreeBatch, num_items: torch.Tensor | int) -> TreeBatch:
    """``batch`` with its ``token-mean`` weights over ``num_items`` target tokens instead of its own
    ``n_targets``: the loss becomes the summed loss over ``num_items``, as Hugging Face's causal-LM
    loss with ``num_items_in_batch``. A count on the GPU is read once (one scalar), so that the
    batch's check carries over instead of reading the whole batch back (`TreeBatch.scaled`)."""
    if batch.loss_mode != "token-mean":
        raise TreeInputError(
            f"num_items_in_batch divides a token-mean loss, but this batch was packed with loss_mode "
            f"{batch.loss_mode!r}; pack it with 'token-mean' (TreeCollator returns no labels for other modes, so "
            "the Trainer passes no count)"
        )
    if isinstance(num_items, torch.Tensor):
        scale = batch.n_targets / num_items.detach().to(torch.float64)
    else:
        scale = batch.n_targets / float(num_items) if num_items else math.inf
    # One scalar read (none for an int count): the batch's check carries over (TreeBatch.scaled).
    return batch.scaled(scale)
