"""A tree-compiled Hugging Face model behaves as the model it wraps: saving, loading, config,
generate, train/eval, state dicts, gradient checkpointing and PEFT adapters."""

from __future__ import annotations

import copy

import pytest
import torch
from test_compile_models import compare_with_paths, make_batch
from testing import perturbed_hf_model

import treecompile as tc
from treecompile.compile import TreeCompiledModel, TreeOutput

transformers = pytest.importorskip("transformers")


def _qwen3(dtype=torch.float64):
    cfg = transformers.Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    return perturbed_hf_model(cfg, dtype, eval=False)


def _trained_once(model):
    """``tree_compile(model)`` after one tree step, so the compiled graph exists when tested."""
    compiled = tc.tree_compile(model)
    batch, _ = make_batch("branchy")
    compiled(batch).loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:  # a PEFT model's frozen base has none
                p.sub_(0.1 * p.grad)
    model.zero_grad(set_to_none=True)
    return compiled


def test_save_pretrained_writes_the_plain_model(tmp_path):
    model = _qwen3()
    compiled = _trained_once(model)
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
    compiled = tc.tree_compile(model)
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
    compiled = tc.tree_compile(model)
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
    compiled = tc.tree_compile(model)
    result = compiled.load_state_dict(other.state_dict())
    assert not result.missing_keys and not result.unexpected_keys
    for (n, p), q in zip(model.named_parameters(), other.parameters()):
        assert torch.equal(p, q), n


def test_deepcopy_copies_the_model_and_keeps_the_options():
    model = _qwen3()
    compiled = tc.tree_compile(model, mask="bitmask", outputs=("entropy",))
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
    from treecompile.stream import StreamOptions

    options = StreamOptions(budget_rows=64)
    compiled = tc.tree_compile(_qwen3(), temperature=0.7, stream=options)
    twin = copy.deepcopy(compiled)
    assert twin.temperature == 0.7
    assert twin._stream is not compiled._stream
    assert twin._stream.options == options and twin._stream.wrapper is twin


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


def test_gradient_checkpointing_enabled_after_compile_is_exact():
    model = _qwen3()
    model.train()  # HF checkpoints only in training mode (attention dropout is 0)
    compiled = tc.tree_compile(model)
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
    with pytest.raises(KeyError, match="a TreeOutput has 0"):
        out[1]
    with pytest.raises(KeyError, match="a TreeOutput has 0"):
        out["logits"]


# ----------------------------------------------------------------------------- PEFT


@pytest.mark.parametrize("family", ["qwen3", "mistral-sw4"])
def test_lora_adapters_applied_before_compile_are_exact(family):
    peft = pytest.importorskip("peft")
    if family == "qwen3":
        model = _qwen3()
    else:
        cfg = transformers.MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, sliding_window=4)
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(cfg).double()
    # Random A and B: the adapters change the model from the first step.
    lora = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    peft_model = peft.get_peft_model(model, lora)
    compiled = tc.tree_compile(peft_model)
    for name in ("branchy", "forest"):
        batch, trees = make_batch(name)
        compare_with_paths(peft_model, compiled, batch, trees, tol="hf")
    # Only the adapters train, and the HF attention interface is routed as on the plain model.
    assert all("lora_" in n for n, p in peft_model.named_parameters() if p.requires_grad)
    assert dict(compiled.counters["rewrite_attention_pass"]) == {"hf_interface": 2}
    assert compiled.counters["rewrite_positions_pass"]["position_ids_input"] >= 1
    assert isinstance(compiled, peft.PeftModel)
    assert list(compiled.state_dict()) == list(peft_model.state_dict())


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
