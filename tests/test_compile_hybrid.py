"""Hybrid models: Gated DeltaNet layers and their causal conv, exact on a tree.

Two layers of tests. The kernels (`treecompile.kernels.gdn`, `.conv`) against their plain
token-by-token reference loops, in float64 to rounding, forward and backward, on a row and
on a tree (where the tree reference composes the reference loop node by node from the
parent's final state, so autograd, not our backward, sums the siblings' gradients). Then
a tiny Qwen3-Next in float64 through `tree_compile` against the unmodified model run on
each path alone (HF's own chunked GDN and conv fallbacks): loss, log-probs and every
gradient.

Trees cover: 1-token nodes, nodes shorter than the conv kernel (so a window reaches into
the grandparent), a node that straddles HF's 64-token chunk boundary, many siblings and a
deep chain of 1-token nodes.
"""

from __future__ import annotations

import random

import pytest
import torch
from test_compile_models import compare_with_paths, make_batch
from testing import TOLERANCES, assert_grads_close, param_grads

import treecompile as tc
from treecompile.compile import TreeCompiledModel, _sequence_kernels, _swapped, tree_compile
from treecompile.errors import UnsupportedModelError
from treecompile.kernels import conv, gdn
from treecompile.passes.conv_context import rewrite_conv_context_pass
from treecompile.passes.pipeline import PASSES
from treecompile.passes.ssm_state import route_ssm_state_pass
from treecompile.reference import per_path_loss

PURE = TOLERANCES[("float64", "pure")]
F64 = torch.float64


# --------------------------------------------------------------------------- trees


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, 64) for _ in range(n)]


def _hybrid_trees() -> dict[str, list[list[int]]]:
    rng = random.Random(0)
    root = _tokens(rng, 3)
    chain = _tokens(rng, 7)
    long_prefix = _tokens(rng, 60)
    return {
        # 1-token and 2-token nodes (shorter than K - 1 = 3): windows reach the grandparent.
        "short-nodes": [root + [5], root + [6, 7], root + [6, 8], root + [6, 8, 9, 10], root + [11, 12, 13, 14]],
        # A deep chain of 1-token nodes: each chain token has a 1-token side branch.
        "deep-chain": [chain] + [chain[:i] + [(chain[i] % 63) + 1] for i in range(1, 7)],
        # Many siblings under one parent.
        "siblings": [root + [c, c + 1] for c in range(20, 30)],
        # Children from row 60 to 72 straddle HF's 64-token chunk boundary.
        "chunk-straddle": [long_prefix + _tokens(rng, 12), long_prefix + _tokens(rng, 9), long_prefix[:30] + [1, 2]],
    }


TREES = _hybrid_trees()


def _pack(paths: list[list[int]]) -> tuple[tc.TreeBatch, list[tc.TrajectoryTree]]:
    trees = [tc.TrajectoryTree.from_sequences(paths)]
    return tc.pack(trees), trees


# --------------------------------------------------------------------------- kernels: GDN


def _gdn_inputs(b: int, s: int, h: int = 2, dk: int = 4, dv: int = 3, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, s, h, dk, generator=g, dtype=F64)
    k = torch.nn.functional.normalize(torch.randn(b, s, h, dk, generator=g, dtype=F64), dim=-1)
    v = torch.randn(b, s, h, dv, generator=g, dtype=F64)
    decay = -torch.rand(b, s, h, generator=g, dtype=F64)
    beta = torch.rand(b, s, h, generator=g, dtype=F64)
    h0 = torch.randn(b, h, dk, dv, generator=g, dtype=F64)
    return [x.requires_grad_() for x in (q, k, v, decay, beta, h0)]


def _grads(outputs, inputs, seed=1):
    g = torch.Generator().manual_seed(seed)
    loss = sum((o * torch.randn(o.shape, generator=g, dtype=o.dtype)).sum() for o in outputs)
    return torch.autograd.grad(loss, inputs)


def _close(got, ref, what):
    for i, (a, b) in enumerate(zip(got, ref)):
        torch.testing.assert_close(a, b, rtol=PURE[0], atol=PURE[1], msg=lambda m, i=i: f"{what} [{i}]: {m}")


@pytest.mark.parametrize("with_state", [False, True], ids=["zero-state", "initial-state"])
@pytest.mark.parametrize("s", [1, 5, 65], ids=lambda s: f"S{s}")
def test_gated_delta_rule_op_matches_reference_loop(s, with_state):
    q, k, v, g, beta, h0 = _gdn_inputs(2, s)
    init = h0 if with_state else None
    inputs = [q, k, v, g, beta] + ([h0] if with_state else [])
    out, final = torch.ops.treecompile.gated_delta_rule(q, k, v, g, beta, init)
    ref_out, ref_final = gdn.gated_delta_rule_reference(q, k, v, g, beta, init)
    _close([out, final], [ref_out, ref_final], "forward")
    _close(_grads([out, final], inputs), _grads([ref_out, ref_final], inputs), "grad")


