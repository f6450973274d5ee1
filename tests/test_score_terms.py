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
from torch import nn
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


# ---------------------------------------------------------------- a key mask that fills -inf

#: A forest whose first tree's paths start with the zoo's padded token (`zoo_custom.PAD`).
_PAD_FIRST = [[[zc.PAD, 2, 3], [zc.PAD, 2, 4, 6]], [[1, 2, 3]]]


def _forest(paths):
    trees = [tc.TrajectoryTree.from_sequences(p) for p in paths]
    return tc.pack(trees), trees


def test_a_path_that_starts_with_a_token_a_minus_inf_key_mask_blocks_is_refused():
    # Per path its first query sees no key: softmax over -inf alone is NaN, spreading along the
    # path; the tree kernel gives the row 0. The batch is refused, the model's other batches exact.
    from treecompile.core.errors import BatchRefused
    from treecompile.core.reference import per_path_loss

    model = _case("key-padding-fill").build()
    compiled = tc.tree_compile(model, backend="eager")
    batch, trees = _forest(_PAD_FIRST)
    assert per_path_loss(model, trees).loss.isnan()
    with pytest.raises(BatchRefused, match=r"a path starts with a token the key mask at zoo_custom\.py:\d+ blocks"):
        compiled(batch)
    for _, batch, trees in zoo.batches():  # the padded token inside paths: exact
        zoo.compare(model, compiled, batch, trees)
    streamed = tc.tree_compile(model, backend="eager", stream=StreamOptions(budget_rows=3))
    with pytest.raises(BatchRefused, match="the key mask at .* blocks"):
        streamed(_forest(_PAD_FIRST)[0])


@pytest.mark.parametrize("case_id,stream", [("key-padding-sdpa", None), ("encoder-layer-padding", None),
                                            ("key-padding-sdpa", StreamOptions(budget_rows=3))])
def test_sdpa_gives_a_query_that_sees_no_key_0_as_the_tree_does(case_id, stream):
    # And no gradient: the kernels' backward gives such a row probabilities of 0, not NaN.
    model = _case(case_id).build()
    compiled = tc.tree_compile(model, backend="eager", stream=stream)
    zoo.compare(model, compiled, *_forest(_PAD_FIRST))


class _PadZeroLM(zc.PaddedLM):
    """`zoo_custom.PaddedLM` whose padded token is 0, the token of the wrapper's padding rows."""

    def forward(self, idx):
        keep = idx != 0
        x = self.emb(idx)
        for blk in self.blocks:
            x = blk(x, keep)
        return self.head(self.norm(x))


def test_the_wrappers_padding_rows_are_not_paths():
    # One target: the wrapper appends a two-token tree of weight 0 starting with token 0.
    model = zoo._custom(_PadZeroLM)()
    compiled = tc.tree_compile(model, backend="eager")
    zoo.compare(model, compiled, *_forest([[[1, 2]]]))


class _MhaPaddingBlock(nn.Module):
    """``nn.MultiheadAttention`` with a boolean causal mask and ``key_padding_mask = ~keep``;
    ``need_weights`` as given (the module's default: True, its own softmax)."""

    def __init__(self, need_weights: bool = True) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(zc.DIM, zc.HEADS, batch_first=True)
        self.need_weights = need_weights

    def forward(self, x, keep):
        t = x.shape[1]
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        y, _ = self.attn(x, x, x, attn_mask=causal, key_padding_mask=~keep, need_weights=self.need_weights)
        return x + y


def test_multihead_attention_with_its_own_softmax_is_refused_where_a_path_starts_padded():
    from treecompile.core.errors import BatchRefused

    lm = type("MhaPaddingLM", (zc.PaddedLM,), {"block_cls": _MhaPaddingBlock})
    model = zoo._custom(lm)()
    compiled = tc.tree_compile(model, backend="eager")
    with pytest.raises(BatchRefused, match="the key mask at .* blocks"):
        compiled(_forest(_PAD_FIRST)[0])
    zoo.compare(model, compiled, *zoo.batches()[0][1:])
    quiet = zoo._custom(lm, need_weights=False)()  # SDPA inside: 0 per path too
    zoo.compare(quiet, tc.tree_compile(quiet, backend="eager"), *_forest(_PAD_FIRST))


class _WindowPaddingAttn(zc._PaddedAttn):
    """Causal within 3 keys, then ``masked_fill(~keep, -inf)``: a query whose window holds only
    padded keys sees none."""

    def __init__(self) -> None:
        super().__init__()
        self.causal.triu_(-2)

    def attend(self, q, k, v, keep):
        t = q.shape[2]
        att = (q @ k.transpose(-2, -1) * zc.HD**-0.5).masked_fill(self.causal[:, :, :t, :t] == 0, float("-inf"))
        att = att.masked_fill(~keep[:, None, None, :], float("-inf"))
        return att.softmax(-1) @ v


