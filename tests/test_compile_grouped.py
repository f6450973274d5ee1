"""Sort-based expert dispatch (treecompile.passes.rows.grouped): exact as torchtitan writes it,
refused by name wherever a step no longer keeps each token's rows to itself.

The zoo runs torchtitan's MoE itself (``torchtitan-moe-sorted``); here one small MoE layer
between an embedding and a head, with each step of the dispatch changed in turn. Every
variant below trains wrong on a tree (or cannot be shown not to): a piece cut at other
boundaries runs a token with another expert's weights, a count used as a value counts every
path's tokens at once.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_compile_models import VOCAB, compare_with_paths, make_batch, tiny
from torch import nn

import treecompile as tc
from treecompile.core.errors import UnsupportedModelError

E, K, DIM = 4, 2, 16


class SortedMoELM(nn.Module):
    """Embedding, a top-2 of 4 experts layer dispatched by argsort / histc / split, a head."""

    def __init__(self, variant: str = "exact"):
        super().__init__()
        self.variant = variant
        self.emb, self.head = nn.Embedding(VOCAB, DIM), nn.Linear(DIM, VOCAB)
        self.gate = nn.Linear(DIM, E, bias=False)
        self.w1 = nn.Parameter(torch.randn(E, 2 * DIM, DIM) * 0.3)
        self.w2 = nn.Parameter(torch.randn(E, DIM, 2 * DIM) * 0.3)

    def keys(self, x):
        scores = F.softmax(self.gate(x), dim=1)
        top, idx = torch.topk(scores, K, dim=1)
        return top, idx

    def forward(self, tokens):
        b, t = tokens.shape
        x = self.emb(tokens).view(-1, DIM)
        top, idx = self.keys(x)
        v = self.variant
        bins = E + 1 if v == "histc-bins" else E
        counts_of = self.keys(x * 1.5)[1] if v == "other-keys" else idx
        counts = torch.histc(counts_of.view(-1).float(), bins=bins, min=0, max=bins).to(torch.int64)
        if v == "sort":  # ScatterMoE's spelling: the sorted keys and their ids at once
            _, order = idx.view(-1).sort()
        else:
            order = torch.argsort(idx.view(-1), stable=True, descending=v == "descending")
        scores = top.view(-1)[order]
        rows = (order // K).reshape(-1, 1).expand(-1, DIM)
        routed = torch.gather(x, 0, rows)
        sizes = (counts * 1 if v == "computed-counts" else counts).tolist()
        if v == "sizes-reversed":
            sizes = sizes[::-1]
        pieces = torch.split(routed[: sum(sizes)], sizes[:E], dim=0)
        outs = []
        for g, piece in enumerate(pieces):
            h = F.silu(piece @ self.w1[g].T)
            if v == "piece-mean":
                h = h - h.mean(dim=0, keepdim=True)
            outs.append(h @ self.w2[g].T)
        if v == "cat-reversed":
            outs = outs[::-1]
        out = torch.cat(outs, dim=0)
        out = torch.vstack((out, out.new_zeros((x.shape[0] * K - sum(sizes), DIM))))
        if v == "count-as-value":
            out = out * (1.0 + counts[0].item() / 100.0)
        y = x.scatter_add(0, rows, out * scores.reshape(-1, 1))
        return self.head(y.view(b, t, DIM))


@pytest.mark.parametrize("variant", ["exact", "sort"])
def test_sorted_dispatch_matches_per_path_training(variant):
    model = tiny(SortedMoELM, variant=variant)
    compiled = tc.tree_compile(model, backend="eager")
    for name in ("branchy", "forest"):
        batch, trees = make_batch(name)
        compare_with_paths(model, compiled, batch, trees, tol="pure")


@pytest.mark.parametrize("variant, named", [
    ("descending", "argsort"),
    ("sizes-reversed", "at sizes other than the counts of its own 4 groups in order"),
    ("cat-reversed", "cat"),
    ("piece-mean", "mean"),
    ("histc-bins", "histc"),
    ("other-keys", "at sizes other than the counts of its own 4 groups in order"),
    ("count-as-value", "a count of rows chosen by the data"),
    ("computed-counts", "takes one row of the sequence by its index"),
])
def test_a_dispatch_step_that_mixes_tokens_is_refused_by_name(variant, named):
    batch, _ = make_batch("branchy")
    model = tiny(SortedMoELM, variant=variant)
    with pytest.raises(UnsupportedModelError) as info:
        tc.tree_compile(model, backend="eager")(batch)
    first = str(info.value).splitlines()[0]
    assert named in first and "test_compile_grouped.py:" in first, first
