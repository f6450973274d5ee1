"""Hybrid models: Gated DeltaNet, Mamba2 and Mamba layers and their causal conv, exact on a tree.

Two layers of tests. The kernels (`treecompile.kernels.scans.recurrence` for Gated DeltaNet and
Mamba2's scan, `.selective_scan` for Mamba's, `.conv`) against their plain token-by-token
reference loops, in float64 to rounding, forward and backward, on a row and on a tree (where
the tree reference composes the reference loop node by node from the parent's final state,
so autograd sums the siblings' gradients). Then tiny hybrid models in float64 through
`tree_compile` (Qwen3-Next, Qwen3.5, Qwen3.5-MoE, OLMo-Hybrid and Qwen4-Exp with Gated
DeltaNet; Bamba, Mamba2, FalconH1, NemotronH, Zamba2 and GraniteMoeHybrid with Mamba2 layers;
Mamba, FalconMamba, Jamba and Zamba with Mamba's selective scan; LFM2, LFM2-MoE and LFM3 with
gated short convs only) against the unmodified model run on each path alone (HF's own
fallbacks): loss, log-probs and every gradient. Families whose sequence mixing has no tree
form (Qwen4-Exp's n-gram embeddings; RecurrentGemma's and xLSTM's token loops), and the Mamba2 and Mamba
families on transformers before 5.15 (their scans written inside the mixer), are refused,
naming the op.

Trees cover: 1-token nodes, nodes shorter than the conv kernel (so a window reaches into
the grandparent), a node that straddles the 64-token chunk boundary, many siblings and a
deep chain of 1-token nodes.
"""

from __future__ import annotations

import random
import re

import pytest
import torch
import torch.nn.functional as F
from test_compile_models import SdpaBlock, compare_with_paths, make_batch, tiny
from torch import nn
from testing import TOLERANCES, assert_grads_close, backward_grads, float_keeping_float64, hf_float64_casts
from zoo import transformers_version

import treecompile as tc
from treecompile.capture.dynamo import sequence_kernels as _sequence_kernels, swapped_kernels as _swapped
from treecompile.compile.wrapper import tree_compile
from treecompile.compile.selfcheck import verify_tree_compile
from treecompile.core.errors import UnsupportedModelError
from treecompile.capture import drop_ins
from treecompile.kernels import conv
from treecompile.kernels.scans import naive, recurrence, selective_scan
from treecompile.passes.conv_context import rewrite_conv_context_pass
from treecompile.passes.ssm_state import route_ssm_state_pass
from treecompile.core.reference import per_path_loss

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


