"""Hugging Face ``Trainer`` on tree batches: a collator, nothing to subclass.

    model = tree_compile(model)                                             # 1: the model
    trainer = Trainer(model=model, args=TrainingArguments(...), train_dataset=records,
                      data_collator=TreeCollator())                         # 2: the collator
    trainer.train()
    trainer.save_model()              # the plain model: loads with AutoModelForCausalLM.from_pretrained

The records are the ones a stock causal-LM run uses: ``{"input_ids": [...]}``, with optional
``"labels"`` (Hugging Face's convention: ``-100`` where a token is not trained, the token
itself where it is) and ``"attention_mask"`` (0 on padding, which is dropped). Each
micro-batch's sequences are merged into one prefix tree, so a prefix they share is computed
once; a record may also be a `TrajectoryTree`.

The loss the collator packs for is ``token-mean``: the sum of the negative log-probabilities
of every trained token of every sequence in the micro-batch, over their number. That is what
the stock ``Trainer`` computes for a causal LM (Hugging Face's loss over the padded
micro-batch, ``labels[..., 1:] != -100`` counted). Beside the tree the collator returns the
micro-batch's ``labels`` (padded with -100, one row per sequence, as a stock collator would):
the ``Trainer`` counts the trained tokens of all accumulated micro-batches from them
(``num_items_in_batch``) and hands the count to the model, which divides the micro-batch's
summed loss by it, so gradient accumulation matches the stock ``Trainer``; and
``Trainer.evaluate()`` sees labels and reports ``eval_loss``.

The ``Trainer``'s default ``remove_unused_columns=True`` keeps the dataset columns named by the
model's ``forward``: a tree-compiled model's names ``input_ids``, ``labels`` and
``attention_mask`` beside ``batch``, the columns this collator reads. Called with those
tensors instead of a ``batch`` (a stock collator's padded batch), the model merges the rows
into a tree itself (`batch_from_rows`) and returns the stock loss.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from treecompile.batch import TreeBatch, pack
from treecompile.errors import TreeInputError
from treecompile.loss import LOSS_MODES
from treecompile.tree import TrajectoryTree

__all__ = ["TreeCollator", "IGNORE_INDEX", "rows_to_tree", "batch_from_rows", "refuse_label_smoothing"]

#: The label Hugging Face's losses skip.
IGNORE_INDEX = -100


class TreeCollator:
    """Collates causal-LM records into ``{"batch": TreeBatch, "labels": [P, T]}``, the inputs
    ``Trainer`` hands a tree-compiled model (``model(batch=..., labels=...)``).

    Args:
        loss_mode: a key of `treecompile.LOSS_MODES`, normalised over the micro-batch;
            ``"token-mean"`` (default) is the stock causal-LM loss (see the module docstring).
            Only with it does the collator return ``labels``: the ``Trainer``'s count of
            trained tokens is a token-mean denominator. With another mode each micro-batch
            is normalised on its own and ``Trainer.evaluate()`` reports no ``eval_loss``.
        path_bits: pack the path bitmask too (for ``tree_compile(mask="bitmask")``).
        vocab_size: if given, token ids at or above it are refused.
    """

    def __init__(self, *, loss_mode: str = "token-mean", path_bits: bool = False,
                 vocab_size: int | None = None) -> None:
        if loss_mode not in LOSS_MODES:
            raise ValueError(f"unknown loss_mode {loss_mode!r}; valid modes: {', '.join(LOSS_MODES)}")
        self.loss_mode = loss_mode
        self.path_bits = path_bits
        self.vocab_size = vocab_size

    def __call__(self, features: Sequence[Any]) -> dict[str, Any]:
        """Args:
            features: records, each ``{"input_ids": [T], "labels": [T] (optional),
                "attention_mask": [T] (optional)}`` (lists, arrays or 1-D tensors) or a
                `TrajectoryTree`. None is modified.

        Returns:
            ``{"batch": TreeBatch}``: the records' sequences merged into one prefix tree, then
            any `TrajectoryTree` records beside it, packed into one row; with ``token-mean``
            also ``"labels"``: ``[P, T]`` int64, one row per path of the batch, padded with
            -100 as a stock collator's labels: each record's labels (its tokens if it has
            none; its padding dropped), then each tree's paths (the token where it is
            trained, -100 elsewhere).

        Raises:
            TreeInputError: a record without ``input_ids``, labels or an attention mask of
                another length, an attention mask that is not one run of ones, a trained label
                on padding, or a label other than ``-100`` or the token at its position (a tree
                trains each sequence on its own next tokens).
        """
        if not len(features):
            raise TreeInputError("TreeCollator got no records")
        seqs, masks, labels, trees = [], [], [], []
        for i, f in enumerate(features):
            if isinstance(f, TrajectoryTree):
                trees.append(f)
                continue
            ids, mask, row = _sequence(i, f)
            seqs.append(ids)
            masks.append(mask)
            labels.append(row)
        # The trees' paths as labels: the token where it is trained, -100 elsewhere.
        labels += [[int(t) if m else IGNORE_INDEX for t, m in zip(p.tokens, p.loss_mask)] for t in trees
                   for p in t.paths()]
        if seqs:
            trees.insert(0, TrajectoryTree.from_sequences(seqs, loss_masks=masks, vocab_size=self.vocab_size))
        batch = pack(trees, loss_mode=self.loss_mode, path_bits=self.path_bits, vocab_size=self.vocab_size)
        if self.loss_mode != "token-mean":
            return {"batch": batch}
        width = max(map(len, labels))
        return {"batch": batch, "labels": torch.tensor([row + [IGNORE_INDEX] * (width - len(row)) for row in labels])}


def _sequence(i: int, record: Any) -> tuple[list[int], list[int] | None, list[int]]:
    """``(token ids, 0/1 loss mask or None, labels)`` of record ``i``, its padding dropped; the
    labels are the record's (its tokens without ``labels``), as a stock collator passes them on."""
    if not isinstance(record, Mapping):
        raise TreeInputError(
            f"record {i} is a {type(record).__name__}; TreeCollator takes {{'input_ids': [...], 'labels': [...]}} "
            "records or TrajectoryTree objects"
        )
    if "input_ids" not in record:
        raise TreeInputError(
            f"record {i} has no 'input_ids' (keys: {sorted(record)}); TreeCollator takes tokenized records "
            "{'input_ids': [...], 'labels': [...] (optional), 'attention_mask': [...] (optional)}"
        )
    ids = _ints(record["input_ids"])
    labels = None if record.get("labels") is None else _ints(record["labels"])
    if labels is not None and len(labels) != len(ids):
        raise TreeInputError(f"record {i}: {len(labels)} labels for {len(ids)} input_ids")
    if record.get("attention_mask") is not None:
        keep = _ints(record["attention_mask"])
        if len(keep) != len(ids):
            raise TreeInputError(f"record {i}: {len(keep)} attention_mask entries for {len(ids)} input_ids")
        cols = [t for t, m in enumerate(keep) if m]
        if cols and cols[-1] - cols[0] + 1 != len(cols):
            raise TreeInputError(f"record {i}: the attention mask has a hole (columns {cols[0]} to {cols[-1]} are "
                                 "not all 1); a record must be one sequence plus padding")
        trained_pad = [t for t, m in enumerate(keep) if not m and labels is not None and labels[t] != IGNORE_INDEX]
        if trained_pad:
            t = trained_pad[0]
            raise TreeInputError(f"record {i}: labels[{t}] = {labels[t]} trains a padding token (attention_mask 0); "
                                 f"mask it with {IGNORE_INDEX}")
        ids = [ids[t] for t in cols]
        labels = None if labels is None else [labels[t] for t in cols]
    if not ids:
        raise TreeInputError(f"record {i} has no tokens")
    if labels is None:
        return ids, None, list(ids)
    wrong = [t for t, (x, y) in enumerate(zip(ids, labels)) if y not in (x, IGNORE_INDEX)]
    if wrong:
        t = wrong[0]
        raise TreeInputError(
            f"record {i}: labels[{t}] = {labels[t]} is neither input_ids[{t}] = {ids[t]} nor {IGNORE_INDEX}; a tree "
            "trains each sequence on its own tokens (mask a token with -100 instead)"
        )
    return ids, [int(y != IGNORE_INDEX) for y in labels], labels


