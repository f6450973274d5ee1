"""tree_compile on plain PyTorch models: float64 equivalence with per-path training.

One compiled model per (model, mask) runs every tree: S, the number of targets and of
predicting rows are dynamic, so the trees also exercise reuse without recompiling.

The interval-mask equivalence cases run the lowering (AOTAutograd on CPU: the default, and
``backend="aot_eager"`` named for ManualGPT); `test_backends_agree` runs ``backend="eager"``
on ManualGPT, and the other tests run the rewritten graph as it is (``backend="eager"``), since
their subject is the rewrite or the wrapper and lowering triples a compile's time.
"""

import gc
import logging
import warnings
import weakref
from collections import OrderedDict

import pytest
import torch
from torch import nn
import zoo
from test_compile_models import (
    TREES,
    CachedRopeLM,
    ManualGPT,
    NanoGPT,
    compare_with_paths,
    make_batch,
    tiny,
)

from treecompile.compile.wrapper import BACKENDS, MASKS, TreeCompiledModel, Verify, tree_compile
from treecompile.core.errors import UnsupportedModelError
from treecompile.stream.options import StreamOptions

MODELS = {
    # model -> the rewrites its graph must show, per pass.
    "nanogpt-sdpa-rope-arange": (NanoGPT, {"rewrite_attention_pass": {"sdpa": 2}, "rewrite_positions_pass": {"arange": 1}}),
    "manual-softmax-tril-wpe": (ManualGPT, {"rewrite_attention_pass": {"softmax_attention": 2}, "rewrite_positions_pass": {"arange": 1}}),
    "sdpa-cached-rope-slice": (CachedRopeLM, {"rewrite_attention_pass": {"sdpa": 1}, "rewrite_positions_pass": {"table_slice": 2}}),
}


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("model_id", list(MODELS))
def test_custom_model_matches_per_path_training(model_id, mask):
    cls, expected = MODELS[model_id]
    model = tiny(cls)
    # ManualGPT names the CPU's default lowering: its interval case is also the aot_eager half
    # of test_backends_agree (the same model, more trees, one capture fewer).
    backend = "eager" if mask != "interval" else "aot_eager" if model_id == "manual-softmax-tril-wpe" else None
    compiled = tree_compile(model, mask=mask, backend=backend)
    for name in TREES:
        batch, trees = make_batch(name)
        compare_with_paths(model, compiled, batch, trees, tol="pure")
    for pass_name, kinds in expected.items():
        assert dict(compiled.counters[pass_name]) == kinds, f"{pass_name}: {compiled.counters[pass_name]}"
    assert compiled.counters["gather_logits_pass"] == {"gather_before_lm_head": 1}
    # Dynamic S: one graph served trees of 11, 14 and 9 tokens.
    assert len(compiled.compile_records) == 1, [r.seq_len for r in compiled.compile_records]


@pytest.mark.full
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_dropped_wrapper_frees_its_model(stream, monkeypatch):
    """``del`` of a tree-compiled model frees the model, its parameters and its graphs, as
    for a model that was never wrapped: torch.compile keeps every backend it was given for
    the life of the process, so the backend must not hold the wrapper. Streamed, the stack
    layout is learnt by a capture (none is known yet) and remembered for the architecture
    (`treecompile.stream.runner._LEARNT`), which must not hold the model either."""
    import treecompile.stream.runner as stream_runner

    monkeypatch.setattr(stream_runner, "_LEARNT", OrderedDict())
    model = tiny(NanoGPT)
    # The default lowering (AOTAutograd) for the whole tree; the streamed parts as captured.
    compiled = tree_compile(model, backend="eager" if stream else None,
                            stream=StreamOptions(budget_rows=8) if stream else None)
    compiled(make_batch("branchy")[0]).loss.backward()
    assert compiled._stream.stats.parts > 1 if stream else len(compiled.compile_records) == 1
    assert len(stream_runner._LEARNT) == stream
    refs = [weakref.ref(x) for x in (model, compiled, next(model.parameters()))]
    del model, compiled
    gc.collect()
    assert [r() for r in refs] == [None, None, None]


@pytest.fixture(scope="module")
def nanogpt_eager():
    """``tree_compile(tiny(NanoGPT), backend="eager")``: one capture for the tests below that
    only read what a call returns or the graph (they train nothing)."""
    torch.manual_seed(0)
    return tree_compile(tiny(NanoGPT), backend="eager")


