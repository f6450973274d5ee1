"""Attention without a softmax on the tree (`treecompile.kernels.attention.pair_sum`): the kernel
against its dense reference, forward and backward, and the pass's refusals."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
import zoo
import zoo_custom as zc

import treecompile as tc
import treecompile.kernels.attention.pair_sum as ps
from treecompile.core.errors import UnsupportedModelError
from treecompile.kernels.attention.naive import tree_pair_sum_reference
from treecompile.stream.options import StreamOptions

FORESTS = {
    # A shared prefix, a path ending inside another, a duplicate, a second tree.
    "branchy": [[[1, 2, 3, 4, 5, 6], [1, 2, 3, 7, 8], [1, 2, 3, 7, 9, 10, 11], [1, 2, 3, 4, 5, 6]], [[12, 13]]],
    # A chain deeper than a block, with a branch at the end.
    "deep": [[list(range(1, 20)) + [20], list(range(1, 20)) + [21, 22]]],
}


def _batch(name):
    return tc.pack([tc.TrajectoryTree.from_sequences(p) for p in FORESTS[name]], warn_por=False)


@pytest.mark.parametrize("forest", list(FORESTS))
@pytest.mark.parametrize("lead,heads,kv_heads,table_len",
                         [(1, 4, 2, None), (4, 4, 4, None), (4, 4, 1, 3), (1, 2, 2, 1)])
@pytest.mark.parametrize("normalize,eps,high,per_query", [(0, 0.0, 0.0, False), (1, 0.5, 0.0, False),
                                                          (2, 2.0, 0.0, True), (3, 1.0, 3.0, True)])
def test_kernel_matches_the_dense_reference_forward_and_backward(monkeypatch, forest, lead, heads, kv_heads,
                                                                  table_len, normalize, eps, high, per_query):
    monkeypatch.setattr(ps, "BLOCK", 4)  # several blocks, and blocks that cut nodes
    batch = _batch(forest)
    s = batch.num_tokens
    g = torch.Generator().manual_seed(0)

    def rand(*shape, positive=False):
        x = torch.randn(*shape, generator=g, dtype=torch.float64)
        return (x.abs() if positive else x).requires_grad_(True)

    # Normalised: positive weights (linear attention's features), some row sums under eps (clamped).
    q, k = rand(1, heads, s, 5, positive=normalize > 0), rand(1, kv_heads, s, 5, positive=normalize > 0)
    v = rand(1, kv_heads, s, 3)
    table = torch.rand(lead, table_len or s, generator=g, dtype=torch.float64).requires_grad_(True)
    # A factor of the query's position too (RetNet's rows scaled), on the other heads' count.
    qtable = (torch.rand(heads // lead if lead == heads else heads, s, generator=g, dtype=torch.float64) + 0.5
              ).requires_grad_(True) if per_query else None
    args = (batch.position_ids, batch.subtree_end, 0.7, normalize, eps, high)
    out = ps.tree_pair_sum(q, k, v, table, *args, qtable)
    ref = tree_pair_sum_reference(q, k, v, table, *args, qtable)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    grad = torch.randn(out.shape, generator=g, dtype=torch.float64)
    inputs = (q, k, v, table) + ((qtable,) if per_query else ())
    got = torch.autograd.grad(out, inputs, grad)
    want = torch.autograd.grad(ref, inputs, grad)
    for name, a, b in zip(("q", "k", "v", "table", "qtable"), got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=lambda m, name=name: f"d{name}: {m}")


def test_kernel_passes_gradcheck(monkeypatch):
    monkeypatch.setattr(ps, "BLOCK", 3)
    batch = _batch("branchy")
    s = batch.num_tokens
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, s, 3, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    table = torch.rand(2, s, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda q, k, v, t: ps.tree_pair_sum(q, k, v, t, batch.position_ids, batch.subtree_end, 0.5), (q, k, v, table))


def test_the_path_alone_gives_each_row_what_the_tree_gives_it():
    """The definition, from the other side: every row of a path run alone (a chain) equals the
    same token's row in the tree."""
    batch = _batch("branchy")
    s = batch.num_tokens
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, s, 4, generator=g, dtype=torch.float64) for _ in range(3))
    table = torch.rand(1, s, generator=g, dtype=torch.float64)
    tree = ps.tree_pair_sum(q, k, v, table, batch.position_ids, batch.subtree_end, 1.0)
    for p in range(batch.num_paths):
        rows = batch.path_rows(p)
        n = len(rows)
        alone = ps.tree_pair_sum(q[:, :, rows], k[:, :, rows], v[:, :, rows], table, torch.arange(n),
                                 torch.full((n,), n), 1.0)
        torch.testing.assert_close(alone, tree[:, :, rows], rtol=1e-12, atol=1e-12)


