"""Streaming execution with a KV stack (treecompile.stream.options) against per-path training.

The plan (parts of consecutive rows, each row once, prefixes = root paths of the parts'
first rows, backward order), the prefix attention kernel against its dense reference, and
whole streamed steps in float64 against the unmodified model run on each path: loss,
log-probs and every parameter gradient, with cuts inside nodes, one-token parts and a
single deep chain. One compiled model per family and mode serves every budget (the graph
does not depend on it).
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import path_sets
from test_compile_hybrid import GatedDeltaNetLayer, GdnLM
from test_compile_models import NanoGPT, tiny
from testing import COMPILE_TOL, assert_grads_close, examples, hf_float64_casts, perturbed_hf_model

from treecompile import TrajectoryTree, pack, tree_compile
from treecompile.capture.dynamo import sequence_kernels, swapped_kernels
from treecompile.core.errors import UnsupportedModelError
from treecompile.kernels.attention.naive import prefix_attention_reference
from treecompile.core.reference import per_path_loss
from treecompile.stream.options import StreamOptions, plan_stream, stream_logprob_loss

transformers = pytest.importorskip("transformers")

# A prompt node of 5 tokens, branches of 1, 3 and 6 tokens, a 1-token node with two
# children, and a second tree: cuts at 1, 3 and 4 rows fall inside nodes and on node ends.
BRANCHY = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 7, 8, 9], [1, 2, 3, 4, 5, 10, 11, 12, 13, 14, 15, 16, 17],
           [1, 2, 3, 4, 5, 10, 11, 12, 13, 14, 15, 18], [20, 21, 22, 23]]
CHAIN = [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8]]  # one path: every part's prefix is every row before it


def _rows_of(batch, j, plan):
    return np.arange(plan.starts[j], plan.starts[j + 1])


@pytest.mark.parametrize("cuts", ["subtree", "rows"])
@pytest.mark.parametrize("budget", [1, 2, 4, 7, 100])
def test_plan_cuts_each_row_once_with_root_path_prefixes(budget, cuts):
    batch = pack(TrajectoryTree.from_sequences(BRANCHY))
    plan = plan_stream(batch, budget, cuts)
    if cuts == "rows":
        assert plan.num_parts == -(-batch.num_tokens // budget)
    else:
        # A part ends where no later row descends from it, unless it takes the whole budget.
        sub = batch.subtree_end.numpy()
        for a, b in zip(plan.starts[:-2], plan.starts[1:-1]):
            assert b - a == budget or sub[a:b].max() <= b, (a, b)
    rows = np.concatenate([_rows_of(batch, j, plan) for j in range(plan.num_parts)])
    assert np.array_equal(rows, np.arange(batch.num_tokens))  # every row once, in order
    assert all(plan.starts[j + 1] - plan.starts[j] <= budget for j in range(plan.num_parts))
    pred = batch.pred_index.numpy()
    for j in range(plan.num_parts):
        # The prefix is the root path of the part's first row, before it (pred chain).
        chain, r = [], pred[plan.starts[j]]
        while r >= 0:
            chain.append(r)
            r = pred[r]
        assert plan.prefix[j].tolist() == chain[::-1]
        assert len(plan.prefix[j]) == int(batch.position_ids[plan.starts[j]])
    # Backward order: a part goes back after every part that reads it.
    order = [p for j in range(plan.num_parts) for p in plan.release[j]]
    assert sorted(order) == list(range(plan.num_parts))
    when = {p: i for i, p in enumerate(order)}
    for j in range(plan.num_parts):
        for q in set(plan.part_of(plan.prefix[j]).tolist()):
            assert when[j] < when[q], (j, q)


def test_plan_of_a_single_chain_keeps_every_part_until_the_end():
    batch = pack(TrajectoryTree.from_sequences(CHAIN))
    plan = plan_stream(batch, 1)
    assert [len(p) for p in plan.prefix] == list(range(12))
    assert plan.stack_depth == 12 and plan.release[-1] == list(range(11, -1, -1))


@pytest.mark.parametrize("softcap,window", [(0.0, 0), (2.0, 3)], ids=["plain", "softcap-w3"])
def test_prefix_kernel_matches_dense_reference(softcap, window):
    torch.manual_seed(0)
    batch = pack(TrajectoryTree.from_sequences(BRANCHY))
    plan = plan_stream(batch, 7)
    j = 2  # starts inside the 13-token branch: prefix rows from the prompt and the branch
    a, b = int(plan.starts[j]), int(plan.starts[j + 1])
    pre = plan.prefix[j]
    sub, pos = batch.subtree_end, batch.position_ids
    p = len(pre)
    kv_end = torch.cat([p + sub[pre].clamp(max=b) - a, p + sub[a:b].clamp(max=b) - a])
    kv_pos = torch.cat([pos[pre], pos[a:b]])
    s, total = b - a, p + b - a
    q = torch.randn(1, 4, s, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 2, total, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 2, total, 8, dtype=torch.float64, requires_grad=True)
    out, _ = torch.ops.treecompile.prefix_tree_attention(q, k, v, kv_end, kv_pos, pos[a:b], 3, 0.3, softcap, window)
    ref = prefix_attention_reference(q, k, v, kv_end, kv_pos, pos[a:b], scale=0.3, softcap=softcap, window=window)
    do = torch.randn_like(out)
    g = torch.autograd.grad(out, (q, k, v), do)
    gr = torch.autograd.grad(ref, (q, k, v), do)
    rtol, atol = COMPILE_TOL["pure"]
    torch.testing.assert_close(out, ref, rtol=rtol, atol=atol)
    for x, y, name in zip(g, gr, "qkv"):
        torch.testing.assert_close(x, y, rtol=rtol, atol=atol, msg=lambda m, n=name: f"d{n}: {m}")
    # The prefix rows get gradients (they flow back into the stack).
    assert g[1][:, :, :p].abs().sum() > 0


def _perturbed(cfg, **kw):
    return perturbed_hf_model(cfg, **kw)


SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)

_MODELS = {
    "nanogpt": lambda: tiny(NanoGPT),
    "qwen3": lambda: _perturbed(transformers.Qwen3Config(**SMALL, head_dim=8)),
    # Window 3 < every part's prefix here: the window crosses part boundaries.
    "gemma2-softcap-sw3": lambda: _perturbed(transformers.Gemma2Config(
        **SMALL, head_dim=8, sliding_window=3, attn_logit_softcapping=2.0, final_logit_softcapping=3.0)),
    "qwen3-moe-no-aux": lambda: _perturbed(transformers.Qwen3MoeConfig(
        **SMALL, moe_intermediate_size=32, head_dim=8, num_experts=4, num_experts_per_tok=2,
        output_router_logits=False), experts_implementation="eager"),  # grouped_mm has no float64 on CPU
    # Coefficient 1: the auxiliary term is a large part of the loss and of the router's
    # gradient, so a part counted wrongly cannot hide under the main loss.
    "qwen3-moe-aux": lambda: _perturbed(transformers.Qwen3MoeConfig(
        **SMALL, moe_intermediate_size=32, head_dim=8, num_experts=4, num_experts_per_tok=2,
        output_router_logits=True, router_aux_loss_coef=1.0), experts_implementation="eager"),
}

def _slow_decay(model):
    """Recurrent layers that remember: HF's init decays a Gated DeltaNet or Mamba2 state by
    ~exp(-13) per token, so a state routed wrongly would change nothing measurable; at ~0.99
    per token it carries the path across parts (checked: zero states change the loss by 1e-2)."""
    with torch.no_grad():
        for m in model.modules():
            if hasattr(m, "A_log") and hasattr(m, "dt_bias"):
                m.A_log.copy_(-2.0 + 0.1 * torch.randn_like(m.A_log))
                m.dt_bias.fill_(-1.0)
    return model


_MODELS["qwen3-next"] = lambda: _slow_decay(_perturbed(transformers.Qwen3NextConfig(
    **SMALL, layer_types=["linear_attention", "full_attention"], head_dim=8, linear_num_key_heads=2,
    linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
    num_experts=0)))
_MODELS["bamba"] = lambda: _slow_decay(_perturbed(transformers.BambaConfig(
    **SMALL, attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_n_groups=2,
    mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=16)))
# Mamba2 and attention side by side in each layer.
_MODELS["falcon-h1"] = lambda: _slow_decay(_perturbed(transformers.FalconH1Config(
    **SMALL, head_dim=8, mamba_n_heads=4, mamba_d_head=16, mamba_d_ssm=64, mamba_d_state=8, mamba_n_groups=2,
    mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=16)))
# A gated short conv (kernel 3) without a scan.
_MODELS["lfm2"] = lambda: _perturbed(transformers.Lfm2Config(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, layer_types=["conv", "full_attention"],
    num_attention_heads=4, num_key_value_heads=2, conv_L_cache=3, block_auto_adjust_ff_dim=False))
# Gated DeltaNet, attention and MoE layers with the router auxiliary loss.
_MODELS["qwen3-next-moe-aux"] = lambda: _slow_decay(_perturbed(transformers.Qwen3NextConfig(
    **SMALL, layer_types=["linear_attention", "full_attention"], head_dim=8, linear_num_key_heads=2,
    linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16,
    decoder_sparse_step=1, output_router_logits=True, router_aux_loss_coef=1.0), experts_implementation="eager"))
# Mamba's selective scan (Mamba-1): two Mamba layers; Jamba, a Mamba layer then attention.
# HF's init decays the state by ~0.9 to 0.999 per token already (dropping the states handed
# across parts changes the loss by 2e-4).
_MODELS["mamba"] = lambda: _perturbed(transformers.MambaConfig(
    vocab_size=64, hidden_size=32, state_size=8, num_hidden_layers=2, expand=2, conv_kernel=4))
_MODELS["jamba"] = lambda: _perturbed(transformers.JambaConfig(
    **SMALL, num_experts=1, attn_layer_period=2, attn_layer_offset=1, use_mamba_kernels=False, mamba_d_state=8,
    mamba_d_conv=4, mamba_expand=2))
#: Families with recurrent layers: the reference runs treecompile's float64 scan and conv
#: kernels per path (HF's fallbacks compute in float32; tests/test_compile_hybrid.py checks
#: those kernels against HF's and the reference loops).
_HYBRID = ("qwen3-next", "bamba", "falcon-h1", "lfm2", "qwen3-next-moe-aux", "mamba", "jamba")
#: Families whose float32 casts (``torch.float32`` and ``tensor.float()``) are made float64 on
#: both sides (`testing.hf_float64_casts`): compared to float64 rounding.
_FLOAT64_CASTS = ("mamba", "jamba")
#: Extra tree_compile options per family.
_OPTIONS = {"qwen3-moe-aux": dict(outputs=("entropy",))}
#: The router auxiliary loss coefficient of the families that have one.
_AUX = {"qwen3-moe-aux": 1.0, "qwen3-next-moe-aux": 1.0}
_COMPILED: dict = {}
#: Families whose streamed graph runs the default lowering (AOTAutograd on CPU): a plain and a
#: hybrid model; an HF Qwen3's streamed graph is lowered in both modes by test_budget.py's
#: test_streamed_prediction_bounds_the_measured_cpu_peak.
_LOWERED = {("nanogpt", "keep"), ("qwen3-next", "keep")}
#: Tests (or parametrizations) that take one family's model from `_compiled` run on one
#: pytest-xdist worker (``--dist loadgroup``, scripts/test.sh), so it is captured once.
_ON_NANOGPT_WORKER = pytest.mark.xdist_group("test_stream:nanogpt")
_ON_QWEN3_WORKER = pytest.mark.xdist_group("test_stream:qwen3")
_ON_QWEN3_NEXT_WORKER = pytest.mark.xdist_group("test_stream:qwen3-next")


def _compiled(family, mode):
    if (family, mode) not in _COMPILED:
        model = _MODELS[family]()
        # The default lowering (AOTAutograd on CPU) for one plain, one HF and one hybrid model;
        # the others run the rewritten graph as it is (the passes are what differs).
        backend = None if (family, mode) in _LOWERED else "eager"
        _COMPILED[family, mode] = model, tree_compile(model, stream=StreamOptions(budget_rows=4, mode=mode),
                                                      backend=backend, **_OPTIONS.get(family, {}))
    return _COMPILED[family, mode]


def _check(family, mode, seqs, budget, loss_mode="token-mean", weights=None, masks=None, scaled=True):
    """Streams one tree and compares with per-path training. ``scaled=False`` compares each
    gradient elementwise (COMPILE_TOL) instead of relative to its largest entry: generated
    trees include ones where a gradient is exactly zero and both sides hold rounding noise."""
    model, compiled = _compiled(family, mode)
    if family in _FLOAT64_CASTS:
        with hf_float64_casts(model, methods=True):
            return _check_run(family, mode, seqs, budget, loss_mode, weights, masks, scaled, "pure")
    return _check_run(family, mode, seqs, budget, loss_mode, weights, masks, scaled,
                      "pure" if family == "nanogpt" else "hf")


def _check_run(family, mode, seqs, budget, loss_mode, weights, masks, scaled, kind):
    model, compiled = _compiled(family, mode)
    compiled._stream.options = StreamOptions(budget_rows=budget, mode=mode)
    tree = TrajectoryTree.from_sequences(seqs, weights=weights, loss_masks=masks)
    batch = pack(tree, loss_mode=loss_mode)
    model.zero_grad(set_to_none=True)
    out = compiled(batch)
    assert not out.logprobs.requires_grad  # a streamed call's logprobs are values
    (2.0 * out.loss).backward()  # the held gradients are scaled by what backward brings
    got = {n: p.grad / 2.0 for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    coef = _AUX.get(family)
    kernels = sequence_kernels(model) if family in _HYBRID else []
    with swapped_kernels(kernels):
        ref = per_path_loss(model, [tree], loss_mode=loss_mode, router_aux_loss_coef=coef)
        ref.loss.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    rtol, atol = COMPILE_TOL[kind]
    torch.testing.assert_close(out.loss.detach(), ref.loss.detach(), rtol=rtol, atol=atol)
    for i in range(batch.num_paths):
        torch.testing.assert_close(out.logprobs[batch.path_rows(i)], ref.logprobs[i].detach(), rtol=rtol, atol=atol,
                                   msg=lambda m, i=i: f"logprobs of path {i}: {m}")
    if coef is None:
        assert out.aux_loss is None
    else:
        torch.testing.assert_close(out.aux_loss, ref.aux_loss.to(out.aux_loss.dtype), rtol=rtol, atol=atol)
    if out.entropy is not None:
        assert not out.entropy.requires_grad  # values, like the logprobs
        for i in range(batch.num_paths):
            torch.testing.assert_close(out.entropy[batch.path_rows(i)], _path_entropy(model, seqs[i]), rtol=rtol,
                                       atol=atol, msg=lambda m, i=i: f"entropy of path {i}: {m}")
    if scaled:
        assert_grads_close(got, want, ("float64", kind))
    else:
        assert got.keys() == want.keys()
        for n in want:
            torch.testing.assert_close(got[n], want[n], rtol=rtol, atol=atol, msg=lambda m, n=n: f"grad of {n}: {m}")
    stats = compiled._stream.stats
    assert stats.parts == plan_stream(batch, budget).num_parts >= -(-batch.num_tokens // budget)
    # With an auxiliary loss a first pass without a graph runs every row once more.
    extra = batch.num_tokens if coef is not None else 0
    assert stats.forward_rows == plan_stream(batch, budget).forward_rows(mode, aux_loss=coef is not None)
    assert stats.forward_rows == plan_stream(batch, budget).forward_rows(mode) + extra
    if mode == "keep":
        assert stats.forward_rows == batch.num_tokens + extra  # every row forward once more: ERR = POR
    return stats


def _path_entropy(model, tokens):
    """``[T]`` entropy of the distribution predicting each token of one path (0 first), by
    the unmodified model on the path alone."""
    from treecompile.core.reference import model_logits

    logp = torch.log_softmax(model_logits(model, torch.tensor([tokens]))[0, :-1].double(), dim=-1)
    return torch.cat([logp.new_zeros(1), -(logp.exp() * logp).sum(-1)])


@_ON_NANOGPT_WORKER
@pytest.mark.parametrize("mode", ["keep", pytest.param("recompute", marks=pytest.mark.slow)])
def test_custom_model_streams_exactly(mode):
    for budget in (1, 7) if mode == "keep" else (3,):  # one-token parts; cuts inside nodes
        _check("nanogpt", mode, BRANCHY, budget)
    _check("nanogpt", mode, CHAIN, 5)  # a single deep chain
    _, compiled = _compiled("nanogpt", mode)
    streamed = [r for r in compiled.compile_records if "route_prefix_kv_pass" in r.counters]
    # One graph for every part of every budget (recompute mode adds its no-grad graph).
    assert len(streamed) == (1 if mode == "keep" else 2)
    assert streamed[0].counters["route_prefix_kv_pass"] == {"prefix_attention": 2}
    assert streamed[0].counters["route_stream_state_pass"] == {"kv_outputs": 4}


@_ON_NANOGPT_WORKER
def test_a_streamed_call_cuts_its_parts_from_the_batch_on_the_host(monkeypatch):
    """The runner reads the batch where the host has it (`on_host`: a CPU batch as it is, a GPU
    batch read back once) and never moves it whole to the model's device: each part moves by
    itself (tests/gpu counts the host syncs this saves on CUDA)."""
    import treecompile.stream.runner as runner
    from treecompile.core.batch import TreeBatch

    model, compiled = _compiled("nanogpt", "keep")
    batch = pack(TrajectoryTree.from_sequences(BRANCHY))
    seen = []
    monkeypatch.setattr(runner, "on_host", lambda b: seen.append(b) or b)
    monkeypatch.setattr(TreeBatch, "to", lambda self, device: pytest.fail(f"the batch was moved to {device}"))
    assert torch.isfinite(compiled(batch).loss)
    assert seen == [batch]


@_ON_NANOGPT_WORKER
@settings(max_examples=examples(10))
@given(case=path_sets(max_paths=4, max_len=8), data=st.data())
def test_custom_model_streams_generated_trees_at_any_budget(case, data):
    _check_generated("nanogpt", case, data)


def _check_generated(family, case, data):
    """`_check` in keep mode on a generated tree, cut at a drawn budget below its rows."""
    seqs, weights, masks = case
    rows = TrajectoryTree.from_sequences(seqs).num_tokens
    if rows < 2:
        return  # a one-row batch is never over a budget
    budget = data.draw(st.integers(1, rows - 1), label="budget")
    _check(family, "keep", seqs, budget, weights=weights, masks=masks, scaled=False)


@_ON_QWEN3_WORKER
@pytest.mark.parametrize("loss_mode", ["token-mean", *[pytest.param(m, marks=pytest.mark.slow)
                                                       for m in ("sum", "seq-mean-token-mean")]])
def test_qwen3_streams_exactly(loss_mode):
    _check("qwen3", "keep", BRANCHY, 4, loss_mode)
    if loss_mode == "token-mean":
        _check("qwen3", "keep", CHAIN, 5, loss_mode)


def _counted_builds(monkeypatch) -> list[int]:
    """The stack layout size (key and value tensors) of every part graph built from now on."""
    import treecompile.stream.runner as stream_runner

    builds = []
    build = stream_runner.StreamRunner._build
    monkeypatch.setattr(stream_runner.StreamRunner, "_build",
                        lambda self, device, shapes: builds.append(len(shapes.shapes)) or build(self, device, shapes))
    return builds


def _per_path_run(model):
    """``(BRANCHY packed, parameter names, per-path result, its gradients by name)``."""
    tree = TrajectoryTree.from_sequences(BRANCHY)
    names, params = zip(*model.named_parameters())
    ref = per_path_loss(model, [tree])
    return pack(tree), names, ref, dict(zip(names, torch.autograd.grad(ref.loss, params)))


@pytest.mark.full
def test_a_hugging_face_models_stack_layout_is_known_before_the_first_capture(monkeypatch):
    """A Hugging Face model whose sequence mixing is all attention through HF's interface: the
    stack layout comes from its attention modules, so the first streamed call captures the
    model once, not once more only to learn the layout. A wrong guess is reported by that
    capture and corrected (one capture more), with the same loss and gradients, the per-path ones."""
    from collections import OrderedDict

    import treecompile.stream.runner as stream_runner

    builds = _counted_builds(monkeypatch)
    model = _perturbed(transformers.Qwen3Config(**{**SMALL, "num_hidden_layers": 1}, head_dim=8))
    batch, names, ref, want = _per_path_run(model)
    rtol, atol = COMPILE_TOL["hf"]
    guess = stream_runner._layout_guess
    for wrong in (False, True):
        if wrong:  # one head fewer than the model's keys and values have
            monkeypatch.setattr(stream_runner, "_layout_guess",
                                lambda w: stream_runner.KVLayout([(h - 1, d, t) for h, d, t in guess(w).shapes]))
        monkeypatch.setattr(stream_runner, "_LEARNT", OrderedDict())  # nothing known of the architecture
        builds.clear()
        compiled = tree_compile(model, backend="eager", stream=StreamOptions(budget_rows=4))
        out = compiled(batch)
        got = dict(zip(names, torch.autograd.grad(out.loss, list(model.parameters()))))
        assert builds == ([2, 2] if wrong else [2]), builds  # one attention layer: a key and a value tensor
        torch.testing.assert_close(out.loss, ref.loss.detach(), rtol=rtol, atol=atol)
        assert_grads_close(got, want, ("float64", "hf"))


@pytest.mark.full
@pytest.mark.parametrize("family", ["qwen3-next", "bamba"])
def test_a_hybrid_models_stack_layout_is_read_from_its_modules(family, monkeypatch):
    """A Gated DeltaNet (Qwen3-Next) or Mamba2 (Bamba) hybrid: the conv channels and the
    recurrent states' shapes come from its mixer modules, the keys' and values' from its
    attention modules, so its first streamed call captures it once (nothing of the
    architecture known before), exactly."""
    from collections import OrderedDict

    import treecompile.stream.runner as stream_runner

    builds = _counted_builds(monkeypatch)
    monkeypatch.setattr(stream_runner, "_LEARNT", OrderedDict())
    monkeypatch.setitem(globals(), "_COMPILED", {})  # a wrapper of its own
    monkeypatch.setitem(globals(), "_LOWERED", set())  # as captured
    _check(family, "keep", BRANCHY, 4)
    assert builds == [2], builds  # one attention layer: a key and a value tensor


@pytest.mark.full
def test_a_known_architectures_stack_layout_saves_the_capture_that_learns_it(monkeypatch):
    """A custom model's stack layout is learnt by a first capture that only reports it. Once a
    streamed call has checked it, a model of that architecture (wrapped again, or copied to
    another dtype as `verify` does) starts from it, and a wrapper that compiled its whole-tree
    graph reads it from that graph: one capture each. A stale layout is reported by that
    capture and corrected (one capture more). Every run gives the per-path loss and gradients."""
    from collections import OrderedDict

    import treecompile.stream.runner as stream_runner

    builds = _counted_builds(monkeypatch)
    monkeypatch.setattr(stream_runner, "_LEARNT", OrderedDict())
    model = tiny(NanoGPT, layers=1)  # one attention call: a key and a value tensor
    batch, names, ref, want = _per_path_run(model)
    rtol, atol = COMPILE_TOL["pure"]

    def streams(subject, expected_builds, one_call_first=False):
        builds.clear()
        compiled = tree_compile(subject, backend="eager", stream=StreamOptions(budget_rows=4))
        if one_call_first:
            compiled(pack(TrajectoryTree.from_sequences([[1, 2, 3]]), warn_por=False))  # under the budget: one call
        out = compiled(batch)
        assert compiled._stream.stats.parts > 1
        assert builds == expected_builds, builds
        return out, dict(zip(names, torch.autograd.grad(out.loss, list(subject.parameters()))))

    for expected in ([0, 2], [2]):  # unknown: learnt by a capture; then known
        out, got = streams(model, expected)
        torch.testing.assert_close(out.loss, ref.loss.detach(), rtol=rtol, atol=atol)
        assert_grads_close(got, want, ("float64", "pure"))
    streams(tiny(NanoGPT, layers=1).float(), [2])  # the float64 layout, moved to float32
    stream_runner._LEARNT.clear()
    out, got = streams(model, [2], one_call_first=True)  # read from the whole-tree graph
    torch.testing.assert_close(out.loss, ref.loss.detach(), rtol=rtol, atol=atol)
    assert_grads_close(got, want, ("float64", "pure"))
    # A stale layout (a head fewer, as if the model had been rebuilt with other heads).
    ((key, (layout, dtype)),) = stream_runner._LEARNT.items()
    stream_runner._LEARNT[key] = (stream_runner.KVLayout([(h - 1, d, t) for h, d, t in layout.shapes]), dtype)
    out, got = streams(model, [2, 2])
    torch.testing.assert_close(out.loss, ref.loss.detach(), rtol=rtol, atol=atol)
    assert_grads_close(got, want, ("float64", "pure"))


@pytest.mark.slow
def test_gemma2_window_across_parts_streams_exactly():
    stats = _check("gemma2-softcap-sw3", "recompute", BRANCHY, 5)
    assert stats.forward_rows > 30  # parts read later ran forward twice


@pytest.mark.parametrize("family,mode", [pytest.param("qwen3", "keep", marks=_ON_QWEN3_WORKER),
                                         ("gemma2-softcap-sw3", "recompute")])
def test_a_parts_attention_as_one_flex_call_streams_exactly(family, mode, monkeypatch):
    """The kernel a part's graph runs on CUDA (`PREFIX_KERNEL`: one FlexAttention call over
    ``[prefix ; own]``), here on CPU through the same higher-order op: exact, and called."""
    import treecompile.passes.stream as stream_passes

    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return flex_hop(*args, **kwargs)

    flex_hop = stream_passes.prefix_flex_hop
    monkeypatch.setitem(stream_passes.PREFIX_KERNEL, "cpu", "flex")
    monkeypatch.setattr(stream_passes, "prefix_flex_hop", counted)
    _check(family, mode, BRANCHY, 5)
    assert calls


@pytest.mark.slow
def test_moe_without_aux_loss_streams_exactly():
    _check("qwen3-moe-no-aux", "keep", BRANCHY, 4)


@_ON_NANOGPT_WORKER
@pytest.mark.slow
def test_under_budget_runs_as_one_call():
    model, compiled = _compiled("nanogpt", "keep")
    compiled._stream.options = StreamOptions(budget_rows=100)
    compiled._stream.stats = None
    out = compiled(pack(TrajectoryTree.from_sequences(BRANCHY)))
    assert out.logprobs.requires_grad and compiled._stream.stats is None


@pytest.mark.full
@pytest.mark.parametrize("mode", ["keep", pytest.param("recompute", marks=pytest.mark.slow)])
def test_moe_router_aux_loss_and_entropy_stream_exactly(mode):
    """The auxiliary loss (coefficient 1) over the whole tree from the parts' router sums, and
    each row's entropy, on two trees: cuts inside nodes and one-token parts, and a chain."""
    _check("qwen3-moe-aux", mode, BRANCHY, 3 if mode == "keep" else 4)
    _check("qwen3-moe-aux", mode, CHAIN, 1 if mode == "keep" else 5)
    _, compiled = _compiled("qwen3-moe-aux", mode)
    streamed = [r for r in compiled.compile_records if "route_prefix_kv_pass" in r.counters]
    assert streamed[-1].counters["check_moe_regions_pass"] == {"experts": 2, "router_aux_loss": 1,
                                                              "router_layers": 2}


