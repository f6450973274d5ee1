"""What the passes judge from example values holds for every later batch: a window wider
than the first batch is found when a longer path arrives (the model is compiled again)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from test_compile_models import compare_with_paths, rope

import treecompile as tc

WINDOW, VOCAB, DIM = 40, 32, 16


class WindowedGPT(nn.Module):
    """Manual attention with a sliding window that exists only in a mask built from ``arange(T)``."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.o = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        b, t = idx.shape
        x = self.emb(idx)
        q, k, v = (z.view(b, t, 2, DIM // 2).transpose(1, 2) for z in self.qkv(x).chunk(3, -1))
        pos = torch.arange(t, device=idx.device)
        q, k = rope(q, pos), rope(k, pos)
        i = torch.arange(t, device=idx.device)
        allowed = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < WINDOW)
        att = (q @ k.transpose(-1, -2)) / math.sqrt(DIM // 2)
        att = F.softmax(att.masked_fill(~allowed, float("-inf")), -1)
        y = (att @ v).transpose(1, 2).reshape(b, t, DIM)
        return self.head(x + self.o(y))


def _tree(g: torch.Generator, stem: int, branches: list[int]) -> tc.TrajectoryTree:
    root = torch.randint(0, VOCAB, (stem,), generator=g).tolist()
    paths = [root + torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in branches]
    return tc.TrajectoryTree.from_sequences(paths)


def test_a_window_wider_than_the_first_batch_is_found_on_a_longer_path():
    torch.manual_seed(0)
    model = WindowedGPT().double().eval()
    g = torch.Generator().manual_seed(0)
    compiled = tc.tree_compile(model, backend="eager")
    short = _tree(g, 5, [6, 5, 7])  # 23 rows: the whole row is shorter than the window
    compare_with_paths(model, compiled, tc.pack([short]), [short], tol="pure")
    assert compiled.compile_records[-1].max_rows is not None
    long = _tree(g, 70, [30, 25])  # paths of 100 and 95 tokens: the window cuts in
    compare_with_paths(model, compiled, tc.pack([long]), [long], tol="pure")
    assert len(compiled.compile_records) == 2
    assert compiled.compile_records[-1].max_rows >= 2 * 100
    # A batch within the proven length runs on the same graph.
    compare_with_paths(model, compiled, tc.pack([short]), [short], tol="pure")
    assert len(compiled.compile_records) == 2
