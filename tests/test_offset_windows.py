"""Windows of the rows at several offsets padded back to the length
(`treecompile.passes.offset_slices`).

The zoo checks recurrentgemma's Conv1D (``recurrentgemma-hawk-conv``); here other windows the
rule makes exact, and windows it leaves to the verify pass.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import zoo
from test_compile_models import NanoGPT
from torch import nn

import treecompile as tc
from treecompile.core.errors import UnsupportedModelError


class _Mixed(NanoGPT):
    """NanoGPT with ``mix(x, gate)`` added to the embeddings."""

    def __init__(self, mix):
        super().__init__(layers=1)
        self.mix = mix
        self.gate = nn.Parameter(torch.randn(self.emb.embedding_dim))

    def forward(self, idx):
        x = self.emb(idx)
        x = x + self.mix(x, self.gate)
        pos = torch.arange(idx.shape[1], device=idx.device)
        for blk in self.blocks:
            x = blk(x, pos)
        return self.head(self.norm(x))


def _model(mix):
    torch.manual_seed(0)
    return zoo.perturb(_Mixed(mix).double().eval())


def _two_offsets(x, g):
    """Row t: x[t - 2] * sigmoid(x[t - 1]) * g, zero on the first two rows of each path."""
    t = x.shape[1]
    return F.pad(x[:, : t - 2] * torch.sigmoid(x[:, 1 : t - 1]) * g, (0, 0, 2, 0))


def _own_row_and_one_back(x, g):
    """Row t: x[t] - x[t - 1], filled with 0.5 on each path's first row."""
    return F.pad(x[:, 1:] - x[:, :-1], (0, 0, 1, 0), value=0.5) * g


def _window_read_elsewhere(x, g):
    w = x[:, :-1] * g
    return F.pad(w, (0, 0, 1, 0)) + w.mean(1, keepdim=True)


def _slice_written_after_the_cut(x, g):
    """The slice is a view: the write after the cut is in what the window reads."""
    y = x.clone()
    cut = y[:, :-1]
    y.mul_(2)
    return F.pad(cut * g, (0, 0, 1, 0))


def _running_sum_in_the_window(x, g):
    return F.pad(x[:, :-1].cumsum(1) * g, (0, 0, 1, 0))


@pytest.mark.parametrize("mix", [_two_offsets, _own_row_and_one_back], ids=["two-offsets", "own-row-and-one-back"])
def test_a_window_of_offset_slices_padded_back_is_exact(mix):
    zoo.run(zoo.Case(mix.__name__, mix.__doc__, lambda: _model(mix)))
    compiled = tc.tree_compile(_model(mix), backend="eager")
    compiled(zoo.batches()[0][1])
    assert compiled.counters["rewrite_conv_context_pass"]["offset_window"] == 1


def test_a_window_read_elsewhere_is_refused():
    model = _model(_window_read_elsewhere)
    with pytest.raises(UnsupportedModelError, match="sequence"):
        tc.tree_compile(model, backend="eager")(zoo.batches()[0][1])


def test_a_slice_of_a_tensor_written_in_place_is_left_to_the_verify_pass():
    model = _model(_slice_written_after_the_cut)
    compiled = tc.tree_compile(model, backend="eager")
    try:
        zoo.run(zoo.Case("written-slice", "", lambda: model))
    except UnsupportedModelError:
        pass  # refused by name: never silently wrong
    try:
        compiled(zoo.batches()[0][1])
    except UnsupportedModelError:
        pass
    assert compiled.counters.get("rewrite_conv_context_pass", {}).get("offset_window", 0) == 0


def test_a_running_sum_in_the_window_is_exact_or_refused():
    try:
        zoo.run(zoo.Case("running-sum-window", "", lambda: _model(_running_sum_in_the_window)))
    except UnsupportedModelError:
        pass  # refused by name: never silently wrong
