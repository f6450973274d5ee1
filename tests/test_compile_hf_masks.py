"""Hugging Face masks are reproduced or refused, never dropped: each layer's mask kind comes
from the ``masking_utils`` builder the model calls (see treecompile/capture/dynamo.py)."""

from __future__ import annotations

import pytest
import torch
from test_compile_models import compare_with_paths, make_batch
from testing import perturbed_hf_model

import treecompile as tc
from treecompile.capture.dynamo import _replacement
from treecompile.capture.hf_interfaces import TreeMask
from treecompile.core.errors import UnsupportedModelError

transformers = pytest.importorskip("transformers")

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8)


def _perturbed(cfg):
    return perturbed_hf_model(cfg)


def test_chunked_attention_follows_the_path():
    """Llama 4's chunked attention (chunks of 4 tokens, paths of up to 7): each query sees the
    ancestors in its chunk of its path; loss and gradients equal per-path training, with HF's
    own chunked mask on each path."""
    cfg = transformers.Llama4TextConfig(**{**SMALL, "intermediate_size_mlp": 64}, attention_chunk_size=4,
                                        num_local_experts=2, interleave_moe_layer_step=1, output_router_logits=False,
                                        no_rope_layers=[1, 1])
    model = _perturbed(cfg)
    compiled = tc.tree_compile(model, backend="eager")
    for name in ("branchy", "single"):
        batch, trees = make_batch(name)
        compare_with_paths(model, compiled, batch, trees, tol="hf")
    assert compiled.counters["rewrite_attention_pass"]["hf_interface"] == 2


def test_a_window_that_exists_only_in_the_mask_is_kept():
    """Mistral's layers pass ``sliding_window`` to the attention; with that argument gone, the
    window lives only in the mask the model builds, and must still be applied."""
    model = _perturbed(transformers.MistralConfig(**SMALL, sliding_window=3))
    for layer in model.model.layers:
        layer.self_attn.sliding_window = None
    compiled = tc.tree_compile(model, backend="eager")
    for name in ("branchy", "single"):
        batch, trees = make_batch(name)
        compare_with_paths(model, compiled, batch, trees, tol="hf")


def test_extra_mask_functions_are_refused():
    build = _replacement("create_causal_mask", "causal", {})
    with pytest.raises(UnsupportedModelError, match=r"create_causal_mask with an extra mask function"):
        build(None, None, None, None, None, or_mask_function=lambda *a: True)


def test_the_marker_refuses_a_mask_tensor_built_by_the_model():
    from treecompile.capture.hf_interfaces import _window_from_mask

    assert _window_from_mask("Attn", None, 5) == 5
    assert _window_from_mask("Attn", TreeMask("sliding", "create_sliding_window_causal_mask", 4), None) == 4
    with pytest.raises(UnsupportedModelError, match=r"differs from the mask's"):
        _window_from_mask("Attn", TreeMask("sliding", "create_sliding_window_causal_mask", 4), 3)
    with pytest.raises(UnsupportedModelError, match=r"^Attn: bidirectional attention mask"):
        _window_from_mask("Attn", TreeMask("bidirectional", "create_bidirectional_mask"), None)
    with pytest.raises(UnsupportedModelError, match=r"^Attn: receives an attention mask Tensor built by the model's own"):
        _window_from_mask("Attn", torch.zeros(1, 1, 4, 4), None)


@pytest.mark.parametrize("impl,mask,causal", [
    ("sdpa", TreeMask("causal", "create_causal_mask"), True),
    ("eager", TreeMask("sliding", "create_sliding_window_causal_mask", 4), True),
    (None, TreeMask("causal", "create_causal_mask"), True),  # Hugging Face's default: eager
    ("flash_attention_2", TreeMask("causal", "create_causal_mask"), False),  # flash reads is_causal, not the mask
    ("sdpa", TreeMask("bidirectional", "create_bidirectional_mask"), False),
])
def test_a_module_marked_not_causal_is_causal_by_a_causal_mask_its_implementation_reads(impl, mask, causal):
    """BigBird-Pegasus's decoder self-attention leaves ``is_causal`` False (the zoo's ``bigbird-pegasus``)."""
    from types import SimpleNamespace

    from treecompile.capture.hf_interfaces import hf_causal_attention

    module = torch.nn.Module()
    module.is_causal, module.config = False, SimpleNamespace(treecompile_routed_from=impl)
    q = torch.zeros(1, 2, 3, 4)
    if causal:
        out, _ = hf_causal_attention(module, q, q, q, mask)
        assert out.shape == (1, 3, 2, 4)
    else:
        with pytest.raises(UnsupportedModelError, match=r"non-causal attention cannot be trained on a tree"):
            hf_causal_attention(module, q, q, q, mask)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_model_whose_code_reads_its_mask_is_captured_with_its_own_mask(stream):
    """Doge adds a gate per key to the causal mask it is handed: reading a TreeMask, the first
    capture stops; the wrapper captures again with the model's own attention and Hugging Face's
    causal mask (once, whole or streamed), and the tree equals per-path training. The model keeps
    its attention implementation outside the calls. (Eager attention: before transformers 5.18
    Doge's SDPA attention skipped the causal mask, see tests/zoo.py.)"""
    from treecompile.stream.options import StreamOptions

    model = _perturbed(transformers.DogeConfig(**SMALL, attn_implementation="eager"))
    compiled = tc.tree_compile(model, backend="eager", stream=StreamOptions(budget_rows=4) if stream else None)
    assert compiled._route.routes
    for name in ("branchy", "single"):
        batch, trees = make_batch(name)
        compare_with_paths(model, compiled, batch, trees, tol="hf")
    assert not compiled._route.routes and [a for _, a, _ in compiled._route.mask_swaps] == ["_ignore_causal_mask_sdpa"]
    assert model.config._attn_implementation == "eager"
    if not stream:
        assert compiled.counters["rewrite_attention_pass"]["softmax_attention"] == 2


def test_a_position_bias_over_other_pairs_than_one_sequences_is_refused():
    """A ``position_bias`` is written out over one sequence's (query, key) pairs: keys of another
    length (a cache, cross attention), or a bias of another shape, are refused by name."""
    from treecompile.capture.hf_interfaces import hf_causal_attention

    q, k = torch.randn(1, 4, 5, 8), torch.randn(1, 4, 7, 8)
    with pytest.raises(UnsupportedModelError, match="position_bias over other than the"):
        hf_causal_attention(torch.nn.Module(), q, k, k, None, position_bias=torch.zeros(1, 4, 5, 7))
    with pytest.raises(UnsupportedModelError, match="position_bias over other than the"):
        hf_causal_attention(torch.nn.Module(), q, q, q, None, position_bias=torch.zeros(1, 4, 5, 4))
