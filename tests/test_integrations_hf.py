"""Hugging Face ``Trainer`` on tree batches (`treecompile.integrations.hf`) against the stock
``Trainer`` on the same records, step for step.

The stock run is the unmodified model on the padded records with ``labels`` (-100 on prompt
and padding tokens): Hugging Face's causal-LM loss, the mean over every trained token of the
micro-batch, or with gradient accumulation the sum over the trained tokens of all accumulated
micro-batches. The tree run merges each micro-batch into one prefix tree (``token-mean``, its
sum divided by the Trainer's count of the window's tokens: the same numbers). Both run with
the Trainer's defaults (``remove_unused_columns=True``) and use SGD with a constant learning
rate and the default gradient clipping, so each step's parameter update is the (clipped)
gradient times the learning rate: comparing updates compares gradients. (Adam's first update
is ``lr * sign(grad)``, so a rounding difference in a near-zero gradient would move a parameter
by ``2 * lr``: not a fair test.)
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest
import torch
from testing import TRAINER_ERROR_RATIO, TRAINER_TOLERANCE, perturbed_hf_model

import treecompile as tc
from treecompile.core.errors import TreeInputError

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # the Trainer's own requirement
from treecompile.integrations.hf import TreeCollator  # noqa: E402

STEPS, BATCH = 3, 4


def _qwen3():
    cfg = transformers.Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    return perturbed_hf_model(cfg, torch.float32, eval=False)


def _records() -> list[dict]:
    """12 records (3 micro-batches of 4): prompts sharing prefixes of one system prompt, responses
    of 1 to 6 tokens, prompt tokens masked with -100; a repeated record and one that is a
    prefix of another, so that trees have paths ending inside them and repeated paths."""
    g = torch.Generator().manual_seed(1)
    system = [5, 6, 7, 8]
    out = []
    for i in range(10):
        n = int(torch.randint(1, 7, (1,), generator=g))
        response = torch.randint(1, 64, (n,), generator=g).tolist()
        prompt = system[: 2 + i % 3]
        out.append({"input_ids": prompt + response, "labels": [-100] * len(prompt) + response})
    out.append(dict(out[0]))
    out.append({"input_ids": out[1]["input_ids"][:-1], "labels": out[1]["labels"][:-1]})
    return out


def _pad(features: list[dict]) -> dict[str, torch.Tensor]:
    """The stock collator: right padding, -100 labels and a zero attention mask on the padding."""
    longest = max(len(f["input_ids"]) for f in features)
    fill = [longest - len(f["input_ids"]) for f in features]
    return {
        "input_ids": torch.tensor([f["input_ids"] + [0] * n for f, n in zip(features, fill)]),
        "labels": torch.tensor([f["labels"] + [-100] * n for f, n in zip(features, fill)]),
        "attention_mask": torch.tensor([[1] * len(f["input_ids"]) + [0] * n for f, n in zip(features, fill)]),
    }


def _train(base, *, tree: bool, tmp_path, lora: bool = False, data=None, evaluate: bool = False, backend=None,
           **args):
    """``(losses [STEPS], updates [STEPS] of {name: tensor}, micro-batches, trainer, model)`` of a
    3-step run on a copy of ``base`` (with random LoRA adapters on q and v if ``lora``), on
    ``data`` (default: `_records()` as a list); with ``evaluate``, ``trainer.evaluate()`` on
    ``data`` is run after training and its metrics are ``trainer.eval_metrics``. ``backend``
    goes to ``tree_compile`` (None: the default lowering)."""
    model = copy.deepcopy(base)
    if lora:
        peft = pytest.importorskip("peft")
        torch.manual_seed(1)
        config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
        model = peft.get_peft_model(model, config)
    seen, losses, updates = [], [], []
    before = {n: p.detach().double().clone() for n, p in model.named_parameters()}

    class Record(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            now = {n: p.detach().double().clone() for n, p in model.named_parameters()}
            updates.append({n: now[n] - before[n] for n in now})
            before.update(now)

    collator = TreeCollator() if tree else _pad

    def collate(features):
        seen.append([{"input_ids": list(f["input_ids"]), "labels": list(f["labels"])} for f in features])
        return collator(features)

    args = {"per_device_train_batch_size": BATCH, **args}
    training_args = transformers.TrainingArguments(
        output_dir=str(tmp_path / ("tree" if tree else "stock")), max_steps=STEPS, optim="sgd", learning_rate=0.5,
        lr_scheduler_type="constant", use_cpu=True, report_to="none", save_strategy="no", seed=0, disable_tqdm=True,
        **args,
    )
    data = _records() if data is None else data
    trainer = transformers.Trainer(
        model=tc.tree_compile(model, backend=backend) if tree else model, args=training_args, train_dataset=data,
        eval_dataset=data,
        data_collator=collate, callbacks=[Record()],
    )
    compute_loss = trainer.compute_loss

    def recorded(*a, **k):
        loss = compute_loss(*a, **k)
        if trainer.model.training:  # training micro-batches only
            losses.append(loss.detach().double().item())
        return loss

    trainer.compute_loss = recorded
    trainer.train()
    assert len(updates) == STEPS and len(losses) == STEPS * training_args.gradient_accumulation_steps
    if evaluate:
        trainer.eval_metrics = trainer.evaluate()
    return losses, updates, seen, trainer, model


def _assert_updates_close(got: list[dict], want: list[dict], tol: float) -> None:
    for step, (g, w) in enumerate(zip(got, want)):
        for name, ref in w.items():
            scale = max(ref.abs().max().item(), 1e-30)
            err = (g[name] - ref).abs().max().item() / scale
            assert err <= tol, f"step {step}, {name}: update differs by {err:.2e} of its largest entry > {tol:.0e}"


def _rel_error(updates: list[dict], ref: list[dict]) -> float:
    num = sum(((got[n] - want[n]) ** 2).sum() for got, want in zip(updates, ref) for n in want)
    den = sum((r**2).sum() for want in ref for r in want.values())
    return (num / den).sqrt().item()


def _trained_tokens(features: list[dict]) -> int:
    return sum(sum(y != -100 for y in f["labels"][1:]) for f in features)


@pytest.mark.parametrize("dtype, checkpointing, data, accumulation", [
    (torch.float64, False, "dataset", 2), (torch.float32, True, "list", 1),
], ids=["float64-dataset-accumulation", "float32-list-checkpointing"])
@pytest.mark.full
def test_trainer_on_trees_matches_the_stock_trainer(dtype, checkpointing, data, accumulation, tmp_path):
    """The Trainer's defaults otherwise (``remove_unused_columns=True`` keeps the columns the
    collator reads); float64: a ``datasets.Dataset``, 2 accumulated micro-batches of different
    trained-token counts per step, and ``evaluate()``'s ``eval_loss``."""
    base = _qwen3().to(dtype)
    records = _records()
    if data == "dataset":
        datasets = pytest.importorskip("datasets")
        # A column no forward names: the Trainer drops it, as for a stock run.
        records = datasets.Dataset.from_list([{**r, "source": "synthetic"} for r in records])
    kw = dict(gradient_checkpointing=checkpointing, data=records, evaluate=accumulation > 1,
              gradient_accumulation_steps=accumulation, per_device_train_batch_size=BATCH // accumulation)
    stock_losses, stock_updates, stock_seen, stock, _ = _train(base, tree=False, tmp_path=tmp_path, **kw)
    # The float64 run checks the Trainer glue (accumulation, a Dataset, evaluate()), which the
    # lowering does not touch: it runs the rewritten graph as it is. The float32 run and the LoRA
    # test keep the default lowering on this Qwen3 under the Trainer.
    backend = "eager" if dtype == torch.float64 else None
    tree_losses, tree_updates, tree_seen, trainer, model = _train(base, tree=True, tmp_path=tmp_path,
                                                                  backend=backend, **kw)
    assert tree_seen == stock_seen  # the same records in the same micro-batches
    assert trainer.args.remove_unused_columns  # the default
    loss_rtol, update_tol = TRAINER_TOLERANCE[str(dtype).removeprefix("torch.")]
    torch.testing.assert_close(torch.tensor(tree_losses), torch.tensor(stock_losses), rtol=loss_rtol, atol=0)
    _assert_updates_close(tree_updates, stock_updates, update_tol)
    if accumulation > 1:
        # Each step's micro-batches train different numbers of tokens: a per-micro-batch mean
        # (divided by the number of micro-batches) would differ from the stock loss.
        counts = [_trained_tokens(micro_batch) for micro_batch in stock_seen[: STEPS * accumulation]]
        assert sum(a != b for a, b in zip(counts[::2], counts[1::2])) >= 2, counts
        tree_eval, stock_eval = trainer.eval_metrics["eval_loss"], stock.eval_metrics["eval_loss"]
        assert tree_eval == pytest.approx(stock_eval, rel=loss_rtol, abs=0)
    if checkpointing:
        assert dict(trainer.model.counters["inline_subgraphs_pass"]) == {"checkpoint": 2}
        _assert_saved_model_loads_without_treecompile(trainer, model, tmp_path / "final")


@pytest.mark.full
def test_trainer_on_trees_trains_lora_adapters_as_the_stock_trainer(tmp_path):
    base = _qwen3().double()
    stock_losses, stock_updates, *_ = _train(base, tree=False, tmp_path=tmp_path, lora=True)
    tree_losses, tree_updates, _, trainer, model = _train(base, tree=True, tmp_path=tmp_path, lora=True)
    loss_rtol, update_tol = TRAINER_TOLERANCE["float64"]
    torch.testing.assert_close(torch.tensor(tree_losses), torch.tensor(stock_losses), rtol=loss_rtol, atol=0)
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trained and all("lora_" in n for n in trained)
    _assert_updates_close([{n: u[n] for n in trained} for u in tree_updates],
                          [{n: u[n] for n in trained} for u in stock_updates], update_tol)
    trainer.save_model(str(tmp_path / "adapter"))  # the adapter, as PEFT saves it
    assert (tmp_path / "adapter" / "adapter_config.json").exists()


def test_trainer_bf16_autocast_error_is_within_the_stock_trainers(tmp_path):
    """bf16 autocast and gradient checkpointing on (TRL's defaults): the tree run's distance from
    the float32 stock run is at most the stock bf16 run's, times the GPU check's ratio."""
    base = _qwen3()
    ref_losses, ref_updates, *_ = _train(base, tree=False, tmp_path=tmp_path, gradient_checkpointing=True)
    # The rewritten graph as it is: bf16 autocast with checkpointing through the default lowering
    # is test_integration_trl.py's test_sft_bf16_checkpointing_within_stock_noise (a Qwen3
    # under TRL's SFT trainer, a Trainer subclass).
    runs = {tree: _train(base, tree=tree, tmp_path=tmp_path, gradient_checkpointing=True, bf16=True,
                         backend="eager" if tree else None)
            for tree in (False, True)}
    (stock_losses, stock_updates, *_), (tree_losses, tree_updates, *_) = runs[False], runs[True]
    stock_err, tree_err = _rel_error(stock_updates, ref_updates), _rel_error(tree_updates, ref_updates)
    assert 0 < tree_err <= TRAINER_ERROR_RATIO * stock_err, (tree_err, stock_err)
    stock_loss_err = max(abs(a - b) for a, b in zip(stock_losses, ref_losses))
    tree_loss_err = max(abs(a - b) for a, b in zip(tree_losses, ref_losses))
    assert tree_loss_err <= TRAINER_ERROR_RATIO * stock_loss_err, (tree_loss_err, stock_loss_err)


@pytest.mark.parametrize("loss_mode", ["token-mean", "sum"])
def test_trainer_label_smoothing_is_refused_naming_the_option(loss_mode, tmp_path):
    """Label smoothing needs the logits, which a tree run never forms. With token-mean the
    Trainer would fail in its own code on a scalar; with another loss mode the collator gives
    no labels and the Trainer would skip the smoothing: trained without it, silently."""
    model = _qwen3()
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=BATCH, label_smoothing_factor=0.1,
        use_cpu=True, report_to="none", save_strategy="no", disable_tqdm=True)
    trainer = transformers.Trainer(model=tc.tree_compile(model, backend="eager"), args=args,
                                   train_dataset=_records(), data_collator=TreeCollator(loss_mode=loss_mode))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    first = (r"^Trainer\(args.label_smoothing_factor=0.1\): label smoothing is computed from the logits, which a "
             r"tree-compiled model never forms")
    with pytest.raises(TreeInputError, match=first):
        trainer.train()
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())  # not a step taken