def test_streamed_aux_loss_refuses_a_function_of_another_form(monkeypatch):
    """A load_balancing_loss_func that is not E * sum(T * P) / N^2 (here squared) cannot be
    added up from the parts' sums: refused when the model is wrapped, naming the function."""
    from treecompile.capture.router_aux import router_aux_of

    model = _MODELS["qwen3-moe-aux"]()
    fn = router_aux_of(model).loss_fn
    mod = sys.modules[fn.__module__]

    def load_balancing_loss_func(gate_logits, num_experts=None, top_k=2, attention_mask=None):
        return fn(gate_logits, num_experts, top_k, attention_mask) ** 2

    load_balancing_loss_func.__module__ = fn.__module__
    monkeypatch.setattr(mod, "load_balancing_loss_func", load_balancing_loss_func)
    first = r"^transformers\.models\.qwen3_moe\..*load_balancing_loss_func \(.*test_stream\.py:\d+\): its router "
    with pytest.raises(UnsupportedModelError, match=first):
        tree_compile(model, stream=StreamOptions(budget_rows=4))


@pytest.mark.full
@_ON_QWEN3_NEXT_WORKER
@pytest.mark.parametrize("mode", ["keep", pytest.param("recompute", marks=pytest.mark.slow)])
def test_gated_deltanet_hybrid_streams_exactly(mode):
    """Qwen3-Next (a Gated DeltaNet layer with its causal conv, then attention): the recurrent
    state and the conv context come from earlier parts, cut inside nodes, in one-token parts
    and along a chain (every part starts mid-node)."""
    _check("qwen3-next", mode, BRANCHY, 4)
    if mode == "keep":
        _check("qwen3-next", mode, BRANCHY, 1)
        _check("qwen3-next", mode, CHAIN, 5)
    _, compiled = _compiled("qwen3-next", mode)
    streamed = [r for r in compiled.compile_records if "route_stream_state_pass" in r.counters]
    # One graph for every part of every budget (recompute mode adds its no-grad graph).
    assert len(streamed) == (1 if mode == "keep" else 2)
    assert streamed[-1].counters["route_stream_state_pass"] == {"kv_outputs": 2, "conv_context": 1,
                                                               "recurrent_state": 1}


