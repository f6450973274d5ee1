"""Prefix grouping inside the stock libraries: the Hugging Face ``Trainer`` (and accelerate's
split of its batches over processes) and TRL's ``SFTTrainer``, not mocked: each micro-batch they
hand the model is one group of the sampler, every record once per epoch."""

from __future__ import annotations

import json
from importlib import resources

import pytest
import torch
from test_prefix_sampler import _clusters

from treecompile import TrajectoryTree
from treecompile.core.errors import TreeInputError
from treecompile.integrations.hf import PrefixGroupingMixin, prefix_grouped_sampler, record_sequences
from treecompile.planning.prefix_sampler import PrefixGroupedSampler

transformers = pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")


def _tiny_model(vocab: int):
    cfg = transformers.Qwen3Config(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg)


def _pad(features):
    width = max(len(f["input_ids"]) for f in features)
    return {
        "input_ids": torch.tensor([f["input_ids"] + [0] * (width - len(f["input_ids"])) for f in features]),
        "labels": torch.tensor([f["input_ids"] + [-100] * (width - len(f["input_ids"])) for f in features]),
        "attention_mask": torch.tensor([[1] * len(f["input_ids"]) + [0] * (width - len(f["input_ids"]))
                                        for f in features]),
    }


class PrefixTrainer(PrefixGroupingMixin, transformers.Trainer):
    pass


def test_trainer_micro_batches_are_the_groups_of_each_epoch(tmp_path):
    """Two epochs with gradient accumulation: the Trainer's micro-batches are the sampler's
    groups of epoch 0, then of epoch 1 (the Trainer sets the epoch through accelerate)."""
    seqs, cluster = _clusters(6, 4)
    index = {tuple(s): i for i, s in enumerate(seqs)}
    seen: list[list[int]] = []

    def collate(features):
        seen.append([index[tuple(f["input_ids"])] for f in features])
        return _pad(features)

    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=4, gradient_accumulation_steps=2, num_train_epochs=2,
        use_cpu=True, report_to="none", save_strategy="no", seed=7, disable_tqdm=True, optim="sgd")
    records = [{"input_ids": s} for s in seqs]
    trainer = PrefixTrainer(model=_tiny_model(200), args=args, train_dataset=records, data_collator=collate)
    sampler = trainer._get_train_sampler()
    assert isinstance(sampler, PrefixGroupedSampler) and (sampler.group_size, sampler.seed) == (4, 7)
    trainer.train()
    assert len(seen) == 12, f"{len(seen)} micro-batches for 2 epochs of 6 groups"
    for epoch in (0, 1):
        sampler.set_epoch(epoch)
        assert seen[6 * epoch:6 * epoch + 6] == sampler.groups(), f"epoch {epoch}"
        assert sorted(i for g in seen[6 * epoch:6 * epoch + 6] for i in g) == list(range(24))
    assert all(len({cluster[i] for i in g}) == 1 for g in seen), "a micro-batch mixes clusters"
    assert seen[:6] != seen[6:], "both epochs in the same order"


@pytest.mark.parametrize("groups", [6, 7])
def test_accelerate_gives_each_process_whole_groups(groups):
    """accelerate's split of the data loader's batches over 2 processes (``BatchSamplerShard``,
    as ``accelerator.prepare`` wraps it): process r takes batches r, r + 2, ...; each is a group.
    With an odd count, ``even_batches`` repeats the first group to fill the last round."""
    from accelerate.data_loader import BatchSamplerShard

    seqs, cluster = _clusters(groups, 4)
    sampler = PrefixGroupedSampler(seqs, group_size=4, seed=1)
    batch_sampler = torch.utils.data.BatchSampler(sampler, 4, drop_last=False)
    shards = [list(BatchSamplerShard(batch_sampler, num_processes=2, process_index=r)) for r in range(2)]
    assert len(shards[0]) == len(shards[1])
    expected = sampler.groups() + sampler.groups()[:groups % 2]
    assert [b for pair in zip(*shards) for b in pair] == expected
    assert all(len({cluster[i] for i in b}) == 1 for s in shards for b in s)


