"""A tree-compiled Hugging Face model behaves as the model it wraps: saving, loading, config,
generate, train/eval, state dicts, gradient checkpointing and PEFT adapters."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from test_compile_models import compare_with_paths, make_batch
from testing import perturbed_hf_model

import treecompile as tc
from treecompile.compile.wrapper import TreeCompiledModel, TreeOutput
from treecompile.core.errors import TreeInputError

transformers = pytest.importorskip("transformers")


def _qwen3(dtype=torch.float64):
    cfg = transformers.Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    return perturbed_hf_model(cfg, dtype, eval=False)


def _trained_once(model, compiled=None):
    """``tree_compile(model)`` (or ``compiled``, a wrapper of ``model``) after one tree step, so
    the compiled graph exists when tested."""
    compiled = compiled or tc.tree_compile(model, backend="eager")
    batch, _ = make_batch("branchy")
    compiled(batch).loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:  # a PEFT model's frozen base has none
                p.sub_(0.1 * p.grad)
    model.zero_grad(set_to_none=True)
    return compiled


def test_save_pretrained_writes_the_plain_model(compiled_qwen3, tmp_path):
    model, compiled = compiled_qwen3
    _trained_once(model, compiled)
    compiled.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(loaded) is type(model)
    saved_config = {k: v for k, v in loaded.config.to_dict().items() if k != "_name_or_path"}
    assert saved_config == {k: v for k, v in model.config.to_dict().items() if k != "_name_or_path"}
    want, got = model.state_dict(), loaded.state_dict()
    assert list(got) == list(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=0, msg=lambda m, k=k: f"{k}: {m}")


def test_wrapper_passes_as_the_model_and_keeps_its_attributes():
    model = _qwen3()
    compiled = tc.tree_compile(model, backend="eager")
    assert type(compiled) is TreeCompiledModel
    assert isinstance(compiled, TreeCompiledModel) and isinstance(compiled, type(model))
    assert isinstance(compiled, transformers.PreTrainedModel)
    assert compiled.config is model.config
    assert list(compiled.state_dict()) == list(model.state_dict())
    assert [n for n, _ in compiled.named_parameters()] == [n for n, _ in model.named_parameters()]
    # A plain module's wrapper does not pretend to be anything else.
    plain = tc.tree_compile(torch.nn.Sequential(torch.nn.Embedding(8, 4), torch.nn.Linear(4, 8)))
    assert plain.__class__ is TreeCompiledModel


def test_train_and_eval_reach_the_model_and_the_wrapper():
    model = _qwen3().eval()
    compiled = tc.tree_compile(model, backend="eager")
    assert not compiled.training  # the model's mode at compile time
    compiled.train()
    assert compiled.eval() is compiled
    assert not compiled.training and not model.training and not any(m.training for m in model.modules())
    compiled.train()
    assert compiled.training and model.training and all(m.training for m in model.modules())


def test_load_state_dict_loads_the_model():
    model, other = _qwen3(), _qwen3()
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(1.5)
    compiled = tc.tree_compile(model, backend="eager")
    result = compiled.load_state_dict(other.state_dict())
    assert not result.missing_keys and not result.unexpected_keys
    for (n, p), q in zip(model.named_parameters(), other.parameters()):
        assert torch.equal(p, q), n


@pytest.mark.full
def test_deepcopy_copies_the_model_and_keeps_the_options():
    model = _qwen3()
    compiled = tc.tree_compile(model, mask="bitmask", outputs=("entropy",), backend="eager")
    batch, _ = make_batch("branchy")
    first = compiled(batch)
    twin = copy.deepcopy(compiled)
    assert type(twin) is TreeCompiledModel and twin.model is not model
    assert (twin.mask, twin._outputs) == ("bitmask", ("entropy",))
    assert all(p is not q and torch.equal(p, q) for p, q in zip(twin.parameters(), model.parameters()))
    out = twin(batch)
    torch.testing.assert_close(out.loss, first.loss, rtol=0, atol=0)
    assert out.entropy is not None
    out.loss.backward()
    assert all(p.grad is None for p in model.parameters())  # the copy trains its own parameters


def test_deepcopy_keeps_the_temperature_and_the_streaming_options():
    from treecompile.stream.options import StreamOptions

    options = StreamOptions(budget_rows=64)
    compiled = tc.tree_compile(_qwen3(), temperature=0.7, stream=options, backend="eager")
    twin = copy.deepcopy(compiled)
    assert twin.temperature == 0.7
    assert twin._stream is not compiled._stream
    assert twin._stream.options == options and twin._stream.setup.model is twin.model  # runs the twin, not the original


def test_generate_runs_the_original_model():
    model = _qwen3(torch.float32).eval()
    prompt = torch.tensor([[1, 2, 3, 4]])
    want = model.generate(prompt, max_new_tokens=5, do_sample=False)
    compiled = _trained_once(model)
    model.eval()
    want = model.generate(prompt, max_new_tokens=5, do_sample=False)  # the weights moved one step
    got = compiled.generate(prompt, max_new_tokens=5, do_sample=False)
    assert torch.equal(got, want)
    assert got.shape == (1, 9)


@pytest.mark.full
def test_gradient_checkpointing_enabled_after_compile_is_exact():
    model = _qwen3()
    model.train()  # HF checkpoints only in training mode (attention dropout is 0)
    # What is tested is the recapture with the checkpointed layers, not the lowering: the
    # rewritten graph runs as it is. test_compile_subgraphs.py's
    # test_hugging_face_gradient_checkpointing_is_exact keeps the default lowering on this
    # checkpointed Qwen3.
    compiled = tc.tree_compile(model, backend="eager")
    batch, trees = make_batch("branchy")
    compare_with_paths(model, compiled, batch, trees, tol="hf")
    assert "inline_subgraphs_pass" not in compiled.counters or not compiled.counters["inline_subgraphs_pass"]
    compiled.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert model.is_gradient_checkpointing
    for name in ("branchy", "forest"):
        batch, trees = make_batch(name)
        compare_with_paths(model, compiled, batch, trees, tol="hf")
    # The graph was recaptured with the checkpointed layers, and they were rewritten.
    assert dict(compiled.counters["inline_subgraphs_pass"]) == {"checkpoint": 2}
    assert dict(compiled.counters["rewrite_attention_pass"]) == {"hf_interface": 2}


def test_tree_output_reads_as_trainer_reads_a_model_output():
    out = TreeOutput(loss=torch.tensor(1.0), logprobs=torch.zeros(3))
    assert out[0] is out.loss and out["loss"] is out.loss and out["logprobs"] is out.logprobs
    assert out["aux_loss"] is None
    # Trainer.prediction_step takes out[1:] as the predictions; unset fields are skipped, as in
    # a ModelOutput.
    assert out[1] is out.logprobs and out[1:] == (out.logprobs,) and len(out.to_tuple()) == 2
    with pytest.raises(IndexError):
        out[2]
    with pytest.raises(KeyError, match="a TreeOutput has an index, a slice or loss"):
        out["logits"]
    # Code written for HF outputs (a Trainer's compute_loss_func) reads .logits: say why there are none.
    with pytest.raises(AttributeError, match=r"^a tree-compiled model returns no logits: .*read \.logprobs"):
        out.logits
    assert not hasattr(out, "past_key_values")
    assert pickle.loads(pickle.dumps(out)).loss == out.loss and copy.deepcopy(out).logprobs.shape == (3,)


def _padded_rows():
    """A stock collator's batch: 4 rows sharing a prompt, right-padded, prompt and padding -100."""
    g = torch.Generator().manual_seed(3)
    prompt = [5, 6, 7, 8, 9]
    seqs = [prompt + torch.randint(1, 64, (n,), generator=g).tolist() for n in (3, 6, 1, 4)]
    seqs[3][: len(seqs[0])] = seqs[0][: len(seqs[3])]  # row 3 shares more than the prompt with row 0
    width = max(map(len, seqs))
    ids = torch.tensor([s + [0] * (width - len(s)) for s in seqs])
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
    labels = torch.where(mask.bool(), ids, -100)
    labels[:, : len(prompt)] = -100
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