def _gdn_inputs(b: int, s: int, h: int = 2, dk: int = 4, dv: int = 3, seed: int = 0, channel: bool = False):
    """``channel``: a decay per key channel ``[B, S, H, Dk]`` (Kimi Delta Attention)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, s, h, dk, generator=g, dtype=F64)
    k = torch.nn.functional.normalize(torch.randn(b, s, h, dk, generator=g, dtype=F64), dim=-1)
    v = torch.randn(b, s, h, dv, generator=g, dtype=F64)
    decay = -torch.rand(b, s, h, *([dk] if channel else []), generator=g, dtype=F64)
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


KINDS = {"gated_delta_rule": naive.gated_delta_rule_reference, "ssd_scan": naive.ssd_scan_reference,
         "kimi_delta_rule": naive.channel_delta_rule_reference, "gla_scan": naive.gla_scan_reference}


def _inputs(kind: str, b: int, s: int, **kw):
    return _gdn_inputs(b, s, channel=kind in ("kimi_delta_rule", "gla_scan"), **kw)


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("with_state", [False, True], ids=["zero-state", "initial-state"])
@pytest.mark.parametrize("s", [1, 5, 64, 65, 130], ids=lambda s: f"S{s}")
def test_scan_op_matches_reference_loop(s, with_state, kind):
    q, k, v, g, beta, h0 = _inputs(kind, 2, s)
    init = h0 if with_state else None
    inputs = [q, k, v, g, beta] + ([h0] if with_state else [])
    out, final = getattr(torch.ops.treecompile, kind)(q, k, v, g, beta, init)
    ref_out, ref_final = KINDS[kind](q, k, v, g, beta, init)
    _close([out, final], [ref_out, ref_final], "forward")
    _close(_grads([out, final], inputs), _grads([ref_out, ref_final], inputs), "grad")


@pytest.mark.parametrize("kind", list(KINDS))
def test_scan_ops_pass_opcheck(kind):
    q, k, v, g, beta, h0 = _inputs(kind, 1, 4)
    op = getattr(torch.ops.treecompile, kind)
    torch.library.opcheck(op, (q, k, v, g, beta, h0))
    torch.library.opcheck(op, (q, k, v, g, beta, None))
    batch, _ = _pack(TREES["short-nodes"])
    q, k, v, g, beta, h0 = _inputs(kind, 1, batch.num_tokens)
    tree_op = getattr(torch.ops.treecompile, f"tree_{kind}")
    torch.library.opcheck(tree_op, (q, k, v, g, beta, h0, _node_table(batch)))
    torch.library.opcheck(tree_op, (q, k, v, g, beta, None, _node_table(batch)))
    torch.library.opcheck(tree_op, (q, k, v, g, beta, h0, _node_table(batch), "torch"))


def test_hf_adapter_matches_hf_chunked_kernel():
    """Our drop-in and HF's chunked fallback agree (HF computes in float32: its rounding)."""
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    q, k, v, g, beta, _ = _gdn_inputs(1, 70, h=2, dk=8, dv=8)
    ours, _ = drop_ins.hf_chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
    # (behind transformers' hub-kernel decorator since 5.15)
    kernel = getattr(hf.torch_chunk_gated_delta_rule, "__wrapped__", hf.torch_chunk_gated_delta_rule)
    theirs, _ = kernel(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_hf_kda_adapter_matches_hf_chunked_kernel():
    """Our Kimi Delta Attention drop-in and HF's chunked fallback agree (HF computes in float32)."""
    hf = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")
    q, k, v, g, beta, h0 = _gdn_inputs(1, 70, h=2, dk=8, dv=8, channel=True)
    ours = drop_ins.hf_chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                              use_qk_l2norm_in_kernel=True)
    kernel = getattr(hf.chunk_kimi_delta_attention, "__wrapped__", hf.chunk_kimi_delta_attention)
    theirs = kernel(q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    for o, t in zip(ours, theirs):
        torch.testing.assert_close(o, t.to(o.dtype), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("with_state", [False, True], ids=["zero-state", "initial-state"])
def test_hf_mamba2_adapter_matches_hf_chunked_kernel(with_state):
    """Our drop-in and HF's Mamba2 chunk scan agree, in float64 (HF computes in float32: its rounding)."""
    from transformers.models.bamba import modeling_bamba as hf

    _skip_before_scan_functions("bamba")
    g = torch.Generator().manual_seed(0)
    b, s, h, p, groups, n = 2, 37, 4, 3, 2, 5
    x = torch.randn(b, s, h, p, generator=g, dtype=F64)
    dt = torch.randn(b, s, h, generator=g, dtype=F64)
    a = -torch.rand(h, generator=g, dtype=F64)
    bb, cc = (torch.randn(b, s, groups, n, generator=g, dtype=F64) for _ in range(2))
    d, dt_bias = torch.randn(h, generator=g, dtype=F64), torch.randn(h, generator=g, dtype=F64)
    init = torch.randn(b, h, p, n, generator=g, dtype=F64) if with_state else None
    kwargs = dict(D=d, dt_bias=dt_bias, dt_softplus=True, dt_limit=(0.0, 5.0), initial_states=init,
                  return_final_states=True)
    ours = drop_ins.hf_mamba2_chunk_scan(x, dt, a, bb, cc, 16, **kwargs)
    theirs = hf.mamba2_chunk_scan.__wrapped__(x, dt, a, bb, cc, 16, **kwargs)
    for o, t in zip(ours, theirs):
        torch.testing.assert_close(o, t.to(F64), rtol=1e-5, atol=1e-5)
    assert drop_ins.hf_mamba2_split_conv1d_scan_combined(x, dt) is None


def _node_table(batch: tc.TreeBatch) -> torch.Tensor:
    return torch.stack([batch.node_start, batch.node_end, batch.node_parent], 1)


def _tree_reference(reference, q, k, v, g, beta, init, batch):
    """The tree recurrence composed from the reference loop, node by node (autograd sums siblings)."""
    finals, outs = [], []
    for start, end, parent in zip(batch.node_start.tolist(), batch.node_end.tolist(), batch.node_parent.tolist()):
        state = init if parent < 0 else finals[parent]
        o, f = reference(*(x[:, start:end] for x in (q, k, v, g, beta)), state)
        finals.append(f)
        outs.append(o)
    return torch.cat(outs, dim=1)


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("name", list(TREES))
def test_tree_scan_follows_each_path(name, kind):
    batch, _ = _pack(TREES[name])
    s = batch.num_tokens
    q, k, v, g, beta, h0 = _inputs(kind, 1, s)
    out = getattr(torch.ops.treecompile, f"tree_{kind}")(q, k, v, g, beta, h0, _node_table(batch))
    # Forward: each path's rows equal the reference loop run on that path alone.
    for p in range(batch.num_paths):
        rows = batch.path_rows(p)
        ref, _ = KINDS[kind](*(x[:, rows] for x in (q, k, v, g, beta)), h0)
        torch.testing.assert_close(out[:, rows], ref, rtol=PURE[0], atol=PURE[1])
    # Backward: against autograd through the node-by-node reference.
    ref = _tree_reference(KINDS[kind], q, k, v, g, beta, h0, batch)
    _close([out], [ref], "forward")
    inputs = [q, k, v, g, beta, h0]
    _close(_grads([out], inputs), _grads([ref], inputs), "grad")


@pytest.mark.parametrize("kind", list(KINDS))
def test_tree_state_routing_matters(kind):
    """Guards the test above: running the packed row linearly leaks siblings' state."""
    batch, _ = _pack(TREES["siblings"])
    q, k, v, g, beta, _ = _inputs(kind, 1, batch.num_tokens)
    tree = getattr(torch.ops.treecompile, f"tree_{kind}")(q, k, v, g, beta, None, _node_table(batch))
    linear, _ = getattr(torch.ops.treecompile, kind)(q, k, v, g, beta, None)
    assert (tree - linear).abs().max() > 1e-3


def test_uneven_level_pads_at_most_twice_its_rows(monkeypatch):
    """One 150-token node beside 30 one-token siblings: split into batches, not 31 x 150 rows."""
    paths = [[1, 2] + list(range(3, 153))] + [[1, 2, 200 + i] for i in range(30)]
    batch, _ = _pack(paths)
    shapes = []
    real = recurrence.chunked_recurrence

    def recording(*args, **kwargs):
        shapes.append(tuple(args[0].shape[:2]))
        return real(*args, **kwargs)

    monkeypatch.setattr(recurrence, "chunked_recurrence", recording)
    q, k, v, g, beta, h0 = _gdn_inputs(1, batch.num_tokens)
    out = torch.ops.treecompile.tree_gated_delta_rule(q, k, v, g, beta, h0, _node_table(batch))
    level_tokens = 150 + 30
    padded = sum(n * w for n, w in shapes[1:])  # after the root's batch
    assert len(shapes) >= 3 and padded <= 2 * level_tokens + 2 * recurrence.CHUNK, shapes
    _close([out], [_tree_reference(KINDS["gated_delta_rule"], q, k, v, g, beta, h0, batch)], "forward")


@pytest.mark.parametrize("name,steps", [("siblings", 2), ("deep-chain", 7), ("chunk-straddle", 3)])
def test_tree_scan_runs_one_batch_per_depth(monkeypatch, name, steps):
    """Nodes of one depth run together: as many sequential batches as the tree is deep."""
    batch, _ = _pack(TREES[name])
    calls = []
    real = recurrence.chunked_recurrence

    def counting(*args, **kwargs):
        calls.append(args[0].shape[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(recurrence, "chunked_recurrence", counting)
    q, k, v, g, beta, _ = _gdn_inputs(1, batch.num_tokens)
    torch.ops.treecompile.tree_gated_delta_rule(q, k, v, g, beta, None, _node_table(batch))
    assert len(calls) == steps and sum(calls) == batch.num_nodes


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

    if _old_transformers():
        pytest.skip(f"transformers {transformers.__version__} has no torch causal_conv1d_fn (it convolves with "
                    "nn.Conv1d, which the conv pass rewrites as it is)")
    x, w, b = _conv_inputs(7)
    ours = drop_ins.hf_causal_conv1d_fn(x, w, b, activation="silu")
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


# --------------------------------------------------------------------------- kernels: Mamba's selective scan


def _mamba_inputs(b: int, s: int, d: int = 5, n: int = 3, seed: int = 0):
    """``u, dt [B, S, D]``, ``A [D, N]`` (negative), ``B, C [B, S, N]``, ``h0 [B, D, N]``, float64."""
    g = torch.Generator().manual_seed(seed)
    u = torch.randn(b, s, d, generator=g, dtype=F64)
    dt = torch.rand(b, s, d, generator=g, dtype=F64)
    a = -2 * torch.rand(d, n, generator=g, dtype=F64)
    bb, cc = (torch.randn(b, s, n, generator=g, dtype=F64) for _ in range(2))
    h0 = torch.randn(b, d, n, generator=g, dtype=F64)
    return [x.requires_grad_() for x in (u, dt, a, bb, cc, h0)]


@pytest.mark.parametrize("chunk", [None, 1, 7], ids=["op", "chunk-1", "chunk-7"])
@pytest.mark.parametrize("with_state", [False, True], ids=["zero-state", "initial-state"])
@pytest.mark.parametrize("s", [1, 5, 64, 65, 130], ids=lambda s: f"S{s}")
def test_selective_scan_matches_reference_loop(s, with_state, chunk):
    """The chunked scan (every chunk from zero at once, then the chunks' start states) is the
    token loop, forward and backward, whatever the chunk size; the op (``sqrt(S)`` rows per
    chunk) too."""
    u, dt, a, bb, cc, h0 = _mamba_inputs(2, s)
    init = h0 if with_state else None
    inputs = [u, dt, a, bb, cc] + ([h0] if with_state else [])
    ref = naive.selective_scan_reference(u, dt, a, bb, cc, init)
    got = selective_scan.chunked_selective_scan(u, dt, a, bb, cc, init, chunk=chunk)
    if chunk is None:
        got = torch.ops.treecompile.selective_scan(u, dt, a, bb, cc, init)
    _close(got, ref, "forward")
    _close(_grads(got, inputs), _grads(ref, inputs), "grad")


def test_selective_scan_ops_pass_opcheck():
    u, dt, a, bb, cc, h0 = _mamba_inputs(1, 4)
    torch.library.opcheck(torch.ops.treecompile.selective_scan, (u, dt, a, bb, cc, h0))
    torch.library.opcheck(torch.ops.treecompile.selective_scan, (u, dt, a, bb, cc, None))
    batch, _ = _pack(TREES["short-nodes"])
    u, dt, a, bb, cc, h0 = _mamba_inputs(1, batch.num_tokens)
    # Transposed views (Hugging Face hands the scan [B, D, S].transpose(1, 2)): the outputs'
    # strides must still be what the fake kernels say.
    ut = u.transpose(1, 2).contiguous().transpose(1, 2)
    for args in [(u, dt, a, bb, cc, h0, _node_table(batch)), (ut, dt, a, bb, cc, None, _node_table(batch), "torch")]:
        torch.library.opcheck(torch.ops.treecompile.tree_selective_scan, args)


def _tree_selective_reference(u, dt, a, bb, cc, init, batch):
    """The tree selective scan composed from the reference loop, node by node (autograd sums siblings)."""
    finals, outs = [], []
    for start, end, parent in zip(batch.node_start.tolist(), batch.node_end.tolist(), batch.node_parent.tolist()):
        state = init if parent < 0 else finals[parent]
        o, f = naive.selective_scan_reference(u[:, start:end], dt[:, start:end], a, bb[:, start:end],
                                              cc[:, start:end], state)
        finals.append(f)
        outs.append(o)
    return torch.cat(outs, dim=1)


@pytest.mark.parametrize("name", list(TREES))
def test_tree_selective_scan_follows_each_path(name):
    batch, _ = _pack(TREES[name])
    u, dt, a, bb, cc, h0 = _mamba_inputs(1, batch.num_tokens)
    out = torch.ops.treecompile.tree_selective_scan(u, dt, a, bb, cc, h0, _node_table(batch))
    # Forward: each path's rows equal the reference loop run on that path alone.
    for p in range(batch.num_paths):
        rows = batch.path_rows(p)
        ref, _ = naive.selective_scan_reference(u[:, rows], dt[:, rows], a, bb[:, rows], cc[:, rows], h0)
        torch.testing.assert_close(out[:, rows], ref, rtol=PURE[0], atol=PURE[1])
    # Backward (A is shared by every row): against autograd through the node-by-node reference.
    ref = _tree_selective_reference(u, dt, a, bb, cc, h0, batch)
    _close([out], [ref], "forward")
    inputs = [u, dt, a, bb, cc, h0]
    _close(_grads([out], inputs), _grads([ref], inputs), "grad")


def test_tree_selective_scan_routing_matters(monkeypatch):
    """Guards the test above: the packed row run linearly leaks siblings' state. And nodes of
    one depth run together: one batch per depth level."""
    batch, _ = _pack(TREES["siblings"])
    u, dt, a, bb, cc, _ = _mamba_inputs(1, batch.num_tokens)
    calls = []
    real = selective_scan.chunked_selective_scan

    def counting(*args, **kwargs):
        calls.append(args[0].shape[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(selective_scan, "chunked_selective_scan", counting)
    tree = torch.ops.treecompile.tree_selective_scan(u, dt, a, bb, cc, None, _node_table(batch))
    assert calls == [1, 10]  # the root, then its ten children
    linear, _ = real(u, dt, a, bb, cc)
    assert (tree - linear).abs().max() > 1e-3


def test_selective_scan_zero_rows_change_no_bit_of_the_state():
    """What the tree form's padding and the streamed parts' injected rows rely on: a row with
    ``dt = 0`` leaves the state as it is (``exp(0) = 1``), bit for bit, and writes ``u B^T``."""
    u, dt, a, bb, cc, h0 = (x.detach() for x in _mamba_inputs(1, 9))
    _, state = selective_scan.chunked_selective_scan(u, dt, a, bb, cc, h0)
    zero = torch.zeros(1, 4, 5, dtype=F64), torch.zeros(1, 4, 3, dtype=F64)
    _, same = selective_scan.chunked_selective_scan(zero[0], zero[0], a, zero[1], zero[1], state)
    assert torch.equal(same, state)


@pytest.mark.parametrize("name", ["auto", "torch", "fla", "triton"])
def test_selective_scan_kernels_by_name(name):
    """The torch scan is the selective scan's only kernel: ``"auto"`` and ``"torch"`` run it,
    ``"fla"`` (which has none for it) raises, as does an unknown name."""
    batch, _ = _pack(TREES["siblings"])
    u, dt, a, bb, cc, h0 = _mamba_inputs(1, batch.num_tokens)
    call = lambda: torch.ops.treecompile.tree_selective_scan(u, dt, a, bb, cc, h0, _node_table(batch), name)
    if name == "fla":
        with pytest.raises(RuntimeError, match="scan_kernel='fla' cannot be used: flash-linear-attention has no kernel "
                                               "for Mamba's selective scan"):
            call()
    elif name == "triton":
        with pytest.raises(ValueError, match="unknown scan kernel 'triton'; valid scan kernels: auto, torch, fla"):
            call()
    else:
        _close([call()], [_tree_selective_reference(u, dt, a, bb, cc, h0, batch)], "forward")


@pytest.mark.parametrize("family", ["mamba", "falcon_mamba", "jamba", "zamba"])
def test_hf_mamba_adapter_matches_hf_selective_scan(family, monkeypatch):
    """Our drop-in and HF's ``mamba_selective_scan`` (its token loop) agree to float64 rounding,
    forward and backward, with ``D``, the ``silu(z)`` gate, the ``dt`` bias, softplus and the
    final state; HF's ``.float()`` casts keep float64 here (in a float64 model they round its
    ``B`` and ``x`` to float32, which the model tests make float64 on both sides too)."""
    import importlib

    transformers = pytest.importorskip("transformers")
    if transformers_version() < SCAN_FUNCTIONS_SINCE:
        pytest.skip(f"transformers {transformers.__version__} has no mamba_selective_scan (its scan is in the mixer)")
    hf = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    monkeypatch.setattr(torch.Tensor, "float", float_keeping_float64)
    g = torch.Generator().manual_seed(0)
    b, d, s, n = 2, 6, 9, 4
    x, dt, z = (torch.randn(b, d, s, generator=g, dtype=F64) for _ in range(3))
    a = -2 * torch.rand(d, n, generator=g, dtype=F64)
    bb, cc = (torch.randn(b, n, s, generator=g, dtype=F64) for _ in range(2))
    skip, bias = torch.randn(d, generator=g, dtype=F64), torch.randn(d, generator=g, dtype=F64)
    inputs = [t.requires_grad_() for t in (x, dt, a, bb, cc, skip, z, bias)]
    kwargs = dict(delta_softplus=True, return_last_state=True)
    ours = drop_ins.hf_mamba_selective_scan(*inputs, **kwargs)
    theirs = hf.mamba_selective_scan.__wrapped__(*inputs, **kwargs)
    _close(ours, theirs, "forward")
    _close(_grads(ours, inputs), _grads(theirs, inputs), "grad")
    # Without the state, a plain tensor; without D, z and the bias, the scan alone.
    alone = drop_ins.hf_mamba_selective_scan(x, dt, a, bb, cc)
    _close([alone], [hf.mamba_selective_scan.__wrapped__(x, dt, a, bb, cc)], "forward, scan alone")
    assert drop_ins.hf_mamba_inner_fn(x, dt) is None


# --------------------------------------------------------------------------- models


transformers = pytest.importorskip("transformers")


def _qwen3_next():
    return transformers.Qwen3NextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"], num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=8, linear_conv_kernel_dim=4, num_experts=0,
    )


def _bamba():
    return transformers.BambaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8,
        mamba_n_groups=2, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=16,
    )


def _mamba2():
    return transformers.Mamba2Config(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_heads=4, head_dim=16, state_size=8, n_groups=2,
        conv_kernel=4, expand=2, chunk_size=16,
    )


def _falcon_h1():
    return transformers.FalconH1Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, mamba_n_heads=4, mamba_d_head=16, mamba_d_ssm=64, mamba_d_state=8,
        mamba_n_groups=2, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=16,
    )


def _nemotron_h():
    return transformers.NemotronHConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3, hybrid_override_pattern="M*-",
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, mamba_num_heads=4, mamba_head_dim=16,
        ssm_state_size=8, n_groups=2, conv_kernel=4, expand=2, chunk_size=16,
    )


def _gdn_layer(**overrides):
    """Qwen3-Next-style Gated DeltaNet sizes, shared by its descendants."""
    return dict(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
    ) | overrides


def _qwen3_5():
    return transformers.Qwen3_5TextConfig(**_gdn_layer(intermediate_size=64))


def _qwen3_5_moe():
    return transformers.Qwen3_5MoeTextConfig(**_gdn_layer(
        moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
    ))


def _olmo_hybrid():
    # Its delta rule may have negative eigenvalues (beta in [0, 2]).
    config = _gdn_layer(intermediate_size=64, pad_token_id=0, eos_token_id=1, linear_allow_neg_eigval=True)
    del config["head_dim"]  # hidden_size // num_attention_heads
    return transformers.OlmoHybridConfig(**config)


def _qwen4_exp():
    # Hyper-connection residual streams and MoE around two Gated DeltaNet layers.
    return transformers.Qwen4ExpTextConfig(**_gdn_layer(
        layer_types=["linear_attention", "linear_attention"], moe_intermediate_size=16,
        shared_expert_intermediate_size=16, num_experts=4, num_experts_per_tok=2, hc_count=2, hc_lowrank=8,
    ))


def _zamba2():
    # A Mamba2 layer, then a shared attention block before a second Mamba2 layer.
    return transformers.Zamba2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, layers_block_type=["mamba", "hybrid"],
        num_attention_heads=4, num_key_value_heads=4, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
        mamba_ngroups=2, n_mamba_heads=4, use_mamba_kernels=False, chunk_size=16, adapter_rank=8,
    )


def _granite_moe_hybrid():
    return transformers.GraniteMoeHybridConfig(
        vocab_size=64, hidden_size=32, intermediate_size=16, num_hidden_layers=2, layer_types=["mamba", "attention"],
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
        shared_intermediate_size=32, position_embedding_type="rope", mamba_n_heads=4, mamba_n_groups=2,
        mamba_d_state=8, mamba_d_head=16, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=16,
    )


def _lfm2():
    # Gated short conv (kernel 3) with no scan after it.
    return transformers.Lfm2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, layer_types=["conv", "full_attention"],
        num_attention_heads=4, num_key_value_heads=2, conv_L_cache=3, block_auto_adjust_ff_dim=False,
    )