def _ints(values: Any) -> list[int]:
    return [int(v) for v in (values.tolist() if hasattr(values, "tolist") else values)]


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
            shifted), a row with a hole in its attention mask, or an empty sequence.
    """
    spans = _row_spans(input_ids, attention_mask, position_ids)
    if labels is not None and labels.shape != input_ids.shape:
        raise TreeInputError(f"labels has shape {tuple(labels.shape)}, input_ids {tuple(input_ids.shape)}")
    ids_cpu = input_ids.detach().cpu()
    lab_cpu = None if labels is None else labels.detach().cpu()
    seqs, masks = [], []
    for k, (i, cols) in enumerate(spans):
        cols = cols.cpu()
        if cols.numel() == 0:
            raise TreeInputError(f"sequence {k} (row {i}) is empty")
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
_CALLER_DEPTH = 16


def refuse_label_smoothing() -> None:
    """Raises `TreeInputError` when the running call comes from Hugging Face's
    ``Trainer.compute_loss`` with label smoothing (``label_smoothing_factor > 0``).

    Label smoothing is computed from the logits, which a tree-compiled model never forms (its
    LM head gathers only each target's log-prob). With a ``token-mean`` `TreeCollator` the
    ``Trainer`` would fail in its own code, finding a scalar where it expects logits; with
    another loss mode the collator returns no labels and the ``Trainer`` would skip the
    smoothing, training without it silently. The ``Trainer`` takes the labels out of the
    inputs before the call and does not pass its options, so this looks at the calling
    ``compute_loss`` (a subclass's own ``compute_loss`` is not looked into)."""
    trainer_module = sys.modules.get("transformers.trainer")
    trainer_class = getattr(trainer_module, "Trainer", None)
    code = getattr(getattr(trainer_class, "compute_loss", None), "__code__", None)
    if code is None:
        return
    frame = sys._getframe(1)
    try:
        for _ in range(_CALLER_DEPTH):
            if frame is None or frame.f_code is code:
                break
            frame = frame.f_back
        else:
            return
        trainer = None if frame is None else frame.f_locals.get("self")
        if getattr(trainer, "label_smoother", None) is None:
            return
        factor = getattr(getattr(trainer, "args", None), "label_smoothing_factor", "?")
        raise TreeInputError(
            f"Trainer(args.label_smoothing_factor={factor}): label smoothing is computed from the logits, which a "
            "tree-compiled model never forms (its LM head gathers only each target's log-prob); train with "
            "label_smoothing_factor=0, or with the stock model"
        )
    finally:
        del frame