@pytest.fixture(scope="module")
def compiled_qwen3():
    """``(model, tree_compile(model))`` shared by the tests below (one capture for them all)."""
    model = _qwen3()
    return model, tc.tree_compile(model, backend="eager")


def test_called_with_padded_rows_it_returns_the_stock_loss(compiled_qwen3):
    """``compiled(input_ids=, labels=, attention_mask=)`` (a stock collator's batch) merges the rows
    into a tree: the loss and the gradients are the stock model's, also normalised by the
    ``num_items_in_batch`` of an accumulation window as the Trainer passes it."""
    from testing import TRAINER_TOLERANCE

    model, compiled = compiled_qwen3
    rows = _padded_rows()
    trained = int((rows["labels"][:, 1:] != -100).sum())
    loss_rtol, grad_tol = TRAINER_TOLERANCE["float64"]
    for num_items in (None, trained + 7):
        extra = {} if num_items is None else {"num_items_in_batch": torch.tensor(num_items)}
        model.zero_grad(set_to_none=True)
        want = model(**rows, **extra).loss
        want.backward()
        want_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        got = compiled(**rows, **extra).loss
        got.backward()
        torch.testing.assert_close(got, want.to(got.dtype), rtol=loss_rtol, atol=0)
        for n, p in model.named_parameters():
            err = ((p.grad - want_grads[n]).abs().max() / want_grads[n].abs().max()).item()
            assert err <= grad_tol, f"num_items_in_batch={num_items}, {n}: gradient differs by {err:.2e}"
    assert len(compiled.compile_records) == 1  # one graph for both


