"""Calls of tree-compiled models from several threads: one at a time, each exact."""

from __future__ import annotations

import threading

import pytest
import torch
import transformers

import treecompile as tc
from testing import perturbed_hf_model

CFG = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
           num_key_value_heads=2, head_dim=8)


@pytest.mark.full
def test_two_threads_making_the_first_call_at_once_both_get_the_exact_result():
    """Two threads' first calls on one compiled model used to interleave the capture's swaps of
    module-level functions (one thread's call restoring them under the other's trace) and refused
    a supported model; now the calls run one at a time, and both equal a call made alone."""
    model = perturbed_hf_model(transformers.Qwen3Config(**CFG))
    batch = tc.pack([tc.TrajectoryTree.from_sequences([[1, 2, 3, 4, 5], [1, 2, 3, 9], [7, 8]])])
    alone = tc.tree_compile(model)(batch).loss.detach()

    compiled = tc.tree_compile(model)
    start = threading.Barrier(2)
    results: dict[int, object] = {}

    def call(i: int) -> None:
        start.wait()
        try:
            results[i] = compiled(batch).loss.detach()
        except Exception as e:  # noqa: BLE001  (reported below, with the thread it happened in)
            results[i] = e

    threads = [threading.Thread(target=call, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert all(isinstance(r, torch.Tensor) for r in results.values()), results
    assert len(results) == 2 and all(torch.equal(r, alone) for r in results.values()), (results, alone)


@pytest.mark.full
def test_forward_called_directly_waits_for_a_running_call():
    """PEFT's LoraModel calls its base model's ``forward`` directly: that path takes the same
    lock as ``__call__``, so it cannot run beside another thread's call."""
    from treecompile.compile import entry

    model = perturbed_hf_model(transformers.Qwen3Config(**CFG))
    compiled = tc.tree_compile(model, backend="eager")
    batch = tc.pack([tc.TrajectoryTree.from_sequences([[1, 2, 3], [1, 4]])], warn_por=False)
    compiled(batch)  # compiled: an unlocked forward would now finish at once
    finished = threading.Event()
    with entry.CALLS:  # another call is running
        worker = threading.Thread(target=lambda: (compiled.forward(batch), finished.set()))
        worker.start()
        assert not finished.wait(2.0), "forward ran while another call held the lock"
    worker.join(60)
    assert finished.is_set()
