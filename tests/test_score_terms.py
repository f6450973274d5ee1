"""Terms on the scores constant along one sequence dim. Biases read from the tokens
(`ScoreChain.token_terms`): a term per key, and one per query, each becomes one more feature of
the query and key the tree kernel multiplies. Tensor factors (`ScoreChain.factors`: per head, per
query, per key) multiply the query or key. The zoo (tests/zoo.py: ``forgetting-transformer``, ``key-gate-bias*``) checks each
spelling against per-path training on the whole tree; here the same models through the default
lowering and streamed, where the keys with their extra feature are what the stack carries."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
import zoo
import zoo_custom as zc

import treecompile as tc
from treecompile.core.errors import UnsupportedModelError
from treecompile.stream.options import StreamOptions


def _case(case_id: str) -> zoo.Case:
    return next(c for c in zoo.all_cases() if c.id == case_id)


@pytest.mark.full
def test_the_default_lowering_takes_the_extra_feature_and_its_gradient():
    model = _case("forgetting-transformer").build()
    compiled = tc.tree_compile(model)  # aot_eager on CPU
    for _, batch, trees in zoo.batches():
        zoo.compare(model, compiled, batch, trees)
    assert compiled.counters["rewrite_attention_pass"] == {"softmax_attention": 2}


@pytest.mark.full
@pytest.mark.parametrize("mode", ["keep", "recompute"])
def test_a_streamed_tree_reads_the_keys_bias_from_the_stack(mode):
    model = _case("key-gate-bias-mqa").build()
    compiled = tc.tree_compile(model, backend="eager", stream=StreamOptions(budget_rows=3, mode=mode))
    for _, batch, trees in zoo.batches():
        zoo.compare(model, compiled, batch, trees)
    streamed = [r for r in compiled.compile_records if "route_prefix_kv_pass" in r.counters]
    assert streamed and streamed[0].counters["route_prefix_kv_pass"] == {"prefix_attention": 2}


class _QueryOnly(zc._GatedAttn):
    """A bias per query only: the softmax cancels it, so per path the gate's gradient is rounding
    noise; on the tree it is a gradient too (not None: an optimizer would skip the gate)."""

    def attend(self, q, k, v, g):
        t = q.shape[2]
        att = q @ k.transpose(-2, -1) * zc.HD**-0.5 + F.softplus(g)[..., :, None]
        att = att.masked_fill(self.causal[:, :, :t, :t] == 0, float("-inf"))
        return att.softmax(-1) @ v


class _PairGate(zc._GatedAttn):
    """A bias read from the tokens of both the query and the key in one product: not a sum of a
    term per query and a term per key, so not a token bias."""

    def attend(self, q, k, v, g):
        t = q.shape[2]
        att = q @ k.transpose(-2, -1) * zc.HD**-0.5 + g[..., :, None] * g[..., None, :]
        att = att.masked_fill(self.causal[:, :, :t, :t] == 0, float("-inf"))
        return att.softmax(-1) @ v


def test_a_bias_per_query_is_left_to_the_softmax():
    model = zoo._custom(zc._spelling(_QueryOnly))()
    compiled = tc.tree_compile(model, backend="eager")
    _, batch, trees = zoo.batches()[0]
    zoo.compare(model, compiled, batch, trees)
    assert compiled.counters["rewrite_attention_pass"] == {"softmax_attention": 2}


def test_a_bias_of_both_tokens_is_computed_densely():
    """Not a token bias (a term per query plus one per key) for the kernel's score_mod; the
    model's own [S, S] ops, kept dense (`dense_pairs`), read both tokens of each pair exactly."""
    model = zoo._custom(zc._spelling(_PairGate))()
    compiled = tc.tree_compile(model, backend="eager")
    for _, batch, trees in zoo.batches():
        zoo.compare(model, compiled, batch, trees)
    assert dict(compiled.counters["rewrite_attention_pass"]) == {"dense_pairs": 2}


class _SequenceSoftmaxGate(zc._GatedAttn):
    """A bias per key normalised over the whole sequence (``softmax`` along it): not a function
    of one token, so not exact on a tree."""

    def attend(self, q, k, v, g):
        t = q.shape[2]
        att = q @ k.transpose(-2, -1) * zc.HD**-0.5 + g.softmax(-1)[:, :, None, :]
        att = att.masked_fill(self.causal[:, :, :t, :t] == 0, float("-inf"))
        return att.softmax(-1) @ v


