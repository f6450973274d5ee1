"""Tables over the rows judged by building them at two lengths (`treecompile.passes.row_tables`).

The zoo checks RWKV-5's decay from the start (``rwkv5-decay-from-start``, exact) and two tables
whose entries change with the length (refused); here other spellings, a table that holds for the
present parameters only, and a table read as an index.
"""

from __future__ import annotations

import pytest
import torch
import zoo
from test_compile_models import NanoGPT
from torch import nn

import treecompile as tc
from treecompile.core.errors import UnsupportedModelError


class _Embedded(NanoGPT):
    """NanoGPT (one layer) whose embeddings and positions are ``embed(idx)``: ``(x, pos)``."""

    def __init__(self):
        super().__init__(layers=1)

    def forward(self, idx):
        x, pos = self.embed(idx)
        for blk in self.blocks:
            x = blk(x, pos)
        return self.head(self.norm(x))


class _CountedRope(_Embedded):
    """RoPE at ``ones(T).cumsum(0) - 1`` (a count along the rows for ``arange(T)``)."""

    def embed(self, idx):
        return self.emb(idx), torch.ones(idx.shape[1], dtype=self.emb.weight.dtype, device=idx.device).cumsum(0) - 1


class _LearnedTable(_Embedded):
    """Learned absolute positions looked up at ``arange(T - 1, -1, -1).flip(0)``."""

    def __init__(self):
        super().__init__()
        self.wpe = nn.Embedding(64, self.emb.embedding_dim)

    def embed(self, idx):
        rows = torch.arange(idx.shape[1] - 1, -1, -1, device=idx.device).flip(0)
        return self.emb(idx) + self.wpe(rows), rows


class _LearnedEndDecay(_Embedded):
    """A gate ``exp(-rate * (T - 1 - t))`` toward the end of the sequence: per path its entries
    depend on the path's length, unless ``rate`` is 0 (as it is at initialisation)."""

    def __init__(self):
        super().__init__()
        self.rate = nn.Parameter(torch.zeros(()))

    def embed(self, idx):
        to_end = torch.arange(idx.shape[1] - 1, -1, -1, device=idx.device).to(self.emb.weight.dtype)
        return self.emb(idx) * torch.exp(-self.rate * to_end)[:, None], torch.arange(idx.shape[1], device=idx.device)


class _TableAsIndex(_Embedded):
    """The rows read in reverse (``x[:, arange(T - 1, -1, -1)]``): an index over the rows, not a table."""

    def embed(self, idx):
        x = self.emb(idx)
        x = x + 0.5 * x[:, torch.arange(idx.shape[1] - 1, -1, -1, device=idx.device)]
        return x, torch.arange(idx.shape[1], device=idx.device)


class _GatheredTable(_Embedded):
    """A sinusoid table built over ``arange(T)`` each call and gathered at the ``position_ids``
    the model is given (transformers 4.x's rotary cache registered again for a longer
    sequence, then ``cos[position_ids]``)."""

    def __init__(self):
        super().__init__()
        self.freqs = nn.Parameter(torch.linspace(0.1, 1.0, self.emb.embedding_dim))

    def table(self, T, device):
        return torch.sin(torch.arange(T, device=device).to(self.freqs.dtype)[:, None] * self.freqs)

    def forward(self, idx, position_ids=None):
        T = idx.shape[1]
        if position_ids is None:
            position_ids = torch.arange(T, device=idx.device)[None]
        x = self.emb(idx) + self.table(T, idx.device)[position_ids.view(-1, T)]
        pos = torch.arange(T, device=idx.device)
        for blk in self.blocks:
            x = blk(x, pos)
        return self.head(self.norm(x))


class _GatheredEndTable(_GatheredTable):
    """The same gather of a table whose entry ``t`` is ``T - 1 - t`` (its distance to the end):
    per path, the path's length."""

    def table(self, T, device):
        return torch.sin((T - 1 - torch.arange(T, device=device)).to(self.freqs.dtype)[:, None] * self.freqs)


def _build(cls):
    def build():
        torch.manual_seed(0)
        return zoo.perturb(cls().double().eval())

    return build


@pytest.mark.parametrize("cls", [_CountedRope, _LearnedTable], ids=["counted-rope", "learned-table"])
def test_a_table_over_the_rows_by_another_spelling_is_read_at_path_positions(cls):
    zoo.run(zoo.Case(cls.__name__, cls.__doc__, _build(cls)))
    compiled = tc.tree_compile(_build(cls)(), backend="eager")
    compiled(zoo.batches()[0][1])
    assert compiled.counters["rewrite_positions_pass"]["row_table"] >= 1


def test_a_table_over_the_rows_gathered_at_the_given_position_ids_is_read_as_it_is():
    zoo.run(zoo.Case("gathered", _GatheredTable.__doc__, _build(_GatheredTable)))
    compiled = tc.tree_compile(_build(_GatheredTable)(), backend="eager")
    compiled(zoo.batches()[0][1])
    assert compiled.counters["rewrite_positions_pass"]["table_gather"] >= 1
    with pytest.raises(UnsupportedModelError, match="arange"):
        tc.tree_compile(_build(_GatheredEndTable)(), backend="eager")(zoo.batches()[0][1])


def test_a_table_that_holds_for_the_present_parameters_only_is_refused():
    model = _build(_LearnedEndDecay)()
    with torch.no_grad():
        model.rate.zero_()  # the table is all ones now, whatever the length: not after a step
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(UnsupportedModelError, match="whose entries change with the sequence length"):
        tc.tree_compile(model, backend="eager")(zoo.batches()[0][1])
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


def test_an_index_over_the_rows_is_not_read_as_a_table():
    with pytest.raises(UnsupportedModelError, match="arange"):
        tc.tree_compile(_build(_TableAsIndex)(), backend="eager")(zoo.batches()[0][1])
