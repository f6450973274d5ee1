"""Hugging Face ``Trainer`` on tree batches: a collator, nothing to subclass.

    model = tree_compile(model)                                   # 1: the model
    trainer = Trainer(model=model, args=TrainingArguments(..., remove_unused_columns=False),
                      train_dataset=records, data_collator=TreeCollator())   # 2: the collator
    trainer.train()
    trainer.save_model()              # the plain model: loads with AutoModelForCausalLM.from_pretrained

The records are the ones a stock causal-LM run uses: ``{"input_ids": [...]}``, with optional
``"labels"`` (Hugging Face's convention: ``-100`` where a token is not trained, the token
itself where it is). Each micro-batch's sequences are merged into one prefix tree, so a
prefix they share is computed once; a record may also be a `TrajectoryTree`.

The loss the collator packs for is ``token-mean``: the sum of the negative log-probabilities
of every trained token of every sequence in the micro-batch, over their number. That is what
the stock ``Trainer`` computes for a causal LM with ``gradient_accumulation_steps=1`` (Hugging
Face's loss over the padded micro-batch, ``labels[..., 1:] != -100`` counted). With gradient
accumulation the stock ``Trainer`` divides by the tokens of all accumulated micro-batches,
whereas a tree micro-batch is its own mean (the ``Trainer`` then divides by the number of
steps): the two differ when micro-batches hold different token counts.

``remove_unused_columns=False`` is needed: the ``Trainer`` keeps only the columns named by the
model's ``forward`` (a tree-compiled model's takes ``batch``), and would drop ``input_ids``
before the collator sees it. The collator says so when a record arrives without it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from treecompile.batch import TreeBatch, pack
from treecompile.errors import TreeInputError
from treecompile.loss import LOSS_MODES
from treecompile.tree import TrajectoryTree

__all__ = ["TreeCollator", "IGNORE_INDEX"]

#: The label Hugging Face's losses skip.
IGNORE_INDEX = -100


class TreeCollator:
    """Collates causal-LM records into ``{"batch": TreeBatch}``, the input ``Trainer`` hands a
    tree-compiled model (``model(batch=...)``).

    Args:
        loss_mode: a key of `treecompile.LOSS_MODES`, normalised over the micro-batch;
            ``"token-mean"`` (default) is the stock causal-LM loss (see the module docstring).
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

    def __call__(self, features: Sequence[Any]) -> dict[str, TreeBatch]:
        """Args:
            features: records, each ``{"input_ids": [T], "labels": [T] (optional)}`` (lists,
                arrays or 1-D tensors) or a `TrajectoryTree`. None is modified.

        Returns:
            ``{"batch": TreeBatch}``: the records' sequences merged into one prefix tree, then
            any `TrajectoryTree` records beside it, packed into one row.

        Raises:
            TreeInputError: a record without ``input_ids`` (with the Trainer setting that
                removes it), labels of another length, or a label other than ``-100`` or the
                token at its position (a tree trains each sequence on its own next tokens).
        """
        if not len(features):
            raise TreeInputError("TreeCollator got no records")
        seqs, masks, trees = [], [], []
        for i, f in enumerate(features):
            if isinstance(f, TrajectoryTree):
                trees.append(f)
                continue
            ids, mask = _sequence(i, f)
            seqs.append(ids)
            masks.append(mask)
        if seqs:
            trees.insert(0, TrajectoryTree.from_sequences(seqs, loss_masks=masks, vocab_size=self.vocab_size))
        return {"batch": pack(trees, loss_mode=self.loss_mode, path_bits=self.path_bits, vocab_size=self.vocab_size)}


def _sequence(i: int, record: Any) -> tuple[list[int], list[int] | None]:
    """``(token ids, 0/1 loss mask or None)`` of record ``i``."""
    if not isinstance(record, Mapping):
        raise TreeInputError(
            f"record {i} is a {type(record).__name__}; TreeCollator takes {{'input_ids': [...], 'labels': [...]}} "
            "records or TrajectoryTree objects"
        )
    if "input_ids" not in record:
        raise TreeInputError(
            f"record {i} has no 'input_ids' (keys: {sorted(record)}). The Trainer removes the columns its model's "
            "forward does not name: pass TrainingArguments(remove_unused_columns=False)"
        )
    ids = _ints(record["input_ids"])
    if record.get("labels") is None:
        return ids, None
    labels = _ints(record["labels"])
    if len(labels) != len(ids):
        raise TreeInputError(f"record {i}: {len(labels)} labels for {len(ids)} input_ids")
    wrong = [t for t, (x, y) in enumerate(zip(ids, labels)) if y not in (x, IGNORE_INDEX)]
    if wrong:
        t = wrong[0]
        raise TreeInputError(
            f"record {i}: labels[{t}] = {labels[t]} is neither input_ids[{t}] = {ids[t]} nor {IGNORE_INDEX}; a tree "
            "trains each sequence on its own tokens (mask a token with -100 instead)"
        )
    return ids, [int(y != IGNORE_INDEX) for y in labels]


def _ints(values: Any) -> list[int]:
    return [int(v) for v in (values.tolist() if hasattr(values, "tolist") else values)]