def _assert_saved_model_loads_without_treecompile(trainer, model, path) -> None:
    """``trainer.save_model`` wrote the plain model: a fresh interpreter that never imports
    treecompile loads it with ``from_pretrained``, with the trained weights."""
    trainer.save_model(str(path))
    load = (
        "import json, sys, transformers\n"
        f"m = transformers.AutoModelForCausalLM.from_pretrained({str(path)!r})\n"
        "assert 'treecompile' not in sys.modules\n"
        "sums = {k: v.double().sum().item() for k, v in m.state_dict().items()}\n"
        "print(json.dumps({'class': type(m).__name__, 'dtype': str(m.dtype), 'sums': sums}))\n"
    )
    out = subprocess.run([sys.executable, "-c", load], capture_output=True, text=True, check=True, timeout=300)
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert (loaded["class"], loaded["dtype"]) == (type(model).__name__, str(model.dtype))
    assert loaded["sums"] == {k: v.double().sum().item() for k, v in model.state_dict().items()}


# ----------------------------------------------------------------------------- the collator alone


def test_collator_merges_the_micro_batch_into_one_tree_and_leaves_records_alone():
    records = _records()[:BATCH]
    kept = copy.deepcopy(records)
    batch = TreeCollator()(records)["batch"]
    assert records == kept
    assert batch.num_paths == BATCH
    assert batch.num_tokens < sum(len(r["input_ids"]) for r in records)  # the shared prompt once
    # token-mean over the trained (label != -100) tokens; position 0 never trains.
    trained = sum(sum(y != -100 for y in r["labels"][1:]) for r in records)
    torch.testing.assert_close(batch.target_weight.sum(), torch.tensor(1.0, dtype=batch.target_weight.dtype))
    assert int((batch.target_weight > 0).sum()) <= trained
    # Unlabelled records train every token after the first; trees pass through.
    tree = tc.TrajectoryTree.from_sequences([[1, 2, 3], [1, 2, 4]])
    both = TreeCollator(loss_mode="sum")([{"input_ids": torch.tensor([9, 8, 7])}, tree])["batch"]
    assert both.num_paths == 3 and float(both.target_weight.sum()) == 2 + 2 + 2
    assert "labels" not in TreeCollator(loss_mode="sum")(records)  # no token count for another mode


