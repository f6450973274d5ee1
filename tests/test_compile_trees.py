"""tree_compile on generated trees and on real trajectory trees, against per-path training.

One compiled model serves every example (S varies; the graph is dynamic), so these also
check that reuse across batch shapes stays exact.
"""

import pytest
import torch
from hypothesis import given, settings
from strategies import path_sets
from test_compile_models import NanoGPT, compare_with_paths, tiny
from testing import TOLERANCES, assert_grads_close, backward_grads, examples, perturbed_hf_model

from treecompile import TrajectoryTree, pack, tree_compile

transformers = pytest.importorskip("transformers")

LOSS_MODES = ["token-mean", "seq-mean-token-mean", "sum"]


def _qwen3(vocab: int, dtype=torch.float64):
    cfg = transformers.Qwen3Config(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    return perturbed_hf_model(cfg, dtype)


NANO = tiny(NanoGPT)
# The rewritten graph as it is (what varies here is the tree, not the lowering): the interval
# cases of test_compile_custom.py run the default lowering on NanoGPT with batches of two
# lengths, and the reuse tests below run it on several shapes.
NANO_COMPILED = tree_compile(NANO, backend="eager")
QWEN = _qwen3(64)
QWEN_COMPILED = tree_compile(QWEN, backend="eager")


def _check(model, compiled, case, kind):
    seqs, weights, masks = case
    tree = TrajectoryTree.from_sequences(seqs, weights=weights, loss_masks=masks)
    batch = pack(tree)
    # Loss, logprobs and grads of these tiny models are O(0.01..10): absolute tolerances
    # from the table apply (max |diff| per quantity).
    _, atol = TOLERANCES[("float64", kind)]
    diffs = compare_with_paths(model, compiled, batch, [tree])
    for what in ("loss", "logprobs", "grad"):
        assert diffs[what] <= 10 * atol, (what, diffs)


@settings(max_examples=examples(25))
@given(path_sets(max_paths=5))
def test_custom_model_on_generated_trees(case):
    _check(NANO, NANO_COMPILED, case, "pure")


@settings(max_examples=examples(15))
@given(path_sets(max_paths=5))
def test_qwen3_on_generated_trees(case):
    _check(QWEN, QWEN_COMPILED, case, "hf")


@pytest.mark.full
def test_generated_trees_reuse_one_graph():
    # After the hypothesis runs above (any order), at most one recompile: the 1 -> many
    # block transition specialises once.
    compiled = tree_compile(tiny(NanoGPT))
    for seqs in ([[1, 2, 3]], [[1, 2], [1, 3, 4, 5]], [[5, 4, 3, 2, 1, 0], [5, 4, 1], [2]]):
        compiled(pack(TrajectoryTree.from_sequences(seqs)))
    assert len(compiled.compile_records) == 1


@pytest.fixture(scope="module")
def real_trees():
    """Trees from the bundled real data (GSM8K groups of 4 solutions; tau-bench trials cut
    after their second assistant turn), tokenized with the bundled 2048-token BPE, and one
    compiled Qwen3 that every loss mode reuses."""
    from treecompile.data.samples import sample_gsm8k, sample_tau_bench
    from treecompile.chat.tokenizer import load_tokenizer

    tok = load_tokenizer("sample")
    gsm = list(sample_gsm8k().values())[:2]
    tau = list(sample_tau_bench().values())[0]
    cut = []
    for conv in tau:
        turns = [i for i, m in enumerate(conv) if m["role"] == "assistant"]
        cut.append(conv[: turns[1] + 1])
    trees = [TrajectoryTree.from_messages(g, tok) for g in gsm]
    trees.append(TrajectoryTree.from_messages(cut, tok, samples="assistant_turns"))
    model = _qwen3(tok.vocab_size)
    return trees, model, tree_compile(model, backend="eager")


@pytest.mark.full
@pytest.mark.parametrize("mode", LOSS_MODES)
def test_qwen3_on_real_gsm8k_and_tau_bench_trees(real_trees, mode):
    trees, model, compiled = real_trees
    batch = pack(trees, loss_mode=mode)
    assert batch.num_paths == sum(t.num_paths for t in trees) == 4 + 4 + 8
    from treecompile.core.reference import per_path_loss

    out, tree_grads = backward_grads(model, lambda: compiled(batch))
    ref, ref_grads = backward_grads(model, lambda: per_path_loss(model, trees, loss_mode=mode))
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-6, atol=1e-7)
    assert_grads_close(tree_grads, ref_grads, ("float64", "hf"))


@pytest.mark.full
def test_verify_on_a_float32_hf_model_checks_in_float64():
    model = _qwen3(64, torch.float32)
    compiled = tree_compile(model, verify=True, backend="eager")
    compiled(pack(TrajectoryTree.from_sequences([[1, 2, 3, 4], [1, 2, 5]])))
    report = compiled.verified
    assert report.dtype == torch.float64
    assert report.worst_grad_diff < 1e-5, report
    assert next(model.parameters()).dtype == torch.float32


@pytest.mark.full
def test_batches_over_one_block_reuse_one_graph():
    # The block tables' sizes follow S: they are dynamic from the first call, so batches of
    # different sizes above one 128-row block share one graph.
    compiled = tree_compile(tiny(NanoGPT))
    g = torch.Generator().manual_seed(0)
    for s in (200, 330, 470):
        prefix = torch.randint(0, 64, (s // 2,), generator=g).tolist()
        seqs = [prefix + torch.randint(0, 64, (s // 4,), generator=g).tolist(),
                prefix + torch.randint(0, 64, (s - s // 2 - s // 4,), generator=g).tolist()]
        compiled(pack(TrajectoryTree.from_sequences(seqs)))
    assert len(compiled.compile_records) == 1, [r.seq_len for r in compiled.compile_records]