def test_record_sequences_drop_padding_and_refuse_trees():
    datasets = pytest.importorskip("datasets")
    records = [{"input_ids": [0, 0, 5, 6], "attention_mask": [0, 0, 1, 1]}, {"input_ids": [5, 7]}]
    assert record_sequences(records) == [[5, 6], [5, 7]]
    ds = datasets.Dataset.from_list([{"input_ids": [0, 5, 6], "attention_mask": [0, 1, 1]},
                                     {"input_ids": [5, 7, 8], "attention_mask": [1, 1, 1]}])
    assert record_sequences(ds) == [[5, 6], [5, 7, 8]]
    with pytest.raises(TreeInputError, match="record 1 \\(TrajectoryTree\\)"):
        record_sequences([{"input_ids": [1]}, TrajectoryTree.from_sequences([[1, 2]])])
    with pytest.raises(TreeInputError, match="'input_ids' column"):
        record_sequences(datasets.Dataset.from_list([{"text": "a"}]))


# --------------------------------------------------------------------------- TRL


def _sft(tmp_path, **kw):
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    from treecompile.integrations.trl import TreeSFTTrainer

    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(resources.files("treecompile") / "samples" / "sample-tokenizer.json"),
        eos_token="<|im_end|>", pad_token="<|endoftext|>")
    rows = [json.loads(line) for line in
            (resources.files("treecompile") / "samples" / "gsm8k_sample.jsonl").read_text().splitlines()[:16]]
    # 4 questions x 4 solutions, the questions interleaved: a random sampler mixes them.
    rows = [rows[4 * (i % 4) + i // 4] for i in range(16)]
    dataset = datasets.Dataset.from_list(
        [{"prompt": r["messages"][0]["content"], "completion": r["messages"][1]["content"]} for r in rows])
    args = trl.SFTConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, max_length=96, use_cpu=True,
                         bf16=False, report_to=[], save_strategy="no", disable_tqdm=True, seed=3,
                         **kw.pop("args", {}))
    return TreeSFTTrainer(model=_tiny_model(2048), args=args, train_dataset=dataset, processing_class=tok, **kw)


def _batch_sequences(batch) -> list[tuple[int, ...]]:
    return [tuple(ids[m.bool()].tolist()) for ids, m in zip(batch["input_ids"], batch["attention_mask"])]


def test_tree_sft_trainer_groups_each_questions_solutions(tmp_path):
    trainer = _sft(tmp_path, prefix_grouping=True)
    sampler = trainer._get_train_sampler()
    assert isinstance(sampler, PrefixGroupedSampler) and (sampler.group_size, sampler.seed) == (4, 3)
    ids = [tuple(x) for x in trainer.train_dataset["input_ids"]]
    batches = [_batch_sequences(b) for b in trainer.get_train_dataloader()]
    assert [[ids.index(s) for s in b] for b in batches] == sampler.groups()
    assert all(len({i % 4 for i in g}) == 1 for g in sampler.groups()), "a micro-batch mixes questions"
    grouped = [TrajectoryTree.from_sequences(list(map(list, b))).stats().por for b in batches]
    stock = [TrajectoryTree.from_sequences(list(map(list, _batch_sequences(b)))).stats().por
             for b in _sft(tmp_path).get_train_dataloader()]
    assert min(grouped) > max(stock), f"POR per micro-batch: grouped {grouped}, random {stock}"


def test_tree_sft_trainer_without_the_option_keeps_trls_sampler(tmp_path):
    assert not isinstance(_sft(tmp_path)._get_train_sampler(), PrefixGroupedSampler)


def test_tree_sft_trainer_refuses_grouping_packed_rows(tmp_path):
    with pytest.raises(ValueError, match="prefix_grouping groups samples; packing=True"):
        _sft(tmp_path, prefix_grouping=True, args={"packing": True})


def test_prefix_grouped_sampler_reads_the_trainer_settings(tmp_path):
    args = transformers.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=3, data_seed=11,
                                          seed=2, dataloader_drop_last=True, use_cpu=True, report_to="none")
    seqs, _ = _clusters(3, 3)
    trainer = transformers.Trainer(model=_tiny_model(200), args=args, train_dataset=[{"input_ids": s} for s in seqs])
    sampler = prefix_grouped_sampler(trainer)
    assert (sampler.group_size, sampler.seed, sampler.drop_last) == (3, 11, True)
