"""tree_compile on tiny Hugging Face models in float64, against each path run alone.

Families cover: GQA (Qwen3, Llama, Qwen2), sliding window (Mistral, window 4 so that the
longest test path of 6 tokens crosses it), soft-capping with alternating sliding layers
(Gemma2), learned absolute positions (GPT-2). Weights are perturbed (no identity norms).
Qwen3 with the interval mask runs the default lowering (AOTAutograd on CPU); the other cases
run the rewritten graph as it is (``backend="eager"``): the rewrite is what differs between them.
"""

import pytest
import torch
from test_compile_models import compare_with_paths, make_batch
from testing import hf_float64_casts, perturbed_hf_model
from zoo import transformers_version

from treecompile.compile.wrapper import tree_compile

transformers = pytest.importorskip("transformers")

COMMON = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2)


def _config(family: str):
    T = transformers
    return {
        "qwen3": lambda: T.Qwen3Config(**COMMON, head_dim=16),
        "llama": lambda: T.LlamaConfig(**COMMON),
        "qwen2": lambda: T.Qwen2Config(**COMMON),
        "mistral-sw4": lambda: T.MistralConfig(**COMMON, sliding_window=4),
        "gemma2-softcap-sw4": lambda: T.Gemma2Config(**COMMON, head_dim=8, sliding_window=4,
                                                      attn_logit_softcapping=2.0, final_logit_softcapping=3.0),
        "gpt2": lambda: T.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                     bos_token_id=0, eos_token_id=0),
    }[family]()


def _model(family: str):
    # Gemma2's soft-capping is applied by its eager attention only (transformers 5.10 loads it
    # with sdpa, which drops it; later versions default to eager).
    return perturbed_hf_model(_config(family), **({"attn_implementation": "eager"} if "gemma2" in family else {}))


# Each family once with the interval mask; the bitmask rule on the families where the
# mask does the most work (GQA, and windows + soft-capping).
CASES = [(f, "interval") for f in ("qwen3", "llama", "qwen2", "mistral-sw4", "gemma2-softcap-sw4", "gpt2")] + [
    ("qwen3", "bitmask"),
    ("gemma2-softcap-sw4", "bitmask"),
]


@pytest.mark.parametrize("family,mask", CASES, ids=[f"{f}-{m}" for f, m in CASES])
def test_hf_model_matches_per_path_training(family, mask):
    """With the model's float32 casts computed in float64 on both sides: float64 rounding only."""
    model = _model(family)
    lowered = (family, mask) == ("qwen3", "interval")
    # On transformers 5.10 the lowered Qwen3 keeps a float32 rounding the widened casts do not
    # reach (7e-11 relative on the loss, measured; not found where): its older bar there.
    tol = "hf" if lowered and transformers_version() < (5, 24) else "pure"
    with hf_float64_casts(model, methods=True):
        attn_implementation = model.config._attn_implementation
        compiled = tree_compile(model, mask=mask, backend=None if lowered else "eager")
        for name in ("branchy", "forest"):
            batch, trees = make_batch(name)
            compare_with_paths(model, compiled, batch, trees, tol=tol)
            # The model's attention implementation is restored after each call (the capturing one
            # and a later one).
            assert model.config._attn_implementation == attn_implementation
    n_layers = 2
    assert compiled.counters["rewrite_attention_pass"] == {"hf_interface": n_layers}
    assert compiled.counters["rewrite_positions_pass"]["position_ids_input"] >= 1
    assert compiled.counters["gather_logits_pass"] == {"gather_before_lm_head": 1}


def test_sliding_window_matters_in_the_test_trees():
    """Guards the test above: without its window, Mistral gives different logprobs on these trees."""
    from treecompile.core.reference import path_logprobs

    windowed = _model("mistral-sw4")
    torch.manual_seed(0)
    cfg = _config("mistral-sw4")
    cfg.sliding_window = None
    full = transformers.AutoModelForCausalLM.from_config(cfg).double().eval()
    full.load_state_dict(windowed.state_dict())
    _, trees = make_batch("branchy")
    longest = max(trees[0].sequences(), key=len)
    diff = (path_logprobs(windowed, longest) - path_logprobs(full, longest)).abs().max()
    assert diff > 1e-4


