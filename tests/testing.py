"""Shared test utilities: tolerances with their reasons, and a prefix-hash 'model'."""

from __future__ import annotations

import hashlib

import numpy as np
import torch

# (dtype, what is compared) -> (rtol, atol), each with the reason for its size.
TOLERANCES = {
    # Pure float64 arithmetic, summed in a different order: rounding only.
    ("float64", "pure"): (1e-12, 1e-12),
    # Hugging Face norms compute in float32 even in a float64 model: a ~1e-7 floor.
    ("float64", "hf"): (1e-6, 1e-7),
}


def hash_logits(prefix: tuple[int, ...], vocab: int) -> np.ndarray:
    """Logits that are a fixed pseudo-random function of the whole prefix."""
    digest = hashlib.blake2b(repr(prefix).encode(), digest_size=8).digest()
    rng = np.random.default_rng(int.from_bytes(digest, "little"))
    return rng.normal(size=vocab) * 2.0


def hash_forward(vocab: int):
    """``forward(model, ids[1, T]) -> logits[1, T, V]`` for :func:`treecompile.reference.per_path_loss`."""

    def forward(model, ids):
        toks = ids[0].tolist()
        rows = [hash_logits(tuple(toks[: t + 1]), vocab) for t in range(len(toks))]
        return torch.tensor(np.stack(rows), dtype=torch.float64)[None]

    return forward


def tree_hash_logits(batch, vocab: int) -> torch.Tensor:
    """``[S, V]`` logits of every row from the prefix along its own path (pred_index chain)."""
    pred = batch.pred_index.tolist()
    ids = batch.input_ids.tolist()
    rows = []
    for j in range(len(ids)):
        chain = []
        k = j
        while k >= 0:
            chain.append(ids[k])
            k = pred[k]
        rows.append(hash_logits(tuple(reversed(chain)), vocab))
    return torch.tensor(np.stack(rows), dtype=torch.float64)


class NoModel(torch.nn.Module):
    """Stands in for a model where ``forward=`` does the work."""

    def __init__(self) -> None:
        super().__init__()
        self.p = torch.nn.Parameter(torch.zeros(1, dtype=torch.float64))
