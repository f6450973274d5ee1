"""What the passes judge from example values holds for every later batch: a window wider
than the first batch is found when a longer path arrives (the model is compiled again)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from test_compile_models import ManualGPT, compare_with_paths, rope

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


class BufferJudgedLM(nn.Module):
    """Eager attention under a mask or bias built from a buffer the user may set between steps:
    a sliding window kept as a tensor (``window``), or ALiBi slopes (``slopes``)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.emb, self.head = nn.Embedding(VOCAB, DIM), nn.Linear(DIM, VOCAB)
        self.qkv = nn.ModuleList(nn.Linear(DIM, 3 * DIM) for _ in range(2))
        self.o = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(2))
        self.register_buffer("window", torch.tensor(100))
        self.register_buffer("slopes", torch.tensor([0.5, 0.25]))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        b, t = idx.shape
        i = torch.arange(t, device=idx.device)
        if self.kind == "window":
            keep = (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < self.window)
            bias = torch.zeros(t, t, dtype=self.emb.weight.dtype).masked_fill(~keep, float("-inf"))
        else:
            bias = -(i[:, None] - i[None, :]).clamp(min=0)[None] * self.slopes[:, None, None]
            bias = bias.masked_fill(i[:, None] < i[None, :], float("-inf"))
        x = self.emb(idx)
        for qkv, o in zip(self.qkv, self.o):
            q, k, v = qkv(x).view(b, t, 3, 2, DIM // 2).permute(2, 0, 3, 1, 4)
            a = ((q @ k.transpose(-2, -1)) / (DIM // 2) ** 0.5 + bias).softmax(-1) @ v
            x = x + o(a.transpose(1, 2).reshape(b, t, DIM))
        return self.head(x)


@pytest.mark.parametrize("kind, change", [
    ("window", "in place"), ("slopes", "in place"), ("window", "a new tensor"),
])
def test_a_buffer_set_between_steps_is_judged_again(kind, change):
    """The passes judge a mask or bias from the buffer's values (a window of 100 lets every key
    through; slopes become the score terms); set to other values between two steps, the buffer
    makes the graph compile again, judged anew (the first graph trained on: loss 1% to 3% off)."""
    import zoo

    model = zoo.perturb(BufferJudgedLM(kind).double())
    compiled = tc.tree_compile(model, backend="eager")
    forests = [[[1, 2, 3, 4, 5, 6], [1, 2, 5], [1, 7, 8, 9, 10, 11]], [[3, 4, 5, 6, 2, 2], [3, 4, 9, 2, 10, 11]]]
    for step, paths in enumerate(forests):
        if step == 1:
            with torch.no_grad():
                if change == "in place":
                    model.window.fill_(2)
                    model.slopes.mul_(3)
                else:
                    model.window = torch.tensor(2)
        trees = [tc.TrajectoryTree.from_sequences(paths)]
        zoo.compare(model, compiled, tc.pack(trees, warn_por=False), trees)
    assert len(compiled.compile_records) == 2
    trees = [tc.TrajectoryTree.from_sequences(forests[0])]
    zoo.compare(model, compiled, tc.pack(trees, warn_por=False), trees)  # unchanged since: no third compile
    assert len(compiled.compile_records) == 2


def test_a_buffer_set_between_steps_is_judged_again_when_streamed():
    """The same, over the streamed runner (parts of at most 8 rows): its part graph compiles again."""
    import zoo

    from treecompile.stream.options import StreamOptions

    model = zoo.perturb(BufferJudgedLM("window").double())
    compiled = tc.tree_compile(model, backend="eager", stream=StreamOptions(budget_rows=8))
    forests = [[[1, 2, 3, 4, 5, 6], [1, 2, 5], [1, 7, 8, 9, 10, 11]], [[3, 4, 5, 6, 2, 2], [3, 4, 9, 2, 10, 11]]]
    for step, paths in enumerate(forests):
        if step == 1:
            with torch.no_grad():
                model.window.fill_(2)
        trees = [tc.TrajectoryTree.from_sequences(paths)]
        zoo.compare(model, compiled, tc.pack(trees, warn_por=False), trees)


def test_a_buffer_extended_for_the_call_and_one_made_in_inference_mode_compile_once():
    """The guard on judged tensors does not compile again at every call: a ``tril`` buffer
    shorter than the packed row is extended once while it is unchanged (a new extension per call
    would be a new tensor each time), and a buffer made under ``torch.inference_mode`` (no version
    counter) is guarded by its identity and memory."""
    import zoo

    paths = [[1 + i, 2 + i, 3, 4, 5, 6, 7, 8, 9] for i in range(3)]  # 27 rows, paths of 9
    trees = [tc.TrajectoryTree.from_sequences(paths)]
    batch = tc.pack(trees, warn_por=False)
    model = zoo.perturb(ManualGPT(block_size=16).double())
    compiled = tc.tree_compile(model, backend="eager")
    for _ in range(3):
        zoo.compare(model, compiled, batch, trees)
    assert len(compiled.compile_records) == 1, len(compiled.compile_records)

    model = zoo.perturb(BufferJudgedLM("window").double())
    with torch.inference_mode():
        model.window = torch.tensor(3)
    compiled = tc.tree_compile(model, backend="eager")
    for _ in range(2):
        zoo.compare(model, compiled, batch, trees)
    assert len(compiled.compile_records) == 1, len(compiled.compile_records)
