"""State a model keeps between calls (treecompile.passes.state): computed as the unmodified
model computes it, written once per call, never written by a call that fails or is refused.

The zoo (tests/zoo_repos/state.py) checks the stateful repository models for exactness and
that the model run on its own is unchanged after tree calls; these tests check what the
zoo cannot see: how often state is written, what a refusal leaves behind, and the names in
the refusals."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
import zoo
import zoo_repos
from torch import nn
from zoo_repos.common import DIM, HD, HEADS, VOCAB
from zoo_repos.state import CountingLM, GrownMaskLM, LucidrainsRotaryLM, MegatronRotaryLM

import treecompile as tc
from treecompile.core.errors import UnsupportedModelError
from treecompile.passes.rows import RULES, Rule
from treecompile.passes.rows.elementwise import pointwise

def _build(cls, **kw) -> nn.Module:
    torch.manual_seed(0)
    return zoo.perturb(cls(**kw).double().eval())


def _batches():
    return [batch for _, batch, _ in zoo.batches()]


def _snapshot(model: nn.Module) -> dict:
    """Everything of the model a call could change: parameters, buffers, and the plain
    attributes of every module (Python numbers, tensors, dicts of them)."""
    state = {f"param {n}": p.detach().clone() for n, p in model.named_parameters()}
    state.update({f"buffer {n}": b.clone() for n, b in model.named_buffers()})
    for name, m in model.named_modules():
        for k, v in vars(m).items():
            if not k.startswith("_") and (v is None or isinstance(v, (int, float, dict, list, torch.Tensor))):
                state[f"attr {name}.{k}"] = copy.deepcopy(v)
    return state


def _assert_same(before: dict, after: dict) -> None:
    assert before.keys() == after.keys(), before.keys() ^ after.keys()
    for k, v in before.items():
        w = after[k]
        same = torch.equal(v, w) if isinstance(v, torch.Tensor) else v == w
        assert same, f"{k} changed: {v!r} -> {w!r}"


def test_counters_advance_once_per_call_and_compile_once():
    """``self.steps += 1`` (a tensor buffer) and ``self.num_calls += 1`` (a Python int) advance by
    one per tree call, as in eager training: the first-call probe, which runs the graph on
    batches of its own, writes neither. The Python int becomes a symbol after its first change,
    so twelve calls (over Dynamo's recompile limit of 8) compile at most twice."""
    model = _build(CountingLM)
    compiled = tc.tree_compile(model, backend="eager")
    batches = _batches()
    for i in range(12):
        compiled(batches[i % 2]).loss.backward()
        assert int(model.steps) == i + 1 and model.num_calls == i + 1, (int(model.steps), model.num_calls)
    assert len(compiled.compile_records) <= 2, [r.seq_len for r in compiled.compile_records]
    assert len(compiled.probed) == len(compiled.compile_records)


def test_a_cache_filled_in_place_is_filled_with_sequence_positions():
    """rotary-embedding-torch writes the frequencies of ``arange(T)`` into ``cached_freqs`` in
    place: after a tree call of T rows the buffer holds what the unmodified model writes for a
    sequence of T tokens (not the tree's positions), and its length in the Python int."""
    model = _build(LucidrainsRotaryLM)
    twin = copy.deepcopy(model)
    batch = _batches()[1]
    tc.tree_compile(model, backend="eager")(batch)
    with torch.no_grad():
        twin(torch.zeros(1, batch.num_tokens, dtype=torch.long))
    for r, t in zip(model.rotary, twin.rotary):
        assert r.cached_freqs_seq_len == t.cached_freqs_seq_len == batch.num_tokens
        assert torch.equal(r.cached_freqs, t.cached_freqs)


def test_stateful_models_leave_the_model_as_an_ordinary_call_would():
    """After tree calls of two lengths (the second shorter, so the cache is read back), each
    stateful repository model, run on its own, gives the logits an untouched copy gives, at the
    tree's length and at others."""
    for case_id in ("llama-4.36-rope-cache", "rotary-embedding-torch-cache", "table-filled-in-place"):
        model = zoo_repos.BY_ID[case_id].build()
        twin = copy.deepcopy(model)
        compiled = tc.tree_compile(model, backend="eager")
        for batch in reversed(_batches()):
            with torch.no_grad():
                compiled(batch)
            zoo.assert_unchanged(model, twin, lengths=(batch.num_tokens, 35, 11, 5))


@pytest.mark.full
def test_buffers_a_call_grew_to_the_packed_length_are_read_back_at_that_length():
    """PaLM-pytorch registers its causal mask and rotary table at the length of a call and
    slices them on later calls no longer than that. A tree call grows them to its row count;
    the next call of that row count would read them back as long as its packed row (Dynamo takes
    the row count for the buffers' size): it runs a zero-weight row more, so the model grows
    them by one, and is exact; so is a shorter one, and the model run on its own is unchanged."""
    model = zoo_repos.BY_ID["palm-lazy-buffers"].build()
    twin = copy.deepcopy(model)
    compiled = tc.tree_compile(model, backend="eager")
    long, short = sorted(zoo.batches(), key=lambda b: -b[1].num_tokens)
    rows = long[1].num_tokens
    for (_, batch, trees), grown in ((long, rows), (long, rows + 1), (short, rows + 1)):
        zoo.compare(model, compiled, batch, trees)
        assert model.blocks[0].mask.shape[-1] == grown
    zoo.assert_unchanged(model, twin, lengths=(rows, 11, 5))


def _exact_call_after_call(model: nn.Module, compiled, runs) -> None:
    """Tree calls in a row on one model, each against per-path training of a copy taken just
    before it (the per-path reference must not reset what the tree calls keep): loss and every
    gradient to float64 rounding."""
    from testing import backward_grads

    from treecompile.core.reference import per_path_loss

    for batch, trees in runs:
        twin = zoo.twin_of(model)
        out, grads = backward_grads(model, lambda: compiled(batch))
        ref, ref_grads = backward_grads(twin, lambda: per_path_loss(twin, trees))
        assert abs(out.loss.item() - ref.loss.item()) <= 1e-12 * abs(ref.loss.item()), (out.loss, ref.loss)
        assert grads.keys() == ref_grads.keys()
        for name, g in ref_grads.items():
            torch.testing.assert_close(grads[name], g, rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.parametrize("cls, kw", [(MegatronRotaryLM, {"sliced": False}), (MegatronRotaryLM, {"sliced": True}),
                                     (GrownMaskLM, {})], ids=["megatron-whole", "gpt-neox-sliced", "grown-mask"])
def test_a_cache_built_at_a_calls_length_is_exact_at_every_later_call(cls, kw):
    """GPT-NeoX / Megatron keep their rotary tables as plain attributes rebuilt whenever the
    length changes, OLMo-style models a mask grown to the longest length: a second call of the
    same row count finds a table exactly as long as its packed row (a cache hit), whose entry i
    is for row index i. It runs again with a zero-weight row more, taking the cache-miss
    branch, and every later call of the last call's row count does: exact at every call of 35,
    35, 11, 11, 35 rows (before: the second call refused, the fourth silently wrong for the
    tables read whole, loss 3.4769 vs 3.4767 per path). The model run on its own afterwards is
    unchanged."""
    model = _build(cls, **kw)
    twin = copy.deepcopy(model)
    compiled = tc.tree_compile(model, backend="eager")
    wide, branchy = sorted(((b, t) for _, b, t in zoo.batches()), key=lambda bt: -bt[0].num_tokens)
    _exact_call_after_call(model, compiled, [wide, wide, branchy, branchy, wide])
    zoo.assert_unchanged(model, twin, lengths=(11, 5))


@pytest.mark.full  # several calls in a row
@pytest.mark.parametrize("case", ["torch-examples-transformer", "kerple-neox"])
def test_a_cache_an_ordinary_call_built_at_the_packed_length_is_rebuilt_in_the_call(case):
    """An ordinary call of the model (evaluation, generation) between tree calls leaves its cache
    as long as the next tree's packed row (pytorch/examples' ``self.src_mask``, gpt-neox's Kerple
    ``cached_matrix``): that tree call runs a row more and is exact, though an earlier call had
    already run a row more (it was refused then)."""
    model = zoo_repos.BY_ID[case].build()
    compiled = tc.tree_compile(model, backend="eager")
    wide, branchy = sorted(((b, t) for _, b, t in zoo.batches()), key=lambda bt: -bt[0].num_tokens)
    _exact_call_after_call(model, compiled, [branchy, branchy])
    with torch.no_grad():
        model(torch.arange(wide[0].num_tokens)[None] % VOCAB)
    _exact_call_after_call(model, compiled, [wide])


def test_a_table_as_long_as_the_packed_row_is_not_read_as_rows():
    """Without the retry a table as long as the packed row that an earlier call built is refused
    naming it (a held tensor whose length is the row count is no row of the batch)."""
    from treecompile.passes.verify import HeldAtRowCount

    model = _build(MegatronRotaryLM, sliced=False)
    compiled = tc.tree_compile(model, backend="eager")
    batch = zoo.batches()[0][1]
    compiled(batch)
    with pytest.raises(HeldAtRowCount) as info:
        compiled._tree_call(batch.validate(), away=False)  # the call without the row more
    first = str(info.value).splitlines()[0]
    assert "reads model.rotary.cos_cached, a tensor the model keeps that is as long as the packed row" in first, first


@pytest.mark.full  # several calls in a row
def test_a_streamed_part_as_long_as_a_kept_table_is_refused_by_name():
    """A streamed part whose row count is the length of the table the model kept reads it as a
    cache hit: refused naming the table (the streamed runner runs no row more), never read as
    rows. Two whole-tree calls of 11 rows leave Megatron's tables 12 long (the second ran a row
    more); the 35-row tree streamed in parts of 12 rows then has a part of 12 rows."""
    from treecompile.passes.verify import HeldAtRowCount
    from treecompile.stream.options import StreamOptions

    model = _build(MegatronRotaryLM, sliced=False)
    compiled = tc.tree_compile(model, backend="eager", stream=StreamOptions(budget_rows=12))
    wide, branchy = sorted((b for _, b, _ in zoo.batches()), key=lambda b: -b.num_tokens)
    compiled(branchy)
    compiled(branchy)
    assert model.rotary.seq_len_cached == 12
    with pytest.raises(HeldAtRowCount) as info:
        compiled(wide)
    assert "reads model.rotary.cos_cached" in str(info.value).splitlines()[0], str(info.value)


@pytest.mark.full  # several calls in a row
def test_a_short_table_extended_for_a_long_batch_is_not_extended_along_its_head_dim_later():
    """A 16-entry rotary table ``[16, 8]`` (the zoo's ``rope-table-16-long-tree``): a batch of 24
    rows extends it for its call; a later batch of 16 rows whose paths have 6 tokens does not
    need it extended, and its head dim (8, within [6, 16)) is no table length (it was extended
    to 16 and the call refused, naming "8 entries"). Each call exact."""
    from treecompile.core.reference import per_path_loss

    model = {c.id: c for c in zoo.all_cases()}["rope-table-16-long-tree"].build()
    compiled = tc.tree_compile(model, backend="eager")

    def trees(rows, longest):
        first = [1 + i % 30 for i in range(longest)]
        seqs, k = [first], longest
        while k < rows:
            n = min(longest - 1, rows - k)
            seqs.append(first[:1] + [2 + (i * 7 + k) % 29 for i in range(n)])
            k += n
        return [tc.TrajectoryTree.from_sequences(seqs)]

    for rows, longest in [(24, 8), (16, 6), (12, 5)]:
        forest = trees(rows, longest)
        batch = tc.pack(forest)
        assert (batch.num_tokens, batch.longest_path()[0]) == (rows, longest)
        got, want = compiled(batch).loss.item(), per_path_loss(model, forest).loss.item()
        assert abs(got - want) <= 1e-12 * abs(want), (rows, got, want)


# ------------------------------------------------------------------ refusals
# ------------------------------------------------------------------ refusals


class KeepsActivationsLM(nn.Module):
    """Keeps the last call's keys on the attention module (a cache some training code fills
    and reads for logging) and a running mean of the hidden states in a buffer."""

    def __init__(self, what: str):
        super().__init__()
        self.what = what
        self.emb, self.wpe = nn.Embedding(VOCAB, DIM), nn.Embedding(64, DIM)
        self.qkv, self.proj, self.head = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM), nn.Linear(DIM, VOCAB)
        self.register_buffer("running_mean", torch.zeros(DIM))
        self.last_keys = None
        self.cache_k = torch.zeros(2, 64, HEADS, HD)  # meta-llama's KV cache: plain attributes, float32
        self.cache_v = torch.zeros(2, 64, HEADS, HD)

    def forward(self, idx):
        b, t = idx.shape
        x = self.emb(idx) + self.wpe(torch.arange(t, device=idx.device))
        q, k, v = (z.view(b, t, HEADS, HD).transpose(1, 2) for z in self.qkv(x).split(DIM, -1))
        if self.what == "keys":
            self.last_keys = k.detach()
        elif self.what == "kv-cache":  # meta-llama/llama3 model.py, start_pos = 0
            self.cache_k = self.cache_k.to(k)
            self.cache_v = self.cache_v.to(v)
            self.cache_k[:b, 0:t] = k.transpose(1, 2)
            self.cache_v[:b, 0:t] = v.transpose(1, 2)
            k, v = self.cache_k[:b, :t].transpose(1, 2), self.cache_v[:b, :t].transpose(1, 2)
        else:
            with torch.no_grad():
                self.running_mean.mul_(0.9).add_(0.1 * x[0, -1])
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.head(x + self.proj(y.transpose(1, 2).reshape(b, t, DIM)))


@pytest.mark.parametrize("what, named", [("keys", "model.last_keys"), ("running", "model.running_mean"),
                                         ("kv-cache", "model.cache_k after the call, written in place by node 'setitem'")])
def test_state_computed_from_the_tokens_is_refused_by_name_and_leaves_the_model_unchanged(what, named):
    """A KV cache the forward writes and reads back is named where it is written (before the
    check of the main graph, which would name the slice by the sequence length)."""
    model = _build(KeepsActivationsLM, what=what)
    before, twin = _snapshot(model), copy.deepcopy(model)
    with pytest.raises(UnsupportedModelError) as info:
        tc.tree_compile(model, backend="eager")(_batches()[0])
    first = str(info.value).splitlines()[0]
    assert named in first and "computed from the batch's tokens" in first, first
    assert "test_compile_state.py:" in first, first
    _assert_same(before, _snapshot(model))
    zoo.assert_unchanged(model, twin, lengths=(11, 5))


class RunningMeanCountingLM(CountingLM):
    """CountingLM with a running mean over the sequence (``cumsum / count``) after the
    embeddings: it mixes rows; a hole in the row rules lets it through to the probe."""

    def forward(self, idx):
        self.steps += 1
        self.num_calls += 1
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        x = x.cumsum(1) / torch.arange(1, idx.shape[1] + 1, device=idx.device, dtype=x.dtype)[:, None]
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_a_call_the_probe_refuses_writes_no_state(monkeypatch):
    """The first-call probe runs inside the graph's first call, before the state it writes is
    written back: a refused call leaves the counters, the buffers and the model's outputs as
    they were (the graph itself did run once)."""
    monkeypatch.setitem(RULES, "cumsum", Rule(pointwise, "pointwise"))  # the rules miss it
    model = _build(RunningMeanCountingLM)
    before, twin = _snapshot(model), copy.deepcopy(model)
    # (without the pass that runs the scan along the paths)
    compiled = tc.tree_compile(model, backend="eager", disable_passes=("rewrite_conv_context_pass",))
    with pytest.raises(UnsupportedModelError, match="first-call probe"):
        compiled(_batches()[0])
    _assert_same(before, _snapshot(model))
    assert int(model.steps) == 0 and model.num_calls == 0
    zoo.assert_unchanged(model, twin, lengths=(11, 5))


class StateMaskLM(nn.Module):
    """Eager attention under a mask the model keeps in a buffer: ``written``: the causal mask
    written into a preallocated buffer and read back in the same call; ``counter``: a window
    that widens with a step counter the model advances at every call; ``from_weights``: a
    window written into a buffer from a parameter's (detached) value."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.wte, self.head = nn.Embedding(VOCAB, DIM), nn.Linear(DIM, VOCAB)
        self.qkv, self.proj = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)
        self.register_buffer("cached", torch.zeros(64, 64))
        self.register_buffer("step", torch.tensor(1))
        self.register_buffer("window", torch.tensor(1))
        self.width = nn.Parameter(torch.tensor(2.5))

    def forward(self, idx):
        b, t = idx.shape
        i = torch.arange(t, device=idx.device)
        causal = i[:, None] >= i[None, :]
        if self.kind == "written":
            self.cached[:t, :t] = causal.to(self.cached.dtype)
            keep = self.cached[:t, :t] > 0
        elif self.kind == "counter":
            self.step += 1
            keep = causal & (i[:, None] - i[None, :] < self.step.clamp(max=4))
        else:
            self.window.copy_(self.width.detach().abs().ceil().long())
            keep = causal & (i[:, None] - i[None, :] < self.window)
        x = self.wte(idx)
        q, k, v = (z.view(b, t, HEADS, HD).transpose(1, 2) for z in self.qkv(x).split(DIM, dim=-1))
        scores = (q @ k.transpose(-2, -1)) / HD ** 0.5
        y = scores.masked_fill(~keep, float("-inf")).softmax(-1) @ v
        return self.head(x + self.proj(y.transpose(1, 2).reshape(b, t, DIM)))


def test_a_mask_written_into_a_buffer_and_read_back_is_judged_as_the_call_writes_it():
    """The mask is judged from what the call writes, not from the buffer as it was before the
    call (zeros at the first call: judged to let no key through, silently wrong)."""
    zoo.run(zoo.Case("state-mask", "written and read back", lambda: _build(StateMaskLM, kind="written")))


@pytest.mark.parametrize("kind, named", [("counter", "model.step"), ("from_weights", "model.window")])
def test_a_mask_judged_from_state_that_changes_at_every_call_is_refused_by_name(kind, named):
    """A value judged once, at the first call, from state the model writes at every call
    from what changes (its own earlier value, a parameter) would be stale at the next."""
    model = _build(StateMaskLM, kind=kind)
    before, twin = _snapshot(model), copy.deepcopy(model)
    with pytest.raises(UnsupportedModelError) as info:
        tc.tree_compile(model, backend="eager")(_batches()[0])
    first = str(info.value).splitlines()[0]
    assert named in first and "would not hold at the next call" in first and "test_compile_state.py:" in first, first
    _assert_same(before, _snapshot(model))
    zoo.assert_unchanged(model, twin, lengths=(11, 5))


class WarmupCountingLM(CountingLM):
    """CountingLM that scales its embeddings by a warm-up factor read from the counter after it
    advances, beside a buffer the forward never reads (Dynamo then hands the compiled graph that
    buffer after its own inputs)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("unused", torch.zeros(3))
        self.advance = True  # False: the per-path reference, at the counter's value of the tree call

    def forward(self, idx):
        if self.advance:
            self.steps += 1
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = (self.wte(idx) + self.wpe(pos)) * (1 + self.steps.to(self.wte.weight.dtype) / 100)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_a_counter_beside_an_unread_buffer_runs_and_advances_once_per_call():
    """Refused before ("got N + 1 inputs for the N it was captured with"); now each call equals
    per-path training at the counter's value in that call, and the counter advances once."""
    from treecompile.core.reference import per_path_loss

    model = _build(WarmupCountingLM)
    compiled = tc.tree_compile(model, backend="eager")
    for i, (_, batch, trees) in enumerate(zoo.batches()):
        out = compiled(batch)
        assert int(model.steps) == i + 1
        twin = copy.deepcopy(model)
        twin.advance = False
        ref = per_path_loss(twin, trees)
        torch.testing.assert_close(out.loss, ref.loss, rtol=1e-12, atol=0)
    assert int(model.steps) == 2


@pytest.mark.parametrize("stream", [None, "keep", "recompute"])
def test_a_counter_of_tokens_per_expert_adds_what_per_path_training_adds(stream):
    """torchtitan's ``tokens_per_expert.add_(histc(top-k indices))``: after each tree call the
    buffer holds what running the model on every path alone adds (a token shared by n paths
    counted n times), for two batches of different sizes; the first-call probe adds nothing.
    Streamed, each part adds its rows once, though a part runs twice (recompute mode's
    forward and backward runs)."""
    from test_compile_models import TREES, make_batch
    from zoo_repos.titan_moe import TitanMoELM

    from treecompile.stream.options import StreamOptions

    model = _build(TitanMoELM)
    twin = copy.deepcopy(model)
    options = StreamOptions(budget_rows=4, mode=stream) if stream else None
    compiled = tc.tree_compile(model, backend="eager", stream=options)
    for name in ("branchy", "forest"):
        batch, _ = make_batch(name)
        compiled(batch).loss.backward()
        if stream:
            assert compiled._stream.stats.parts > 2, compiled._stream.stats
        with torch.no_grad():
            for tree in TREES[name]:
                for path in tree:
                    twin(torch.tensor([path]))
        counts = {n: b for n, b in model.named_buffers() if n.endswith("tokens_per_expert")}
        assert counts and all(b.sum() > 0 for b in counts.values())
        for n, b in counts.items():
            assert torch.equal(b, twin.get_buffer(n)), (name, n, b, twin.get_buffer(n))


class RowSumCounterLM(nn.Module):
    """A counter whose increment is a sum over the rows of the activations (no histogram)."""

    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Embedding(VOCAB, DIM), nn.Linear(DIM, VOCAB)
        self.register_buffer("seen", torch.zeros(DIM))

    def forward(self, idx):
        x = self.emb(idx)
        with torch.no_grad():
            self.seen.add_(x.detach().sum(dim=(0, 1)))
        return self.head(x)


def test_a_counter_that_is_not_a_histogram_of_groups_is_refused_by_name():
    model = _build(RowSumCounterLM)
    before, twin = _snapshot(model), copy.deepcopy(model)
    with pytest.raises(UnsupportedModelError) as info:
        tc.tree_compile(model, backend="eager")(_batches()[0])
    first = str(info.value).splitlines()[0]
    assert "model.seen" in first, first
    _assert_same(before, _snapshot(model))
    zoo.assert_unchanged(model, twin, lengths=(11, 5))


@pytest.mark.parametrize("mode", ["keep", "recompute"])
@pytest.mark.parametrize("cls", [WarmupCountingLM, CountingLM])
def test_a_streamed_call_reads_the_state_from_before_it_and_leaves_one_calls_state(cls, mode):
    """Streamed over several parts (recompute mode runs some twice), every part reads the state
    the model had before the call: a warm-up factor read from a counter the call advances
    (``self.steps += 1``; with ``self.num_calls += 1``, unread; each advanced once per part
    before). After each call the counters advanced once."""
    from treecompile.core.reference import per_path_loss
    from treecompile.stream.options import StreamOptions

    model = _build(cls)
    twin = copy.deepcopy(model)
    compiled = tc.tree_compile(model, backend="eager", stream=StreamOptions(budget_rows=4, mode=mode))
    chain = [1 + (i * 7) % (VOCAB - 1) for i in range(20)]
    deep = [tc.TrajectoryTree.from_sequences([chain, chain[:12] + [5, 6, 7]])]
    for i, (_, batch, trees) in enumerate([*zoo.batches(), ("deep", tc.pack(deep), deep)]):
        ref_model = copy.deepcopy(model)
        if cls is WarmupCountingLM:  # per path at the counter's value after this call's advance
            ref_model.steps += 1
            ref_model.advance = False
        ref = per_path_loss(ref_model, trees)
        out = compiled(batch)
        out.loss.backward()
        assert compiled._stream.stats.parts > 2, compiled._stream.stats
        torch.testing.assert_close(out.loss, ref.loss, rtol=1e-12, atol=1e-12)
        if cls is WarmupCountingLM:
            assert int(model.steps) == i + 1
        if cls is CountingLM:
            assert int(model.steps) == model.num_calls == i + 1, (int(model.steps), model.num_calls)
    if cls is CountingLM:  # (WarmupCountingLM's logits follow the counter by design)
        zoo.assert_unchanged(model, twin, lengths=(11, 5))


def test_a_table_filled_in_place_and_read_back_is_refused_in_a_streamed_call():
    """``if T > self.filled: self.table[:T] = ...; x + self.table[:T]``: a part decides whether to
    fill at its own row count, shorter than its rows' positions, and read rows the model never
    filled (silently wrong before, once a part after a short first part read past it). Refused
    naming the table, on the first streamed call and after a whole-tree call filled it; the
    model as it was after each refusal."""
    from zoo_repos.state import FilledTableLM

    from treecompile.stream.options import StreamOptions

    model = _build(FilledTableLM)
    twin = copy.deepcopy(model)
    chain = [1 + (i * 7) % (VOCAB - 1) for i in range(20)]
    deep = tc.pack([tc.TrajectoryTree.from_sequences([chain, chain[:12] + [5, 6, 7]])])
    streamed = tc.tree_compile(model, backend="eager", stream=StreamOptions(budget_rows=4))
    for _ in range(2):
        before = _snapshot(model)
        with pytest.raises(UnsupportedModelError) as info:
            streamed(deep)
        first = str(info.value).splitlines()[0]
        assert first.startswith("treecompile cannot stream this model: it fills model.table in place"), first
        _assert_same(before, _snapshot(model))
        tc.tree_compile(model, backend="eager")(_batches()[0])  # fills the table for 11 rows
        assert model.filled > 0
    zoo.assert_unchanged(model, twin, lengths=(11, 5))


def test_a_table_filled_before_the_wrap_is_read_only_where_it_was_filled_in_a_streamed_call():
    """``FilledTableLM`` run eagerly on 12 tokens (its table filled for 12 positions), then a
    streamed call over parts of 4 rows of a 20-token chain: a part does not take the fill branch
    (4 <= 12) and would read the table at positions up to 19. Exact or refused by name, never the
    unfilled rows: refused, the model run on a path of 15 tokens fills it
    (`treecompile.compile.length_check`)."""
    from zoo_repos.state import FilledTableLM

    from treecompile.core.reference import per_path_loss
    from treecompile.stream.options import StreamOptions

    model = _build(FilledTableLM)
    chain = [1 + (i * 7) % (VOCAB - 1) for i in range(20)]
    with torch.no_grad():
        model(torch.tensor([chain[:12]]))
    trees = [tc.TrajectoryTree.from_sequences([chain, chain[:12] + [5, 6, 7]])]
    try:
        out = tc.tree_compile(model, backend="eager", stream=StreamOptions(budget_rows=4))(tc.pack(trees))
    except UnsupportedModelError as e:
        first = str(e).splitlines()[0]
        assert "(`if T > self.filled:`) goes the other way for a path of 15 tokens" in first, first
        return
    ref = per_path_loss(model, trees)
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-12, atol=1e-12)