@_ON_QWEN3_NEXT_WORKER
@pytest.mark.slow
@settings(max_examples=examples(8))
@given(case=path_sets(max_paths=4, max_len=8), data=st.data())
def test_gated_deltanet_hybrid_streams_generated_trees_at_any_budget(case, data):
    """Entry and read-out states on generated trees (duplicate paths, paths ending inside
    others, forests) cut at any budget."""
    _check_generated("qwen3-next", case, data)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["bamba", "falcon-h1", "lfm2"])
def test_mamba2_and_conv_hybrids_stream_exactly(family):
    """Bamba (a Mamba2 layer with its causal conv, then attention), Falcon-H1 (Mamba2 and
    attention side by side) and LFM2 (a short conv, no scan), keep mode."""
    _check(family, "keep", BRANCHY, 4)
    _check(family, "keep", CHAIN, 3)


@pytest.mark.parametrize("family,mode", [("jamba", "keep"), pytest.param("mamba", "recompute", marks=pytest.mark.slow)])
def test_mamba_hybrids_stream_exactly(family, mode):
    """Mamba's selective scan across parts: Jamba (a Mamba layer with its causal conv, then
    attention) and Mamba (two Mamba layers, recompute mode), each state injected into and read
    out of the scan's own rows (`stream_selective_scan`), to float64 rounding."""
    stats = _check(family, mode, BRANCHY, 4)
    assert stats.parts > 1
    _check(family, mode, CHAIN, 3)
    _, compiled = _compiled(family, mode)
    if family == "jamba":
        # The stack layout read from its modules (a Mamba mixer's channels and state size, the
        # attention's heads) is the one the graph checked: a first call captures it once.
        import treecompile.stream.runner as stream_runner

        guess, checked = stream_runner._layout_guess(compiled._stream.setup), compiled._stream._shapes
        assert (guess.shapes, guess.conv, guess.states) == (checked.shapes, checked.conv, checked.states)
        assert checked.states == [(64, 8, 1, torch.float64)]
    streamed = [r for r in compiled.compile_records if "route_stream_state_pass" in r.counters][-1]
    layers = 1 if family == "jamba" else 2
    assert streamed.counters["route_ssm_state_pass"] == {"selective_scan": layers}
    assert streamed.counters["route_stream_state_pass"]["recurrent_state"] == layers
    assert streamed.counters["route_stream_state_pass"]["conv_context"] == layers


