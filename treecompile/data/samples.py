"""Sample trajectories and a small tokenizer shipped with treecompile.

Real public data (MIT-licensed; sources and license notices in this folder's
``README.md``), small enough to ship, so that the demo and the examples work with
only the repository:

* :func:`sample_tau_bench`: 4 tau-bench airline tasks x 4 trials of a GPT-4o agent;
* :func:`sample_gsm8k`: 30 GSM8K questions x 4 model solutions (GRPO-like groups);
* :func:`sample_think`: 2 tau2-bench airline trials of grok-3-mini, with its reasoning;
* ``sample-tokenizer.json``: a byte-level BPE (2,048 ids, ChatML specials) trained on
  tau-bench airline and GSM8K text, loaded by ``load_tokenizer("sample")``.

Example:
    >>> from treecompile import TrajectoryTree
    >>> from treecompile.data.samples import sample_conversations
    >>> tree = TrajectoryTree.from_messages(sample_conversations(), "sample")
    >>> tree.num_paths
    4

``scripts/make_sample_data.py`` regenerates every file from the full data.
"""

from __future__ import annotations

import json
from typing import Any

from treecompile.core.sample_files import SAMPLE_FILES, sample_path

__all__ = ["SAMPLE_FILES", "sample_conversations", "sample_gsm8k", "sample_path", "sample_tau_bench", "sample_think"]

def _grouped_jsonl(name: str) -> dict[str, list[list[dict[str, Any]]]]:
    out: dict[str, list[list[dict[str, Any]]]] = {}
    with sample_path(name).open(encoding="utf-8") as f:
        for line in f:
            if line.strip():
                obj = json.loads(line)
                out.setdefault(obj["group"], []).append(obj["messages"])
    return out


def sample_tau_bench() -> dict[int, list[list[dict[str, Any]]]]:
    """tau-bench airline sample: ``task_id -> [conversation per trial]`` (4 tasks x 4 trials)."""
    from treecompile.data.datasets import load_tau_bench

    return load_tau_bench(sample_path("tau_bench"))


def sample_gsm8k() -> dict[str, list[list[dict[str, Any]]]]:
    """GSM8K sample: ``"gsm8k-{i}" -> 4 conversations`` ([user question, assistant solution])."""
    return _grouped_jsonl("gsm8k")


def sample_think() -> dict[str, list[list[dict[str, Any]]]]:
    """tau2-bench airline sample with assistant reasoning (``reasoning_content``): task -> 2 trials."""
    return _grouped_jsonl("think")


def sample_conversations() -> list[list[dict[str, Any]]]:
    """The 4 trials of the first sample tau-bench task: one ready-made group of conversations."""
    return next(iter(sample_tau_bench().values()))
