"""Every way of moving data between rows that the passes cannot prove tree-exact is refused
by name (a gather at the positions before a row reads its ancestors: exact): roll / narrow / unfold along the
sequence, values computed from the sequence length, norms over the sequence, opaque modules
and custom ops. Each model here trains silently wrong on a tree if it is let through."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from test_compile_models import NanoGPT, compare_with_paths, make_batch, tiny

import treecompile as tc
from treecompile.core.errors import BatchRefused, UnsupportedModelError
from treecompile.stream.options import StreamOptions

HEAD = r"^treecompile cannot make this model exact on a tree: node '\w+' \((call_function|call_method) \w+\) at test_compile_row_refusals\.py:\d+ "


def _with_mix(name: str, mix):
    """NanoGPT whose embeddings go through ``mix(x, idx)`` first; the mix is sensitive to what
    it moves (no norm right after it would cancel it out)."""

    class Mixed(NanoGPT):
        def forward(self, idx):
            pos = torch.arange(0, idx.shape[1], dtype=torch.long, device=idx.device)
            x = self.emb(idx)
            x = x * (1.0 + 0.1 * torch.tanh(mix(x, idx)))
            for blk in self.blocks:
                x = blk(x, pos)
            return self.head(self.norm(x))

    Mixed.__name__ = Mixed.__qualname__ = name
    return Mixed


def _t(x):
    return x.shape[1]


def _decay(u, t):
    """A kernel of the distance alone, ``exp(-0.3 d)`` scaled per channel of ``u`` ``[B, C, T]``."""
    per_channel = (1 + torch.arange(u.shape[1], dtype=u.dtype))[:, None] / 8
    return torch.exp(-0.3 * torch.arange(t, dtype=u.dtype))[None, :] * per_channel


def _fft_conv(kernel=_decay, n=lambda t: 2 * t, take=lambda y, t: y[..., :t], scale=lambda t: 1):
    """``irfft(rfft(u, n) * rfft(k, n) * scale, n)`` cut by ``take``, over the channels of ``x``."""
    def mix(x, idx):
        t = _t(x)
        u = x.transpose(1, 2)
        k = kernel(u, t)
        y = torch.fft.irfft(torch.fft.rfft(u, n=n(t)) * torch.fft.rfft(k, n=n(t)) * scale(t), n=n(t))
        return take(y, t).transpose(1, 2)

    return mix


CASES = {
    "gather-last-row": (lambda x, idx: x.gather(1, torch.full_like(idx, _t(x) - 1)[..., None].expand_as(x)),
                        r"uses the sequence length as a value|gathers or scatters rows"),
    "roll": (lambda x, idx: torch.roll(x, 1, dims=1), r"reduces or reorders \(roll\) along the sequence"),
    "narrow-shift": (lambda x, idx: torch.cat([x[:, :1], x.narrow(1, 0, _t(x) - 1)], 1),
                     r"changes the sequence length"),
    # Padded at the end, the window reads the next row (padded in front it is causal: zoo "window").
    "unfold-window": (lambda x, idx: F.pad(x, (0, 0, 0, 1)).unfold(1, 2, 1).mean(-1), r"changes the sequence length"),
    "length-normalised-position": (lambda x, idx: (torch.arange(_t(x), dtype=x.dtype) / _t(x))[None, :, None] * x,
                                   r"uses the sequence length as a value \(the length S itself\)"),
    "length-scaled": (lambda x, idx: x * (_t(x) - 1), r"uses the sequence length as a value \(s\d+ - 1, computed"),
    "layer-norm-over-sequence": (lambda x, idx: F.layer_norm(x, x.shape[1:]),
                                 r"normalises over the sequence"),
    "group-norm": (lambda x, idx: F.group_norm(x.transpose(1, 2), 4).transpose(1, 2),
                   r"normalises over the sequence"),
    # A scan over a row in front (zoo "rooted-scan") whose front row is also read on its own, or
    # that is scaled by a table over T + 1 rows: both left as written, refused at the cat.
    "rooted-scan-front-read": (lambda x, idx: (lambda r: r[:, 1:] + r[:, :1])(
        torch.cat([x.new_ones(x.shape[0], 1, x.shape[2]), x], 1).cumsum(1)), r"changes the sequence length"),
    "rooted-scan-length-table": (lambda x, idx: (torch.cat([x.new_ones(x.shape[0], 1, x.shape[2]), x], 1) * torch.arange(
        _t(x) + 1, dtype=x.dtype)[None, :, None]).cumsum(1)[:, 1:], r"changes the sequence length"),
    # The first row kept and the later rows reading the rows before (zoo "smear"), but through
    # a mean over them, or two rows back: left as written, refused at the cut.
    "smear-mean": (lambda x, idx: torch.cat([x[:, :1], x[:, 1:] + x[:, :-1].mean(1, keepdim=True)], 1),
                   r"changes the sequence length"),
    "smear-two-back": (lambda x, idx: torch.cat([x[:, :2], x[:, 2:] + x[:, :-2]], 1), r"changes the sequence length"),
    # A scan over the cut rows would read the root's row once run on every row: left as written.
    "smear-scan": (lambda x, idx: torch.cat([x[:, :1], x[:, 1:].cumsum(1) * 0.1 + x[:, :-1]], 1),
                   r"changes the sequence length"),
    # Convolutions by FFT (zoo "s4d", "h3", "hyena-fft"), each with one condition of the rule broken.
    "fft-conv-circular": (_fft_conv(n=lambda t: t), r"not provably at least S \+ K - 1"),
    "fft-conv-length-filter": (_fft_conv(kernel=lambda u, t: torch.exp(-3 * torch.arange(t, dtype=u.dtype) / t)),
                               r"kernel changes with the sequence length"),
    "fft-conv-token-kernel": (_fft_conv(kernel=lambda u, t: u.mean(1, keepdim=True)), r"of two token operands"),
    "fft-conv-future": (_fft_conv(kernel=lambda u, t: _decay(u, 2 * t - 1), n=lambda t: 3 * t,
                                  take=lambda y, t: y[..., t - 1:2 * t - 1]), r"used other than as \[\.\.\., :S\]"),
    "fft-conv-unscaled": (_fft_conv(scale=lambda t: 2 * t), r"multiply to 2\*s\d+, not 1"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_row_movement_is_refused_by_name(case):
    mix, why = CASES[case]
    batch, _ = make_batch("branchy")
    with pytest.raises(UnsupportedModelError) as info:
        tc.tree_compile(tiny(_with_mix(case, mix)))(batch)
    first = str(info.value).splitlines()[0]
    assert __import__("re").search(HEAD + ".*(" + why + ")", first), first
    assert "test_compile_row_refusals.py" in str(info.value).splitlines()[1], str(info.value)


#: Gathers along the rows at positions at or before the row's own: the row's ancestors on its path.
POSITION_GATHERS = {
    "gather-token-shift": lambda x, idx: x[:, (torch.arange(_t(x), device=x.device) - 1).clamp(min=0)],
    "index-select-shift": lambda x, idx: x.index_select(1, (torch.arange(_t(x)) - 1).clamp(min=0)),
    "gather-root-row": lambda x, idx: x.gather(1, torch.zeros_like(idx)[..., None].expand_as(x)),
}


@pytest.mark.parametrize("case", sorted(POSITION_GATHERS))
def test_a_gather_at_earlier_positions_reads_the_ancestors(case):
    batch, trees = make_batch("branchy")
    model = tiny(_with_mix(case, POSITION_GATHERS[case]))
    compiled = tc.tree_compile(model)
    compare_with_paths(model, compiled, batch, trees, tol="pure")
    assert compiled.counters["rewrite_conv_context_pass"]["position_gather"] == 1
    streamed = tc.tree_compile(model, backend="eager", stream=StreamOptions(budget_rows=8))
    with pytest.raises(UnsupportedModelError, match=r"gathers rows at positions, and this call has no path"):
        streamed(batch)


def test_a_gather_of_a_later_row_is_refused_per_batch():
    """``x.gather(1, positions + 1)`` on a token 2 (then the next row): per path a row after it."""
    batch, _ = make_batch("branchy")
    mix = lambda x, idx: x.gather(1, (torch.arange(_t(x)) + (idx == 2).long())[..., None].expand_as(x))  # noqa: E731
    model = tiny(_with_mix("NextRow", mix))
    with pytest.raises(BatchRefused, match=r"reads, for a row, the path's row at position \d+, after it"):
        tc.tree_compile(model)(batch)


def test_a_convolution_by_fft_is_exact():
    """The cases above without their defect: a kernel of the distance, ``n = 2S``, ``[..., :S]``."""
    batch, trees = make_batch("branchy")
    model = tiny(_with_mix("FFTConv", _fft_conv()))
    compiled = tc.tree_compile(model)
    compare_with_paths(model, compiled, batch, trees, tol="pure")
    assert compiled.counters["rewrite_attention_pass"]["fft_conv"] == 1
    # The kernel's copy indexes distances: no row state, so the probe never compares it as rows.
    record = compiled.compile_records[-1]
    kernel = [n for n in record.graph_module.graph.nodes if n.name.startswith("arange")]
    assert kernel and all(record.row_states.get(n, "absent") is None for n in kernel), kernel
    streamed = tc.tree_compile(model, backend="eager", stream=StreamOptions(budget_rows=8))
    with pytest.raises(UnsupportedModelError, match=r"is a convolution by FFT, and this call has no path structure"):
        streamed(batch)


def test_a_length_temperature_is_refused():
    """``math.log(T)`` makes Dynamo specialise the length: the graph is refused as a whole."""
    batch, _ = make_batch("branchy")
    model = tiny(_with_mix("log-length", lambda x, idx: x * math.log(_t(x))))
    with pytest.raises(UnsupportedModelError, match=r"makes the sequence length a constant"):
        tc.tree_compile(model)(batch)


class TorchMHA(NanoGPT):
    """``nn.MultiheadAttention`` with an additive causal mask built from the length (or none:
    bidirectional)."""

    def __init__(self, causal: bool = True, **kw):
        super().__init__(**kw)
        self.mha = nn.MultiheadAttention(32, 4, batch_first=True)
        self.causal = causal

    def forward(self, idx):
        x = self.emb(idx)
        t = idx.shape[1]
        m = torch.triu(torch.full((t, t), float("-inf")), 1) if self.causal else None
        y, _ = self.mha(x, x, x, attn_mask=m, need_weights=False)
        return self.head(self.norm(x + y))


def test_torch_multihead_attention_with_a_causal_mask_is_exact():
    batch, trees = make_batch("branchy")
    model = tiny(TorchMHA)
    compiled = tc.tree_compile(model)
    compare_with_paths(model, compiled, batch, trees, tol="pure")
    assert compiled.counters["rewrite_attention_pass"]["multihead_attention"] == 1


def test_a_torch_encoder_layer_without_gradients_is_exact_and_its_fast_path_setting_kept():
    """Without gradients, in eval mode, ``nn.TransformerEncoderLayer`` takes torch's fused fast
    path, which hides the mask and the softmax: a rollout's no-grad call was refused ("node 'ones'
    produces a [.., S, S] tensor") where calls with gradients ran. The fast path is off during
    treecompile's calls, and the user's setting is as it was after."""
    import zoo

    from treecompile.core.reference import per_path_loss

    model = {c.id: c for c in zoo.all_cases()}["encoder-layer-padding"].build()
    compiled = tc.tree_compile(model, backend="eager")
    for _, batch, trees in zoo.batches():
        with torch.no_grad():
            got, want = compiled(batch).loss.item(), per_path_loss(model, trees).loss.item()
        assert abs(got - want) <= 1e-12 * abs(want), (got, want)
    assert torch.backends.mha.get_fastpath_enabled()


def test_torch_multihead_attention_without_a_mask_is_refused_as_bidirectional():
    batch, _ = make_batch("branchy")
    with pytest.raises(UnsupportedModelError, match=HEAD + r"is nn.MultiheadAttention over the packed rows, not "
                       r"rewritten .*\(nn.MultiheadAttention without a causal mask \(bidirectional"):
        tc.tree_compile(tiny(TorchMHA, causal=False))(batch)


@torch.library.custom_op("tctest::smooth", mutates_args=())
def _smooth(x: torch.Tensor) -> torch.Tensor:
    return (x + x.roll(1, 1)) / 2


@_smooth.register_fake
def _(x):
    return torch.empty_like(x)


def test_an_unknown_custom_op_over_the_sequence_is_refused():
    batch, _ = make_batch("branchy")
    model = tiny(_with_mix("custom-op", lambda x, idx: torch.ops.tctest.smooth(x)))
    with pytest.raises(UnsupportedModelError, match=r"custom op treecompile does not know, applied to the sequence"):
        tc.tree_compile(model)(batch)


class _RunningMean(torch.autograd.Function):
    """A custom autograd function whose forward mixes the rows (a running mean)."""

    @staticmethod
    def forward(ctx, x):
        n = torch.ones_like(x).cumsum(1)
        ctx.save_for_backward(n)
        return x.cumsum(1) / n

    @staticmethod
    def backward(ctx, g):
        (n,) = ctx.saved_tensors
        return (g / n).flip(1).cumsum(1).flip(1)


class _Scale(torch.autograd.Function):
    """A token-wise custom autograd function: accepted."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * torch.sigmoid(x)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        s = torch.sigmoid(x)
        return g * (s + x * s * (1 - s))