def test_gated_delta_rule_op_passes_opcheck():
    q, k, v, g, beta, h0 = _gdn_inputs(1, 4)
    torch.library.opcheck(torch.ops.treecompile.gated_delta_rule, (q, k, v, g, beta, h0))
    torch.library.opcheck(torch.ops.treecompile.gated_delta_rule, (q, k, v, g, beta, None))


def test_hf_adapter_matches_hf_chunked_kernel():
    """Our drop-in and HF's chunked fallback agree (HF computes in float32: its rounding)."""
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    q, k, v, g, beta, _ = _gdn_inputs(1, 70, h=2, dk=8, dv=8)
    ours, _ = gdn.hf_chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
    theirs, _ = hf.torch_chunk_gated_delta_rule.__wrapped__(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def _tree_reference(q, k, v, g, beta, init, batch):
    """The tree recurrence composed from the reference loop, node by node (autograd sums siblings)."""
    finals, outs = [], []
    for start, end, parent in zip(batch.node_start.tolist(), batch.node_end.tolist(), batch.node_parent.tolist()):
        state = init if parent < 0 else finals[parent]
        o, f = gdn.gated_delta_rule_reference(*(x[:, start:end] for x in (q, k, v, g, beta)), state)
        finals.append(f)
        outs.append(o)
    return torch.cat(outs, dim=1)


@pytest.mark.parametrize("name", list(TREES))
def test_tree_gated_delta_rule_follows_each_path(name):
    batch, _ = _pack(TREES[name])
    s = batch.num_tokens
    q, k, v, g, beta, h0 = _gdn_inputs(1, s)
    tables = (batch.node_start, batch.node_end, batch.node_parent)
    out = torch.ops.treecompile.tree_gated_delta_rule(q, k, v, g, beta, h0, *tables)
    # Forward: each path's rows equal the reference loop run on that path alone.
    for p in range(batch.num_paths):
        rows = batch.path_rows(p)
        ref, _ = gdn.gated_delta_rule_reference(*(x[:, rows] for x in (q, k, v, g, beta)), h0)
        torch.testing.assert_close(out[:, rows], ref, rtol=PURE[0], atol=PURE[1])
    # Backward: against autograd through the node-by-node reference.
    ref = _tree_reference(q, k, v, g, beta, h0, batch)
    _close([out], [ref], "forward")
    inputs = [q, k, v, g, beta, h0]
    _close(_grads([out], inputs), _grads([ref], inputs), "grad")


def test_tree_state_routing_matters():
    """Guards the test above: running the packed row linearly leaks siblings' state."""
    batch, _ = _pack(TREES["siblings"])
    q, k, v, g, beta, _ = _gdn_inputs(1, batch.num_tokens)
    tree = torch.ops.treecompile.tree_gated_delta_rule(
        q, k, v, g, beta, None, batch.node_start, batch.node_end, batch.node_parent
    )
    linear, _ = torch.ops.treecompile.gated_delta_rule(q, k, v, g, beta, None)
    assert (tree - linear).abs().max() > 1e-3


# --------------------------------------------------------------------------- kernels: conv


def _conv_inputs(s: int, c: int = 5, kk: int = 4, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, c, s, generator=g, dtype=F64)
    w = torch.randn(c, kk, generator=g, dtype=F64)
    b = torch.randn(c, generator=g, dtype=F64)
    return [t.requires_grad_() for t in (x, w, b)]


def _path_ancestors(batch: tc.TreeBatch, kk: int) -> torch.Tensor:
    pred = batch.pred_index.tolist()
    table = []
    for row in range(batch.num_tokens):
        col, cur = [], row
        for _ in range(kk - 1):
            cur = pred[cur] if cur >= 0 else -1
            col.append(cur)
        table.append(col)
    return torch.tensor(table, dtype=torch.int64).reshape(batch.num_tokens, kk - 1)


@pytest.mark.parametrize("kk", [1, 2, 4])
@pytest.mark.parametrize("s", [1, 3, 9], ids=lambda s: f"S{s}")
def test_causal_conv1d_op_matches_reference_loop(s, kk):
    x, w, b = _conv_inputs(s, kk=kk)
    out = torch.ops.treecompile.causal_conv1d(x, w, b)
    ref = conv.causal_conv1d_reference(x, w, b)
    _close([out], [ref], "forward")
    _close(_grads([out], [x, w, b]), _grads([ref], [x, w, b]), "grad")
    nobias = torch.ops.treecompile.causal_conv1d(x, w, None)
    _close([nobias], [conv.causal_conv1d_reference(x, w, None)], "forward, no bias")
    torch.library.opcheck(torch.ops.treecompile.causal_conv1d, (x, w, b))


def test_hf_conv_adapter_matches_hf_fallback():
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    x, w, b = _conv_inputs(7)
    ours = conv.hf_causal_conv1d_fn(x, w, b, activation="silu")
    theirs = hf.causal_conv1d_fn.__wrapped__(x, w, b, activation="silu")
    _close([ours], [theirs], "forward")


@pytest.mark.parametrize("name", list(TREES))
def test_tree_causal_conv1d_follows_each_path(name):
    batch, _ = _pack(TREES[name])
    x, w, b = _conv_inputs(batch.num_tokens)
    anc = _path_ancestors(batch, w.shape[1])
    out = torch.ops.treecompile.tree_causal_conv1d(x, w, b, anc)
    for p in range(batch.num_paths):
        rows = batch.path_rows(p)
        ref = conv.causal_conv1d_reference(x[:, :, rows], w, b)
        torch.testing.assert_close(out[:, :, rows], ref, rtol=PURE[0], atol=PURE[1])
    ref = conv.causal_conv1d_reference(x, w, b, anc)
    _close(_grads([out], [x, w, b]), _grads([ref], [x, w, b]), "grad")
    torch.library.opcheck(torch.ops.treecompile.tree_causal_conv1d, (x, w, b, anc))


# --------------------------------------------------------------------------- Qwen3-Next


transformers = pytest.importorskip("transformers")


def _qwen3_next():
    cfg = transformers.Qwen3NextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"], num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=8, linear_conv_kernel_dim=4, num_experts=0,
    )
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg).double().eval()