def test_logprobs_are_zero_where_nothing_predicts(nanogpt_eager):
    batch, _ = make_batch("forest")
    out = nanogpt_eager(batch)
    roots = batch.pred_index < 0
    assert roots.sum() == 2
    assert torch.all(out.logprobs[roots] == 0)
    assert torch.all(out.logprobs[~roots] < 0)
    assert out.logprobs.shape == batch.target_weight.shape
    torch.testing.assert_close(out.loss, -(batch.target_weight * out.logprobs).sum())


def test_lm_head_sees_only_needed_rows(nanogpt_eager):
    """In the rewritten graph the vocabulary projection reads gathered rows, not all S."""
    import torch.nn.functional as F

    batch, _ = make_batch("branchy")
    compiled = nanogpt_eager
    compiled(batch)
    gm = compiled.compile_records[-1].graph_module
    heads = [n for n in gm.graph.nodes if n.target is F.linear and "head" in n.args[1].name]
    assert len(heads) == 1
    assert heads[0].args[0].target is torch.index_select, heads[0].args[0].format_node()


def test_wrapper_keeps_parameters_and_checkpoints():
    model = tiny(NanoGPT)
    compiled = tree_compile(model)
    assert isinstance(compiled, TreeCompiledModel)
    assert [id(p) for p in compiled.parameters()] == [id(p) for p in model.parameters()]
    assert list(compiled.state_dict()) == list(model.state_dict())
    assert dict(compiled.named_parameters()).keys() == dict(model.named_parameters()).keys()
    state = {k: v.clone() + 1 for k, v in model.state_dict().items()}
    compiled.load_state_dict(state)
    torch.testing.assert_close(model.state_dict()["head.weight"], state["head.weight"])
    compiled.train()
    assert model.training
    compiled.eval()
    assert not model.training
    assert compiled.model is model and compiled.emb is model.emb


def test_optimizer_step_on_the_wrapper_trains_the_model():
    model = tiny(NanoGPT)
    compiled = tree_compile(model, backend="eager")
    opt = torch.optim.SGD(compiled.parameters(), lr=0.1)
    batch, _ = make_batch("branchy")
    before = compiled(batch).loss.item()
    for _ in range(3):
        opt.zero_grad()
        compiled(batch).loss.backward()
        opt.step()
    assert compiled(batch).loss.item() < before


# "aot_eager": test_custom_model_matches_per_path_training[manual-softmax-tril-wpe-interval].
@pytest.mark.parametrize("backend", ["eager"])
def test_backends_agree(backend):
    model = tiny(ManualGPT)
    batch, trees = make_batch("branchy")
    compare_with_paths(model, tree_compile(model, backend=backend), batch, trees, tol="pure")


def test_unknown_options_list_the_valid_ones():
    model = tiny(NanoGPT)
    with pytest.raises(ValueError, match="valid masks: interval, bitmask"):
        tree_compile(model, mask="dense")
    with pytest.raises(ValueError, match="valid backends: " + ", ".join(BACKENDS)):
        tree_compile(model, backend="tensorrt")


def test_disable_passes_names_the_passes_that_can_be_left_out():
    with pytest.raises(ValueError, match="cannot disable 'positions'; passes that can be disabled: "
                                         "inline_subgraphs_pass, rewrite_attention_pass"):
        tree_compile(tiny(NanoGPT), disable_passes=("positions",))
    with pytest.raises(ValueError, match="verify_graph_pass always runs"):
        tree_compile(tiny(NanoGPT), disable_passes=("verify_graph_pass",))
    with pytest.raises(ValueError, match="a tuple of pass names"):
        tree_compile(tiny(NanoGPT), disable_passes="rewrite_positions_pass")


def test_a_disabled_rewrite_is_refused_by_the_verification_and_logged_by_name(caplog):
    """Without the positions rewrite the model's arange positions are left over the packed
    rows: refused by name, never trained wrong. Each pass logs its own counters."""
    compiled = tree_compile(tiny(NanoGPT), disable_passes=("rewrite_positions_pass",), backend="eager")
    with caplog.at_level(logging.DEBUG, logger="treecompile.passes"), pytest.raises(UnsupportedModelError):
        compiled(make_batch("branchy")[0])
    logged = {r.args[0]: r.args[1] for r in caplog.records if r.name == "treecompile.passes" and r.args}
    assert "rewrite_positions_pass" not in logged
    assert logged["rewrite_attention_pass"] == {"sdpa": 2}


