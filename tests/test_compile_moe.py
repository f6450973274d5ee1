"""tree_compile on a tiny Qwen3-MoE in float64: experts and the router's auxiliary loss.

Ground truth for the auxiliary (load-balancing) loss: per-path training puts all paths
through the unmodified model in one padded batch, and HF computes
``load_balancing_loss_func(router_logits, num_experts, top_k, attention_mask)`` over every
real token of every path; the loss is ``main + router_aux_loss_coef * aux``. On the tree a
token shared by ``n`` paths is one row, so its router statistics must weigh ``n``
(``path_count``). Coefficient 1.0 makes the auxiliary term a large part of the loss and of
the router's gradient, so a wrong weighting cannot hide under the main loss.

The per-path side runs HF's ``eager`` experts (a loop over experts, the plainest
spelling); the tree side runs HF's ``grouped_mm`` experts between treecompile's markers.
"""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch
from test_compile_models import TOL, make_batch
from testing import assert_grads_close, backward_grads

import treecompile as tc
from treecompile.compile.wrapper import tree_compile
from treecompile.core.errors import UnsupportedModelError
from treecompile.capture.router_aux import router_aux_of
from treecompile.core.reference import per_path_loss

transformers = pytest.importorskip("transformers")

N_LAYERS = 2


def _config(**overrides):
    kw = dict(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=N_LAYERS,
              num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
              output_router_logits=True, router_aux_loss_coef=0.01, decoder_sparse_step=1, mlp_only_layers=[])
    kw.update(overrides)
    return transformers.Qwen3MoeConfig(**kw)


def _model(cls=None, **overrides):
    """Weights moved off their init (no identity norms), in float64."""
    torch.manual_seed(0)
    cls = cls or transformers.Qwen3MoeForCausalLM
    model = cls._from_config(_config(**overrides), experts_implementation="eager").double().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


_COMPILED: dict = {}
XDIST_GROUP_BY = "coef"  # tests sharing a compiled model run on one xdist worker (conftest)


def _compiled(coef: float):
    """One model and its compiled wrapper per coefficient, shared by the tests below."""
    if coef not in _COMPILED:
        model = _model(router_aux_loss_coef=coef)
        # The default lowering (AOTAutograd) for one coefficient; the other runs the rewritten
        # graph as it is: the router passes are what differs.
        _COMPILED[coef] = (model, tree_compile(model, backend=None if coef == 0.01 else "eager"))
    return _COMPILED[coef]


def _tree_and_reference(model, compiled, batch, trees, coef):
    out, tree_grads = backward_grads(model, lambda: compiled(batch))
    ref, ref_grads = backward_grads(model, lambda: per_path_loss(model, trees, router_aux_loss_coef=coef))
    return out, tree_grads, ref, ref_grads


# "branchy": shared prefixes, a path ending inside another ([1,2,3,4] in [1,2,3,4,6]) and a
# duplicate path ([1,2,5] twice); "forest": two trees side by side.
@pytest.mark.parametrize("coef", [0.01, 1.0], ids=["coef0.01", "coef1"])
@pytest.mark.parametrize("trees_name", ["branchy", "forest"])
def test_router_aux_loss_matches_per_path_training(coef, trees_name):
    model, compiled = _compiled(coef)
    batch, trees = make_batch(trees_name)
    assert int(batch.path_count.max()) > 1  # some token is shared, so the weighting matters
    out, tree_grads, ref, ref_grads = _tree_and_reference(model, compiled, batch, trees, coef)
    rtol, atol = TOL["hf"]
    torch.testing.assert_close(out.aux_loss.detach().double(), ref.aux_loss.detach().double(), rtol=rtol, atol=atol)
    torch.testing.assert_close(out.loss.detach(), ref.loss.detach(), rtol=rtol, atol=atol)
    for i in range(batch.num_paths):
        torch.testing.assert_close(out.logprobs.detach()[batch.path_rows(i)], ref.logprobs[i], rtol=rtol, atol=atol)
    assert "model.layers.0.mlp.gate.weight" in ref_grads
    assert_grads_close(tree_grads, ref_grads, ("float64", "hf"))
    assert compiled.counters["check_moe_regions_pass"] == {"experts": N_LAYERS, "router_aux_loss": 1, "router_layers": N_LAYERS}


def test_path_count_weighting_is_detectable(monkeypatch):
    """Guards the test above: counting each tree row once (path_count ignored) gives a
    different auxiliary loss and total loss on these trees, far outside the tolerance.
    (Such a batch is invalid, so the per-call validation is switched off here.)"""
    monkeypatch.setattr(tc.TreeBatch, "validate", lambda self, vocab_size=None: self)
    coef = 1.0
    model, compiled = _compiled(coef)
    batch, trees = make_batch("branchy")
    ref = per_path_loss(model, trees, router_aux_loss_coef=coef)
    once = dataclasses.replace(batch, path_count=(batch.path_count > 0).to(batch.path_count.dtype))
    with torch.no_grad():
        right, wrong = compiled(batch), compiled(once)
    assert abs(right.aux_loss.item() - ref.aux_loss.item()) < 1e-6
    assert abs(wrong.aux_loss.item() - ref.aux_loss.item()) > 1e-3
    assert abs(wrong.loss.item() - ref.loss.item()) > 1e-3


