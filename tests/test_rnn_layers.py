"""torch's recurrent layers (nn.LSTM, nn.GRU, nn.RNN) on a tree (kernels/scans/rnn.py, the SSM
state pass): each tree node runs from its parent node's final states. The zoo checks the
word_language_model LMs with the rewritten graph run as it is; here, the default lowering,
the swap of torch's ``_VF`` undone after a call, and a streamed call refused by name."""

from __future__ import annotations

import pytest
import torch
import zoo_repos
from test_compile_models import compare_with_paths, make_batch
from zoo import perturb

import treecompile as tc
from treecompile.core.errors import UnsupportedModelError
from treecompile.stream.options import StreamOptions


def _lstm():
    torch.manual_seed(0)
    return perturb(zoo_repos.RNNModel("LSTM").double().eval())


@pytest.mark.full
def test_an_lstm_lm_lowered_by_default_matches_per_path_training():
    model = _lstm()
    compiled = tc.tree_compile(model)
    for shape in ("branchy", "forest"):
        batch, trees = make_batch(shape)
        compare_with_paths(model, compiled, batch, trees, tol="pure")
    assert compiled.counters["route_ssm_state_pass"]["rnn"] == 1


def test_torch_vf_is_torch_s_own_outside_a_call():
    import torch.nn.modules.rnn as rnn

    model = _lstm()
    batch, _ = make_batch("branchy")
    tc.tree_compile(model, backend="eager")(batch)
    assert rnn._VF is torch._VF


def test_a_streamed_call_refuses_a_recurrent_layer_by_name():
    batch, _ = make_batch("branchy")
    compiled = tc.tree_compile(_lstm(), backend="eager", stream=StreamOptions(budget_rows=4))
    with pytest.raises(UnsupportedModelError, match=r"is a recurrent layer, and this call has no path structure"):
        compiled(batch)


class _SeedLSTM(torch.nn.Module):
    """An LSTM over a learned seed (no token in it), its mean added to every embedding; then an
    LSTM over the tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(32, 16)
        self.seed = torch.nn.Parameter(torch.randn(1, 5, 16))
        self.prior = torch.nn.LSTM(16, 16, batch_first=True)
        self.rnn = torch.nn.GRU(16, 16, batch_first=True)
        self.head = torch.nn.Linear(16, 32)

    def forward(self, idx):
        x = self.emb(idx) + self.prior(self.seed)[0].mean(1, keepdim=True)
        return self.head(self.rnn(x)[0])


def test_a_layer_not_over_the_tokens_runs_as_torch_s_own():
    torch.manual_seed(0)
    model = perturb(_SeedLSTM().double().eval())
    compiled = tc.tree_compile(model, backend="eager")
    batch, trees = make_batch("forest")
    compare_with_paths(model, compiled, batch, trees, tol="pure")
    assert compiled.counters["route_ssm_state_pass"]["rnn"] == 1  # the GRU; the seed's LSTM is torch's


def test_an_eager_call_while_the_swap_holds_is_torch_s_own():
    """Another thread's eager nn.LSTM while a tree call holds the swap: torch's function, with
    its autograd."""
    import torch.nn.modules.rnn as rnn

    from treecompile.kernels.scans.rnn import VF_FOR_CAPTURE

    lstm = torch.nn.LSTM(4, 5, 2, batch_first=True).double()
    x = torch.randn(2, 6, 4, dtype=torch.float64, requires_grad=True)
    want = lstm(x)[0]
    saved, rnn._VF = rnn._VF, VF_FOR_CAPTURE
    try:
        got = lstm(x)[0]
    finally:
        rnn._VF = saved
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    got.sum().backward()
    assert x.grad is not None
