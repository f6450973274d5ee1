"""Attention kept on dense ``[S, S]`` tensors (`treecompile.passes.attention.dense_pairs`).

The zoo (``cope``, ``fixed-pattern-mask``, ``absolute-pair-bias``, ``in-place-bias``, ...) checks
models the rule makes exact against per-path training; here the rule's refusals, one per way a
chain of ``[S, S]`` ops stops being exact on a tree, the bitmask rule, and streaming.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import zoo
import zoo_custom as zc
from test_pair_sum import _LearnedLeakAttn
from zoo_repos.pairs import CoPELM

import treecompile as tc
from treecompile.core.errors import BatchRefused, UnsupportedModelError
from treecompile.stream.options import StreamOptions


# A shared prefix, a path ending inside another, a duplicate, a second tree.
_BRANCHY = [[[1, 2, 3, 4, 5, 6], [1, 2, 3, 7, 8], [1, 2, 3, 7, 9, 10, 11], [1, 2, 3, 4, 5, 6]], [[12, 13]]]


def _refused(attn_cls, match):
    model = zoo.perturb(zc._spelling(attn_cls)().double().eval())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(UnsupportedModelError, match=match):
        tc.tree_compile(model, backend="eager")(zoo.batches()[0][1])
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


class _MeanOverKeys(zc._Attn):
    """Scores scaled by a mean over the keys: per path a mean over ``T`` keys, on the tree over ``S``."""

    def attend(self, q, k, v):
        t = q.shape[2]
        att = (q @ k.transpose(-2, -1)).masked_fill(self.causal[:, :, :t, :t] == 0, 0.0)
        att = att / (1 + att.abs().mean(-1, keepdim=True))
        return att.masked_fill(self.causal[:, :, :t, :t] == 0, float("-inf")).softmax(-1) @ v


class _ArgmaxKey(zc._Attn):
    """The index of the largest score (a packed row index on the tree) used as a value."""

    def attend(self, q, k, v):
        t = q.shape[2]
        att = (q @ k.transpose(-2, -1)).masked_fill(self.causal[:, :, :t, :t] == 0, float("-inf"))
        top, where = att.max(-1, keepdim=True)
        return (att - top).softmax(-1) @ v + where.to(v.dtype) * 0.01


class _OverLength(zc._Attn):
    """Scores divided by the length: per path the path's length."""

    def attend(self, q, k, v):
        t = q.shape[2]
        att = (q @ k.transpose(-2, -1)) / t
        gate = torch.sigmoid(att).masked_fill(self.causal[:, :, :t, :t] == 0, 0.0).cumsum(-1)
        return (att + gate).masked_fill(self.causal[:, :, :t, :t] == 0, float("-inf")).softmax(-1) @ v


class _HalfWindow(zc._Attn):
    """A window of ``T // 2`` keys built as a tensor (a function of the length) under a key cumsum."""

    def attend(self, q, k, v):
        t = q.shape[2]
        i = torch.arange(t, device=q.device)
        keep = (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < t // 2)
        att = q @ k.transpose(-2, -1)
        counted = torch.sigmoid(att).masked_fill(~keep, 0.0).cumsum(-1)
        return (att + counted).masked_fill(~keep, float("-inf")).softmax(-1) @ v


class _UnmaskedCumsum(zc._Attn):
    """A cumulative sum over the keys of gates never masked (the future counts for the past)."""

    def attend(self, q, k, v):
        t = q.shape[2]
        att = q @ k.transpose(-2, -1)
        att = att + F.logsigmoid(att).flip(-1).cumsum(-1).flip(-1)
        return att.masked_fill(self.causal[:, :, :t, :t] == 0, float("-inf")).softmax(-1) @ v


class _LearnedLeak(_LearnedLeakAttn):
    """Causal weights whose future is a learned value, zero at the start (causal now, not after a
    step): ``where(tril, 1, leak)`` times the sigmoid of the scores (not a pair sum)."""

    def attend(self, q, k, v):
        t = q.shape[2]
        keep = torch.where(self.causal[:, :, :t, :t] == 1, torch.ones((), dtype=q.dtype), self.leak)
        return (torch.sigmoid(q @ k.transpose(-2, -1)) * keep) @ v


def test_a_future_value_read_from_a_parameter_is_not_taken_for_a_constant():
    model = zoo.perturb(zc._spelling(_LearnedLeak)().double().eval())
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, _LearnedLeak):
                m.leak.zero_()
    with pytest.raises(UnsupportedModelError, match=r"sums values over keys it does not ignore off the path"):
        tc.tree_compile(model, backend="eager")(zoo.batches()[0][1])


