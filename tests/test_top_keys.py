"""Sparse attention that keeps each query's top-k keys (DeepSeek-V3.2's indexer), on dense ``[S, S]``
tensors (`treecompile.passes.attention.dense_pairs`, `treecompile.passes.attention.top_keys`).

The zoo runs the Hugging Face models (``deepseek-v32``, ``glm-moe-dsa``, ``deepseek-v32-ties``); here the
tie rule itself, a sparse attention written by hand (exact, and refused on a batch whose scores tie,
leaving the grad mode and the model as they were), and what the rule refuses.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import zoo
import zoo_custom as zc

import treecompile as tc
from treecompile.core.errors import BatchRefused, UnsupportedModelError
from treecompile.passes.attention.top_keys import ambiguous_queries, tree_top_keys

INF = float("inf")


def _rows(*rows):
    return torch.tensor(rows, dtype=torch.float64)


@pytest.mark.parametrize("scores,visible,k,tied", [
    ([3.0, 1.0, 1.0, 0.0], [1, 1, 1, 1], 2, True),        # the 2nd and 3rd best tie: which one is kept is chance
    ([3.0, 3.0, 1.0, 0.0], [1, 1, 1, 1], 2, False),       # a tie inside the top 2: both kept
    ([3.0, 1.0, 0.0, 0.0], [1, 1, 1, 1], 2, False),       # a tie below the top 2: neither kept
    ([5.0, -INF, -INF, -INF], [1, 0, 0, 0], 2, False),    # fewer visible keys than k: all of them kept
    ([5.0, -INF, -INF, -INF], [1, 1, 0, 0], 2, True),     # a visible key at -inf ties with the hidden ones
    ([2.0, 1.0, -INF, -INF], [1, 1, 0, 0], 4, False),     # k covers the row
])
def test_a_choice_is_ambiguous_exactly_where_tied_scores_meet_at_the_kth_key(scores, visible, k, tied):
    vis = torch.tensor(visible, dtype=torch.bool)[None].expand(1, len(visible))
    chosen, got = ambiguous_queries(_rows(scores), k, -INF, vis)
    assert got.tolist() == [tied]
    assert sorted(chosen[0].tolist()) == sorted(_rows(scores).topk(min(k, len(scores))).indices[0].tolist()) or tied


def test_a_tie_refuses_the_batch_naming_the_line():
    with pytest.raises(BatchRefused, match=r"the top-2 keys of 1 query at model.py:7 are a choice among tied scores"):
        tree_top_keys(_rows([3.0, 1.0, 1.0, 0.0]), 2, -INF, torch.ones(1, 4, dtype=torch.bool), "model.py:7")
    chosen = tree_top_keys(_rows([3.0, 1.0, 2.0, 0.0]), 2, -INF, torch.ones(1, 4, dtype=torch.bool), "model.py:7")
    assert sorted(chosen.flatten().tolist()) == [0, 2]


class _SparseAttn(zc._Attn):
    """DeepSeek sparse attention written by hand: an indexer's per-head ReLU scores summed with
    per-query weights, the causal keys' top ``TOPK`` per query, SDPA over those."""

    TOPK = 3
    INDEX_HEADS = 16

    def __init__(self) -> None:
        super().__init__()
        self.iq = nn.Linear(zc.DIM, self.INDEX_HEADS * 8)
        self.ik = nn.Linear(zc.DIM, 8)
        self.iw = nn.Linear(zc.DIM, self.INDEX_HEADS)

    def index(self, h, causal):
        """The indexer's scores ``[b, t, t]``, hidden off the causal keys."""
        b, t, _ = h.shape
        scores = torch.matmul(self.iq(h).view(b, t, self.INDEX_HEADS, 8), self.ik(h).transpose(-1, -2).unsqueeze(1))
        index = torch.matmul(self.iw(h).unsqueeze(-2), scores.relu()).squeeze(-2)
        return index.masked_fill(~causal, float("-inf"))

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.heads(x)
        causal = self.causal[0, 0, :t, :t].bool()
        with torch.no_grad():  # the indexer gets no gradient from the loss (as in Hugging Face's)
            top = self.index(self.ln(x), causal).topk(min(self.TOPK, t), dim=-1).indices
        keep = torch.zeros(b, t, t, dtype=torch.bool).scatter(-1, top, True) & causal
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None])
        x = x + self.o(y.transpose(1, 2).reshape(b, t, zc.DIM))
        return x + self.mlp(self.ln2(x))