def test_a_minus_inf_key_mask_under_a_window_is_left_to_the_dense_rule():
    # The tree kernel would give a query whose window holds only padded keys 0; the dense rule
    # computes the softmax as the model writes it (NaN there, as per path).
    model = zoo._custom(type("WindowPaddingLM", (zc.PaddedLM,), {"block_cls": _WindowPaddingAttn}))()
    compiled = tc.tree_compile(model, backend="eager")
    for _, batch, trees in zoo.batches():
        zoo.compare(model, compiled, batch, trees)
    assert compiled.counters["rewrite_attention_pass"] == {"dense_pairs": 2}
    assert compiled(_forest([[[1, zc.PAD, zc.PAD, zc.PAD, 2, 3]]])[0]).loss.isnan()


@pytest.mark.parametrize("case_id,checks", [("forgetting-transformer", 0), ("key-gate-bias", 0), ("doge-eager", 0),
                                            ("encoder-layer-padding", 0), ("key-padding-sdpa", 0),
                                            ("key-padding-fill", 2), ("key-padding-extended", 2),
                                            ("key-padding-sdpa-bias", 2)])
def test_only_a_key_mask_that_can_leave_a_query_blind_is_checked(case_id, checks):
    # The check reads the device (one host sync per attention): a float term computed by ops that
    # keep finite values finite (a running sum of log forget gates, a gate per key) needs none, nor
    # a -inf mask where the spelling gives what the kernel gives (SDPA's 0, nn.TransformerEncoderLayer).
    model = _case(case_id).build()
    compiled = tc.tree_compile(model, backend="eager")
    compiled(zoo.batches()[0][1])
    graphs = [r.graph_module for r in compiled.compile_records if r.graph_module is not None]
    found = sum(n.target is torch.ops.treecompile.root_sees_a_key.default for g in graphs for n in g.graph.nodes)
    assert found == checks


class _FinfoKeyAttn(zc._PaddedAttn):
    """Hugging Face's extended mask: ``(1 - keep) * finfo.min`` per key added to the scores, then
    the causal ``-inf``; ``after``: the key mask filled with ``finfo.min`` after the causal one
    (which it overwrites at later blocked keys)."""

    def __init__(self, after: bool = False) -> None:
        super().__init__()
        self.after = after

    def attend(self, q, k, v, keep):
        t = q.shape[2]
        att = q @ k.transpose(-2, -1) * zc.HD**-0.5
        if self.after:
            att = att.masked_fill(self.causal[:, :, :t, :t] == 0, float("-inf"))
            return att.masked_fill(~keep[:, None, None, :], torch.finfo(q.dtype).min).softmax(-1) @ v
        att = att + (1.0 - keep[:, None, None, :].to(q.dtype)) * torch.finfo(q.dtype).min
        return att.masked_fill(self.causal[:, :, :t, :t] == 0, float("-inf")).softmax(-1) @ v


@pytest.mark.parametrize("after", [False, True])
def test_a_run_of_tokens_a_finite_key_mask_blocks_from_the_root_is_refused(after):
    # Per path the second query sees two blocked keys and weighs them alike with the later keys the
    # fill overwrote (finfo.min, not -inf): 3.3299 per path, the tree gave 3.5173 without a refusal.
    from treecompile.core.errors import BatchRefused
    from treecompile.core.reference import per_path_loss

    model = zoo._custom(type("FinfoKeyLM", (zc.PaddedLM,), {"block_cls": _FinfoKeyAttn}), after=after)()
    compiled = tc.tree_compile(model, backend="eager")
    batch, trees = _forest([[[zc.PAD, zc.PAD, zc.PAD, 2, 3], [zc.PAD, zc.PAD, 4]], [[1, 2, 3]]])
    assert per_path_loss(model, trees).loss.isfinite()
    with pytest.raises(BatchRefused, match="the key mask at .* blocks"):
        compiled(batch)
    zoo.compare(model, compiled, *_forest([[[1, zc.PAD, 3], [1, zc.PAD, zc.PAD, 6]], [[zc.PAD + 1, 2, 3]]]))


class _MemoryMha(nn.Module):
    """``nn.MultiheadAttention`` from the rows to a learned memory, ``need_weights`` left at True."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(zc.DIM, zc.HEADS, batch_first=True)
        self.memory = nn.Parameter(torch.randn(1, 3, zc.DIM))

    def forward(self, x, keep):
        m = self.memory.expand(x.shape[0], -1, -1)
        return x + self.attn(x, m, m)[0]


def test_multihead_attention_to_a_memory_with_its_weights_is_exact():
    model = zoo._custom(type("MemoryMhaLM", (zc.PaddedLM,), {"block_cls": _MemoryMha}))()
    compiled = tc.tree_compile(model, backend="eager")
    zoo.compare(model, compiled, *zoo.batches()[0][1:])
    assert compiled.counters["rewrite_attention_pass"] == {"memory_attention": 2}