def _lfm2_moe():
    return transformers.Lfm2MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=3,
        layer_types=["conv", "full_attention", "conv"], num_dense_layers=1, num_experts=4, num_experts_per_tok=2,
        num_attention_heads=4, num_key_value_heads=2,
    )


def _lfm3():
    # Short conv, full attention and sliding-window attention (window 4, shorter than the paths).
    return transformers.Lfm3Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        layer_types=["conv", "full_attention", "sliding_attention"], sliding_window=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, conv_L_cache=3, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )


def _mamba():
    # Two Mamba layers; the scan spelt as the loop over the tokens (on transformers before
    # 5.15 the loop itself is captured, and refused).
    return transformers.MambaConfig(
        vocab_size=64, hidden_size=32, state_size=8, num_hidden_layers=2, expand=2, conv_kernel=4,
        use_associative_scan=False,
    )


def _falcon_mamba():
    # Norms on B, C and dt; the scan spelt as an associative scan where one is available.
    return transformers.FalconMambaConfig(
        vocab_size=64, hidden_size=32, state_size=8, num_hidden_layers=1, expand=2, conv_kernel=4,
    )


def _jamba():
    # A Mamba layer (its kernels' fallbacks: use_mamba_kernels=False), then attention.
    return transformers.JambaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_experts=1, attn_layer_period=2, attn_layer_offset=1, use_mamba_kernels=False,
        mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
    )