def test_reference_aux_loss_equals_a_padded_batch_hf_call():
    """per_path_loss's auxiliary term (paths run alone, router logits concatenated) equals
    HF's own, on one right-padded batch of all paths with an attention mask; and its total
    loss equals HF's loss with labels (token mean over all paths + coef * aux)."""
    coef = 0.5
    model = _model(router_aux_loss_coef=coef)
    paths = [[1, 2, 3, 4, 5, 6, 7], [1, 2, 3], [1, 2, 3], [9, 8, 7, 6, 5], [4, 4]]
    width = max(map(len, paths))
    ids = torch.zeros(len(paths), width, dtype=torch.int64)
    mask = torch.zeros(len(paths), width, dtype=torch.int64)
    for i, p in enumerate(paths):
        ids[i, : len(p)] = torch.tensor(p)
        mask[i, : len(p)] = 1
    labels = ids.masked_fill(mask == 0, -100)
    with torch.no_grad():
        hf = model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False, output_router_logits=True)
        ref = per_path_loss(model, paths, router_aux_loss_coef=coef)
    # HF computes the auxiliary loss, and its cross-entropy, in float32: a float32 rounding floor.
    torch.testing.assert_close(ref.aux_loss, hf.aux_loss, rtol=1e-6, atol=0)
    torch.testing.assert_close(ref.loss, hf.loss.double(), rtol=1e-6, atol=0)
    assert abs(ref.aux_loss.item() - 1.0) > 1e-3  # not the perfectly balanced value, which any weighting gives


@pytest.mark.parametrize(
    "overrides", [dict(output_router_logits=False), dict(router_aux_loss_coef=0.0)], ids=["logits-off", "coef0"]
)
def test_moe_without_aux_loss_matches_per_path_training(overrides):
    model = _model(**overrides)
    compiled = tree_compile(model, backend="eager")
    batch, trees = make_batch("branchy")
    out, tree_grads, ref, ref_grads = _tree_and_reference(model, compiled, batch, trees, None)
    assert out.aux_loss is None
    torch.testing.assert_close(out.loss.detach(), ref.loss.detach(), rtol=TOL["hf"][0], atol=TOL["hf"][1])
    assert_grads_close(tree_grads, ref_grads, ("float64", "hf"))
    assert compiled.counters["check_moe_regions_pass"] == {"experts": N_LAYERS}


def _verified_grouped_mm(**overrides):
    """A float32 model on HF's default grouped_mm experts, called once with verify=True (its
    float64 copy against per-path training); the compiled model."""
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(_config(**overrides)).float().eval()
    compiled = tree_compile(model, verify=True, backend="eager")
    compiled(make_batch("branchy")[0])
    report = compiled.verified
    assert report is not None and report.dtype == torch.float64
    assert report.worst_grad_diff <= report.tolerance
    return compiled


@pytest.mark.full
def test_verify_checks_the_aux_loss():
    """verify=True (float64 copy, HF's default grouped_mm experts on the user's model) passes."""
    _verified_grouped_mm(router_aux_loss_coef=1.0)


@pytest.mark.full
def test_one_expert_per_token_keeps_the_experts_permutation():
    """HF's grouped_mm experts with one expert per token sort the S tokens by expert and undo it
    with ``inv_perm[perm] = arange(S)``: a permutation of the region's tokens, which the positions
    pass must not take for positions (it did, and the experts region refused the model)."""
    compiled = _verified_grouped_mm(num_experts_per_tok=1)
    assert compiled.counters["check_moe_regions_pass"]["experts"] == N_LAYERS


# A model whose auxiliary loss ignores the attention mask: its statistics cannot be weighted
# per path, so the MoE pass must refuse it (found by tree_compile through the model's module).
_hf_loss = transformers.models.qwen3_moe.modeling_qwen3_moe.load_balancing_loss_func


def load_balancing_loss_func(gate_logits, num_experts=None, top_k=2, attention_mask=None):
    return _hf_loss(gate_logits, num_experts, top_k, None)


class MaskIgnoringMoe(transformers.Qwen3MoeForCausalLM):
    pass


def test_aux_loss_that_ignores_the_mask_is_refused():
    model = _model(MaskIgnoringMoe, router_aux_loss_coef=0.01)
    batch, _ = make_batch("branchy")
    with pytest.raises(UnsupportedModelError, match="without the row weights"):
        tree_compile(model)(batch)


def test_aux_loss_without_its_parts_is_refused():
    stub = torch.nn.Module()
    stub.config = types.SimpleNamespace(output_router_logits=True, router_aux_loss_coef=0.1)
    with pytest.raises(UnsupportedModelError, match="num_experts"):
        router_aux_of(stub)
    stub.config.router_aux_loss_coef = 0.0
    assert router_aux_of(stub) is None


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_grouped_mm_op_matches_per_group_products(dtype):
    """``treecompile::grouped_mm`` (what the experts marker runs where ``torch._grouped_mm``
    does not): empty groups, forward and both gradients."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(9, 5, generator=g, dtype=dtype, requires_grad=True)
    w = torch.randn(4, 5, 3, generator=g, dtype=dtype, requires_grad=True)
    offs = torch.tensor([2, 2, 7, 9])  # group 1 is empty
    out = torch.ops.treecompile.grouped_mm(x, w, offs)
    groups = [(0, 0, 2), (2, 2, 7), (3, 7, 9)]
    ref = torch.cat([x[a:b] @ w[i] for i, a, b in groups])
    torch.testing.assert_close(out, ref)
    d = torch.randn(out.shape, generator=g, dtype=dtype)
    got = torch.autograd.grad(out, (x, w), d)
    want = torch.autograd.grad(ref, (x, w), d)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    assert torch.equal(got[1][1], torch.zeros_like(got[1][1]))
    torch.library.opcheck(torch.ops.treecompile.grouped_mm, (x, w, offs))