def test_bitmask_needs_path_bits():
    from treecompile import TreeInputError

    batch, _ = make_batch("branchy", path_bits=False)
    with pytest.raises(TreeInputError, match="path_bits=True"):
        tree_compile(tiny(NanoGPT), mask="bitmask", backend="eager")(batch)


def test_verify_passes_an_exact_model_and_leaves_it_as_it_was():
    model = tiny(NanoGPT)
    model.train()
    for p in model.parameters():
        p.grad = torch.full_like(p, 7.0)
    batch, _ = make_batch("forest")
    compiled = tree_compile(model, verify=True, backend="eager")
    out = compiled(batch)
    assert torch.isfinite(out.loss)
    report = compiled.verified
    assert report.dtype == torch.float64 and report.paths == 6
    assert report.worst_grad_diff < 1e-10 and report.loss_diff < 1e-12
    assert model.training
    assert all(torch.all(p.grad == 7.0) for p in model.parameters())
    compiled(batch)  # checked once, on the first call
    assert compiled.verified is report


class _Float32Router(nn.Module):
    """A layer whose own code casts to float32 before a weight of the model's dtype (Inkling 2's
    router: ``F.linear(hidden_states.float(), self.weight)``): it runs in float32, not in float64."""

    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(dim, dim) / dim)

    def forward(self, x):
        return x + torch.nn.functional.linear(x.float(), self.weight).tanh().to(x.dtype)


def test_verify_checks_in_the_models_dtype_a_model_that_cannot_run_in_float64():
    """``verify=True`` checks a float64 copy; a model whose own code cannot run in float64 is
    checked on itself, in its dtype (it raised the copy's RuntimeError before)."""
    model = tiny(NanoGPT).float()
    model.head = nn.Sequential(_Float32Router(model.head.in_features), model.head)
    batch, _ = make_batch("forest")
    compiled = tree_compile(model, verify=True, backend="eager")
    assert torch.isfinite(compiled(batch).loss)
    report = compiled.verified
    assert report.dtype == torch.float32 and report.worst_grad_diff < report.tolerance


def test_verify_copies_a_model_with_weight_norm():
    """``verify=True``'s float64 copy of a model whose attribute autograd computed (the ``weight``
    ``torch.nn.utils.weight_norm`` recomputes at every call; ``copy.deepcopy`` refuses it) is made
    as the reference's copies are (it raised RuntimeError before)."""
    model = tiny(NanoGPT)
    model.head = nn.utils.weight_norm(model.head)
    compiled = tree_compile(model, verify=True, backend="eager")
    assert torch.isfinite(compiled(make_batch("forest")[0]).loss)
    report = compiled.verified
    assert report.dtype == torch.float64 and report.worst_grad_diff < 1e-10 and report.loss_diff < 1e-12


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_verify_in_place_checks_a_twin_without_the_check_and_the_temperature(monkeypatch, temperature):
    """A model too large to copy is checked in place, through a twin that neither checks again
    (the wrapper itself would recurse) nor divides by a temperature the per-path reference
    does not apply."""
    import treecompile.compile.selfcheck as selfcheck

    monkeypatch.setattr(selfcheck, "VERIFY_COPY_LIMIT_BYTES", 0)
    model = tiny(NanoGPT)
    compiled = tree_compile(model, temperature=temperature, verify=True, backend="eager")
    compiled(make_batch("forest")[0])
    assert compiled.verified.worst_grad_diff < 1e-10 and compiled.verified.loss_diff < 1e-12
    assert compiled.temperature == temperature and compiled.verify is Verify.FULL


class _LeakyMask(TreeCompiledModel):
    """A wrapper whose mask lets every row see every earlier row of the packed row (siblings
    included): a silent error no graph check can see."""

    def _inputs(self, batch):
        import dataclasses

        leaky = dataclasses.replace(batch, subtree_end=torch.full_like(batch.subtree_end, batch.num_tokens))
        return super()._inputs(leaky)


