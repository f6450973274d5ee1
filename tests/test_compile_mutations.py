"""In-place ops survive every pass: each mutation form, in a model and at pass level.

A mutation's return value is usually unused (``buf.index_add_(...)``, ``out.copy_(h)``), so a
dead-code elimination that treats tensor methods as pure deletes it: expert gradients become
exactly zero, a tensor filled by ``copy_`` is read uninitialised. Each form below writes into
memory that the model reads afterwards; the tree-compiled model must match per-path training
in float64, and the rewritten graph must still hold every in-place op.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn
from test_compile_models import SdpaBlock, compare_with_paths, make_batch

import treecompile as tc
from treecompile.passes._graph import eliminate_dead_code, mutated_args

DIM, VOCAB = 16, 64


class Mix(nn.Module):
    """A token-wise layer that writes its result in place, in one of several spellings."""

    def __init__(self, form: str) -> None:
        super().__init__()
        self.form = form  # fixed per module: Dynamo specialises on it
        self.a, self.b = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)
        # Channel slots for the scatter-style forms (a permutation of the hidden dim).
        self.register_buffer("slots", torch.randperm(DIM, generator=torch.Generator().manual_seed(1)))
        self.register_buffer("keep", torch.arange(DIM) % 3 != 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        g = self.b(x)
        f = self.form
        if f == "add_":  # in-place residual, return value unused
            x = x.clone()
            x.add_(h)
            return x
        if f == "iadd":
            x = x.clone()
            x += h
            return x
        if f == "copy_":  # fill an uninitialised buffer (MLA-style)
            buf = torch.empty_like(h)
            buf.copy_(h * g)
            return x + buf
        if f == "index_add_":  # experts accumulate into a preallocated buffer
            buf = torch.zeros_like(h)
            buf.index_add_(2, self.slots, h)
            buf.index_add_(2, self.slots, g * 0.5)
            return x + buf
        if f == "scatter_":
            buf = torch.zeros_like(h)
            buf.scatter_(2, self.slots.expand_as(h), h)
            return x + buf
        if f == "masked_fill_":
            h = h * g
            h.masked_fill_(~self.keep, 0.25)
            return x + h
        if f == "index_put_":
            buf = torch.zeros(DIM, *h.shape[:2], dtype=h.dtype)
            buf.index_put_((self.slots,), h.permute(2, 0, 1))
            return x + buf.permute(1, 2, 0)
        if f == "setitem":
            buf = torch.zeros_like(h)
            buf[..., : DIM // 2] = h[..., : DIM // 2]
            buf[..., DIM // 2 :] = g[..., DIM // 2 :]
            return x + buf
        if f == "view_mul_":  # a write through a view
            buf = h.clone()
            buf[..., : DIM // 2].mul_(3.0)
            return x + buf
        if f == "out=":  # (autograd refuses out= on tensors that need grad: a constant here)
            scale = torch.empty(DIM, dtype=h.dtype)
            torch.add(self.keep.to(h.dtype), 0.5, out=scale)
            return x + h * g * scale
        if f == "relu_":
            h = h * g
            F.relu(h, inplace=True)
            return x + h
        raise AssertionError(f)


FORMS = ["add_", "iadd", "copy_", "index_add_", "scatter_", "masked_fill_", "index_put_", "setitem", "view_mul_",
         "out=", "relu_"]


class MutatingLM(nn.Module):
    """Causal SDPA blocks (RoPE at ``arange``), each followed by every `Mix` form in turn."""

    def __init__(self, forms: list[str]) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(SdpaBlock(DIM, 2, 1) for _ in range(2))
        self.mixes = nn.ModuleList(nn.Sequential(*(Mix(f) for f in forms)) for _ in range(2))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.emb(idx)
        for blk, mix in zip(self.blocks, self.mixes):
            x = mix(blk(x, pos))
        return self.head(x)


def _model(forms: list[str]) -> nn.Module:
    torch.manual_seed(0)
    model = MutatingLM(forms).double().eval()
    with torch.no_grad():  # no zero bias, no identity norm: those hide a dropped write
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model


def _count_mutations(gm: fx.GraphModule) -> int:
    return sum(1 for n in gm.graph.nodes if mutated_args(n))


# In-place ops each form records in the captured graph.
WRITES = {"add_": 1, "iadd": 1, "copy_": 1, "index_add_": 2, "scatter_": 1, "masked_fill_": 1, "index_put_": 1,
          "setitem": 2, "view_mul_": 1, "out=": 1, "relu_": 1}


@pytest.mark.full
def test_every_in_place_form_matches_per_path_training():
    """One model with every form (one compile): per-path equality on two batches of different
    lengths, and every in-place op of the capture still in the rewritten graph."""
    model = _model(FORMS)
    compiled = tc.tree_compile(model)
    for name in ("branchy", "forest"):  # two batches of different lengths, one graph
        batch, trees = make_batch(name)
        compare_with_paths(model, compiled, batch, trees, tol="pure")
    (record,) = compiled.compile_records
    assert record.in_place_ops == 2 * sum(WRITES.values())
    assert _count_mutations(record.graph_module) == record.in_place_ops


@pytest.mark.parametrize("form", FORMS)
def test_dropping_the_write_changes_the_model(form):
    """The fixture cannot pass by accident: without its in-place op each form computes
    something else."""
    mix = Mix(form).double()
    with torch.no_grad():
        for p in mix.parameters():
            p.add_(0.1 * torch.randn_like(p))
    x = torch.randn(1, 5, DIM, dtype=torch.float64)
    seen: list[int] = []

    def drop_writes(gm, example_inputs):
        seen.append(_count_mutations(gm))
        for n in list(gm.graph.nodes):
            if mutated_args(n):
                n.replace_all_uses_with(mutated_args(n)[0])
                gm.graph.erase_node(n)
        gm.recompile()
        return gm.forward

    expected = mix(x)
    # One cache entry per form on Mix.forward's code object.
    with torch._dynamo.config.patch(recompile_limit=len(FORMS) + 1):
        got = torch.compile(mix, backend=drop_writes, fullgraph=True)(x)
    assert seen == [WRITES[form]]
    assert not torch.allclose(got, expected), form


def _graph_of(fn, *args) -> fx.GraphModule:
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch.compile(fn, backend=keep, fullgraph=True)(*args)
    return graphs[0]


def test_dead_code_elimination_keeps_observed_writes_and_drops_unobserved_ones():
    def fn(x, w):
        seen = torch.zeros(3, 4)
        seen[:, :2].add_(x @ w)  # read later through `seen`: kept
        unseen = torch.ones(3, 4)
        unseen.mul_(2.0)  # nothing reads `unseen`: removable
        x.add_(1.0)  # writes an input: kept even though nothing reads it
        return seen.sum()

    gm = _graph_of(fn, torch.randn(3, 5), torch.randn(5, 2))
    names = lambda: [n.target for n in gm.graph.nodes if mutated_args(n)]  # noqa: E731
    assert names() == ["add_", "mul_", "add_"]
    eliminate_dead_code(gm)
    assert names() == ["add_", "add_"]
    gm.recompile()
    x = torch.randn(3, 5)
    w = torch.randn(5, 2)
    x0 = x.clone()
    out = gm(x, w)
    torch.testing.assert_close(out[0] if isinstance(out, (tuple, list)) else out, (x0 @ w).sum())
    torch.testing.assert_close(x, x0 + 1)


def test_a_pass_that_drops_an_in_place_op_is_an_error():
    from types import SimpleNamespace

    from treecompile.passes.pipeline import run_passes

    def fn(x):
        buf = torch.zeros_like(x)
        buf.copy_(x)
        return buf * 2

    gm = _graph_of(fn, torch.randn(3))

    def careless_pass(gm, ctx):
        for n in list(gm.graph.nodes):
            if n.target == "copy_":
                n.replace_all_uses_with(n.args[0])
                gm.graph.erase_node(n)
        return gm

    with pytest.raises(RuntimeError, match="careless_pass removed the in-place op .*copy_"):
        run_passes(gm, ctx=SimpleNamespace(pass_name="", counters={}), passes=[careless_pass])



def _functorch_calls(gm):
    from treecompile.passes._functorch_ops import FUNCTORCH_LEVEL_OPS, FUNCTORCH_STATE

    return [n.target.__name__ for n in gm.graph.nodes
            if n.op == "call_function" and n.target in FUNCTORCH_STATE | FUNCTORCH_LEVEL_OPS]


def test_dead_code_elimination_keeps_vmap_levels_while_a_batched_op_lives():
    """torch.vmap's level calls have no users: removed alone, the batched ops left would fail."""

    def live(x, w):
        return torch.vmap(lambda row: row * w)(x).sum()

    gm = _graph_of(live, torch.randn(3, 4), torch.randn(4))
    before = _functorch_calls(gm)
    assert "_vmap_increment_nesting" in before and "_add_batch_dim" in before
    eliminate_dead_code(gm)
    assert _functorch_calls(gm) == before
    gm.recompile()
    x, w = torch.randn(3, 4), torch.randn(4)
    out = gm(w, x)  # Dynamo's placeholder order
    torch.testing.assert_close(out[0] if isinstance(out, (tuple, list)) else out, (x * w).sum())

    def dead(x, w):
        unused = torch.vmap(lambda row: row * w)(x)  # noqa: F841
        return x.sum()

    gm = _graph_of(dead, torch.randn(3, 4), torch.randn(4))
    assert _functorch_calls(gm)
    eliminate_dead_code(gm)
    assert _functorch_calls(gm) == []  # with its last batched op the levels go too