def test_padded_rows_it_cannot_train_exactly_are_refused():
    from treecompile.core.errors import TreeInputError

    compiled = tc.tree_compile(_qwen3(), backend="eager")
    rows = _padded_rows()
    trained_pad = dict(rows, labels=torch.where(rows["attention_mask"].bool(), rows["labels"], rows["input_ids"]))
    with pytest.raises(TreeInputError, match=r"labels\[0, 8\] = 0 trains a padding token"):
        compiled(**trained_pad)
    batch, _ = make_batch("branchy")
    with pytest.raises(TreeInputError, match="either a TreeBatch .* or padded rows"):
        compiled(batch, input_ids=rows["input_ids"])
    with pytest.raises(TreeInputError, match="num_items_in_batch divides a token-mean loss.*'sum'"):
        compiled(tc.pack(tc.TrajectoryTree.from_sequences([[1, 2, 3]]), loss_mode="sum"), num_items_in_batch=4)
    with pytest.raises(TypeError, match="expected a TreeBatch .* or input_ids, got NoneType"):
        compiled()
    assert compiled._compiled is None  # refused before anything ran


def test_pickled_wrapper_reloads_and_compiles_again(compiled_qwen3, tmp_path):
    """``pickle`` and ``torch.save`` of a compiled model (one that has run) keep the model and the
    options; the loaded wrapper compiles at its first call and computes what the original did."""
    import pickle

    from treecompile.stream.options import StreamOptions

    model, compiled = compiled_qwen3
    batch, _ = make_batch("branchy")
    want = compiled(batch)
    assert compiled._compiled is not None
    torch.save(compiled, tmp_path / "compiled.pt")
    twin = torch.load(tmp_path / "compiled.pt", weights_only=False)
    assert type(twin) is TreeCompiledModel and twin._compiled is None
    assert twin.model is not model and twin.training == model.training
    assert [n for n, _ in twin.named_parameters()] == [n for n, _ in model.named_parameters()]
    assert all(torch.equal(p, q) for p, q in zip(twin.parameters(), model.parameters()))
    torch.testing.assert_close(twin(batch).loss, want.loss, rtol=0, atol=0)
    # Every option survives pickling (checked without running).
    other = tc.tree_compile(model, mask="bitmask", outputs=("entropy",), temperature=0.9, lm_head="fused", backend="eager")
    copy_ = pickle.loads(pickle.dumps(other))
    assert (copy_.mask, copy_._outputs, copy_.temperature, copy_._passes) == ("bitmask", ("entropy",), 0.9,
                                                                              other._passes)
    options = StreamOptions(budget_rows=64)
    copy_ = pickle.loads(pickle.dumps(tc.tree_compile(model, stream=options, backend="eager")))
    assert copy_._stream.options == options and copy_._stream.setup.model is copy_.model  # runs the copy


# ----------------------------------------------------------------------------- PEFT


@pytest.mark.parametrize("family", ["qwen3", "mistral-sw4"])
def test_lora_adapters_applied_before_compile_are_exact(family):
    peft = pytest.importorskip("peft")
    if family == "qwen3":
        model = _qwen3()
    else:
        cfg = transformers.MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, sliding_window=4)
        model = perturbed_hf_model(cfg, eval=False)
    # Random A and B: the adapters change the model from the first step.
    lora = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    peft_model = peft.get_peft_model(model, lora)
    compiled = tc.tree_compile(peft_model, backend="eager")
    for name in ("branchy", "forest"):
        batch, trees = make_batch(name)
        compare_with_paths(peft_model, compiled, batch, trees, tol="hf")
    # Only the adapters train, and the HF attention interface is routed as on the plain model.
    assert all("lora_" in n for n, p in peft_model.named_parameters() if p.requires_grad)
    assert dict(compiled.counters["rewrite_attention_pass"]) == {"hf_interface": 2}
    assert compiled.counters["rewrite_positions_pass"]["position_ids_input"] >= 1
    assert isinstance(compiled, peft.PeftModel)
    assert list(compiled.state_dict()) == list(peft_model.state_dict())