def test_collator_labels_count_the_trained_tokens_as_the_trainer_does():
    """``labels[..., 1:] != -100`` (the Trainer's ``num_items_in_batch``) is the batch's target count;
    padding (attention mask 0) is dropped; a tree record's paths get a row each."""
    records = [dict(r) for r in _records()[:3]]
    records[1] = {"input_ids": [0, 0] + records[1]["input_ids"] + [0],
                  "labels": [-100, -100] + records[1]["labels"] + [-100],
                  "attention_mask": [0, 0] + [1] * len(records[1]["input_ids"]) + [0]}
    tree = tc.TrajectoryTree.from_sequences([[1, 2, 3, 4], [1, 2, 5]], loss_masks=[[0, 0, 1, 1], [0, 1, 1]])
    out = TreeCollator()([*records, tree])
    batch, labels = out["batch"], out["labels"]
    assert labels.shape[0] == batch.num_paths == 5
    assert int((labels[..., 1:] != -100).sum()) == batch.n_targets == _trained_tokens(_records()[:3]) + 2 + 2
    # A record's row is its labels, as a stock collator passes them (its padding dropped).
    for row, want in zip(labels, [r["labels"] for r in _records()[:3]] + [[-100, -100, 3, 4], [-100, 2, 5]]):
        assert row[: len(want)].tolist() == want and (row[len(want):] == -100).all()
    unpadded = TreeCollator()([_records()[1]])["batch"]
    assert torch.equal(TreeCollator()([records[1]])["batch"].input_ids, unpadded.input_ids)