def test_stream_selective_scan_injects_and_reads_states_exactly():
    """The streamed selective scan's own rows carry the state in and out: a part's node hanging
    from an injection node of given state ``S`` runs as the scan from ``S``, and a readout
    node returns the node's final state, forward and backward, to float64 rounding."""
    from test_compile_hybrid import _mamba_inputs

    from treecompile.kernels.scans.naive import selective_scan_reference
    from treecompile.passes.stream import stream_selective_scan

    s, d, n = 7, 5, 3
    u, dt, a, bb, cc, h0 = _mamba_inputs(1, s, d, n)
    states = h0.detach()[..., None].requires_grad_()  # [1, D, N, 1]
    # Injection node (N rows, a root), the part's rows (its child), a readout node (theirs).
    table = torch.tensor([[0, n, -1], [n, n + s, 0], [n + s, 2 * n + s, 1]])
    own, read = stream_selective_scan(u, dt, a, bb, cc, states, table, torch.zeros(1, dtype=torch.int64))
    ref_out, ref_final = selective_scan_reference(u, dt, a, bb, cc, states[..., 0])
    rtol, atol = COMPILE_TOL["pure"]
    torch.testing.assert_close(own, ref_out, rtol=rtol, atol=atol)
    torch.testing.assert_close(read, ref_final[..., None], rtol=rtol, atol=atol)
    g = torch.Generator().manual_seed(1)
    w1, w2 = torch.randn(own.shape, generator=g, dtype=own.dtype), torch.randn(read.shape, generator=g, dtype=own.dtype)
    inputs = [u, dt, a, bb, cc, states]
    got = torch.autograd.grad((own * w1).sum() + (read * w2).sum(), inputs)
    want = torch.autograd.grad((ref_out * w1).sum() + (ref_final[..., None] * w2).sum(), inputs)
    for name, x, y in zip(["u", "dt", "A", "B", "C", "state"], got, want):
        torch.testing.assert_close(x, y, rtol=rtol, atol=atol, msg=lambda m, name=name: f"d{name}: {m}")