class _WrittenFromTokens(zc._Attn):
    """A mask built in place with values read from the tokens (per query: its own scale)."""

    def attend(self, q, k, v):
        t = q.shape[2]
        i = torch.arange(t, device=q.device)
        keep = torch.zeros(t, t, dtype=q.dtype, device=q.device)
        keep.add_((i[:, None] >= i[None, :]).to(q.dtype) * torch.sigmoid(q[0, 0, :, :1]))
        return (torch.sigmoid(q @ k.transpose(-2, -1)) * keep) @ v


@pytest.mark.parametrize("attn,match", [
    (_WrittenFromTokens, r"written in place with values read from the tokens"),
    (_MeanOverKeys, r"takes an \[S, S\] tensor out of the region \(mean\)"),
    (_ArgmaxKey, r"reads the index of a maximum over the keys"),
    (_OverLength, r"reads the sequence length as a value"),
    (_HalfWindow, r"a function of the sequence length"),
    (_UnmaskedCumsum, r"sums over the keys from the end entries it does not ignore off the path"),
])
def test_what_is_not_exact_on_a_tree_is_refused_by_name(attn, match):
    _refused(attn, match)


def test_cope_runs_under_the_bitmask_rule():
    model = zoo.perturb(CoPELM().double().eval())
    compiled = tc.tree_compile(model, backend="eager", mask="bitmask")
    trees = [tc.TrajectoryTree.from_sequences(p) for p in _BRANCHY]
    zoo.compare(model, compiled, tc.pack(trees, path_bits=True, warn_por=False), trees)
    assert dict(compiled.counters["rewrite_attention_pass"]) == {"dense_pairs": 1}


def test_streaming_refuses_it_by_name():
    model = zoo.perturb(CoPELM().double().eval())
    streamed = tc.tree_compile(model, backend="eager", stream=StreamOptions(budget_rows=8))
    with pytest.raises(UnsupportedModelError, match=r"attention computed on \[S, S\] tensors at .* is not run over "
                                                    r"streamed parts"):
        streamed(zoo.batches()[1][1])


def test_a_learned_table_of_zeros_is_not_taken_for_a_function_of_the_distance():
    """A learned ``[T, T]`` bias that starts at zero is a function of ``i - j`` only until its
    first step: it is judged with its parameters moved, and kept dense (absolute positions)."""
    model = zoo.perturb(zc.InPlaceBiasLM().double().eval())
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, zc.InPlaceBiasAttn):
                m.bias.zero_()
    compiled = tc.tree_compile(model, backend="eager")
    for _, batch, trees in zoo.batches():
        zoo.compare(model, compiled, batch, trees)
    assert dict(compiled.counters["rewrite_attention_pass"]) == {"dense_pairs": 2}


def _gated_scores(q, k, strict=False):
    """Scores plus a gate of themselves (no kernel spelling takes them), the future (and with
    ``strict`` the diagonal) filled with the dtype's most negative number."""
    t = q.shape[2]
    i = torch.arange(t, device=q.device)
    allowed = i[:, None] > i[None, :] if strict else i[:, None] >= i[None, :]
    att = q @ k.transpose(-2, -1)
    return (att + torch.sigmoid(att)).masked_fill(~allowed, torch.finfo(att.dtype).min)