def _zamba():
    # Two Mamba heads: one selective scan each.
    return transformers.ZambaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        layers_block_type=["mamba"], num_attention_heads=4, num_key_value_heads=4,
        n_mamba_heads=2, use_mamba_kernels=False, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
    )


def _kimi_linear():
    return transformers.KimiLinearConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        layer_types=["linear_attention"], mlp_layer_types=["dense"], num_attention_heads=4,
        num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, v_head_dim=8,
        qk_nope_head_dim=8, linear_head_dim=8, linear_num_heads=4, linear_conv_kernel_dim=4, pad_token_id=0,
        bos_token_id=1, eos_token_id=2,
    )


def _bailing_hybrid():
    return transformers.BailingHybridConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        layer_types=["linear_attention"], first_k_dense_replace=1, num_attention_heads=4,
        num_key_value_heads=4, kv_lora_rank=16, qk_rope_head_dim=8, v_head_dim=8, qk_nope_head_dim=8, head_dim=8,
        n_group=1, topk_group=1, short_conv_kernel_size=4, num_mtp_layers=0, pad_token_id=0, eos_token_id=1,
    )


#: name -> (config, the SSM state pass's counters, trees to train on).
MODELS = {
    "qwen3_next": (_qwen3_next, {"gated_delta_rule": 1}, ["branchy", "forest", *TREES]),
    "bamba": (_bamba, {"ssd_scan": 1}, ["branchy", "forest", *TREES]),
    "mamba2": (_mamba2, {"ssd_scan": 2}, ["branchy", "short-nodes"]),
    "falcon_h1": (_falcon_h1, {"ssd_scan": 2}, ["branchy", "deep-chain"]),
    "nemotron_h": (_nemotron_h, {"ssd_scan": 1}, ["branchy", "siblings"]),
    "qwen3_5": (_qwen3_5, {"gated_delta_rule": 1}, ["branchy", "chunk-straddle"]),
    "qwen3_5_moe": (_qwen3_5_moe, {"gated_delta_rule": 1}, ["branchy", "siblings"]),
    "olmo_hybrid": (_olmo_hybrid, {"gated_delta_rule": 1}, ["branchy", "short-nodes"]),
    "qwen4_exp": (_qwen4_exp, {"gated_delta_rule": 2}, ["branchy", "deep-chain"]),
    "zamba2": (_zamba2, {"ssd_scan": 2}, ["branchy", "short-nodes"]),
    "granitemoehybrid": (_granite_moe_hybrid, {"ssd_scan": 1}, ["branchy", "siblings"]),
    "lfm2": (_lfm2, {}, ["branchy", "short-nodes"]),
    "lfm2_moe": (_lfm2_moe, {}, ["branchy", "deep-chain"]),
    "lfm3": (_lfm3, {}, ["branchy", "forest"]),
    # Mamba's selective scan (Mamba-1): two trees of different lengths each.
    "mamba": (_mamba, {"selective_scan": 2}, ["branchy", "short-nodes"]),
    "falcon_mamba": (_falcon_mamba, {"selective_scan": 1}, ["branchy", "deep-chain"]),
    "jamba": (_jamba, {"selective_scan": 1}, ["branchy", "chunk-straddle"]),
    "zamba": (_zamba, {"selective_scan": 2}, ["branchy", "siblings"]),
    # Kimi Delta Attention (a decay per key channel): its chunked form pads the row to whole chunks,
    # its drop-in runs treecompile::kimi_delta_rule.
    "kimi_linear": (_kimi_linear, {"kimi_delta_rule": 1}, ["branchy", "chunk-straddle"]),
    "bailing_hybrid": (_bailing_hybrid, {"kimi_delta_rule": 1}, ["branchy", "deep-chain"]),
}