def test_the_probe_catches_a_silently_wrong_model():
    from treecompile.core.errors import UnsupportedModelError

    batch, _ = make_batch("forest")
    with pytest.raises(UnsupportedModelError, match=r"(?s)first-call probe found that node 'tree_flex_attention_interval'"
                       r".*when only the tokens of another branch change.*one treecompile inserted"):
        _LeakyMask(tiny(NanoGPT), mask="interval", backend="eager", verify="probe")(batch)


def test_verify_catches_a_silently_wrong_model(monkeypatch):
    """verify=True's full check refuses it on its own (the probe, which runs first, is skipped here)."""
    import treecompile.compile.probe
    from treecompile.core.errors import UnsupportedModelError

    monkeypatch.setattr(treecompile.compile.probe, "probe_graph", lambda *args: treecompile.compile.probe.ProbeReport(0, 0, 0))
    batch, _ = make_batch("forest")
    with pytest.raises(UnsupportedModelError, match="gradient of '.*' differs by"):
        _LeakyMask(tiny(NanoGPT), mask="interval", backend="eager", verify=True)(batch)


def test_temperature_divides_the_logits_exactly():
    """``temperature=T``: log-probs, entropy and gradients of the logits divided by T, per path;
    the LM head still reads only the gathered rows."""
    from testing import COMPILE_TOL, assert_grads_close, backward_grads

    from treecompile.core.reference import model_logits, path_logprobs

    model = tiny(NanoGPT)
    batch, trees = make_batch("branchy")
    t = 0.7
    compiled = tree_compile(model, temperature=t, outputs=("entropy",), backend="eager")
    out, grads = backward_grads(model, lambda: compiled(batch))
    assert compiled.counters["gather_logits_pass"] == {"gather_before_lm_head": 1}

    def scaled(m, ids):
        return model_logits(m, ids) / t

    def reference():
        loss, ents = 0.0, []
        for p, path in enumerate(t_.path(q) for t_ in trees for q in range(t_.num_paths)):
            lp = path_logprobs(model, path.tokens, forward=scaled)
            rows = batch.path_rows(p)
            torch.testing.assert_close(out.logprobs[rows][1:].detach(), lp[1:].detach(), rtol=1e-12, atol=1e-12)
            logits = scaled(model, torch.as_tensor(path.tokens)[None])[0, :-1]
            ent = -(logits.log_softmax(-1).exp() * logits.log_softmax(-1)).sum(-1)
            torch.testing.assert_close(out.entropy[rows][1:].detach(), ent.detach(), rtol=1e-12, atol=1e-12)
            mask = torch.as_tensor(path.loss_mask, dtype=lp.dtype)
            mask[0] = 0
            loss = loss - batch.path_coef[p].to(lp.dtype) * (mask * lp).sum()  # c_p already holds the weight
        return type("Out", (), {"loss": loss})()

    ref, ref_grads = backward_grads(model, reference)
    torch.testing.assert_close(out.loss, ref.loss, rtol=COMPILE_TOL["pure"][0], atol=COMPILE_TOL["pure"][1])
    assert_grads_close(grads, ref_grads, ("float64", "pure"))
    for bad in (0, -1.0, float("inf"), float("nan"), True):
        with pytest.raises(ValueError, match="temperature must be a positive finite number"):
            tree_compile(model, temperature=bad)


def test_attention_over_k_mT_as_newer_torch_records_it():
    """torch >= 2.14 records ``k.mT`` (and ``x.T``, ``x.H``, ``x.mH``) as aten ops where 2.13
    records ``getattr(k, "mT")``: litgpt's soft-capped attention (``q @ k.mT * scale``) with
    its getattr nodes turned into the aten ops before the passes is matched and exact."""
    import builtins

    import zoo
    import zoo_repos

    from treecompile.passes.pipeline import passes_for

    aten = {"T": torch.ops.aten.numpy_T.default, "mT": torch.ops.aten.mT.default, "H": torch.ops.aten.matrix_H.default,
            "mH": torch.ops.aten.mH.default}
    seen = []

    def as_newer_torch(name, gm, ctx):
        if name != "inline_subgraphs_pass":
            return
        for n in list(gm.graph.nodes):
            if n.op == "call_function" and torch.ops.aten.mT in (n.target, getattr(n.target, "overloadpacket", None)):
                seen.append("mT")  # recorded so by this torch already
            if n.op == "call_function" and n.target is builtins.getattr and n.args[1] in aten:
                with gm.graph.inserting_before(n):
                    new = gm.graph.call_function(aten[n.args[1]], (n.args[0],))
                new.meta.update(n.meta)
                n.replace_all_uses_with(new)
                gm.graph.erase_node(n)
                seen.append(n.args[1])

    model = zoo_repos.BY_ID["litgpt-softcap"].build()
    compiled = TreeCompiledModel(model, mask="interval", backend="eager", verify="probe",
                                 passes=passes_for(before=as_newer_torch))
    for _, batch, trees in zoo.batches():
        zoo.compare(model, compiled, batch, trees)
    assert "mT" in seen
    assert dict(compiled.counters["rewrite_attention_pass"]) == {"softmax_attention": 1}