@pytest.mark.parametrize("called_first", [False, True], ids=["fresh", "after-a-call"])
def test_lora_adapters_applied_after_compile_are_exact(called_first):
    peft = pytest.importorskip("peft")
    model = _qwen3()
    compiled = tc.tree_compile(model, backend="eager")
    batch, trees = make_batch("branchy")
    if called_first:
        plain = compiled(batch).loss.detach()
    lora = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False, task_type="CAUSAL_LM")
    peft_model = peft.get_peft_model(compiled, lora)
    # The adapters went into the wrapped model: the wrapper's next call recompiles with them.
    assert sum("lora_A" in n for n, _ in model.named_parameters()) == 4
    assert peft_model.base_model.model is compiled
    for name in ("branchy", "forest"):
        batch, trees = make_batch(name)
        compare_with_paths(model, lambda b: peft_model(b), batch, trees, tol="hf")
    # The per-path reference finds the model inside the PEFT model (its call returns log-probs).
    from treecompile.core.reference import per_path_loss

    torch.testing.assert_close(per_path_loss(peft_model, trees).loss, per_path_loss(model, trees).loss, rtol=0, atol=0)
    assert all("lora_" in n for n, p in model.named_parameters() if p.requires_grad)
    if called_first:
        assert len(compiled.compile_records) >= 2
        assert not torch.equal(peft_model(make_batch("branchy")[0]).loss.detach(), plain)


def test_the_reference_unwraps_only_a_chain_of_wrappers():
    """A module holding a tree-compiled model beside other layers is the caller's own model: the
    per-path reference calls it as it is, never the compiled model inside it alone."""
    from treecompile.core.reference import reference_model

    model = _qwen3()
    compiled = tc.tree_compile(model, backend="eager")
    assert reference_model(compiled) is model
    chain = torch.nn.Sequential(torch.nn.ModuleDict({"inner": compiled}))
    assert reference_model(chain) is model  # one child each, down to the wrapper
    beside = torch.nn.ModuleDict({"lm": compiled, "head": torch.nn.Linear(2, 2)})
    assert reference_model(beside) is beside


def test_hf_forward_arguments_pass_unset_and_are_refused_when_set():
    compiled = tc.tree_compile(_qwen3(), backend="eager")
    batch, _ = make_batch("branchy")
    with pytest.raises(TreeInputError, match="ignores 'output_hidden_states'"):
        compiled(batch, output_hidden_states=True)
    with pytest.raises(TreeInputError, match="ignores 'inputs_embeds'"):
        compiled(input_ids=batch, inputs_embeds=torch.zeros(1, 3, 32))
    with pytest.raises(TypeError, match="takes no argument 'pixel_values'"):
        compiled(batch, pixel_values=None)
    assert compiled._compiled is None  # refused before any work


def test_lora_model_saves_its_adapter(tmp_path):
    peft = pytest.importorskip("peft")
    model = _qwen3()
    peft_model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=False))
    compiled = _trained_once(peft_model)
    compiled.save_pretrained(tmp_path)
    assert (tmp_path / "adapter_config.json").exists()
    reloaded = peft.PeftModel.from_pretrained(_qwen3(), tmp_path)
    want = {n: p for n, p in peft_model.named_parameters() if "lora_" in n}
    got = dict(reloaded.named_parameters())
    for n, p in want.items():
        torch.testing.assert_close(got[n], p, rtol=0, atol=0, msg=lambda m, n=n: f"{n}: {m}")


def test_a_vocabulary_resized_after_wrapping_is_the_one_checked():
    """``resize_token_embeddings`` after ``tree_compile``: ids of the new entries are taken, and
    ids past the new size refused (the wrapper reads the model's size at each call)."""
    model = _qwen3()
    compiled = tc.tree_compile(model, backend="eager")
    old = model.get_input_embeddings().num_embeddings
    model.resize_token_embeddings(old + 8)
    tree = tc.TrajectoryTree.from_sequences([[1, old + 3, 2, old + 7], [1, old + 3, 5]])
    out = compiled(tc.pack(tree))
    assert torch.isfinite(out.loss)
    with pytest.raises(TreeInputError, match=str(old + 8)):
        compiled(tc.pack(tc.TrajectoryTree.from_sequences([[1, old + 8, 2]])))