#: Causal convs where a model has more than one per recurrent layer, or convs without a scan.
CONV_LAYERS = {"lfm2": 1, "lfm2_moe": 2, "lfm3": 1, "zamba": 1}

#: The first transformers version with the family (exact or refused ones).
SINCE = {"qwen4_exp": (5, 16), "lfm3": (5, 23), "kimi_linear": (5, 17), "bailing_hybrid": (5, 20),
         "qwen4_exp_ngram": (5, 16)}

#: Before transformers 5.15 the Mamba2 families write their chunked scan inside the mixer's
#: forward (there is no ``mamba2_chunk_scan`` to swap for a tree scan): refused there, naming
#: the pad of the chunked scan. The other families run their causal convs as an
#: ``nn.Conv1d(padding=K - 1)`` sliced to the length (OLMo-hybrid: one each for q, k and v).
SCAN_FUNCTIONS_SINCE = (5, 15)
OLD_CONVS_PER_LAYER = {"olmo_hybrid": 3}
_TOKEN_LOOP = ("sequence length a constant", "takes one token of the row at a time")
#: So do the Mamba-1 families their selective scan (no ``mamba_selective_scan`` to swap):
#: refused there, naming the scan's line, an associative scan over the row or a loop over the
#: tokens, whichever the config picks.
OLD_SELECTIVE_SCAN_REFUSALS = {
    "mamba": (*_TOKEN_LOOP, "in slow_forward: ssm_state = discrete_A[:, :, i, :] * ssm_state + deltaB_u"),
    "falcon_mamba": ("changes the sequence length", "in slow_forward: _, all_h = associative_scan("),
    "jamba": (*_TOKEN_LOOP, "in slow_forward: ssm_state = discrete_A[:, :, i, :] * ssm_state + deltaB_u"),
    "zamba": (*_TOKEN_LOOP, "in slow_forward: ssm_state = discrete_A[:, :, :, i, :].transpose(0, 1) * ssm_state"),
}


def _old_transformers() -> bool:
    return transformers_version() < SCAN_FUNCTIONS_SINCE


def _skip_if_absent(name: str) -> None:
    if transformers_version() < SINCE.get(name, (0, 0)):
        pytest.skip(f"transformers {transformers.__version__} has no {name} (added in {SINCE[name]})")


def _scan_in_mixer(name: str) -> bool:
    """Whether the family is refused on this transformers: a Mamba2 or Mamba scan written inside the mixer."""
    return _old_transformers() and bool({"ssd_scan", "selective_scan"} & MODELS[name][1].keys())


def _skip_before_scan_functions(name: str) -> None:
    if _scan_in_mixer(name):
        pytest.skip(f"{name} is refused on transformers {transformers.__version__} (its scan is written "
                    "inside the mixer; test_hybrid_model_matches_per_path_training checks the refusal)")


def _model(name: str):
    """The family's tiny model in float64, every weight moved off its init (no unit norm, no
    zero bias). Eager experts: HF's grouped_mm has no float64 kernel on the CPU (per-path
    reference)."""
    torch.manual_seed(0)
    config = MODELS[name][0]()
    model = transformers.AutoModelForCausalLM.from_config(config, experts_implementation="eager").double().eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model


#: Families whose float32 casts are ``tensor.float()`` calls too (Mamba's ``A_log``, ``D`` and
#: ``dt`` bias, its torch scan's ``B`` and ``x``, Mamba's logits), which `testing.hf_float64_casts` makes
#: float64 as well (``methods=True``): loss and gradients then equal per-path training to
#: float64 rounding (COMPILE_TOL["pure"]).
FLOAT_METHOD_CASTS = ("mamba", "falcon_mamba", "jamba", "zamba")


_COMPILED: dict[str, tuple] = {}
XDIST_GROUP_BY = "name"  # tests sharing a compiled model run on one xdist worker (conftest)


#: Families whose equivalence runs through the default lowering (aot_eager on CPU).
_LOWERED = ("qwen3_next", "bamba")


def _compiled(name: str):
    if name not in _COMPILED:
        model = _model(name)
        # The rewrite is what differs between the families; the AOTAutograd lowering of the scan
        # and conv ops (their registered backward) is exercised on Qwen3-Next and Bamba, the other
        # families run the rewritten graph eagerly (a third of the compile time).
        _COMPILED[name] = (model, tree_compile(model, backend=None if name in _LOWERED else "eager"))
    return _COMPILED[name]


@pytest.mark.parametrize("name,tree", [(m, t) for m, (_, _, trees) in MODELS.items() for t in trees])
def test_hybrid_model_matches_per_path_training(name, tree):
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    _skip_if_absent(name)
    kernels = (hf.torch_chunk_gated_delta_rule, hf.causal_conv1d_fn)
    model, compiled = _compiled(name)
    batch, trees = make_batch(tree) if tree in ("branchy", "forest") else _pack(TREES[tree])
    if _scan_in_mixer(name):
        if tree != MODELS[name][2][0]:
            pytest.skip(f"{name} is refused on transformers {transformers.__version__}: checked on its first tree")
        with pytest.raises(UnsupportedModelError) as refusal:
            compiled(batch)
        message = str(refusal.value)
        if name in OLD_SELECTIVE_SCAN_REFUSALS:
            assert all(fragment in message for fragment in OLD_SELECTIVE_SCAN_REFUSALS[name]), message
        else:
            assert re.search(r"node '\w+' \(call_function pad\) at modeling_\w+\.py:\d+ changes the sequence length",
                             message), message
        return
    exact = name in FLOAT_METHOD_CASTS
    with hf_float64_casts(model, methods=exact):
        # Against the unmodified model per path, its float32 casts made float64 on both sides
        # (a few `.float()` calls remain outside FLOAT_METHOD_CASTS: absolute TOL["hf"]).
        tree_run = backward_grads(model, lambda: compiled(batch))
        if name == "qwen3_next":
            # HF's kernels are restored after each call, the capturing one (the first tree)
            # and every later one (here rather than in a test of its own: a later test would
            # recompile the shared graph, since Dynamo guards on the number of model classes
            # transformers has registered).
            assert (hf.torch_chunk_gated_delta_rule, hf.causal_conv1d_fn) == kernels
        compare_with_paths(model, compiled, batch, trees, tol="pure" if exact else "hf", tree_run=tree_run)
        # Against per-path training with the same linear-sequence kernels swapped in (checked
        # against the reference loop and HF's kernels above): every gradient, however small,
        # within the scaled ("float64", "hf") budget (("float64", "pure") where exact).
        tree_grads = tree_run[1]
        with _swapped(_sequence_kernels(model)):
            _, ref_grads = backward_grads(model, lambda: per_path_loss(model, trees))
    assert_grads_close(tree_grads, ref_grads, ("float64", "pure" if exact else "hf"))
    counters = compiled.counters
    layers = CONV_LAYERS.get(name, sum(MODELS[name][1].values()))
    if _old_transformers():
        convs = layers * OLD_CONVS_PER_LAYER.get(name, 1)
        assert counters["rewrite_conv_context_pass"] == {"causal_conv1d": convs, "depthwise_conv1d": convs}
    else:
        assert counters["rewrite_conv_context_pass"] == {"causal_conv1d": layers}
    assert counters.get("route_ssm_state_pass", {}) == MODELS[name][1]