@pytest.mark.slow
def test_hybrid_moe_with_aux_loss_streams_exactly():
    """Qwen3-Next with MoE layers and the router auxiliary loss, in recompute mode: the
    recurrent state, conv context and router sums together (the first pass without a graph
    hands states over as the passes with graphs do)."""
    _check("qwen3-next-moe-aux", "recompute", BRANCHY, 4)


def test_temperature_streams_as_the_one_call_tree():
    """``temperature`` divides the logits of every streamed part (log-probs, entropy and
    gradients equal the one-call tree's, which test_compile_custom checks per path)."""
    model = tiny(NanoGPT)
    compiled = tree_compile(model, temperature=0.7, outputs=("entropy",), stream=StreamOptions(budget_rows=100),
                            backend="eager")
    batch = pack(TrajectoryTree.from_sequences(BRANCHY))
    runs = []
    for budget in (100, 3):
        compiled._stream.options = StreamOptions(budget_rows=budget)
        model.zero_grad(set_to_none=True)
        out = compiled(batch)
        out.loss.backward()
        runs.append((out, {n: p.grad.clone() for n, p in model.named_parameters()}))
    (one, want), (streamed, got) = runs
    assert compiled._stream.stats.parts > 1
    rtol, atol = COMPILE_TOL["pure"]
    for what in ("loss", "logprobs", "entropy"):
        torch.testing.assert_close(getattr(streamed, what).detach(), getattr(one, what).detach(), rtol=rtol,
                                   atol=atol, msg=lambda m, w=what: f"{w}: {m}")
    assert_grads_close(got, want, ("float64", "pure"))


def test_bad_options_are_refused():
    with pytest.raises(ValueError, match="valid modes: keep, recompute"):
        StreamOptions(budget_rows=4, mode="fast")
    with pytest.raises(ValueError, match="positive int"):
        StreamOptions(budget_rows=0)
    for kw in ({}, dict(budget_rows=4, budget_bytes=10**6)):
        with pytest.raises(ValueError, match="exactly one of budget_rows .* and budget_bytes"):
            StreamOptions(**kw)
    for bad in (0, -5, True, 1.5e6):
        with pytest.raises(ValueError, match="budget_bytes must be a positive int"):
            StreamOptions(budget_bytes=bad)
    with pytest.raises(ValueError, match="unknown optimizer 'adam'; valid: adamw"):
        StreamOptions(budget_bytes=10**6, optimizer="adam")


def _initial_state_gdn():
    return GdnLM([GatedDeltaNetLayer(32, initial_state=True)])


def _two_key_sizes():
    return GdnLM([GatedDeltaNetLayer(32, head_dim=8), GatedDeltaNetLayer(32, head_dim=4)])


@pytest.mark.parametrize("build,refusal", [
    (_initial_state_gdn, r"is a recurrent scan with an initial state: a streamed part starts its roots from the zero "
                         r"state\.\n  at .*test_compile_hybrid\.py\", line \d+, in forward: o, _ = .*chunk_gated_delta_rule\b"),
    (_two_key_sizes, r"recurrent layers of different key sizes \[4, 8\] cannot share one streamed node table\.\n"
                     r"  at .*test_compile_hybrid\.py\", line \d+, in forward: o, _ = .*chunk_gated_delta_rule\b"),
], ids=["initial-state", "two-key-sizes"])
def test_a_streamed_part_refuses_recurrent_states_its_stack_cannot_carry(build, refusal):
    """A streamed part starts its roots from the zero state and keeps one node table for every
    recurrent layer: a model that needs either otherwise is refused, naming the scan and the
    model's source line, before any gradient is written."""
    torch.manual_seed(0)
    model = build().double()
    batch = pack(TrajectoryTree.from_sequences(BRANCHY))
    compiled = tree_compile(model, backend="eager", stream=StreamOptions(budget_rows=4))
    with pytest.raises(UnsupportedModelError, match=refusal):
        compiled(batch)
    assert all(p.grad is None for p in model.parameters())


#: NanoGPT's dimensions for the cost model (a custom model has no config to read).
NANO_DIMS = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2)