def test_a_token_shift_is_captured_once_with_the_paths_and_refused_when_streamed():
    """A model of its own code with no conv module whose graph shifts the sequence (x-transformers'
    ShiftTokens) is captured once, with the path structure it gets from the start; streamed, the
    part graphs have no such structure for it, and the call is refused naming the shift."""
    import zoo
    from zoo_custom import ShiftTokensLM

    model = zoo.perturb(ShiftTokensLM().double().eval())
    compiled = tree_compile(model, backend="eager")
    for _, batch, _ in zoo.batches():
        compiled(batch)
    assert len(compiled.compile_records) == 1
    assert compiled.counters["rewrite_conv_context_pass"]["shift"] == 4  # two shifted segments per layer
    streamed = tree_compile(zoo.perturb(ShiftTokensLM().double().eval()), backend="eager",
                            stream=StreamOptions(budget_rows=8))
    with pytest.raises(UnsupportedModelError, match=r"shifts the sequence, and this call has no path structure"):
        streamed(zoo.batches()[1][1])


def test_torch_compile_of_a_tree_compiled_model_changes_nothing_and_says_so():
    """``torch.compile(compiled)`` raised an AssertionError from Dynamo. The wrapper's call is
    never traced by an outer compile: the same loss, and a warning that says why."""
    from treecompile.core.advice import TreeWarning

    compiled = tree_compile(tiny(NanoGPT), backend="eager")
    batch = make_batch("branchy")[0]
    expected = compiled(batch).loss.item()
    with pytest.warns(TreeWarning, match=r"torch.compile\(...\) of a tree-compiled model does nothing"):
        out = torch.compile(compiled)(batch)
    assert out.loss.item() == expected


@pytest.mark.full
def test_the_full_check_is_not_taken_for_an_outer_compile():
    """The full check calls a tree-compiled twin inside the call: not an outer torch.compile."""
    from treecompile.core.advice import TreeWarning

    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=r"torch.compile\(...\) of a tree-compiled", category=TreeWarning)
        checked = tree_compile(tiny(NanoGPT), backend="eager", verify=True)
        checked(make_batch("branchy")[0])
    assert checked.verified is not None


class _WarningLM(torch.nn.Module):
    """A model whose forward issues a ``warnings.warn(message)`` (as torch's own functions do
    about their arguments): Dynamo cannot trace the call, and issues it after the graph instead
    (a category argument it cannot reorder: such a model is refused naming the line)."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(32, 16)
        self.attn = torch.nn.Linear(16, 48)
        self.head = torch.nn.Linear(16, 32)

    def forward(self, idx):
        x = self.emb(idx)
        if x.shape[1] > 1:
            warnings.warn("a warning from the model's forward")
        q, k, v = self.attn(x).view(1, -1, 3, 2, 8).unbind(2)
        y = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                             is_causal=True)
        return self.head(x + y.transpose(1, 2).reshape(x.shape))


def test_a_warning_in_the_models_forward_is_issued_and_does_not_stop_the_capture():
    model = zoo.perturb(_WarningLM().double().eval())
    compiled = tree_compile(model, backend="eager")
    _, batch, trees = zoo.batches()[0]
    with pytest.warns(UserWarning, match="a warning from the model's forward"):
        zoo.compare(model, compiled, batch, trees)
    assert compiled.counters["rewrite_attention_pass"] == {"sdpa": 1}