class _SparseAttnEinsum(_SparseAttn):
    """The indexer as DeepSeek's reference writes it: ``einsum("bshd,btd->bsht")`` scores per head,
    ``einsum("bsht,bsh->bst")`` summing them with each query's weights."""

    def index(self, h, causal):
        b, t, _ = h.shape
        scores = torch.einsum("bshd,btd->bsht", self.iq(h).view(b, t, self.INDEX_HEADS, 8), self.ik(h)).relu()
        return torch.einsum("bsht,bsh->bst", scores, self.iw(h)).masked_fill(~causal, float("-inf"))


class _SparseAttnReference(_SparseAttn):
    """DeepSeek-V3.2's reference (``inference/model.py``): the chosen keys' mask built in place,
    ``torch.full(.., -inf).scatter_(-1, topk_indices, 0)``, plus the causal mask, added to the
    scores before a softmax."""

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.heads(x)
        h = self.ln(x)
        mask = torch.where(self.causal[0, 0, :t, :t].bool(), 0.0, float("-inf")).to(x.dtype)
        scores = torch.einsum("bshd,btd->bsht", self.iq(h).view(b, t, self.INDEX_HEADS, 8), self.ik(h)).relu()
        index = torch.einsum("bsht,bsh->bst", scores, self.iw(h)) + mask
        top = index.topk(min(self.TOPK, t), dim=-1)[1]
        index_mask = torch.full((b, t, t), float("-inf"), dtype=x.dtype)
        index_mask.scatter_(-1, top, 0)
        att = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5 + (index_mask + mask).unsqueeze(1)
        y = att.softmax(-1) @ v
        x = x + self.o(y.transpose(1, 2).reshape(b, t, zc.DIM))
        return x + self.mlp(self.ln2(x))


def _model(attn=_SparseAttn):
    torch.manual_seed(0)
    return zoo.perturb(zc._spelling(attn)().double().eval())


@pytest.mark.parametrize("attn", [_SparseAttn, _SparseAttnEinsum, _SparseAttnReference],
                         ids=["matmul", "einsum", "reference"])
def test_a_sparse_attention_written_by_hand_equals_per_path_training(attn):
    model = _model(attn)
    compiled = tc.tree_compile(model, backend="eager")
    for _, batch, trees in zoo.batches():
        zoo.compare(model, compiled, batch, trees)
    # Per layer: the indexer's scores up to the top-k, and the attention's mask.
    assert dict(compiled.counters["rewrite_attention_pass"]) == {"dense_pairs": 4}


def test_a_batch_whose_scores_tie_is_refused_and_leaves_the_grad_mode_and_the_model_as_they_were():
    model = _model()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, _SparseAttn):
                m.iw.weight.zero_()  # every key scores the indexer's bias: all tie
    before = {k: v.clone() for k, v in model.state_dict().items()}
    compiled = tc.tree_compile(model, backend="eager")
    with pytest.raises(BatchRefused, match=r"are a choice among tied scores"):
        compiled(zoo.batches()[1][1])
    assert torch.is_grad_enabled()
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


class _ChosenKeysRead(_SparseAttn):
    """The chosen keys' indices added to the output: packed row indices on the tree."""

    def forward(self, x):
        t = x.shape[1]
        top = self.index(self.ln(x), self.causal[0, 0, :t, :t].bool()).topk(min(self.TOPK, t), dim=-1).indices
        return x + top.sum(-1, keepdim=True).to(x.dtype)


class _UnmaskedIndexer(_SparseAttn):
    """Top-k over scores the future is not hidden from."""

    def index(self, h, causal):
        return super().index(h, torch.ones_like(causal))


@pytest.mark.parametrize("attn,match", [
    (_ChosenKeysRead, r"reads the keys a top-k over the keys chose other than to mark them"),
    (_UnmaskedIndexer, r"chooses among keys it does not rank last off the path"),
])
def test_what_is_not_exact_is_refused_by_name(attn, match):
    model = zoo.perturb(zc._spelling(attn)().double().eval())
    with pytest.raises(UnsupportedModelError, match=match):
        tc.tree_compile(model, backend="eager")(zoo.batches()[0][1])