@pytest.mark.parametrize("transform,inside", [
    (lambda x: torch.vmap(torch.sin)(x), "_add_batch_dim"),
    (lambda x: torch.vmap(torch.func.grad(lambda a: a.sin().sum()))(x), "_wrap_for_grad"),
], ids=["vmap", "grad-in-vmap"])
def test_a_mask_evaluation_failing_inside_a_transform_closes_the_levels_it_opened(transform, inside):
    from types import SimpleNamespace

    from treecompile.passes._mask_eval import evaluate

    gm = _graph_of(transform, torch.randn(3, 4))
    anchor = next(n for n in gm.graph.nodes if getattr(n.target, "__name__", "") == inside)

    def fails(t):
        raise ValueError("fails inside the transform")

    with gm.graph.inserting_after(anchor):
        failing = gm.graph.call_function(fails, (anchor,))
    ctx = SimpleNamespace(seq_len=None, example_inputs=[torch.randn(3, 4)], judged=set(), state=None)
    assert torch._C._functorch.maybe_current_level() is None
    assert torch._C._autograd._saved_tensors_hooks_is_enabled()
    with pytest.raises(ValueError, match="fails inside the transform"):
        evaluate(ctx, failing)
    assert torch._C._functorch.maybe_current_level() is None
    assert torch._C._autograd._saved_tensors_hooks_is_enabled()  # torch.func.grad turns them off
    assert not torch._C._functorch.get_inplace_requires_grad_allowed()