def test_a_bias_per_key_that_mixes_the_sequence_is_refused_where_it_mixes():
    model = zoo._custom(zc._spelling(_SequenceSoftmaxGate))()
    compiled = tc.tree_compile(model, backend="eager")
    _, batch, _ = zoo.batches()[0]
    with pytest.raises(UnsupportedModelError, match=r"softmax\) .*reduces or reorders \(softmax\) along the sequence"):
        compiled(batch)


class _FactorAfterMask(zc._Attn):
    """A learned temperature applied after a finite mask fill: it would scale the fill."""

    def __init__(self):
        super().__init__()
        self.temp = torch.nn.Parameter(torch.ones(zc.HEADS, 1, 1))

    def attend(self, q, k, v):
        t = q.shape[2]
        att = (q @ k.transpose(-2, -1)).masked_fill(self.causal[:, :, :t, :t] == 0, -1e4) * self.temp
        return att.softmax(-1) @ v


class _FactorOfTheRow(zc._Attn):
    """A factor per query computed from its row of scores (``amax``): the row is the tree's."""

    def attend(self, q, k, v):
        t = q.shape[2]
        att = q @ k.transpose(-2, -1) * zc.HD**-0.5
        att = att * torch.sigmoid(att.amax(-1, keepdim=True))
        att = att.masked_fill(self.causal[:, :, :t, :t] == 0, float("-inf"))
        return att.softmax(-1) @ v


class _MaxShift(zc._Attn):
    """The masked scores shifted by their row maximum, ``torch.max(att, -1, keepdim=True)[0]``
    (not detached): a constant per query, which the softmax cancels."""

    def attend(self, q, k, v):
        t = q.shape[2]
        att = (q @ k.transpose(-2, -1) * zc.HD**-0.5).masked_fill(self.causal[:, :, :t, :t] == 0, float("-inf"))
        return (att - torch.max(att, -1, keepdim=True)[0]).softmax(-1) @ v


class _ShiftBeforeCap(zc._Attn):
    """The row maximum taken off before a soft-cap: ``tanh`` does not commute with the shift."""

    def attend(self, q, k, v):
        t = q.shape[2]
        att = q @ k.transpose(-2, -1) * zc.HD**-0.5
        att = 5 * torch.tanh((att - att.amax(-1, keepdim=True).detach()) / 5)
        return att.masked_fill(self.causal[:, :, :t, :t] == 0, float("-inf")).softmax(-1) @ v


class _ShiftOverQueries(zc._Attn):
    """A maximum over the queries (``amax(-2)``) taken off: not a constant per query."""

    def attend(self, q, k, v):
        t = q.shape[2]
        att = (q @ k.transpose(-2, -1) * zc.HD**-0.5).masked_fill(self.causal[:, :, :t, :t] == 0, -1e4)
        return (att - att.amax(-2, keepdim=True).detach()).softmax(-1) @ v


def test_scores_shifted_by_their_row_maximum_are_the_softmax_s_own():
    # PaLM-pytorch's detached `amax` is the zoo's `palm-lazy-buffers`; here `max(...)[0]`, kept in the graph.
    zoo.run(zoo.Case("max-shift", _MaxShift.__doc__, zoo._custom(zc._spelling(_MaxShift))))


@pytest.mark.parametrize("attn,why", [
    (_FactorAfterMask, "a mask or bias before a tensor factor on the scores"),
    (_FactorOfTheRow, "the attention scores are also used by node 'amax'"),
    (_ShiftBeforeCap, "the scores are shifted by their maximum before a soft-cap"),
    (_ShiftOverQueries, "the attention scores are also used by node 'amax'"),
])
def test_a_factor_that_would_scale_a_mask_or_reads_the_row_is_refused(attn, why):
    model = zoo._custom(zc._spelling(attn))()
    compiled = tc.tree_compile(model, backend="eager")
    with pytest.raises(UnsupportedModelError, match=re.escape(why)):
        compiled(zoo.batches()[0][1])
