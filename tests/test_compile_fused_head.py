"""tree_compile(lm_head="fused"): the LM head and log-softmax in row chunks, still exact."""

import pytest
import torch
from test_compile_models import NanoGPT, compare_with_paths, make_batch, tiny
from testing import perturbed_hf_model

from treecompile import tree_compile

transformers = pytest.importorskip("transformers")

COMMON = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2)
FAMILIES = {
    "qwen3": (lambda: transformers.Qwen3Config(**COMMON, head_dim=16), "fused_lm_head"),
    "gpt2-tied": (lambda: transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                                  bos_token_id=0, eos_token_id=0), "fused_lm_head"),
    # A final soft-cap is not a plain linear head: it keeps the gathered path.
    "gemma2-final-softcap": (lambda: transformers.Gemma2Config(**COMMON, head_dim=8, final_logit_softcapping=3.0),
                             "gather_before_lm_head"),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_fused_head_matches_per_path_training(family):
    make_cfg, expected = FAMILIES[family]
    model = perturbed_hf_model(make_cfg())
    compiled = tree_compile(model, lm_head="fused", backend=None if family == "qwen3" else "eager")
    for name in ("branchy", "forest"):
        batch, trees = make_batch(name)
        compare_with_paths(model, compiled, batch, trees, tol="hf")
    assert dict(compiled.counters["fuse_lm_head_pass"]) == {expected: 1}


def test_fused_head_on_a_custom_model_is_exact_to_rounding():
    model = tiny(NanoGPT)
    compiled = tree_compile(model, lm_head="fused", backend="eager")
    batch, trees = make_batch("branchy")
    compare_with_paths(model, compiled, batch, trees, tol="pure")
    assert dict(compiled.counters["fuse_lm_head_pass"]) == {"fused_lm_head": 1}


def test_unknown_lm_head_lists_the_choices():
    with pytest.raises(ValueError, match="valid choices: gather, fused"):
        tree_compile(tiny(NanoGPT), lm_head="chunked")
