"""Models that mix the sequence in ways a tree cannot follow are refused, never trained wrong.

Each refusal must name the op and the user source line that produced it.
"""

import pytest
import torch
import torch.nn.functional as F
from test_compile_models import VOCAB, BiGruLM, ConvLM, CumsumLM, compare_with_paths, make_batch, tiny
from torch import nn

from treecompile import UnsupportedModelError
from treecompile.compile.wrapper import tree_compile


class _EmbedHeadLM(nn.Module):
    """An embedding and a head; each model below puts one sequence-mixing op between them."""

    def __init__(self, vocab=VOCAB, dim=16):
        super().__init__()
        self.emb, self.head = nn.Embedding(vocab, dim), nn.Linear(dim, vocab)


class BidirectionalLM(_EmbedHeadLM):
    """SDPA without a causal mask: every token sees the whole row."""

    def forward(self, idx):
        x = self.emb(idx)[:, None]
        return self.head(F.scaled_dot_product_attention(x, x, x)[:, 0])


class PrefixLMMaskLM(_EmbedHeadLM):
    """Manual attention whose structural mask is not causal (a bidirectional prefix of 3)."""

    def forward(self, idx):
        t = idx.shape[1]
        x = self.emb(idx)[:, None]
        i = torch.arange(t, device=idx.device)
        allowed = (i[None, :] <= i[:, None]) | (i[None, :] < 3)
        att = (x @ x.transpose(-2, -1)).masked_fill(~allowed, float("-inf")).softmax(-1)
        return self.head((att @ x)[:, 0])


class MeanPoolLM(_EmbedHeadLM):
    """Adds the mean over the whole sequence to every token (global pooling)."""

    def forward(self, idx):
        x = self.emb(idx)
        return self.head(x + x.mean(dim=1, keepdim=True))


class TokenShiftLM(_EmbedHeadLM):
    """RWKV-style token shift: mixes each token with the previous row of the packed sequence."""

    def forward(self, idx):
        x = self.emb(idx)
        shifted = torch.cat([torch.zeros_like(x[:, :1]), x[:, :-1]], dim=1)
        return self.head(x + shifted)


class DropoutAttentionLM(_EmbedHeadLM):
    """Causal SDPA with dropout: random per call, so no tree can match it."""

    def forward(self, idx):
        x = self.emb(idx)[:, None]
        return self.head(F.scaled_dot_product_attention(x, x, x, is_causal=True, dropout_p=0.1)[:, 0])