class DictCounterLM(nn.Module):
    """Counts its calls in a dict entry it replaces: ``self.stats["calls"] = self.stats["calls"] + 1``."""

    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Embedding(VOCAB, DIM), nn.Linear(DIM, VOCAB)
        self.block = zoo_repos.state._SdpaBlock()
        self.stats = {"calls": torch.zeros((), dtype=torch.long)}

    def forward(self, idx):
        self.stats["calls"] = self.stats["calls"] + 1
        return self.head(self.block(self.emb(idx)))


def test_a_value_set_outside_the_modules_from_its_old_value_is_refused_in_a_streamed_call():
    """A dict entry set from its own value: a streamed call cannot set it back after a part, so
    it is refused naming the entry before any part runs; a whole-tree call counts once."""
    from treecompile.stream.options import StreamOptions

    model = _build(DictCounterLM)
    before = _snapshot(model)
    with pytest.raises(UnsupportedModelError) as info:
        tc.tree_compile(model, backend="eager", stream=StreamOptions(budget_rows=4))(_batches()[0])
    first = str(info.value).splitlines()[0]
    assert first.startswith("treecompile cannot stream this model: the model sets model.stats"), first
    _assert_same(before, _snapshot(model))
    tc.tree_compile(model, backend="eager")(_batches()[0])
    assert int(model.stats["calls"]) == 1