def test_softcap_the_models_attention_would_drop_is_refused():
    """Hugging Face's sdpa attention applies no soft-cap (transformers 5.10 drops it silently):
    a Gemma2 loaded with sdpa trains per path without it, so the tree, which would apply it,
    refuses by name and says how to load the model."""
    from treecompile.core.errors import UnsupportedModelError

    model = _model("gemma2-softcap-sw4")
    model.config._attn_implementation_internal = "sdpa"
    with pytest.raises(UnsupportedModelError, match=r"Gemma2Attention: attention soft-capping \(softcap=2\.0\) under "
                                                    r"attn_implementation='sdpa', which does not apply it"):
        tree_compile(model, backend="eager")(make_batch("branchy")[0])
    assert model.config._attn_implementation == "sdpa" and not hasattr(model.config, "treecompile_routed_from")


def test_a_new_model_class_or_a_repeated_checkpointing_hook_does_not_recapture():
    """Between steps, state a compiled HF forward reads changes without changing the graph:
    transformers registers every model class it builds (``_CAN_RECORD_REGISTRY``), so a reward
    or reference model of a new class grows the registry; and turning gradient checkpointing
    off and on (TRL's GRPO trainer does, around each generation) adds one more copy of
    transformers' input-require-grads hook to the embeddings. Neither may make the
    tree-compiled model capture again (the hooks would hit Dynamo's recompile limit)."""
    model = _model("qwen3")
    compiled = tree_compile(model, backend="eager")
    batch, trees = make_batch("branchy")
    model.gradient_checkpointing_enable()
    compiled(batch)
    records = len(compiled.compile_records)
    fresh = type("FreshLlamaForCausalLM", (transformers.LlamaForCausalLM,), {})
    fresh(_config("llama"))  # a class no test built before: the registry grows
    for _ in range(2):
        model.gradient_checkpointing_disable()
        model.gradient_checkpointing_enable()
    assert len(model.model.embed_tokens._forward_hooks) == 3
    compare_with_paths(model, compiled, batch, trees, tol="hf")
    assert len(compiled.compile_records) == records
    assert len(model.model.embed_tokens._forward_hooks) == 3  # the model's hooks are left as they were


def test_each_compiled_graph_gets_a_code_name_of_its_own():
    """Dynamo keeps what it learnt about a function's inputs per file, line and name. With the
    name taken from the wrapper's id, a wrapper built after another was freed (at its address)
    inherited its history: a Qwen3 with head_dim 8 after one with 16 saw its attention scale
    as a variable float, which the attention pass cannot read (measured with every graph given
    one name). So no two graphs of a process share a name."""
    from treecompile.capture.call import compile_named

    def fn(x):
        return x + 1

    names = {compile_named(fn, "tree_forward", lambda gm, inputs: gm)._torchdynamo_orig_callable.__code__.co_name
             for _ in range(3)}
    assert len(names) == 3 and all(n.startswith("tree_forward_") for n in names)


@pytest.mark.full
def test_an_attention_scale_traced_as_a_variable_is_refused_by_name(monkeypatch):
    """Dynamo traces a float as a variable once it has seen it change between calls of one
    function. Forced here by giving every graph one code name (as the wrapper's id once did):
    the second model's attention scale differs, arrives as a traced value, and the model is
    refused naming the attention and why, instead of failing inside the pass."""
    import itertools

    import treecompile.capture.call as call
    from treecompile.core.errors import UnsupportedModelError

    # A name no earlier graph of this process had (Dynamo's history of a name outlives its graphs).
    monkeypatch.setattr(call, "_GRAPH_NUMBERS", itertools.repeat("one_name_for_every_graph"))
    batch, _ = make_batch("branchy")
    for head_dim in (16, 8):
        compiled = tree_compile(perturbed_hf_model(transformers.Qwen3Config(**COMMON, head_dim=head_dim)),
                                backend="eager")
        if head_dim == 16:
            compiled(batch)
    with pytest.raises(UnsupportedModelError, match="scale is a traced variable, not a constant"):
        compiled(batch)