@pytest.fixture(scope="module")
def qwen3_next():
    model = _qwen3_next()
    return model, tree_compile(model)


@pytest.mark.parametrize("name", ["branchy", "forest", *TREES])
def test_qwen3_next_matches_per_path_training(qwen3_next, name):
    model, compiled = qwen3_next
    batch, trees = make_batch(name) if name in ("branchy", "forest") else _pack(TREES[name])
    # Against the unmodified model per path. HF's GDN fallback computes in float32 (it casts),
    # so this comparison has a float32 floor: absolute TOL["hf"].
    compare_with_paths(model, compiled, batch, trees, tol="hf")
    # Against per-path training with the same linear-sequence kernels swapped in (checked
    # against the reference loop and HF's kernel above): float64 but for HF's float32 norms,
    # so every gradient, however small, within the scaled ("float64", "hf") budget.
    model.zero_grad(set_to_none=True)
    compiled(batch).loss.backward()
    tree_grads = param_grads(model)
    model.zero_grad(set_to_none=True)
    with _swapped(_sequence_kernels(model)):
        per_path_loss(model, trees).loss.backward()
    assert_grads_close(tree_grads, param_grads(model), ("float64", "hf"))
    model.zero_grad(set_to_none=True)
    counters = compiled.counters
    assert counters["conv_context"] == {"causal_conv1d": 1}
    assert counters["ssm_state"] == {"gated_delta_rule": 1}
    assert counters["attention"] == {"hf_interface": 1}


def test_qwen3_next_kernels_are_restored_after_each_call(qwen3_next):
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    before = (hf.torch_chunk_gated_delta_rule, hf.causal_conv1d_fn)
    model, compiled = qwen3_next
    compiled(make_batch("branchy")[0])
    assert (hf.torch_chunk_gated_delta_rule, hf.causal_conv1d_fn) == before


def test_qwen3_next_verify_passes():
    compiled = tree_compile(_qwen3_next(), verify=True)
    compiled(make_batch("branchy")[0])
    assert compiled.verified.worst_grad_diff < compiled.verified.tolerance


@pytest.mark.parametrize("missing", ["conv_context", "ssm_state"])
def test_qwen3_next_without_its_pass_is_refused(missing):
    """The verify pass names a sequence kernel left linear, never trains it wrong."""
    drop = {"conv_context": rewrite_conv_context_pass, "ssm_state": route_ssm_state_pass}[missing]
    passes = tuple(p for p in PASSES if p is not drop)
    compiled = TreeCompiledModel(_qwen3_next(), mask="interval", backend=None, verify=False, passes=passes)
    with pytest.raises(UnsupportedModelError, match="sequence kernel"):
        compiled(make_batch("branchy")[0])