@pytest.mark.parametrize("budget", [4, 100])
def test_a_loss_of_the_logprobs_makes_two_calls_and_one_step_of_state(budget):
    """`stream_logprob_loss` calls the model twice for one step (log-probabilities without grad,
    then their objective's gradient as weights): the counters a model keeps (``self.steps += 1``,
    ``self.num_calls += 1``, torchtitan's ``tokens_per_expert``) advance once per step, streamed
    (budget 4) or in one call (budget 100)."""
    from test_compile_models import TREES, make_batch
    from zoo_repos.titan_moe import TitanMoELM

    from treecompile.stream.options import StreamOptions, stream_logprob_loss

    counting, titan = _build(CountingLM), _build(TitanMoELM)
    twin = copy.deepcopy(titan)
    batch, _ = make_batch("branchy")
    for model in (counting, titan):
        compiled = tc.tree_compile(model, backend="eager", stream=StreamOptions(budget_rows=budget))
        stream_logprob_loss(compiled, batch, lambda lp: (lp ** 2).sum()).loss.backward()
    assert int(counting.steps) == counting.num_calls == 1, (int(counting.steps), counting.num_calls)
    with torch.no_grad():
        for tree in TREES["branchy"]:
            for path in tree:
                twin(torch.tensor([path]))
    for n, b in titan.named_buffers():
        if n.endswith("tokens_per_expert"):
            assert b.sum() > 0 and torch.equal(b, twin.get_buffer(n)), (n, b, twin.get_buffer(n))
