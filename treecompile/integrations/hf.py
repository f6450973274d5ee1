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

Which records share a micro-batch is the sampler's choice; the ``Trainer``'s random sampler
scatters records that share a prefix. `PrefixGroupingMixin` before ``Trainer`` in a subclass's
bases makes each micro-batch a group of records sharing long prefixes
(`treecompile.planning.prefix_sampler.PrefixGroupedSampler`)::

    class PrefixTrainer(PrefixGroupingMixin, Trainer):
        pass
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from treecompile.core.batch import pack
from treecompile.core.errors import TreeInputError, unknown_choice
from treecompile.core.loss import LOSS_MODES
from treecompile.capture.hf_interfaces import refuse_label_smoothing
from treecompile.core.padded_rows import IGNORE_INDEX, as_int_list, batch_from_rows, record_span, rows_to_tree
from treecompile.core.tree import TrajectoryTree
from treecompile.planning.prefix_sampler import PrefixGroupedSampler

__all__ = ["TreeCollator", "IGNORE_INDEX", "rows_to_tree", "batch_from_rows", "refuse_label_smoothing",
           "PrefixGroupingMixin", "prefix_grouped_sampler", "record_sequences"]

#: The label Hugging Face's losses skip.


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
            raise ValueError(unknown_choice("loss_mode", loss_mode, LOSS_MODES, "modes"))
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
        return {"batch": batch.mark_labels_beside(),
                "labels": torch.tensor([row + [IGNORE_INDEX] * (width - len(row)) for row in labels])}


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
    ids = as_int_list(record["input_ids"])
    labels = None if record.get("labels") is None else as_int_list(record["labels"])
    keep = None if record.get("attention_mask") is None else as_int_list(record["attention_mask"])
    span = record_span(ids, labels, keep, f"record {i}")
    ids, labels = ids[span], None if labels is None else labels[span]
    if not ids:
        raise TreeInputError(f"record {i} has no tokens")
    if labels is None:
        return ids, None, list(ids)
    return ids, [int(y != IGNORE_INDEX) for y in labels], labels


# --------------------------------------------------------------------------- prefix grouping


def record_sequences(dataset: Any) -> list[Any]:
    """The token ids of each record of ``dataset``, in order: its ``input_ids``, without the
    positions where its ``attention_mask`` is 0 (the tokens `TreeCollator` and TRL's trees keep).

    Args:
        dataset: a ``datasets.Dataset`` with an ``input_ids`` column, or any sequence of records
            ``{"input_ids": [T], "attention_mask": [T] (optional)}``. Only read.

    Raises:
        TreeInputError: a record that is not such a mapping (a `TrajectoryTree` record included).
    """
    names = getattr(dataset, "column_names", None)
    if names is not None:
        if "input_ids" not in names:
            raise TreeInputError(f"prefix grouping reads the dataset's 'input_ids' column; its columns are {names}")
        ids = dataset["input_ids"]
        masks = dataset["attention_mask"] if "attention_mask" in names else [None] * len(dataset)
        rows = ({"input_ids": x, "attention_mask": m} for x, m in zip(ids, masks))
    else:
        rows = (dataset[i] for i in range(len(dataset)))
    out = []
    for i, record in enumerate(rows):
        if not isinstance(record, Mapping) or "input_ids" not in record:
            what = type(record).__name__ if not isinstance(record, Mapping) else f"keys {sorted(record)}"
            raise TreeInputError(f"record {i} ({what}): prefix grouping sorts records by their 'input_ids'")
        # The tokens TreeCollator keeps, read and checked as it reads them (labels aside).
        out.append(_sequence(i, {"input_ids": record["input_ids"], "attention_mask": record.get("attention_mask")})[0])
    return out


def prefix_grouped_sampler(trainer: Any, dataset: Any = None) -> PrefixGroupedSampler:
    """The ``Trainer``'s training sampler with each micro-batch a group of records sharing long
    prefixes: groups of the data loader's batch size, seeded with ``args.data_seed`` (else
    ``args.seed``) and the epoch, the short group left out with ``args.dataloader_drop_last``.

    Args:
        trainer: a ``transformers.Trainer`` (TRL's trainers included).
        dataset: the training dataset (default ``trainer.train_dataset``); see `record_sequences`.
    """
    args = trainer.args
    dataset = trainer.train_dataset if dataset is None else dataset
    seed = args.data_seed if args.data_seed is not None else args.seed
    return PrefixGroupedSampler(record_sequences(dataset), group_size=getattr(trainer, "_train_batch_size",
                                                                              args.train_batch_size),
                                seed=seed, drop_last=args.dataloader_drop_last)


class PrefixGroupingMixin:
    """``Trainer`` mixin: each training micro-batch is a group of records sharing long prefixes.

    Put it before ``Trainer`` in the bases. Overrides ``_get_train_sampler`` only, with
    `prefix_grouped_sampler`: every record once per epoch, a new grouping and group order each
    epoch (the ``Trainer`` calls ``set_epoch``), the same on every process. Datasets without a
    length (``IterableDataset``) keep the ``Trainer``'s own order.
    """

    def _get_train_sampler(self, train_dataset=None):
        dataset = self.train_dataset if train_dataset is None else train_dataset
        if dataset is None or not hasattr(dataset, "__len__"):
            return super()._get_train_sampler(train_dataset)
        return prefix_grouped_sampler(self, dataset)