class MergedRowsPoolLM(_EmbedHeadLM):
    """Merges the rows with the heads ([B, S, H, D] -> [B * S * H, D]), then pools over them."""

    def forward(self, idx):
        b, t = idx.shape
        x = self.emb(idx)
        rows = x.view(b, t, 4, -1).reshape(-1, x.shape[-1] // 4)
        pooled = rows.amax(0)
        return self.head(x + pooled.repeat(4))


class MergedRowsCumsumLM(_EmbedHeadLM):
    """A running sum over the merged [S * H] rows: each token sees the ones before it in the row."""

    def forward(self, idx):
        b, t = idx.shape
        x = self.emb(idx)
        rows = x.reshape(b, t * 4, -1).cumsum(1)
        return self.head(x + rows.reshape(b, t, -1))


class TokenLoopLM(_EmbedHeadLM):
    """A linear recurrence as a Python loop over the tokens: Dynamo makes the length a constant."""

    def forward(self, idx):
        x = self.emb(idx)
        h = torch.zeros_like(x[:, 0])
        outs = []
        for t in range(x.shape[1]):
            h = 0.5 * h + x[:, t]
            outs.append(h)
        return self.head(torch.stack(outs, 1))


class ZeroPadShiftLM(_EmbedHeadLM):
    """RWKV's time shift, ``ZeroPad2d((0, 0, 1, -1))``: the previous row, at the same length."""

    def __init__(self) -> None:
        super().__init__()
        self.shift = nn.ZeroPad2d((0, 0, 1, -1))

    def forward(self, idx):
        x = self.emb(idx)
        return self.head(x + self.shift(x))


REFUSED = {
    # model -> (op named in the message, source fragment named in the message)
    "bidirectional-gru": (BiGruLM, "recurrent layer that is bidirectional", "self.rnn("),
    "bidirectional-sdpa": (BidirectionalLM, "scaled_dot_product_attention", "scaled_dot_product_attention(x, x, x)"),
    "prefix-lm-mask": (PrefixLMMaskLM, "not causal", "x @ x.transpose"),
    "mean-pool": (MeanPoolLM, "along the sequence", "x.mean(dim=1"),
    "attention-dropout": (DropoutAttentionLM, "dropout", "dropout_p=0.1"),
    "merged-rows-pool": (MergedRowsPoolLM, "along the sequence", "rows.amax(0)"),
    "merged-rows-cumsum": (MergedRowsCumsumLM, "along the sequence", ".cumsum(1)"),
    "token-loop": (TokenLoopLM, "sequence length a constant", "takes one token of the row at a time"),
}

class CountedScanLM(nn.Module):
    """Scans whose result dtype is not their input's: a bool cumsum (a count, int64 in torch)
    and an int32 one, along the sequence."""

    def __init__(self, vocab: int = 32, dim: int = 16):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.count = nn.Embedding(64, dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        evens = (idx % 2 == 0).cumsum(1)  # how many even tokens so far on the path
        threes = (idx % 3 == 0).to(torch.int32).cumsum(1)
        return self.head(x + self.count(evens.clamp(max=63)) + self.count(threes.clamp(max=63)))


#: Sequence mixing that has a tree form: once refused, now exact (a scan along the path, the
#: previous token on the path, a causal conv's taps along the path).
EXACT = {"cumsum": CumsumLM, "counted-scan": CountedScanLM, "token-shift": TokenShiftLM,
         "zero-pad-shift": ZeroPadShiftLM, "conv1d": ConvLM}


@pytest.mark.parametrize("model_id", list(EXACT))
def test_scans_and_token_shifts_follow_the_path(model_id):
    torch.manual_seed(0)
    model = tiny(EXACT[model_id])
    compiled = tree_compile(model)
    for name in ("branchy", "forest"):
        batch, trees = make_batch(name)
        compare_with_paths(model, compiled, batch, trees, tol="pure")


@pytest.mark.parametrize("model_id", list(REFUSED))
def test_sequence_mixing_is_refused_with_op_and_source(model_id):
    cls, what, where = REFUSED[model_id]
    batch, _ = make_batch("branchy")
    compiled = tree_compile(tiny(cls))
    with pytest.raises(UnsupportedModelError) as info:
        compiled(batch)
    msg = str(info.value)
    assert what in msg, msg
    assert where in msg, msg


def test_a_constant_length_refusal_names_the_whole_path_of_its_line():
    """Dynamo records where the length became a number with the path cut on the left; the
    refusal names the file whole, so that it can be opened from the message."""
    import zoo
    import zoo_custom

    case = next(c for c in zoo.all_cases() if c.id == "range-positions")
    with pytest.raises(UnsupportedModelError) as info:
        zoo.run(case.installed())
    assert f" at {zoo_custom.__file__}:" in str(info.value).splitlines()[0]


class BranchOnValueLM(_EmbedHeadLM):
    """A buffer whose feature dim falls between the longest path and the packed row count (a
    random projection ``[16, width]``, Performer's) beside a branch on a tensor's value."""

    def __init__(self, width: int):
        super().__init__()
        self.register_buffer("projection", torch.randn(16, width))

    def forward(self, idx):
        x = self.emb(idx)
        if x.sum() > 0:  # the capture fails here, not at the buffer
            x = x * 2
        return self.head(x + (x[..., :1] @ self.projection[:1, :1]))


def test_a_capture_failing_on_a_value_names_its_line_not_a_buffer():
    """A capture that fails on a tensor's value is not blamed on a buffer that happens to have
    a dim in the range a table sliced by the row count would have, nor retried with it grown."""
    batch, _ = make_batch("branchy")
    longest = int(batch.position_ids.max()) + 1
    width = batch.num_tokens - 1
    assert longest <= width < batch.num_tokens
    with pytest.raises(UnsupportedModelError) as info:
        tree_compile(tiny(BranchOnValueLM, width=width))(batch)
    first = str(info.value).splitlines()[0]
    assert "if x.sum() > 0:" in first and "slices buffer" not in first, first


def test_a_module_backward_hook_is_refused_by_name_at_wrap_time():
    """fairseq's LinearizedConvolution clears an inference cache in a hook registered by
    register_backward_hook: refused naming the module and the hook, the model left as it was."""
    model = _EmbedHeadLM()

    def _clear_linearized_weight(module, grad_input, grad_output):
        return None

    model.head.register_backward_hook(_clear_linearized_weight)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(UnsupportedModelError, match=r"module 'head' \(Linear\) has a backward hook registered by "
                                                    r"register_backward_hook \(.*_clear_linearized_weight\)"):
        tree_compile(model)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert len(model.head._backward_hooks) == 1
