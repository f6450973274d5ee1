"""Queries whose every visible key is blocked: per path a softmax over ``-inf`` alone is NaN (and
NaN spreads along the path), one over a finite fill weighs alike every key holding the fill (the
later ones too, where the causal mask is the same fill), SDPA's gives 0 as the tree kernel does.
Key masks read from the tokens (`treecompile.passes.attention.token_bias.root_sees_a_key`: a
batch with a path that starts with a blocked token is refused) and structural masks that hide
each query's own key (left to the dense rule, which computes the softmax as written)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import zoo
import zoo_custom as zc
from torch import nn

import treecompile as tc
from treecompile.core.errors import UnsupportedModelError
from treecompile.stream.options import StreamOptions


def _case(case_id: str) -> zoo.Case:
    return next(c for c in zoo.all_cases() if c.id == case_id)


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
    twin = zoo.twin_of(model)
    compiled = tc.tree_compile(model, backend="eager")
    batch, trees = _forest(_PAD_FIRST)
    with pytest.raises(BatchRefused, match=r"a path starts with a token the key mask at zoo_custom\.py:\d+ blocks"):
        compiled(batch)
    zoo.assert_unchanged(model, twin, lengths=(7, 9))  # the refusal left the model as it was
    assert per_path_loss(model, trees).loss.isnan()
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
    """``nn.MultiheadAttention`` with a boolean causal mask (``window``: keys less than that many
    tokens back) and ``key_padding_mask = ~keep``; ``need_weights`` as given (the module's default:
    True, its own softmax)."""

    def __init__(self, need_weights: bool = True, window: int | None = None) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(zc.DIM, zc.HEADS, batch_first=True)
        self.need_weights, self.window = need_weights, window

    def forward(self, x, keep):
        t = x.shape[1]
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        if self.window is not None:
            causal = causal | torch.ones(t, t, dtype=torch.bool, device=x.device).tril(-self.window)
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


def test_multihead_attention_with_its_own_softmax_under_a_window_is_refused_by_name():
    # A query whose window holds only padded keys: NaN per path; no root check can tell.
    lm = type("MhaWindowPaddingLM", (zc.PaddedLM,), {"block_cls": _MhaPaddingBlock})
    model = zoo._custom(lm, window=3)()
    with pytest.raises(UnsupportedModelError, match="a key_padding_mask under a windowed attn_mask"):
        tc.tree_compile(model, backend="eager")(zoo.batches()[0][1])
    quiet = zoo._custom(lm, need_weights=False, window=3)()  # SDPA inside: 0 per path, as on the tree
    compiled = tc.tree_compile(quiet, backend="eager")
    zoo.compare(quiet, compiled, *_forest([[[1, 2, zc.PAD, zc.PAD, zc.PAD, 3, 4]], [[zc.PAD, 2]]]))
    assert compiled.counters["rewrite_attention_pass"] == {"multihead_attention": 2}


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


class _StrictAttn(zc._Attn):
    """A causal mask that hides the query's own key (``triu(0)``), filled with ``fill``, before a
    softmax (``sdpa``: SDPA with the boolean mask ``tril(-1)``)."""

    def __init__(self, fill: str = "-inf") -> None:
        super().__init__()
        self.fill = fill

    def attend(self, q, k, v):
        t = q.shape[2]
        hidden = torch.ones(t, t, dtype=torch.bool, device=q.device).triu(0)
        if self.fill == "sdpa":
            return F.scaled_dot_product_attention(q, k, v, attn_mask=~hidden)
        fill = float("-inf") if self.fill == "-inf" else torch.finfo(q.dtype).min
        return (q @ k.transpose(-2, -1) * zc.HD**-0.5).masked_fill(hidden, fill).softmax(-1) @ v


def test_a_mask_that_hides_the_querys_own_key_is_computed_as_written():
    # Per path the first query sees no key: NaN over -inf, a mean over every later key over
    # finfo.min (the kernel gave 0: 3.4848 on the tree vs 3.3369 per path, without a refusal).
    from treecompile.core.errors import BatchRefused
    from treecompile.core.reference import per_path_loss

    _, batch, trees = zoo.batches()[0]
    nan = zoo._custom(zc._spelling(_StrictAttn))()
    compiled = tc.tree_compile(nan, backend="eager")
    assert compiled(batch).loss.isnan() and per_path_loss(nan, trees).loss.isnan()
    assert compiled.counters["rewrite_attention_pass"] == {"dense_pairs": 2}
    finite = zoo._custom(zc._spelling(_StrictAttn), fill="finfo")()
    with pytest.raises(BatchRefused, match="no key above the mask's blocked value"):
        tc.tree_compile(finite, backend="eager")(batch)
    sdpa = zoo._custom(zc._spelling(_StrictAttn), fill="sdpa")()  # 0 per path, as on the tree
    zoo.compare(sdpa, tc.tree_compile(sdpa, backend="eager"), batch, trees)