@pytest.mark.parametrize("name", ["qwen3_next", "bamba"])
def test_hybrid_verify_passes(name):
    _skip_before_scan_functions(name)
    # The check compiles a float64 copy with the wrapper's options: the rewritten graph run
    # eagerly here (the lowering is exercised by the equivalence tests above).
    model, _ = _compiled(name)
    report = verify_tree_compile(tree_compile(model, backend="eager"), make_batch("branchy")[0])
    assert report.worst_grad_diff < report.tolerance


def test_mamba_in_training_mode_verifies():
    """A Mamba model in training mode, where its mixer first tries HF's fused ``mamba_inner_fn``
    (swapped for None: the unfused conv and scan, each rewritten), with ``verify=True``: the
    wrapper's own check against per-path training passes on the first call."""
    _skip_before_scan_functions("mamba")
    model, _ = _compiled("mamba")
    model.train()
    try:
        compiled = tree_compile(model, backend="eager", verify=True)
        compiled(make_batch("branchy")[0]).loss.backward()
    finally:
        model.eval()
        model.zero_grad(set_to_none=True)
    assert compiled.verified.worst_grad_diff < compiled.verified.tolerance
    assert compiled.counters["route_ssm_state_pass"] == {"selective_scan": 2}
    assert compiled.counters["rewrite_conv_context_pass"] == {"causal_conv1d": 2}


def _qwen3_next_one_layer():
    return transformers.Qwen3NextConfig(**(_qwen3_next().to_dict() | dict(
        num_hidden_layers=1, layer_types=["linear_attention"])))


def _bamba_one_layer():
    return transformers.BambaConfig(**(_bamba().to_dict() | dict(num_hidden_layers=1, attn_layer_indices=[])))


def _mamba_one_layer():
    return transformers.MambaConfig(**(_mamba().to_dict() | dict(num_hidden_layers=1)))


#: One recurrent layer each: enough for a refusal that needs the capture to reach the scan and its conv.
_ONE_LAYER = {"qwen3_next": _qwen3_next_one_layer, "bamba": _bamba_one_layer, "mamba": _mamba_one_layer}


@pytest.mark.parametrize("name", list(_ONE_LAYER))
@pytest.mark.parametrize("missing", [rewrite_conv_context_pass.__name__, route_ssm_state_pass.__name__])
def test_hybrid_without_its_pass_is_refused(missing, name):
    """The verify pass names a sequence kernel left linear, never trains it wrong."""
    _skip_before_scan_functions(name)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_ONE_LAYER[name]()).double().eval()
    compiled = tree_compile(model, backend="eager", disable_passes=(missing,))
    # (Before transformers 5.15 Qwen3-Next's conv is an nn.Conv1d, not a sequence kernel.)
    refusal = "sequence kernel|is a convolution over the sequence" if _old_transformers() else "sequence kernel"
    if name == "mamba" and missing == route_ssm_state_pass.__name__:
        # (Refused as an op the row rules do not know until they name it a sequence kernel.)
        refusal = (r"node 'selective_scan' \(call_function selective_scan\) at modeling_mamba\.py:\d+ is a "
                   r"(sequence kernel|custom op treecompile does not know)")
    with pytest.raises(UnsupportedModelError, match=refusal):
        compiled(make_batch("branchy")[0])


def _qwen4_exp_ngram():
    # Per-layer embeddings of hashed n-grams of the previous tokens (PLE) on its one layer.
    return transformers.Qwen4ExpTextConfig(**_gdn_layer(
        num_hidden_layers=1, layer_types=["linear_attention"], moe_intermediate_size=16,
        shared_expert_intermediate_size=16, num_experts=4, num_experts_per_tok=2, hc_count=2, hc_lowrank=8,
        ple_layer_ids=[1], ple_embed_dim=32, ngram_size=3, heads_per_ngram=2, ngram_vocab_size_base=97,
        make_ngram_vocab_size_divisible_by=8, eos_token_id=2,
    ))


def _recurrent_gemma():
    return transformers.RecurrentGemmaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, lru_width=32, attention_window_size=8, conv1d_width=4,
    )


def _xlstm():
    return transformers.xLSTMConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=1, num_heads=2, mode="train", chunk_size=1,
        autocast_kernel_dtype="float32", inference_state_dtype="float32", ffn_round_up_to_multiple_of=8,
    )


#: name -> (config, fragments of the refusal that name the op).
REFUSED = {
    # The n-gram embedding reads the previous tokens of the packed row.
    "qwen4_exp_ngram": (_qwen4_exp_ngram, ("changes the sequence length", "token_history = torch.cat(")),
    # Recurrences written as Python loops over the tokens: Dynamo makes the length a constant.
    "recurrent_gemma": (_recurrent_gemma, _TOKEN_LOOP),
    "xlstm": (_xlstm, _TOKEN_LOOP),
}


@pytest.mark.full
@pytest.mark.parametrize("name", list(REFUSED))
def test_unsupported_hybrid_is_refused(name):
    """Sequence mixing without a tree form is refused, naming the op, never trained wrong."""
    _skip_if_absent(name)
    config, fragments = REFUSED[name]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config(), experts_implementation="eager").double().eval()
    with pytest.raises(UnsupportedModelError) as refusal:
        tree_compile(model, backend="eager")(make_batch("branchy")[0])
    message = str(refusal.value)
    for fragment in fragments:
        assert fragment in message, message


# --------------------------------------------------------------------------- a custom fla-style model


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=False, cu_seqlens=None):
    """flash-linear-attention's ``chunk_gated_delta_rule`` signature and semantics, as plain torch
    (``q, k`` ``[B, T, H, K]``, ``v`` ``[B, T, HV, V]``, log decay ``g``): a user's model calls
    it by this name, as it would call fla's Triton kernel on a GPU."""
    if use_qk_l2norm_in_kernel:  # fla's l2norm: x / sqrt(sum(x^2) + eps)
        q, k = (x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6) for x in (q, k))
    rep = v.shape[2] // k.shape[2]
    q, k = q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)
    q = q * (q.shape[-1] ** -0.5 if scale is None else scale)
    out, final = naive.gated_delta_rule_reference(q, k, v, g, beta, initial_state)
    return out, (final if output_final_state else None)


class ShortConv(nn.Conv1d):
    """A depthwise causal conv written as fla's ShortConvolution is: ``padding=K - 1``, keep the first T."""

    def __init__(self, channels: int, kernel: int) -> None:
        super().__init__(channels, channels, kernel, groups=channels, padding=kernel - 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, C]
        t = x.shape[1]
        return F.silu(super().forward(x.transpose(1, 2))[..., :t].transpose(1, 2))