def test_dead_code_elimination_keeps_a_func_grad_transform():
    """torch.func.grad inside the graph: its level push and pop, and the requires-grad switch on
    its input, have no users; removed, the graph fails (or differentiates nothing)."""

    def fn(x, w):
        return (torch.func.grad(lambda a: (a * w).sin().sum())(x) * 2).sum()

    x, w = torch.randn(3, 4), torch.randn(4)
    gm = _graph_of(fn, x, w)
    eliminate_dead_code(gm)
    assert {"_grad_increment_nesting", "_set_tensor_requires_grad", "_grad_decrement_nesting"} <= set(_functorch_calls(gm))
    gm.recompile()
    out = gm(w, x)  # Dynamo's placeholder order
    torch.testing.assert_close(out[0] if isinstance(out, (tuple, list)) else out, fn(x, w))


def test_dead_code_elimination_keeps_switches_a_model_sets_and_resets():
    """``with torch.inference_mode()`` and ``with sdpa_kernel(...)`` inside a model: the calls
    that leave them have no users; removed, the rest of the graph would run inside them."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def fn(q):
        with sdpa_kernel(SDPBackend.MATH):
            y = F.scaled_dot_product_attention(q, q, q, is_causal=True)
        with torch.inference_mode():
            unused = q * 2  # noqa: F841
        return y.sum()

    gm = _graph_of(fn, torch.randn(1, 2, 4, 8))
    switches = lambda: [n.target.__name__ for n in gm.graph.nodes  # noqa: E731
                        if n.op == "call_function" and n.target.__name__ in ("_sdpa_kernel", "_exit_inference_mode")]
    before = switches()
    assert before == ["_sdpa_kernel", "_sdpa_kernel", "_exit_inference_mode"]
    eliminate_dead_code(gm)
    assert switches() == before


class HeadWriteLM(nn.Module):
    """An LM head whose logits, or whose input, a later op writes in place (OLMo scales its
    logits with ``logits.mul_``): the head cannot be recomputed on gathered rows from before
    the write."""

    def __init__(self, form: str) -> None:
        super().__init__()
        self.form = form
        self.emb = nn.Embedding(VOCAB, DIM)
        self.block = SdpaBlock(DIM, 2, 1)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.block(self.emb(idx), torch.arange(idx.shape[1], device=idx.device))
        logits = self.head(x)
        if self.form == "logits_mul_":
            logits.mul_(0.5)
        elif self.form == "view_add_":  # through a view of the logits
            logits[..., : VOCAB // 2].add_(0.75)
        elif self.form == "cast_mul_":  # after a cast that the head's chain walks through
            logits = logits.double()[:, :]
            logits.mul_(1.5)
        return logits


@pytest.mark.parametrize("lm_head", ["gather", "fused"])
@pytest.mark.parametrize("form", ["logits_mul_", "view_add_", "cast_mul_"])
def test_a_write_into_the_logits_or_the_heads_input_is_kept(form, lm_head):
    torch.manual_seed(0)
    model = HeadWriteLM(form).double().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    compiled = tc.tree_compile(model, lm_head=lm_head, backend="eager")
    for name in ("branchy", "forest"):
        batch, trees = make_batch(name)
        compare_with_paths(model, compiled, batch, trees, tol="pure")


def test_python_operators_spelled_with_an_underscore_write_nothing():
    """``a & b`` is recorded as ``operator.and_``: pure, though its name ends in an underscore (a
    mask buffer ``&`` a key gate was taken for a write into the buffer, and refused)."""
    import operator

    g = torch.fx.Graph()
    a, b = g.placeholder("a"), g.placeholder("b")
    nodes = [g.call_function(f, (a, b)) for f in (operator.and_, operator.or_, operator.is_)]
    nodes.append(g.call_function(operator.not_, (a,)))
    nodes.append(g.call_function(operator.iand, (a, b)))
    assert [bool(mutated_args(n)) for n in nodes] == [False, False, False, False, True]


class _PaddedMaskLM(nn.Module):
    """SDPA under a causal float mask that the model then writes in place: with the keys at a
    padding token blocked (``ids == PAD``, read from the tokens), or with structural values only."""

    PAD = 22

    def __init__(self, form: str) -> None:
        super().__init__()
        self.form = form
        self.emb, self.head = nn.Embedding(32, DIM), nn.Linear(DIM, 32)
        self.qkv, self.o = nn.ModuleList(nn.Linear(DIM, 3 * DIM) for _ in range(2)), nn.ModuleList(
            nn.Linear(DIM, DIM) for _ in range(2))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        b, t = ids.shape
        mask = torch.full((t, t), float("-inf"), dtype=self.emb.weight.dtype).triu(1)[None, None].repeat(b, 1, 1, 1)
        if self.form == "masked_fill_":
            mask.masked_fill_((ids == self.PAD)[:, None, None, :], float("-inf"))
        elif self.form == "setitem":
            mask[(ids == self.PAD)[:, None, None, :].expand_as(mask)] = float("-inf")
        elif self.form == "copy_":  # a padding flag copied into a fresh tensor
            pad = torch.zeros(b, t, dtype=torch.bool)
            pad.copy_(ids == self.PAD)
            mask = mask.masked_fill(pad[:, None, None, :], float("-inf"))
        elif self.form == "index_put":  # the padding keys' entries set by their indices
            rows, keys = torch.nonzero(ids == self.PAD, as_tuple=True)
            mask[rows, :, :, keys] = float("-inf")
        else:  # structural: the diagonal written again with its own value
            mask[..., torch.arange(t), torch.arange(t)] = 0.0
        mask[..., 0] = 0.0  # the first key stays visible
        x = self.emb(ids)
        for qkv, o in zip(self.qkv, self.o):
            q, k, v = qkv(x).view(b, t, 3, 2, DIM // 2).permute(2, 0, 3, 1, 4)
            if self.form in ("copy_", "index_put"):  # eager attention
                a = ((q @ k.transpose(-2, -1)) / (DIM // 2) ** 0.5 + mask).softmax(-1) @ v
            else:
                a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            x = x + o(a.transpose(1, 2).reshape(b, t, DIM))
        return self.head(x)


@pytest.mark.parametrize("form", ["masked_fill_", "setitem", "copy_", "index_put", "structural"])
def test_a_mask_written_in_place_from_the_tokens_is_not_judged_by_the_first_batch(form):
    """The first batch holds no padding token, so the mask it builds is plainly causal; the
    second blocks the key of a padding token in the middle of a path. A mask's values include
    what is written into it in place: read from the tokens, the mask is not structural (was
    rewritten to the tree mask from the first batch's values, and the second batch's loss
    silently differed from per-path training)."""
    import zoo

    from treecompile.core.errors import UnsupportedModelError

    model = zoo.perturb(_PaddedMaskLM(form).double())
    compiled = tc.tree_compile(model, backend="eager")
    forests = [[[1, 2, 3, 4], [1, 2, 5], [1, 7, 8, 9, 10, 11]],
               [[3, 4, 5, 6, 22, 22], [3, 4, 9, 22, 10, 11], [3, 12, 13]]]
    for paths in forests:
        trees = [tc.TrajectoryTree.from_sequences(paths)]
        batch = tc.pack(trees, warn_por=False)
        if form == "structural":
            zoo.compare(model, compiled, batch, trees)
        else:
            with pytest.raises(UnsupportedModelError, match=r"^treecompile cannot make this model exact on a tree: "
                               r"node .* at test_compile_mutations.py:\d+ .*computed from (the inputs|parameters or the inputs)"):
                compiled(batch)
