"""What a user runs today, as `treecompile.bench.cuda` and `treecompile.bench.profile_cuda` measure it.

The Qwen3 shapes both benchmark (random weights), and the unmodified Hugging Face model's
training step on the paths of a tree, written out as a user runs it: right-padded into one
batch with SDPA, or packed into one row with FlexAttention and a document mask, with HF's own
loss, split into micro-batches (gradient accumulation) on out-of-memory.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["MODEL_SHAPES", "Baseline", "Padded", "Packed", "model_of", "paths_of", "targets"]

#: Hugging Face Qwen3 shapes (the published configs' sizes; weights random).
MODEL_SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True),
    "qwen3-1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True),
    # The 1.7B shape with 8 of its 28 layers: `scripts/gpu.sh perf` (compile time grows with depth).
    "qwen3-1.7b-8l": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=8, num_attention_heads=16,
                          num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True),
    # Seconds on a CPU: for tests of this module.
    "tiny": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=8, vocab_size=2048, tie_word_embeddings=True),
}


def model_of(name: str, dtype: torch.dtype, device: torch.device, seed: int):
    import transformers

    torch.manual_seed(seed)
    config = transformers.Qwen3Config(**MODEL_SHAPES[name], max_position_embeddings=1 << 17)
    with device:
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.train()


def paths_of(trees) -> list[tuple[list[int], list[bool]]]:
    """Each path's tokens and loss mask (position 0 never a target)."""
    out = []
    for t in trees:
        for p in t.paths():
            if p.weight != 1:
                raise ValueError("the HF baselines' loss has no per-path weights; paths of weight 1 only")
            mask = [True] * len(p.tokens) if p.loss_mask is None else [bool(m) for m in p.loss_mask]
            out.append((list(p.tokens), mask))
    return out


def _padded_inputs(paths, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    width = max(len(t) for t, _ in paths)
    ids = torch.zeros(len(paths), width, dtype=torch.int64)
    att = torch.zeros(len(paths), width, dtype=torch.int64)
    labels = torch.full((len(paths), width), -100, dtype=torch.int64)
    for i, (toks, mask) in enumerate(paths):
        n = len(toks)
        ids[i, :n] = torch.tensor(toks)
        att[i, :n] = 1
        lab = torch.tensor(toks)
        lab[~torch.tensor(mask)] = -100
        labels[i, :n] = lab
    return ids.to(device), att.to(device), labels.to(device)


def _packed_inputs(paths, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ids, pos, labels = [], [], []
    for toks, mask in paths:
        ids += toks
        pos += list(range(len(toks)))
        lab = [t if m else -100 for t, m in zip(toks, mask)]
        lab[0] = -100  # HF shifts labels: the first token would be "predicted" by the previous path
        labels += lab
    as_row = lambda x: torch.tensor([x], dtype=torch.int64, device=device)  # noqa: E731
    return as_row(ids), as_row(pos), as_row(labels)


def _micro_batches(paths, micro: int) -> list[list]:
    """The paths in ``micro`` consecutive groups of (nearly) equal size."""
    k = -(-len(paths) // micro)
    return [paths[i:i + k] for i in range(0, len(paths), k)]


def targets(paths) -> int:
    """Targets HF's shifted labels count: every loss-masked token after a path's first."""
    return sum(sum(m[1:]) for _, m in paths)


class Baseline:
    """One step of an HF baseline over ``micro`` micro-batches of the paths (1 unless a step ran
    out of memory): HF's loss is a token mean per call, so each micro-batch's is re-weighted to
    the mean over all (gradient accumulation). The inputs are built once per ``micro``, outside
    the timed steps, as the tree's batch is packed once."""

    attention: str  #: the HF attention implementation the model runs with

    def __init__(self, model, fn, paths, device):
        self.model, self.fn, self.paths, self.device = model, fn, paths, device
        self.micro = 1
        self.total = targets(paths)
        self._inputs: tuple[int, list] | None = None  # (micro, [(call kwargs, targets)])

    def _call_kwargs(self, paths) -> dict:
        raise NotImplementedError

    def __call__(self) -> float:
        if self._inputs is None or self._inputs[0] != self.micro:
            self._inputs = None  # the previous micro-batches' memory first
            self._inputs = (self.micro, [(self._call_kwargs(part), targets(part))
                                         for part in _micro_batches(self.paths, self.micro)])
        self.model.config._attn_implementation = self.attention
        loss_sum = 0.0
        for kwargs, n in self._inputs[1]:
            out = self.fn(**kwargs, use_cache=False)
            (out.loss * (n / self.total)).backward()
            loss_sum += float(out.loss.detach()) * n / self.total
        return loss_sum


class Padded(Baseline):
    """The paths right-padded into one batch with an attention mask, SDPA."""

    attention = "sdpa"

    def _call_kwargs(self, paths) -> dict:
        ids, att, labels = _padded_inputs(paths, self.device)
        return dict(input_ids=ids, attention_mask=att, labels=labels)


class Packed(Baseline):
    """The paths packed into one row. With FlexAttention, the document-causal BlockMask is
    handed to HF (which passes a BlockMask through unchanged): the interval rule on a forest of
    one-path trees, built from per-block bounds like the tree's own. Otherwise HF derives the
    document mask from ``position_ids``."""

    def __init__(self, model, fn, paths, device, attention: str):
        super().__init__(model, fn, paths, device)
        self.attention = attention

    def _call_kwargs(self, paths) -> dict:
        ids, pos, labels = _packed_inputs(paths, self.device)
        mask = None
        if self.attention == "flex_attention":
            from treecompile.kernels.attention.blockmask import tree_block_mask

            ends, total = [], 0
            for t, _ in paths:
                total += len(t)
                ends += [total] * len(t)
            mask = tree_block_mask(torch.tensor(ends, dtype=torch.int64, device=self.device))
        return dict(input_ids=ids, position_ids=pos, attention_mask=mask, labels=labels)