@pytest.mark.full
def test_the_default_lowering_runs_the_kernel_and_its_backward():
    case = next(c for c in zoo.all_cases() if c.id == "retnet-learned-decay")
    model = case.build()
    compiled = tc.tree_compile(model)  # aot_eager on CPU: the fake kernels and the backward op traced
    name, batch, trees = zoo.batches()[0]
    result = zoo.compare(model, compiled, batch, trees)
    assert compiled.counters["rewrite_attention_pass"]["pair_sum"] == 2, result


@pytest.mark.full
def test_streaming_refuses_it_by_name_and_the_bitmask_rule_keeps_it_dense():
    model = zoo.perturb(zc.QuadraticLinearLM().double().eval())
    batch = zoo.batches()[1][1]
    streamed = tc.tree_compile(model, backend="eager", stream=StreamOptions(budget_rows=8))
    with pytest.raises(UnsupportedModelError, match=r"attention without a softmax at .* is not run over streamed"):
        streamed(batch)
    # The pair sum kernel runs on the interval rule; under the bitmask rule the model's own
    # [S, S] ops are kept dense (`dense_pairs`), exact with the dense tree mask of either rule.
    bitmask = tc.tree_compile(model, backend="eager", mask="bitmask")
    trees = [tc.TrajectoryTree.from_sequences(p) for p in FORESTS["branchy"]]
    zoo.compare(model, bitmask, tc.pack(trees, path_bits=True, warn_por=False), trees)
    assert dict(bitmask.counters["rewrite_attention_pass"]) == {"dense_pairs": 2}


class _SymmetricDecayAttn(zc._Attn):
    """A decay of |i - j|: every key, before and after the query, gets a nonzero factor."""

    def attend(self, q, k, v):
        i = torch.arange(q.shape[2], device=q.device, dtype=q.dtype)
        return (q @ k.transpose(-1, -2) * 0.9 ** (i[:, None] - i[None, :]).abs()) @ v


class _PositionDecayAttn(zc._Attn):
    """A factor of the query's index as well as the distance: ``(i + 1) ** -1 * 0.9 ** (i - j)``."""

    def attend(self, q, k, v):
        i = torch.arange(q.shape[2], device=q.device, dtype=q.dtype)
        d = i[:, None] - i[None, :]
        mask = torch.where(d >= 0, 0.9 ** d.clamp(min=0) / (i[:, None] + 1), torch.zeros_like(d))
        return (F.elu(q) @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) * mask) @ v


class _RowScaledOverLengthAttn(zc._Attn):
    """A decay mask divided by the length, then scaled per row by its row sum as RetNet does:
    ``x / sqrt(x.sum(-1))`` with ``x = 0.9 ** (i - j) / T``."""

    def attend(self, q, k, v):
        t = q.shape[2]
        i = torch.arange(t, device=q.device, dtype=q.dtype)
        d = i[:, None] - i[None, :]
        x = 0.9 ** d.clamp(min=0) * (d >= 0) / t
        return (q @ k.transpose(-1, -2) * (x / x.sum(-1, keepdim=True).sqrt())) @ v


@pytest.mark.parametrize("attn,why", [(_SymmetricDecayAttn, "not causal"),
                                      (_RowScaledOverLengthAttn, "one that changes with the sequence length")])
