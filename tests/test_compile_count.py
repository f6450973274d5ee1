"""One compile per run: every optimizer step of a training run brings a different tree (rows,
depth, width and block layout all change), and the step must not compile again for it.

Each case runs 20 different trees through one compiled model with a backward each, then a few
under ``torch.no_grad()``, and allows one graph per grad mode. The first tree is the hardest
start: one sequence inside a single attention block (torch specialises a size-1 dimension of a
first call, so a first call with one block, one node or one target would otherwise pin it).
"""

from __future__ import annotations

import random

import pytest
import torch
import zoo_custom as zc
from test_compile_models import compare_with_paths
from testing import perturbed_hf_model

from treecompile import TrajectoryTree, pack, tree_compile
from treecompile.bench.compile_stats import recompile_reasons

transformers = pytest.importorskip("transformers")


def _trees() -> list[TrajectoryTree]:
    """20 trees: a 2-token sequence first (one block, one node, one target), then GRPO-like
    groups, multi-turn chains, deep trees and single sequences of 3 to ~700 rows, 1 to 12 paths
    (token ids below 32, every vocabulary here)."""
    rng = random.Random(1)

    def tok(n: int) -> list[int]:
        return [rng.randrange(1, 32) for _ in range(n)]

    shapes = [[[1, 2]]]
    for i in range(19):
        kind = i % 4
        if kind == 0:  # a group: one prompt, several completions
            prompt = tok(rng.randint(5, 200))
            shapes.append([prompt + tok(rng.randint(1, 90)) for _ in range(rng.randint(2, 12))])
        elif kind == 1:  # a multi-turn chain: each sample a prefix of the next
            turns, seq = [], []
            for _ in range(rng.randint(2, 5)):
                seq = seq + tok(rng.randint(3, 60))
                turns.append(seq)
            shapes.append(turns)
        elif kind == 2:  # one sequence
            shapes.append([tok(rng.randint(3, 400))])
        else:  # a deep tree: branches off branches
            root = tok(rng.randint(2, 40))
            paths = [root]
            for _ in range(rng.randint(2, 8)):
                paths.append(rng.choice(paths) + tok(rng.randint(1, 40)))
            shapes.append(paths)
    return [TrajectoryTree.from_sequences(s) for s in shapes]


def _qwen3():
    cfg = transformers.Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    return perturbed_hf_model(cfg, torch.float64, eval=False)


MODELS = {
    "qwen3": _qwen3,
    # A causal conv after attention: the calls pass the path structure (the node table).
    "conv": lambda: zc.CausalConvSliceLM().double(),
}


@pytest.mark.parametrize("name", ["qwen3", pytest.param("conv", marks=pytest.mark.full),
                                  pytest.param("qwen3-streamed", marks=pytest.mark.full)])
def test_twenty_different_trees_compile_once_per_grad_mode(name):
    """Streamed (parts of at most 200 rows), a tree that fits runs whole and a longer one as
    parts: one graph for each kind of call, per grad mode."""
    from treecompile.stream.plan import StreamOptions

    torch.manual_seed(0)
    streamed = name.endswith("-streamed")
    model = MODELS[name.removesuffix("-streamed")]()
    compiled = tree_compile(model, stream=StreamOptions(budget_rows=200) if streamed else None)
    trees = _trees()
    assert len({(t.num_tokens, t.num_paths) for t in trees}) == 20
    assert trees[0].num_tokens < 128 < max(t.num_tokens for t in trees)
    torch._logging.set_logs(recompiles=True)
    try:
        with recompile_reasons() as reasons:
            for tree in trees:
                compiled(pack(tree)).loss.backward()
            with_grad = len(compiled.compile_records)
            with torch.no_grad():
                for tree in trees[:4]:
                    compiled(pack(tree))
    finally:
        torch._logging.set_logs()
    kinds = 2 if streamed else 1  # the four trees under no_grad all fit whole: one graph more
    assert (with_grad, len(compiled.compile_records)) == (kinds, kinds + 1), reasons
    # The graph that served every tree is exact on the first (run with a padding target) and
    # the last: loss, log-probs and every gradient.
    for tree in (trees[0], trees[-1]):
        compare_with_paths(model, compiled, pack(tree), [tree], tol="hf" if name == "qwen3" else "pure")


class _HistoryLM(zc._LM):
    """Keeps a list of its calls' lengths and stops learning after a million of them
    (``len(self.history)``): Dynamo guards on the list's length, so every call compiles again."""

    block_cls = zc._SdpaAttn

    def __init__(self):
        super().__init__(layers=1)
        self.history = []

    def forward(self, idx):
        self.history.append(idx.shape[1])
        out = super().forward(idx)
        return out.detach() if len(self.history) > 10**6 else out


def test_a_model_that_recompiles_at_every_call_is_refused_naming_the_guard(monkeypatch):
    """Past the recompile limit (64 for treecompile's graphs; 3 here) the call is refused, naming
    the guard that failed, never run uncompiled (which would be per-sequence attention on the
    packed row); below it, each call is exact."""
    from treecompile.capture import call
    from treecompile.core.errors import UnsupportedModelError

    monkeypatch.setitem(call.DYNAMO_CONFIG, "recompile_limit", 3)
    torch.manual_seed(0)
    model = _HistoryLM().double()
    compiled = tree_compile(model, backend="eager")
    trees = _trees()[3:4]
    batch = pack(trees)
    for _ in range(3):
        compare_with_paths(model, compiled, batch, trees, tol="pure")
    with pytest.raises(UnsupportedModelError) as info:
        for _ in range(3):
            compiled(batch)
    first = str(info.value).splitlines()[0]
    assert "would be compiled again after 3 compiles" in first and "history" in first, first