class LeftPadConv(nn.Module):
    """The other spelling: zero left padding, then a depthwise conv without padding."""

    def __init__(self, channels: int, kernel: int) -> None:
        super().__init__()
        self.kernel = kernel
        self.weight = nn.Parameter(torch.randn(channels, 1, kernel) / kernel)
        self.bias = nn.Parameter(torch.zeros(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.conv1d(F.pad(x.transpose(1, 2), (self.kernel - 1, 0)), self.weight, self.bias, groups=x.shape[-1])
        return F.silu(y.transpose(1, 2))


class GatedDeltaNetLayer(nn.Module):
    """A Gated DeltaNet layer as flash-linear-attention writes it (GVA, short convs, gated output norm)."""

    def __init__(self, dim: int = 32, heads: int = 2, v_heads: int = 4, head_dim: int = 8, conv: int = 4,
                 left_pad: bool = False, kernel_attribute: bool = False, initial_state: bool = False) -> None:
        super().__init__()
        # The kernel kept as the layer's attribute, as transformers before 5.15 keeps it
        # (``self.chunk_gated_delta_rule = chunk_gated_delta_rule or torch_chunk_gated_delta_rule``).
        self.scan = chunk_gated_delta_rule if kernel_attribute else None
        # A learned state every sequence's scan starts from (the whole tree trains it exactly).
        self.h0 = nn.Parameter(torch.randn(v_heads, head_dim, head_dim) * 0.1) if initial_state else None
        self.heads, self.v_heads, self.head_dim = heads, v_heads, head_dim
        self.q_proj = nn.Linear(dim, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(dim, heads * head_dim, bias=False)
        self.v_proj = nn.Linear(dim, v_heads * head_dim, bias=False)
        self.a_proj = nn.Linear(dim, v_heads, bias=False)
        self.b_proj = nn.Linear(dim, v_heads, bias=False)
        self.g_proj = nn.Linear(dim, v_heads * head_dim, bias=False)
        self.A_log = nn.Parameter(torch.log(torch.linspace(1, 4, v_heads)))
        self.dt_bias = nn.Parameter(torch.randn(v_heads) * 0.1)
        make = LeftPadConv if left_pad else ShortConv
        self.q_conv, self.k_conv = make(heads * head_dim, conv), make(heads * head_dim, conv)
        self.v_conv = make(v_heads * head_dim, conv)
        self.o_norm = nn.RMSNorm(head_dim, eps=1e-6)
        self.o_proj = nn.Linear(v_heads * head_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_conv(self.q_proj(x)).view(b, t, self.heads, self.head_dim)
        k = self.k_conv(self.k_proj(x)).view(b, t, self.heads, self.head_dim)
        v = self.v_conv(self.v_proj(x)).view(b, t, self.v_heads, self.head_dim)
        g = -self.A_log.exp() * F.softplus(self.a_proj(x) + self.dt_bias)
        beta = self.b_proj(x).sigmoid()
        h0 = None if self.h0 is None else self.h0.expand(b, -1, -1, -1)
        o, _ = (self.scan or chunk_gated_delta_rule)(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, initial_state=h0)
        gate = self.g_proj(x).view(b, t, self.v_heads, self.head_dim)
        o = self.o_norm(o) * F.silu(gate)
        return self.o_proj(o.reshape(b, t, -1))


class FlaStyleHybridLM(nn.Module):
    """GDN (nn.Conv1d short convs), SDPA attention, GDN (left-padded functional convs)."""

    def __init__(self, vocab: int = 64, dim: int = 32) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.gdn1, self.gdn2 = GatedDeltaNetLayer(dim), GatedDeltaNetLayer(dim, left_pad=True)
        self.norms = nn.ModuleList(nn.RMSNorm(dim) for _ in range(2))
        self.attn = SdpaBlock(dim, 4, 2)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.emb(idx)
        x = x + self.gdn1(self.norms[0](x))
        x = self.attn(x, pos)
        x = x + self.gdn2(self.norms[1](x))
        return self.head(x)


@pytest.fixture(scope="module")
def fla_style():
    model = tiny(FlaStyleHybridLM)
    return model, tree_compile(model, backend="eager")


@pytest.mark.parametrize("name", ["branchy", "forest", *TREES])
def test_fla_style_model_matches_per_path_training(fla_style, name):
    """A custom model calling fla's kernel by name and plain depthwise convs: float64, rounding only."""
    model, compiled = fla_style
    batch, trees = make_batch(name) if name in ("branchy", "forest") else _pack(TREES[name])
    compare_with_paths(model, compiled, batch, trees, tol="pure")
    counters = compiled.counters
    assert counters["route_ssm_state_pass"] == {"gated_delta_rule": 2}
    assert counters["rewrite_conv_context_pass"] == {"depthwise_conv1d": 6, "causal_conv1d": 6}
    assert counters["rewrite_attention_pass"] == {"sdpa": 1}


class GdnLM(nn.Module):
    """Embedding, residual Gated DeltaNet layers (flash-linear-attention's spelling), head."""

    def __init__(self, layers) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        self.layers = nn.ModuleList(layers)
        self.head = nn.Linear(32, 64, bias=False)

    def forward(self, idx):
        x = self.emb(idx)
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x)


def test_a_kernel_kept_as_a_layer_attribute_is_swapped_and_exact():
    """A layer that picked its kernel at construction holds it in an attribute: swapped there
    too (else its reference loop is captured and refused), and in the copy verify checks."""
    model = tiny(lambda: GdnLM([GatedDeltaNetLayer(32, kernel_attribute=True)]))
    batch, trees = make_batch("branchy")
    compiled = tree_compile(model, backend="eager", verify=True)
    compare_with_paths(model, compiled, batch, trees, tol="pure")
    assert compiled.counters["route_ssm_state_pass"] == {"gated_delta_rule": 1}
    assert compiled.verified.worst_grad_diff < compiled.verified.tolerance
    assert model.layers[0].scan is chunk_gated_delta_rule  # restored after the call


def test_a_learned_initial_state_trains_exactly_on_the_whole_tree():
    """Every root's scan starts from the model's own initial state, as each path's does."""
    model = tiny(lambda: GdnLM([GatedDeltaNetLayer(32, initial_state=True)]))
    batch, trees = make_batch("branchy")
    compiled = tree_compile(model, backend="eager")
    compare_with_paths(model, compiled, batch, trees, tol="pure")
    assert compiled.counters["route_ssm_state_pass"] == {"gated_delta_rule": 1}
    model.zero_grad(set_to_none=True)
    compiled(batch).loss.backward()
    assert model.layers[0].h0.grad.abs().sum() > 0  # the state is trained, not a constant


@pytest.mark.parametrize("padding", [2, 3], ids=["padding-short", "padding-K-1"])
def test_non_causal_conv_is_refused(padding):
    """A conv that is not causal (or keeps the wrong rows) stays a conv, and the verify pass refuses it."""

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(64, 8)
            self.conv = nn.Conv1d(8, 8, 4, groups=8, padding=padding)
            self.head = nn.Linear(8, 64)

        def forward(self, idx):
            x = self.emb(idx).transpose(1, 2)
            t = idx.shape[1]
            y = self.conv(x)[..., 1 : t + 1] if padding == 3 else self.conv(x)[..., :t]
            return self.head(y.transpose(1, 2))

    with pytest.raises(UnsupportedModelError, match="convolution over the sequence"):
        tree_compile(tiny(Model), backend="eager")(make_batch("branchy")[0])


# --------------------------------------------------------------------------- variable-length kernels


def _varlen_stand_in(delta: bool, calls: list, broken: bool = False):
    """A variable-length kernel with fla's calling convention, from the token loop: one
    sequence per ``cu_seqlens`` span, each from its own initial state (``broken``: from zero)."""

    def run(q, k, v, g, beta, initial_state, cu_seqlens):
        calls.append(len(cu_seqlens) - 1)
        outs, finals = [], []
        bounds = cu_seqlens.tolist()
        for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
            init = None if broken else initial_state[i:i + 1]
            o, f = naive.recurrence_reference(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b], init,
                                              delta=delta)
            outs.append(o)
            finals.append(f)
        return torch.cat(outs, 1), torch.cat(finals)

    return run


@pytest.mark.parametrize("kind,delta", [("gated_delta_rule", True), ("ssd_scan", False)])
def test_tree_scan_runs_levels_through_a_varlen_kernel(kind, delta):
    calls: list[int] = []
    batch, _ = _pack(TREES["deep-chain"])
    q, k, v, g, beta, h0 = _gdn_inputs(1, batch.num_tokens)
    table = _node_table(batch)
    out = recurrence.tree_recurrence(q, k, v, g, beta, h0, table, delta=delta, varlen=_varlen_stand_in(delta, calls))
    # One call per depth level, one sequence per node.
    assert calls == [len(lv) for lv in recurrence.node_levels(table)]
    ref = _tree_reference(KINDS[kind], q, k, v, g, beta, h0, batch)
    _close([out], [ref], "forward")
    inputs = [q, k, v, g, beta, h0]
    _close(_grads([out], inputs), _grads([ref], inputs), "grad")


def test_a_varlen_kernel_is_checked_against_the_torch_scan():
    cpu = torch.device("cpu")
    assert recurrence.varlen_disagreement(_varlen_stand_in(True, []), cpu, True, F64) is None
    why = recurrence.varlen_disagreement(_varlen_stand_in(True, [], broken=True), cpu, True, F64)
    assert why is not None and why.startswith("differs from the torch scan in out")


@pytest.mark.parametrize("name", ["auto", "torch"])
def test_default_and_torch_scan_kernels_run_the_torch_scan_on_cpu(name):
    assert recurrence.varlen_kernel(name, torch.device("cpu"), True, F64) is None
    batch, _ = _pack(TREES["siblings"])
    q, k, v, g, beta, h0 = _gdn_inputs(1, batch.num_tokens)
    out = torch.ops.treecompile.tree_gated_delta_rule(q, k, v, g, beta, h0, _node_table(batch), name)
    _close([out], [_tree_reference(KINDS["gated_delta_rule"], q, k, v, g, beta, h0, batch)], "forward")


def test_a_scan_kernel_asked_for_by_name_that_cannot_be_used_raises():
    batch, trees = _pack(TREES["siblings"])
    q, k, v, g, beta, h0 = _gdn_inputs(1, batch.num_tokens)
    # On this CPU-only run fla is either not installed or not on CUDA: either way, not usable.
    with pytest.raises(RuntimeError, match="scan_kernel='fla' (asks for flash-linear-attention|runs on CUDA only)"):
        torch.ops.treecompile.tree_gated_delta_rule(q, k, v, g, beta, h0, _node_table(batch), "fla")
    with pytest.raises(ValueError, match="unknown scan kernel 'triton'; valid scan kernels: auto, torch, fla"):
        recurrence.varlen_kernel("triton", torch.device("cpu"), True, F64)
    model = tiny(FlaStyleHybridLM)
    with pytest.raises(ValueError, match="unknown scan_kernel 'triton'; valid scan kernels: auto, torch, fla"):
        tree_compile(model, scan_kernel="triton")
    compiled = tree_compile(model, backend="eager", scan_kernel="fla")
    with pytest.raises(RuntimeError, match="scan_kernel='fla' (asks for flash-linear-attention|runs on CUDA only)"):
        compiled(batch)
    graph = compiled.compile_records[-1].graph_module.graph
    scans = [n for n in graph.nodes if n.target is torch.ops.treecompile.tree_gated_delta_rule.default]
    assert len(scans) == 2 and all(n.args[-1] == "fla" for n in scans)


def test_ops_on_transposed_inputs_return_what_their_fakes_say():
    """Hugging Face passes the conv ``x`` as ``[B, S, C].transpose(1, 2)`` and the scans views:
    the real ops' output strides must match their fake kernels' (Inductor asserts them on
    CUDA; a mismatch failed every Mamba2 hybrid there)."""
    batch, _ = _pack(TREES["short-nodes"])
    x, w, b = _conv_inputs(batch.num_tokens)
    xt = x.transpose(1, 2).contiguous().transpose(1, 2)  # same values, strides of HF's view
    assert not xt.is_contiguous()
    anc = _path_ancestors(batch, w.shape[1])
    torch.library.opcheck(torch.ops.treecompile.tree_causal_conv1d, (xt, w, b, anc))
    torch.library.opcheck(torch.ops.treecompile.causal_conv1d, (xt, w, b))
    for kind in KINDS:
        q, k, v, g, beta, h0 = (t.transpose(-1, -2).contiguous().transpose(-1, -2) if t.dim() > 2 else t
                                for t in _gdn_inputs(1, batch.num_tokens))
        torch.library.opcheck(getattr(torch.ops.treecompile, f"tree_{kind}"),
                              (q, k, v, g, beta, h0, _node_table(batch), "torch"))


def test_fla_on_hopper_with_a_triton_that_miscompiles_its_backward_is_refused(monkeypatch):
    """fla's gated backward is wrong on Hopper with Triton >= 3.4.0, < 3.7.1 (fla #640); fla
    0.6 raises there, older fla returns wrong gradients. treecompile refuses the combination
    without relying on its small check problem."""
    import sys
    import types

    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    capability = [(9, 0)]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability[0])
    monkeypatch.setitem(sys.modules, "triton", types.SimpleNamespace(__version__="3.6.0"))
    monkeypatch.setattr(recurrence, "_fla_dispatches_to_tilelang", lambda: False)
    assert "fla issue #640" in recurrence.known_bad_fla(cuda)
    assert recurrence.known_bad_fla(torch.device("cpu")) is None
    monkeypatch.setitem(sys.modules, "triton", types.SimpleNamespace(__version__="3.7.1"))
    assert recurrence.known_bad_fla(cuda) is None
    monkeypatch.setitem(sys.modules, "triton", types.SimpleNamespace(__version__="3.4.0"))
    capability[0] = (8, 0)
    assert recurrence.known_bad_fla(cuda) is None
    capability[0] = (9, 0)

    monkeypatch.setattr(recurrence, "_fla_kernel", lambda delta: _varlen_stand_in(delta, []))
    monkeypatch.setattr(recurrence, "varlen_disagreement", lambda *a: pytest.fail("the check problem ran"))
    recurrence.varlen_kernel.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="fla issue #640.*using the torch scan instead"):
            assert recurrence.varlen_kernel("auto", cuda, True, torch.float32) is None
        with pytest.raises(RuntimeError, match="scan_kernel='fla' cannot be used: .*fla issue #640"):
            recurrence.varlen_kernel("fla", cuda, False, torch.float32)
    finally:
        recurrence.varlen_kernel.cache_clear()