def test_a_factor_that_is_not_a_causal_function_of_the_distance_is_refused(attn, why):
    model = zoo.perturb(zc._spelling(attn)().double().eval())
    with pytest.raises(UnsupportedModelError, match=rf"attention without a softmax whose pair factor is {why}"):
        tc.tree_compile(model, backend="eager")(zoo.batches()[0][1])


def test_a_factor_of_the_query_position_is_kept_dense():
    """``(i + 1) ** -1 * 0.9 ** (i - j)`` is not a function of the distance (no pair sum table), but
    a function of the two path positions: the model's own [S, S] ops, kept dense, are exact."""
    model = zoo.perturb(zc._spelling(_PositionDecayAttn)().double().eval())
    compiled = tc.tree_compile(model, backend="eager")
    for _, batch, trees in zoo.batches():
        zoo.compare(model, compiled, batch, trees)
    assert dict(compiled.counters["rewrite_attention_pass"]) == {"dense_pairs": 2}


class _WideningDecayAttn(zc._Attn):
    """A decay of shape ``[H, 1, T, T]`` times scores ``[1, H, T, T]``: the product is ``[H, H, T, T]``
    (every head's scores under every head's decay), averaged back over the first dim."""

    def attend(self, q, k, v):
        t, h = q.shape[2], q.shape[1]
        i = torch.arange(t, device=q.device, dtype=q.dtype)
        d = i[:, None] - i[None, :]
        rate = torch.linspace(0.5, 0.9, h, dtype=q.dtype)[:, None, None, None]
        decay = rate ** d.clamp(min=0) * (d >= 0)
        return ((q @ k.transpose(-1, -2) * decay) @ v).mean(0, keepdim=True)


def test_a_factor_that_widens_the_scores_is_not_taken_for_a_pair_sum():
    """The kernel's result has the scores' heads; a factor that broadcasts the scores to more
    dims would be dropped with its extra dim: not a pair sum. The model's own [S, S] ops, kept
    dense (`dense_pairs`), compute it exactly."""
    model = zoo.perturb(zc._spelling(_WideningDecayAttn)().double().eval())
    compiled = tc.tree_compile(model, backend="eager")
    for _, batch, trees in zoo.batches():
        zoo.compare(model, compiled, batch, trees)
    assert dict(compiled.counters["rewrite_attention_pass"]) == {"dense_pairs": 2}


class _LearnedLeakAttn(zc._Attn):
    """Causal weights whose future is a learned value, zero at the start: ``where(tril, 1, leak)``
    times the scores. Per path the future keys count as soon as ``leak`` moves (and ``leak`` has
    a gradient from the start)."""

    def __init__(self):
        super().__init__()
        self.leak = torch.nn.Parameter(torch.zeros(()))

    def attend(self, q, k, v):
        t = q.shape[2]
        keep = torch.where(self.causal[:, :, :t, :t] == 1, torch.ones((), dtype=q.dtype), self.leak)
        return (q @ k.transpose(-2, -1) * keep) @ v


def test_a_factor_causal_only_for_the_present_parameters_is_refused():
    model = zoo.perturb(zc._spelling(_LearnedLeakAttn)().double().eval())
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, _LearnedLeakAttn):
                m.leak.zero_()
    with pytest.raises(UnsupportedModelError, match=r"not causal for other values of its parameters"):
        tc.tree_compile(model, backend="eager")(zoo.batches()[0][1])


class _LearnedScaleAttn(zc._Attn):
    """Linear attention with a learned factor per head (ones at the start): constant over the
    distances, but not a constant: it must keep its gradient and follow its steps."""

    def __init__(self):
        super().__init__()
        self.g = torch.nn.Parameter(torch.ones(zc.HEADS))

    def attend(self, q, k, v):
        t = q.shape[2]
        att = q @ k.transpose(-2, -1) * self.g.view(1, -1, 1, 1)
        return att.masked_fill(self.causal[:, :, :t, :t] == 0, 0.0) @ v


def test_a_learned_factor_constant_over_the_distances_is_not_baked():
    model = zoo.perturb(zc._spelling(_LearnedScaleAttn)().double().eval())
    compiled = tc.tree_compile(model, backend="eager")
    for _, batch, trees in zoo.batches():
        zoo.compare(model, compiled, batch, trees)