def test_an_autograd_function_that_mixes_rows_is_refused_and_a_token_wise_one_is_exact():
    from test_compile_models import compare_with_paths

    batch, trees = make_batch("branchy")
    with pytest.raises(UnsupportedModelError, match=r"torch\.autograd\.Function whose body has node .*cumsum"):
        tc.tree_compile(tiny(_with_mix("autograd-running-mean", lambda x, idx: _RunningMean.apply(x))))(batch)
    model = tiny(_with_mix("autograd-token-wise", lambda x, idx: _Scale.apply(x)))
    compare_with_paths(model, tc.tree_compile(model, backend="eager"), batch, trees, tol="pure")


class LanguageAdapters(NanoGPT):
    """X-MOD's language adapters: each batch entry goes through the adapter its language picks,
    chosen with a boolean mask over the batch (``x[lang == i]``: whole rows of one entry)."""

    def __init__(self, length_chooses: bool = False) -> None:
        super().__init__()
        self.adapters = nn.ModuleList(nn.Linear(32, 32) for _ in range(2))
        self.register_buffer("lang", torch.tensor([1]))
        self.length_chooses = length_chooses

    def forward(self, idx):
        pos = torch.arange(0, idx.shape[1], dtype=torch.long, device=idx.device)
        x = self.emb(idx)
        lang = self.lang.expand(idx.shape[0])
        if self.length_chooses:  # a language read from the length: a path alone picks another adapter
            lang = torch.where(torch.full_like(lang, idx.shape[1]) > 9, 1 - lang, lang)
        adapted = torch.zeros_like(x)
        for i, adapter in enumerate(self.adapters):
            chosen = lang == i
            adapted[chosen] = adapter(x[chosen])
        x = x + adapted
        for blk in self.blocks:
            x = blk(x, pos)
        return self.head(self.norm(x))


def test_entries_of_the_batch_chosen_by_a_mask_are_whole_rows():
    import zoo

    batch, trees = make_batch("branchy")
    model = zoo.perturb(tiny(LanguageAdapters))
    compare_with_paths(model, tc.tree_compile(model), batch, trees, tol="pure")
    refused = zoo.perturb(tiny(LanguageAdapters, length_chooses=True))
    with pytest.raises(UnsupportedModelError, match=r"selects along the batch with a mask computed from the sequence "
                                                    r"length"):
        tc.tree_compile(refused)(batch)
