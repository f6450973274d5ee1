"""Tree packing inside TRL's `SFTTrainer` and `GRPOTrainer`: two changed lines in a script.

    from treecompile.integrations.trl import TreeSFTTrainer   # was: from trl import SFTTrainer
    trainer = TreeSFTTrainer(model=model, args=args, train_dataset=ds, processing_class=tok)

Everything else stays TRL's: its datasets and collators, its prompt/completion and
assistant-only masks, its loss normalisation, its GRPO generation, rewards, advantages and
loss types. What changes is how a micro-batch reaches the model. The rows of TRL's padded
batch are merged into a prefix tree (a GRPO group's prompt, a prompt shared by several
completions, a conversation prefix shared by several samples: computed once), packed with
`treecompile.pack` and run through `treecompile.tree_compile` of the same model.

* SFT: the tree's loss masks are TRL's labels (a token is a target iff its label is not
  -100), so completion-only and assistant-only training are whatever TRL's collator made
  them. The loss is TRL's: the sum of the target tokens' negative log-likelihoods divided
  by ``num_items_in_batch`` (the target count of the whole accumulation window), so gradient
  accumulation matches the stock trainer; ``loss_type="dft"`` is supported too.
* GRPO: `_get_per_token_logps_and_entropies`, the one place TRL runs the policy (and the
  reference model) on prompt + completion, is replaced by one tree forward per chunk; the
  tree's per-row log-probs and entropies (logits divided by TRL's ``temperature``) are
  gathered into TRL's ``[B, completion_len]`` layout. TRL then computes its own loss, so
  every ``loss_type`` (grpo, bnpo, dr_grpo, dapo, cispo, sapo, luspo, vespo), sequence-level
  importance sampling (GSPO), the KL penalty and the entropy bonus are TRL's code, with TRL's
  defaults. Exact: a shared token has one log-probability, and its gradient is the sum of
  what each row's loss sends it.

A trainer subclass of your own takes the mixin instead: ``class MyTrainer(TreeSFTMixin,
SFTTrainer)``. Options for `treecompile.tree_compile` (``mask``, ``backend``, ``lm_head``,
``verify``) go in the class attribute ``tree_compile_options`` or the ``tree_compile_options=``
argument of the trainer.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from treecompile.core.batch import TreeBatch, pack
from treecompile.compile.wrapper import TreeCompiledModel, tree_compile
from treecompile.core.errors import TreeInputError
from treecompile.integrations.hf import prefix_grouped_sampler, rows_to_tree

__all__ = [
    "TreeSFTMixin",
    "TreeGRPOMixin",
    "TreeSFTTrainer",
    "TreeGRPOTrainer",
    "rows_to_tree",
    "tree_logprob_index",
]


def _require_trl() -> Any:
    try:
        import trl
    except ImportError as e:  # pragma: no cover - exercised only without the extra
        raise ImportError(
            "treecompile.integrations.trl needs TRL: pip install 'treecompile[trl]' (trl >= 1.16)"
        ) from e
    return trl


# --------------------------------------------------------------------------- batch <-> tree


def tree_logprob_index(batch: TreeBatch, starts: Sequence[int], lengths: Sequence[int], width: int) -> torch.Tensor:
    """``[P, width]`` packed row of token ``starts[p] + j`` of path ``p``, -1 past ``lengths[p]``.

    With ``idx = tree_logprob_index(...)``, ``logprobs[idx.clamp(min=0)]`` masked where
    ``idx < 0`` puts a tree's per-row values into the usual ``[B, completion_len]`` layout.
    """
    out = torch.full((batch.num_paths, width), -1, dtype=torch.int64)
    for p in range(batch.num_paths):
        rows = batch.path_rows(p).cpu()
        n = int(lengths[p])
        if starts[p] + n > rows.numel() or n > width:
            raise TreeInputError(f"path {p} has {rows.numel()} tokens; cannot take {n} from {starts[p]}")
        out[p, :n] = rows[starts[p]: starts[p] + n]
    return out.to(batch.device)


def _gather(values: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    picked = values[idx.clamp(min=0)]
    return torch.where(idx >= 0, picked, torch.zeros((), dtype=picked.dtype, device=picked.device))


# --------------------------------------------------------------------------- the compiled model


class _TreeModels:
    """The `TreeCompiledModel` of each model a trainer runs (the policy, a reference model).

    The trainer holds them; a registry of weak references lets a second live trainer on the
    same model object with the same options and the same precision and checkpointing (an
    evaluation trainer, a rerun with another loss type) reuse the compiled graph instead of
    compiling again. Each of those settings is a different graph, so a trainer that changes
    one gets a graph of its own rather than another recompile of a shared one (Dynamo fails
    after 8). Nothing outlives the trainers that use it.
    """

    _registry: weakref.WeakValueDictionary = weakref.WeakValueDictionary()

    def __init__(self, options: dict[str, Any]) -> None:
        self.options = dict(options)
        self._held: dict[tuple[int, str], TreeCompiledModel] = {}

    def __call__(self, model: torch.nn.Module, setting: tuple = (), **extra: Any) -> TreeCompiledModel:
        options = {**self.options, **extra}
        key = (id(model), repr(sorted(options.items())), setting)
        compiled = self._held.get(key) or self._registry.get(key)
        if compiled is None or compiled.model is not model:
            compiled = tree_compile(model, **options)
            self._registry[key] = compiled
        self._held[key] = compiled
        return compiled


@contextlib.contextmanager
def _class_forward(model: torch.nn.Module) -> Iterator[None]:
    """Runs ``model`` with its class's ``forward`` during the tree call.

    TRL replaces ``model.forward`` with a fused-LM-head wrapper (a new closure per trainer) that
    calls the original forward unless asked for the fused head. The tree call never asks, so the
    class's forward is the same computation; seen through it, the compiled graph's guards do not
    depend on which trainer patched the model, and a second trainer reuses the graph.
    """
    patched = model.__dict__.pop("forward", None)
    try:
        yield
    finally:
        if patched is not None:
            model.__dict__["forward"] = patched


def _setting(trainer: Any, model: torch.nn.Module) -> tuple:
    """What else the compiled graph depends on: mixed precision and activation checkpointing."""
    checkpointing = any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())
    return (bool(trainer.args.bf16), bool(trainer.args.fp16), checkpointing)


def _unwrap(trainer: Any, model: torch.nn.Module) -> torch.nn.Module:
    model = trainer.accelerator.unwrap_model(model)
    if isinstance(model, TreeCompiledModel):
        model = model.model
    return model


def _init_tree(self: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    options = kwargs.pop("tree_compile_options", None)
    if options is None:
        options = getattr(type(self), "tree_compile_options", {}) or {}
    for key in ("outputs", "temperature"):
        if key in options:
            raise ValueError(f"tree_compile_options must not set {key!r}: the trainer sets it from its own config")
    self._tree_models = _TreeModels(options)
    return kwargs


# --------------------------------------------------------------------------- SFT

#: What TRL's collator adds to a padding-free batch (``padding_free=True``, and ``packing=True``
#: with its default ``bfd`` strategy) for the varlen attention kernels: the sequence bounds the
#: tree reads from the position ids, where each sequence starts at 0.
_PADDING_FREE_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")


def _check_padding_free(inputs: dict[str, Any]) -> None:
    """A padding-free batch is a list of sequences, one row of them with positions restarting at
    0; its ``cu_seq_lens`` must give the same bounds (else the stock kernels and the tree would
    train different sequences)."""
    bounds = [k for k in ("cu_seq_lens_q", "cu_seq_lens_k") if k in inputs]
    if not bounds:
        return
    positions = inputs.get("position_ids")
    if positions is None or positions.dim() != 2 or positions.size(0) != 1 or "attention_mask" in inputs:
        raise ValueError("a padding-free batch (cu_seq_lens) must be one row with position_ids and no attention_mask, "
                         "as TRL's collator makes it")
    starts = torch.nonzero(positions[0] == 0).flatten().cpu()
    want = torch.cat([starts, torch.tensor([positions.size(1)])]).to(torch.int64)
    for key in bounds:
        got = inputs[key].detach().cpu().to(torch.int64).flatten()
        if not torch.equal(got, want):
            raise ValueError(f"{key} {got.tolist()} disagrees with the sequence starts of position_ids "
                             f"{want.tolist()}: the tree trains the sequences the positions give")


class TreeSFTMixin:
    """`SFTTrainer.compute_loss` on a prefix tree of the micro-batch's sequences.

    Put it before ``SFTTrainer`` in the bases. The loss, its normalisation by
    ``num_items_in_batch`` and the ``entropy`` and ``num_tokens`` metrics are the stock
    trainer's (``mean_token_accuracy`` is not logged: the tree computes no argmax). An
    evaluation that asks for logits (``return_outputs=True``) runs the stock path.

    ``prefix_grouping=True`` (an argument of the trainer, or the class attribute) makes each
    training micro-batch a group of samples sharing long prefixes instead of a random draw
    (`treecompile.integrations.hf.prefix_grouped_sampler`); not with ``packing=True``.
    """

    tree_compile_options: dict[str, Any] = {}
    prefix_grouping: bool = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs = _init_tree(self, kwargs)
        self.prefix_grouping = bool(kwargs.pop("prefix_grouping", type(self).prefix_grouping))
        super().__init__(*args, **kwargs)
        if self.prefix_grouping and getattr(self.args, "packing", False):
            raise ValueError("prefix_grouping groups samples; packing=True has already packed unrelated samples "
                             "into each row: turn one of them off")

    def _get_train_sampler(self, train_dataset=None):
        if not self.prefix_grouping:
            return super()._get_train_sampler(train_dataset)
        return prefix_grouped_sampler(self, train_dataset)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if return_outputs:
            return super().compute_loss(model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch)
        if getattr(self, "aux_loss_enabled", False):
            raise ValueError("tree packing in SFTTrainer does not handle a router auxiliary loss yet: set "
                             "model.config.output_router_logits=False or use the stock SFTTrainer")
        if self.compute_loss_func is not None or (self.label_smoother is not None and self.args.loss_type == "nll"):
            raise ValueError("tree packing in SFTTrainer computes the loss from log-probabilities: a custom "
                             "compute_loss_func or label smoothing needs the full logits (use the stock SFTTrainer)")
        unknown = set(inputs) - {"input_ids", "attention_mask", "labels", "position_ids", "use_cache",
                                 "completion_mask", "assistant_masks", "seq_lengths", *_PADDING_FREE_KEYS}
        if unknown:
            raise ValueError(f"tree packing in SFTTrainer takes text batches only; got extra inputs {sorted(unknown)}")
        _check_padding_free(inputs)
        mode = "train" if self.model.training else "eval"
        inner = _unwrap(self, model)
        compiled = self._tree_models(inner, _setting(self, inner), outputs=("entropy",))
        tree = rows_to_tree(inputs["input_ids"], attention_mask=inputs.get("attention_mask"),
                            labels=inputs.get("labels"), position_ids=inputs.get("position_ids"))
        # loss mode "sum": each target's weight counts the sequences training it.
        batch = pack(tree, loss_mode="sum", device=inputs["input_ids"].device)
        with self.accelerator.autocast(), _class_forward(inner):
            out = compiled(batch)
        lp = out.logprobs
        weight = batch.target_weight.to(lp.dtype)
        per_token = -lp
        if self.args.loss_type == "dft":
            # DFT (as TRL): each token's loss scaled by its own probability, detached.
            per_token = per_token * lp.detach().exp()
        num_tokens = batch.n_targets if num_items_in_batch is None else num_items_in_batch
        loss = (weight * per_token).sum() / torch.as_tensor(num_tokens, device=lp.device).clamp(min=1)
        if self.args.average_tokens_across_devices and num_items_in_batch is not None:
            loss = loss * (self.accelerator.num_processes // self.get_tp_size())

        with torch.no_grad():
            n_valid = self.accelerator.gather_for_metrics(weight.sum().detach()).sum()
            ent = self.accelerator.gather_for_metrics((weight * out.entropy.to(lp.dtype)).sum().detach()).sum()
            self._metrics[mode]["entropy"].append((ent / n_valid).item() if n_valid > 0 else 0.0)
        if mode == "train":
            if "attention_mask" in inputs:
                local = inputs["attention_mask"].sum()
            else:
                local = torch.tensor(inputs["input_ids"].numel(), device=inputs["input_ids"].device)
            self._total_train_tokens += self.accelerator.gather_for_metrics(local).sum().item() // self._tp_size
        self._metrics[mode]["num_tokens"] = [self._total_train_tokens]
        return loss


# --------------------------------------------------------------------------- GRPO


class TreeGRPOMixin:
    """`GRPOTrainer` with the policy (and reference) forward on prefix trees.

    Put it before ``GRPOTrainer`` in the bases. Overrides
    ``_get_per_token_logps_and_entropies`` only; TRL computes the loss from what it returns.
    Text-only: a multimodal batch or a router auxiliary loss is refused.
    """

    tree_compile_options: dict[str, Any] = {}

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs = _init_tree(self, kwargs)
        super().__init__(*args, **kwargs)

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False, **multimodal):
        given = sorted(k for k, v in multimodal.items() if v is not None)
        if given:
            raise ValueError(f"tree packing in GRPOTrainer takes text batches only; got {given}")
        if compute_aux_loss:
            raise ValueError("tree packing in GRPOTrainer does not handle a router auxiliary loss yet: set "
                             "model.config.output_router_logits=False or use the stock GRPOTrainer")
        inner = _unwrap(self, model)
        # Entropy always: one compiled graph for the loss pass and the old-log-prob pass.
        compiled = self._tree_models(inner, _setting(self, inner), outputs=("entropy",),
                                     temperature=self.temperature)
        k = int(logits_to_keep)
        batch_size = batch_size or input_ids.size(0)
        all_logps, all_entropies = [], []
        for start in range(0, input_ids.size(0), batch_size):
            ids = input_ids[start:start + batch_size]
            mask = attention_mask[start:start + batch_size]
            prompt_len = mask[:, :-k].sum(1).tolist()
            completion_len = mask[:, -k:].sum(1).tolist()
            # TRL left-pads prompts and right-pads completions: each row is prompt + completion + padding
            # once the prompt's padding is dropped; rows_to_tree checks that it is one run.
            tree = rows_to_tree(ids, attention_mask=mask)
            batch = pack(tree, loss_mode="sum", device=ids.device)
            with self.accelerator.autocast(), _class_forward(inner):
                out = compiled(batch)
            idx = tree_logprob_index(batch, prompt_len, completion_len, k)
            all_logps.append(_gather(out.logprobs, idx))
            if compute_entropy:
                all_entropies.append(_gather(out.entropy, idx))
        logps = torch.cat(all_logps, dim=0)
        entropies = torch.cat(all_entropies, dim=0) if compute_entropy else None
        return logps, entropies, None


def _trainer_classes() -> tuple[type, type]:
    trl = _require_trl()

    class TreeSFTTrainer(TreeSFTMixin, trl.SFTTrainer):
        """`trl.SFTTrainer` training on prefix trees (see `TreeSFTMixin`)."""

    class TreeGRPOTrainer(TreeGRPOMixin, trl.GRPOTrainer):
        """`trl.GRPOTrainer` running the policy on prefix trees (see `TreeGRPOMixin`)."""

    for cls in (TreeSFTTrainer, TreeGRPOTrainer):
        cls.__module__ = __name__
        cls.__qualname__ = cls.__name__
    return TreeSFTTrainer, TreeGRPOTrainer


def __getattr__(name: str) -> Any:
    # The trainer classes subclass TRL's: built on first use, so that importing this module
    # (and its docs) works without TRL installed.
    if name in ("TreeSFTTrainer", "TreeGRPOTrainer"):
        sft, grpo = _trainer_classes()
        globals().update(TreeSFTTrainer=sft, TreeGRPOTrainer=grpo)
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