def test_budget_bytes_streams_in_the_largest_parts_whose_streamed_step_fits():
    """A byte budget bounds the whole streamed step, stack included: the parts are the
    largest whose predicted peak (`stream_peak_bytes`) fits, chosen per batch; the result
    is the row budget's, bit for bit, and per-path training's."""
    from treecompile.planning.budget import CostModel
    from treecompile.stream.plan import stream_peak_bytes

    cost = CostModel.from_config(NANO_DIMS, dtype="float64", device="cpu", optimizer="sgd")
    # A 40-token prompt and 4 rollouts of 20: 119 rows, enough that streaming saves more than the
    # stack it keeps (on a tree of a few rows the whole step is the smaller).
    rng = np.random.default_rng(0)
    prompt = rng.integers(1, 64, 40).tolist()
    tree = TrajectoryTree.from_sequences([prompt + rng.integers(1, 64, 20).tolist() for _ in range(4)])
    batch = pack(tree)
    peak = {c: stream_peak_bytes(plan_stream(batch, c), cost, "keep") for c in range(1, batch.num_tokens)}
    budget = peak[10]  # parts of 10 rows fit; the whole batch in one call does not
    assert cost.peak_bytes(batch.num_tokens) > budget
    model = tiny(NanoGPT)
    by_bytes = StreamOptions(budget_bytes=budget, config=NANO_DIMS, optimizer="sgd")
    compiled = tree_compile(model, backend="eager", stream=by_bytes)
    assert compiled._stream.budget_rows == cost.capacity(budget)  # the most rows of one call
    out = compiled(batch)
    out.loss.backward()
    stats = compiled._stream.stats
    rows = stats.budget_rows
    assert rows >= 10 and peak[rows] <= budget and (rows + 1 == batch.num_tokens or peak[rows + 1] > budget)
    assert stats.peak_bytes == peak[rows] and stats.mode == "keep" and f"parts of at most {rows} rows" in stats.why
    got = (out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
    compiled._stream.options = StreamOptions(budget_rows=rows)  # one compiled graph serves both
    model.zero_grad(set_to_none=True)
    out = compiled(batch)
    out.loss.backward()
    assert compiled._stream.stats.parts == plan_stream(batch, rows).num_parts > 1
    assert compiled._stream.stats.peak_bytes is None
    torch.testing.assert_close(got[0], out.loss.detach(), rtol=0, atol=0)
    for n, p in model.named_parameters():
        torch.testing.assert_close(got[1][n], p.grad, rtol=0, atol=0, msg=lambda m, n=n: f"grad of {n}: {m}")
    # And both are per-path training.
    model.zero_grad(set_to_none=True)
    ref = per_path_loss(model, [tree])
    ref.loss.backward()
    rtol, atol = COMPILE_TOL["pure"]
    torch.testing.assert_close(got[0], ref.loss.detach(), rtol=rtol, atol=atol)
    assert_grads_close(got[1], {n: p.grad for n, p in model.named_parameters()}, ("float64", "pure"))
    # A batch whose whole step fits runs as one call.
    compiled._stream.options = by_bytes
    fits = cost.capacity(budget)
    assert not compiled._stream.wants(pack(TrajectoryTree.from_sequences([list(range(1, fits + 1))])))
    assert compiled._stream.wants(pack(TrajectoryTree.from_sequences([list(range(1, fits + 2))])))


def _prompt_with_rollouts():
    """A cost model of a small Qwen3-shaped float32 model (SGD) and a 320-token prompt with
    12 rollouts of 120 tokens: the byte-budget search tests' tree (no model runs)."""
    from treecompile.planning.budget import CostModel, ModelDims

    dims = ModelDims(layers=2, hidden=64, intermediate=128, heads=4, kv_heads=2, head_dim=16, vocab=64)
    cost = CostModel.from_config(dims, dtype="float32", device="cpu", optimizer="sgd")
    rng = np.random.default_rng(0)
    prompt = rng.integers(1, 64, 320).tolist()
    batch = pack(TrajectoryTree.from_sequences([prompt + rng.integers(1, 64, 120).tolist() for _ in range(12)]),
                 warn_por=False)
    return cost, batch


def test_auto_mode_weighs_keep_modes_parts_against_recomputed_rows():
    """``mode="auto"`` (byte budgets only), on a prompt with 12 rollouts, by the cost model
    alone (no model runs): a roomy budget keeps (every row forward once); a tighter one
    where keep mode needs many more parts than recompute mode recomputes rows takes
    recompute; tighter still, keep mode does not fit at all."""
    from treecompile.planning.budget import BudgetError
    from treecompile.stream.plan import PART_OVERHEAD_ROWS, choose_stream, stream_peak_bytes

    cost, batch = _prompt_with_rollouts()
    whole = cost.peak_bytes(batch.num_tokens)

    def both(budget):
        keep, rec = (choose_stream(batch, cost, budget, m) for m in ("keep", "recompute"))
        extra = rec.plan.forward_rows("recompute") - rec.plan.forward_rows("keep")
        return keep, rec, extra, choose_stream(batch, cost, budget, "auto")

    roomy = whole * 7 // 10
    keep, rec, extra, auto = both(roomy)
    assert extra >= PART_OVERHEAD_ROWS * (keep.plan.num_parts - rec.plan.num_parts)
    assert (auto.mode, auto.rows) == ("keep", keep.rows) and auto.why.startswith("keep mode")
    assert auto.peak_bytes == stream_peak_bytes(auto.plan, cost, "keep") <= roomy
    assert stream_peak_bytes(plan_stream(batch, auto.rows + 1), cost, "keep") > roomy
    keep, rec, extra, auto = both(whole // 2)
    assert extra < PART_OVERHEAD_ROWS * (keep.plan.num_parts - rec.plan.num_parts)
    assert (auto.mode, auto.rows) == ("recompute", rec.rows) and "keep mode fits only" in auto.why
    tight = choose_stream(batch, cost, whole // 4, "auto")
    assert tight.mode == "recompute" and tight.peak_bytes <= whole // 4 and "keep mode does not fit" in tight.why
    with pytest.raises(BudgetError, match="recompute mode keeps less on the stack"):
        choose_stream(batch, cost, whole // 4, "keep")
    with pytest.raises(BudgetError, match=f"cannot stream this batch of {batch.num_tokens:,} rows"):
        choose_stream(batch, cost, cost.static_bytes(), "auto")
    with pytest.raises(ValueError, match="mode='auto' chooses by memory: it needs budget_bytes"):
        StreamOptions(budget_rows=4, mode="auto")


def test_budget_search_plans_each_size_once_and_never_over_max_parts(monkeypatch):
    """`choose_stream` plans each part size once for both modes of ``"auto"``, and never
    tries sizes that cut the batch into more than `MAX_STREAM_PARTS` parts."""
    import treecompile.stream.plan as sp

    cost, batch = _prompt_with_rollouts()
    tried = []
    planner = sp.plan_stream
    monkeypatch.setattr(sp, "plan_stream", lambda b, c, cuts="subtree": tried.append(c) or planner(b, c, cuts))
    monkeypatch.setattr(sp, "MAX_STREAM_PARTS", 8)
    least = -(-batch.num_tokens // 8)
    choice = sp.choose_stream(batch, cost, cost.peak_bytes(batch.num_tokens) // 2, "auto")
    assert choice.plan.num_parts <= 8 and min(tried) == least and len(tried) == len(set(tried))


def test_budget_bytes_reads_a_hugging_face_models_config_and_dtype():
    from treecompile.planning.budget import CostModel

    model = _MODELS["qwen3"]()
    runner = tree_compile(model, backend="eager", stream=StreamOptions(budget_bytes=50_000_000))._stream
    want = CostModel.from_config(model.config, dtype="float64", device="cpu").capacity(50_000_000)
    assert runner.budget_rows == want > 1


def test_budget_bytes_too_small_or_not_modelled_is_refused():
    from treecompile.planning.budget import BudgetError, CostModel

    cost = CostModel.from_config(NANO_DIMS, dtype="float64", device="cpu")
    with pytest.raises(BudgetError, match=r"StreamOptions\(budget_bytes=\d+\): a budget of .* does not fit one token: "
                                          r"parameters, gradients and optimizer state \(adamw, float64\)"):
        tree_compile(tiny(NanoGPT), stream=StreamOptions(budget_bytes=cost.peak_bytes(1) - 1, config=NANO_DIMS))
    with pytest.raises(BudgetError, match="NanoGPT has no config; pass StreamOptions\\(config=...\\)"):
        tree_compile(tiny(NanoGPT), stream=StreamOptions(budget_bytes=10**9))
    with pytest.raises(BudgetError, match="recurrent or convolution layers"):
        tree_compile(_MODELS["lfm2"](), stream=StreamOptions(budget_bytes=10**9))
    with pytest.raises(BudgetError, match="mixture-of-experts configs are not modelled"):
        tree_compile(_MODELS["qwen3-moe-no-aux"](), stream=StreamOptions(budget_bytes=10**9))
    with pytest.raises(BudgetError, match=r"StreamOptions\(budget_bytes=\d+\): Gemma2 soft-caps its logits"):
        tree_compile(_MODELS["gemma2-softcap-sw3"](), stream=StreamOptions(budget_bytes=10**9))


@pytest.mark.parametrize("mode", ["keep", "recompute"])
def test_plan_stream_command_reports_the_schedule(mode, capsys):
    import argparse
    import json

    from treecompile.cli.plan import add_command, run

    parser = argparse.ArgumentParser()
    add_command(parser.add_subparsers(dest="command"))
    # A capacity below the longest path: partitioning would refuse it, streaming does not.
    args = parser.parse_args(["plan", "sample:tau_bench", "--tokenizer", "sample", "--limit", "2", "--capacity",
                              "300", "--stream", mode, "--json"])
    assert run(args) == 0
    out = json.loads(capsys.readouterr().out)
    for t in out["trees"]:
        assert t["parts"] >= -(-t["rows"] // 300) and 1 <= t["stack_depth"] <= t["parts"]
        assert sorted(p for r in t["schedule"] for p in r) == list(range(t["parts"]))
        if mode == "keep":
            assert t["forward_rows"] == t["rows"] and t["err"] == pytest.approx(t["por"])
        else:
            assert t["forward_rows"] > t["rows"] and t["err"] < t["por"]


@pytest.mark.parametrize("mode", ["keep", "recompute"])
def test_plan_stream_command_counts_the_aux_loss_pass(mode, capsys):
    """``--aux-loss``: a streamed step of a model with a router auxiliary loss runs every row
    forward once more without a graph; the report counts it, so even keep mode's ERR < POR."""
    import json

    from treecompile.cli.main import main

    base = ["plan", "sample:tau_bench", "--tokenizer", "sample", "--limit", "2", "--capacity", "300", "--stream", mode]
    assert main([*base, "--json"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main([*base, "--aux-loss", "--json"]) == 0
    aux = json.loads(capsys.readouterr().out)
    assert aux["aux_loss"] and not plain["aux_loss"]
    for p, t in zip(plain["trees"], aux["trees"]):
        assert t["aux_pass_rows"] == t["rows"] and p["aux_pass_rows"] == 0
        assert t["forward_rows"] == p["forward_rows"] + t["rows"]
        assert t["err"] == pytest.approx(1 - t["forward_rows"] / t["path_tokens"])
        assert t["err"] < p["err"] <= t["por"] and t["err"] < t["por"]
        assert {k: t[k] for k in ("parts", "stack_depth", "schedule")} == {k: p[k] for k in ("parts", "stack_depth",
                                                                                            "schedule")}
    assert main([*base, "--aux-loss"]) == 0
    text = capsys.readouterr().out
    assert "--aux-loss: the router auxiliary loss's gradient needs the whole tree's router sums first" in text
    assert main(base) == 0
    assert "a model with a router auxiliary loss runs one more forward pass (--aux-loss)" in capsys.readouterr().out
    assert main(["plan", "sample:tau_bench", "--tokenizer", "sample", "--limit", "1", "--aux-loss"]) == 2
    assert "--aux-loss counts the extra forward pass of a streamed step: give it with --stream" in (
        capsys.readouterr().err)


@pytest.mark.full
def test_plan_stream_command_takes_a_budget_in_bytes(tmp_path, capsys):
    """``--budget-bytes B --config PATH``: per tree, the parts ``choose_stream`` picks for the
    whole streamed step within B, the mode (``auto`` weighs them) and the predicted peak."""
    import argparse
    import json

    from treecompile.planning.budget import BudgetError, CostModel
    from treecompile.cli.main import main
    from treecompile.cli.plan import _load_trees, add_command
    from treecompile.stream.plan import choose_stream

    config = transformers.Qwen3Config(**SMALL, head_dim=8)
    config.save_pretrained(tmp_path / "qwen3")
    cost = CostModel.from_config(config, dtype="float32", optimizer="sgd", device="cpu")
    budget = cost.peak_bytes(1000) + 1
    assert cost.capacity(budget) == 1000
    base = ["plan", "sample:tau_bench", "--tokenizer", "sample", "--limit", "2"]
    model = ["--config", str(tmp_path / "qwen3"), "--dtype", "float32", "--optimizer", "sgd", "--device", "cpu"]
    for mode in ("keep", "auto"):
        argv = [*base, "--stream", mode, "--budget-bytes", f"{budget}", *model]
        assert main([*argv, "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["capacity"] == 1000 and out["budget"]["budget_bytes"] == budget and out["budget"]["capacity"] == 1000
        parser = argparse.ArgumentParser()
        add_command(parser.add_subparsers(dest="command"))
        _, trees, _ = _load_trees(parser.parse_args(base))
        streamed = 0
        for t, tree in zip(out["trees"], trees):
            try:
                want = choose_stream(pack(tree, warn_por=False), cost, budget, mode)
            except BudgetError as e:  # keep mode cannot hold a long conversation's stack: said per tree
                assert t["error"] == str(e) and mode == "keep"
                continue
            assert (t["mode"], t["part_rows"], t["predicted_peak_bytes"]) == (want.mode, want.rows, want.peak_bytes)
            assert t["predicted_peak_bytes"] <= budget and t["parts"] == want.plan.num_parts > 1 and t["why"]
            streamed += 1
        assert streamed == (2 if mode == "auto" else 0)
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert f"within --budget-bytes {budget:,} for the whole step; a tree of at most 1000 rows runs as one call" in text
    assert " recompute " in text and "peak MiB" in text
    # Refusals: a budget under one token's step, both budgets, no config, auto without bytes.
    assert main([*base, "--stream", "keep", "--budget-bytes", "1000", *model]) == 2
    assert "does not fit one token" in capsys.readouterr().err
    assert main([*argv, "--capacity", "300"]) == 2
    assert "give --capacity (rows) or --budget-bytes (bytes), not both" in capsys.readouterr().err
    assert main([*base, "--stream", "keep", "--budget-bytes", "1e9"]) == 2
    assert "--budget-bytes needs --config PATH" in capsys.readouterr().err
    assert main([*base, "--stream", "auto", "--capacity", "300"]) == 2
    assert "--stream auto chooses the mode by memory: give --budget-bytes" in capsys.readouterr().err


@_ON_NANOGPT_WORKER
@pytest.mark.slow
def test_a_loss_nonlinear_in_the_logprobs_streams_exactly():
    """A PPO-style clipped ratio objective of the log-probabilities: streamed by
    `stream_logprob_loss` it equals the same objective on the one-call compiled model."""
    model, compiled = _compiled("nanogpt", "keep")
    batch = pack(TrajectoryTree.from_sequences(BRANCHY))
    torch.manual_seed(1)
    old = -3.0 + 0.3 * torch.randn(batch.num_tokens, dtype=torch.float64)
    adv = torch.randn(batch.num_tokens, dtype=torch.float64) * (batch.pred_index >= 0)

    def objective(lp):
        ratio = torch.exp(lp - old)
        return -(torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv)).sum() / batch.num_tokens

    compiled._stream.options = StreamOptions(budget_rows=100)  # one call: the exact tree loss
    model.zero_grad(set_to_none=True)
    ref = objective(compiled(batch).logprobs)
    ref.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    compiled._stream.options = StreamOptions(budget_rows=3)
    model.zero_grad(set_to_none=True)
    weights = batch.target_weight.clone()
    out = stream_logprob_loss(compiled, batch, objective)
    out.loss.backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    assert torch.equal(batch.target_weight, weights)  # the caller's batch is untouched
    rtol, atol = COMPILE_TOL["pure"]
    torch.testing.assert_close(out.loss.detach(), ref.detach(), rtol=rtol, atol=atol)
    assert_grads_close(got, want, ("float64", "pure"))


@pytest.mark.full
@_ON_NANOGPT_WORKER
@pytest.mark.parametrize("objective", ["ppo-dualclip-k3", "pg-k1"])
def test_rl_objectives_stream_exactly(objective):
    """`treecompile.rl.losses.policy_loss` (off-policy clipped ratios with dual-clip and a KL to a
    reference, or the plain policy gradient), streamed through `stream_logprob_loss` in parts
    of 3 rows, equals it on the one-call tree (itself per-path training:
    tests/test_rl_objectives.py). The entropy bonus is not a function of the
    log-probabilities and does not stream (streamed entropies are values)."""
    from treecompile.rl.losses import PolicyLossConfig, build_rl_batch, policy_loss

    model, compiled = _compiled("nanogpt", "keep")
    tree = TrajectoryTree.from_sequences(BRANCHY)
    rng = np.random.default_rng(3)
    lengths = [len(s) for s in BRANCHY]
    config = (PolicyLossConfig(eps_low=0.1, eps_high=0.28, clip_c=1.3, kl_coef=0.3, kl_estimator="k3")
              if objective.startswith("ppo") else PolicyLossConfig(objective="pg", kl_coef=0.2, kl_estimator="k1"))
    rl = build_rl_batch(tree, advantages=rng.normal(size=len(lengths)).tolist(),
                        old_logprobs=[-3.0 + 0.4 * rng.normal(size=n) for n in lengths],
                        ref_logprobs=[-3.0 + 0.4 * rng.normal(size=n) for n in lengths],
                        loss_agg_mode="seq-mean-token-mean")

    def objective_of(lp):
        return policy_loss(lp, rl, config).loss

    compiled._stream.options = StreamOptions(budget_rows=100)  # one call: the tree's exact loss
    model.zero_grad(set_to_none=True)
    ref = objective_of(compiled(rl.batch).logprobs)
    ref.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    compiled._stream.options = StreamOptions(budget_rows=3)
    model.zero_grad(set_to_none=True)
    out = stream_logprob_loss(compiled, rl.batch, objective_of)
    out.loss.backward()
    assert compiled._stream.stats.parts > 1
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    rtol, atol = COMPILE_TOL["pure"]
    torch.testing.assert_close(out.loss.detach(), ref.detach(), rtol=rtol, atol=atol)
    assert_grads_close(got, want, ("float64", "pure"))


@pytest.mark.full
@pytest.mark.slow
def test_streamed_peak_memory_is_below_the_whole_tree():
    """The CPU allocator's peak over one step (treecompile.planning.budget.measure_peak_bytes): a tree
    8x the budget, streamed in recompute mode, peaks under half of the whole tree in one
    call; keep mode (the stack's graphs alive) under the whole tree (docs/benchmarks.md
    measures a larger tree)."""
    from treecompile.planning.budget import measure_peak_bytes

    cfg = transformers.Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float()
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 128, 128).tolist()
    # The rollouts start with distinct tokens: the tree branches once, after the prompt.
    tree = TrajectoryTree.from_sequences([prompt + [120 + i] + rng.integers(0, 128, 47).tolist() for i in range(8)])
    batch = pack(tree)  # 512 rows
    # Each rollout is a part nothing later reads; the prompt's two parts stay on the stack.
    assert plan_stream(batch, 64).stack_depth == 3
    peaks = {}
    for name, options in [("whole", None), ("keep", StreamOptions(64)), ("recompute", StreamOptions(64, "recompute"))]:
        # The rewritten graphs as they are: what is compared is what each way of running the
        # tree holds at once. test_budget.py measures the default lowering's streamed peak.
        compiled = tree_compile(model, stream=options, backend="eager")

        def step():
            compiled(batch).loss.backward()

        step()  # compiles
        model.zero_grad(set_to_none=True)
        peaks[name] = measure_peak_bytes(step)
        model.zero_grad(set_to_none=True)
    print(f"\npeak bytes: {peaks}")
    assert peaks["recompute"] < peaks["whole"] / 2, peaks
    assert peaks["keep"] < peaks["whole"], peaks


@pytest.mark.parametrize("mode,cuts", [("keep", "subtree"), ("recompute", "rows")])
def test_verify_checks_the_streamed_variant(mode, cuts):
    """``verify=True`` on a streamed call checks the streamed variant itself (in the wrapper's
    mode and cuts) on a check tree that splits into several parts with ancestors on the stack."""
    model = tiny(NanoGPT)
    compiled = tree_compile(model, verify=True, backend="eager",
                            stream=StreamOptions(budget_rows=8, mode=mode, cuts=cuts))
    batch = pack(TrajectoryTree.from_sequences(BRANCHY))
    with torch.no_grad():  # a first call without grad (a rollout's log-probs) is checked with grad
        compiled(batch)
    report = compiled.stream_verified
    assert compiled.verified is None  # no whole call yet
    assert all(p.grad is None for p in model.parameters())  # the check leaves the model's gradients
    assert report.dtype == torch.float64 and report.paths == 6
    assert report.stream.parts > 1 and report.stream.stack_depth >= 2
    assert report.stream.budget_rows < report.stream.rows
    assert report.worst_grad_diff < 1e-10 and report.loss_diff < 1e-12
    compiled(batch).loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    compiled(batch).loss.backward()  # checked once, on the first streamed call
    assert compiled.stream_verified is report
    assert all(torch.equal(2 * g, p.grad) for g, p in zip(grads, model.parameters()))


def test_verify_catches_a_wrong_streamed_variant(monkeypatch):
    """A streamed variant whose parts read zeros instead of their ancestors' keys and values
    is wrong only where a part has a prefix: verify=True must refuse it at the first streamed call."""
    import treecompile.stream.runner as stream_runner

    def no_prefix(*args, **kwargs):
        kv, conv, states = gather_prefix(*args, **kwargs)
        return [torch.zeros_like(x) for x in kv], conv, states

    gather_prefix = stream_runner.gather_prefix
    monkeypatch.setattr(stream_runner, "gather_prefix", no_prefix)
    compiled = tree_compile(tiny(NanoGPT), verify=True, backend="eager", stream=StreamOptions(budget_rows=8))
    with pytest.raises(UnsupportedModelError, match=r"(?s)verify: the streamed tree-compiled model .* disagrees with "
                                                    r"per-path training.*gradient of '.*' differs by.*"
                                                    r"`treecompile inspect --stream-rows 4`"):
        compiled(pack(TrajectoryTree.from_sequences(BRANCHY)))