class _MinMasked(zc._Attn):
    """Scores plus a gate of themselves (no kernel spelling), the future filled with the dtype's
    most negative number (Hugging Face's convention) rather than ``-inf``; ``strict``: the
    diagonal blocked too, so the first query sees no key."""

    strict = False

    def attend(self, q, k, v):
        return _gated_scores(q, k, strict=self.strict).softmax(-1) @ v


class _MinMaskedStrict(_MinMasked):
    strict = True


def _exact(attn_cls, regions: int = 2) -> None:
    """The model of ``attn_cls`` blocks equals per-path training on both trees, one dense region a block."""
    model = zoo.perturb(zc._spelling(attn_cls)().double().eval())
    compiled = tc.tree_compile(model, backend="eager")
    for _, batch, trees in zoo.batches():
        zoo.compare(model, compiled, batch, trees)
    assert dict(compiled.counters["rewrite_attention_pass"]) == {"dense_pairs": regions}


def test_a_softmax_over_keys_blocked_by_the_lowest_number_is_exact_where_each_query_sees_a_key():
    _exact(_MinMasked)
    # The first query of every path sees no key: per path its softmax weighs the path's T keys
    # alike, on the tree the S keys of the packed row: that batch is refused.
    strict = zoo.perturb(zc._spelling(_MinMaskedStrict)().double().eval())
    with pytest.raises(BatchRefused, match=r"quer(y|ies) at test_dense_pairs.py:\d+ sees? no key above the mask's "
                                           r"blocked"):
        tc.tree_compile(strict, backend="eager")(zoo.batches()[0][1])
    assert torch.is_grad_enabled()


def test_the_check_of_blocked_keys_passes_a_row_that_sees_one():
    from treecompile.passes.attention.pair_state import sees_a_key

    lowest = torch.finfo(torch.float64).min
    visible = torch.tensor([[True, False], [True, True]])
    scores = torch.tensor([[0.5, lowest], [lowest, 2.0]], dtype=torch.float64)
    assert sees_a_key(scores, visible, lowest, "m.py:1").item() == 0.0
    with pytest.raises(BatchRefused, match=r"1 query at m.py:1 sees no key"):
        sees_a_key(torch.tensor([[lowest, 1.0], [lowest, 2.0]], dtype=torch.float64), visible, lowest, "m.py:1")


class _SinkColumn(zc._Attn):
    """gpt-oss's eager attention around scores no kernel spelling takes: a learned sink logit per
    head as one more key column, the row maximum subtracted, the column dropped after the softmax."""

    keep = slice(None, -1)

    def __init__(self) -> None:
        super().__init__()
        self.sinks = torch.nn.Parameter(torch.randn(zc.HEADS))

    def attend(self, q, k, v):
        att = _gated_scores(q, k)
        sinks = self.sinks.reshape(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[2], -1)
        combined = torch.cat([att, sinks], dim=-1)
        combined = combined - combined.max(dim=-1, keepdim=True).values
        return combined.softmax(-1)[..., self.keep] @ v


class _SinkFirst(_SinkColumn):
    keep = slice(1, None)  # drops the first key instead of the sink


def test_a_sink_column_beside_the_scores_is_every_querys_own():
    _exact(_SinkColumn)
    _refused(_SinkFirst, r"reads a sink column's scores other than dropping the column")


class _FilledThenWritten(zc._Attn):
    """Weights over the keys from a mask built in place in a fill (``zeros(T, T)``, then the causal
    entries set to 1): not one value any more, so read at path positions like any mask."""

    def attend(self, q, k, v):
        t = q.shape[2]
        i = torch.arange(t, device=q.device)
        keep = torch.zeros(t, t, dtype=q.dtype, device=q.device)
        keep[i[:, None] >= i[None, :]] = 1.0
        return (torch.sigmoid(q @ k.transpose(-2, -1)) * keep) @ v


def test_a_fill_written_in_place_is_read_as_a_mask():
    _exact(_FilledThenWritten)