@pytest.mark.parametrize("record, match", [
    ({"input_ids": [1, 2, 3], "labels": [-100, 2]}, "2 labels for 3 input_ids"),
    ({"input_ids": [1, 2, 3], "labels": [-100, 5, 3]}, r"labels\[1\] = 5 is neither input_ids\[1\] = 2"),
    ([1, 2, 3], "record 0 is a list"),
    ({"text": "hello"}, r"record 0 has no 'input_ids' \(keys: \['text'\]\); TreeCollator takes tokenized"),
    ({"input_ids": [1, 2, 3], "attention_mask": [1, 0, 1]}, "the attention mask has a hole"),
    ({"input_ids": [1, 2, 0], "labels": [-100, 2, 0], "attention_mask": [1, 1, 0]},
     r"labels\[2\] = 0 trains a padding token"),
], ids=["length", "other-token", "not-a-record", "no-input-ids", "mask-hole", "trained-padding"])
def test_collator_refuses_records_it_cannot_train_exactly(record, match):
    with pytest.raises(TreeInputError, match=match):
        TreeCollator()([record])


def test_collator_refuses_an_unknown_loss_mode():
    with pytest.raises(ValueError, match="unknown loss_mode 'mean'; valid modes: token-mean"):
        TreeCollator(loss_mode="mean")


def test_importing_the_integrations_imports_no_framework():
    code = (
        "import sys\n"
        "import treecompile, treecompile.integrations\n"
        "from treecompile.integrations import hf, verl\n"
        "loaded = sorted(m for m in ('transformers', 'trl', 'verl', 'ray', 'accelerate') if m in sys.modules)\n"
        "assert not loaded, loaded\n"
        "assert treecompile.integrations.hf is hf\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)
