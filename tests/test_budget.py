"""treecompile.planning.budget: the cost model's formula, capacity solving, and its accuracy against the
peak memory measured on CPU for tiny float32 Qwen3 and Llama training steps."""

import gc

import pytest
import torch

from treecompile.planning.budget import (
    CPU_BLOCK_ROWS,
    CPU_CALL_ROWS,
    BudgetError,
    CostModel,
    ModelDims,
    measure_peak_bytes,
)

transformers = pytest.importorskip("transformers")

# Tiny configs: "attention" is predicted to peak in the attention backward (a small vocabulary),
# "head" in the [R, V] log-probabilities (large vocabulary), "deep" by saved layer activations.
CONFIGS = {
    "qwen3-attention": ("Qwen3Config", dict(vocab_size=64, hidden_size=64, intermediate_size=160,
                                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                            head_dim=16)),
    "llama-head": ("LlamaConfig", dict(vocab_size=4096, hidden_size=64, intermediate_size=512,
                                       num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1)),
    "qwen3-deep": ("Qwen3Config", dict(vocab_size=512, hidden_size=128, intermediate_size=384,
                                       num_hidden_layers=6, num_attention_heads=2, num_key_value_heads=2,
                                       head_dim=32)),
    # The LM head shares the embedding matrix: the backward's end holds the head's and the
    # input embedding's gradients of it and their sum at once.
    "qwen3-tied": ("Qwen3Config", dict(vocab_size=512, hidden_size=128, intermediate_size=384,
                                       num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                                       head_dim=32, tie_word_embeddings=True)),
}

# Accepted prediction / measurement - 1, with why. The model must never predict less than
# the measured peak (a capacity from it must fit). Above it: the CPU attention's masked call is
# counted as [512, S] where it is at most [512, min(S, 512)] (+9.3% to +9.7% measured at
# S=256..1024 for the attention-bound config); the other configs measured within +1.5% (the
# first layer's attention backward beside nearly every new gradient, at S=64). Margin for
# allocator noise.
OVERESTIMATE = {"qwen3-attention": 0.12, "llama-head": 0.03, "qwen3-deep": 0.03, "qwen3-tied": 0.03}


def _config(name):
    cls, kw = CONFIGS[name]
    return getattr(transformers, cls)(**kw)


def test_parameter_count_matches_the_model():
    for name in CONFIGS:
        cfg = _config(name)
        model = transformers.AutoModelForCausalLM.from_config(cfg)
        cost = CostModel.from_config(cfg, dtype="float32", device="cpu")
        assert cost.dims.num_parameters == sum(p.numel() for p in model.parameters()), name
    assert CostModel.from_config(_config("qwen3-deep"), dtype="float32").dims.qk_norm
    assert not CostModel.from_config(_config("llama-head"), dtype="float32").dims.qk_norm


_SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2)


@pytest.mark.parametrize("cls,why", [
    ("Gemma3TextConfig", (r"Gemma3ForCausalLM with one decoder layer holds 238,400 weights where the dense decoder "
                          r"the cost model describes .* holds 238,272: .*pre_feedforward_layernorm.weight")),
    ("Gemma2Config", r"Gemma2 soft-caps its logits, which keeps \[R, V\] tensors the cost model does not count"),
    ("BambaConfig", r"Bamba has linear_attention layers, which the cost model does not describe"),
    ("Starcoder2Config", r"Starcoder2ForCausalLM .* mlp.c_fc.weight"),
])
def test_a_model_the_cost_model_does_not_describe_is_refused(cls, why):
    """Its memory would be under-counted (more norms a layer, [R, V] soft-capped logits, a
    recurrent layer, a two-matrix MLP): refused naming what differs, from the config object or
    from a dict with its model_type."""
    config = getattr(transformers, cls)(**_SMALL)
    with pytest.raises(BudgetError, match=why + r".*; give the capacity in rows \(budget_rows, --capacity\) or "
                                                r"describe the model with a treecompile.planning.budget.ModelDims"):
        CostModel.from_config(config)
    with pytest.raises(BudgetError, match=why):
        CostModel.from_config(config.to_dict())


def test_projection_biases_and_qk_norms_are_read_from_the_model():
    """Qwen2's q/k/v biases (no config key says so) and Qwen3's q/k norms come from a
    meta-device instance: the parameter count is the model's. A dict without model_type is
    the caller's own description, taken as it is."""
    for cls, flags in [("Qwen2Config", dict(attention_bias=True, qk_norm=False)),
                       ("Qwen3Config", dict(attention_bias=False, qk_norm=True))]:
        config = getattr(transformers, cls)(**_SMALL)
        dims = CostModel.from_config(config).dims
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
        assert dims.num_parameters == sum(p.numel() for p in model.parameters()), cls
        assert {k: getattr(dims, k) for k in flags} == flags, cls
    described = {k: v for k, v in transformers.Gemma3TextConfig(**_SMALL).to_dict().items() if k != "model_type"}
    assert CostModel.from_config(described).dims.layers == 2


def test_block_rows_match_the_kernel():
    from treecompile.kernels.attention import cpu_attention
    from treecompile.kernels.attention.flex import BLOCK_SIZE

    assert CPU_BLOCK_ROWS == BLOCK_SIZE
    assert CPU_CALL_ROWS == cpu_attention._GROUP_ROWS == cpu_attention._MASKED_KEYS


@pytest.mark.parametrize("shape", ["path", "branchy"])
def test_the_cpu_attention_terms_bound_its_measured_working_memory(shape):
    """One call of the CPU attention op, forward and backward, on 2,048 tokens (one path; a
    1,024-token prefix and 16 branches): the peak above its inputs is at most the model's
    attention terms (its output, log-sum-exp and output gradient, the attention backward's
    gradients, the call's mask and keys)."""
    from treecompile import TrajectoryTree, pack
    from treecompile.kernels.attention.cpu_attention import tree_attention_cpu
    from treecompile.kernels.attention.flex import tree_block_mask

    hq, hkv, d, s = 4, 2, 16, 2048
    gen = torch.Generator().manual_seed(0)
    tokens = lambda n: torch.randint(3, 200, (n,), generator=gen).tolist()  # noqa: E731
    if shape == "path":
        tree = TrajectoryTree.from_sequences([tokens(s)])
    else:
        root = tokens(s // 2)
        tree = TrajectoryTree.from_sequences([root + tokens(s // 32) for _ in range(16)])
    batch = pack(tree, warn_por=False)
    assert batch.num_tokens == s
    q, k, v = (torch.randn(1, h, s, d, generator=gen, requires_grad=True) for h in (hq, hkv, hkv))
    bm = tree_block_mask(batch.subtree_end, block_size=CPU_BLOCK_ROWS)

    def step():
        out, _ = tree_attention_cpu(q, k, v, [batch.subtree_end], bm.kv_num_blocks, bm.kv_indices,
                                    bm.full_kv_num_blocks, bm.full_kv_indices, "interval", CPU_BLOCK_ROWS, 0.25,
                                    0.0, 0, 0)
        out.backward(torch.ones_like(out))

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the fused kernel's per-thread buffers, which the model does not count
    try:
        step()
        q.grad = k.grad = v.grad = None
        gc.collect()
        measured = measure_peak_bytes(step)
    finally:
        torch.set_num_threads(threads)
    dims = ModelDims(layers=1, hidden=hq * d, intermediate=1, heads=hq, kv_heads=hkv, head_dim=d, vocab=1)
    terms = CostModel.from_config(dims, dtype="float32", device="cpu").breakdown(s)
    output = (2 * hq * d * 4 + hq * 4) * s  # out, its gradient, lse
    predicted = output + terms["attention backward"] + terms["call mask"] + terms["call keys"]
    assert measured <= predicted, (measured, predicted)


@pytest.mark.parametrize("device,attention", [("cuda", None), ("cpu", None), ("cpu", "flex-dense")])
@pytest.mark.parametrize("checkpointing", ["none", "layer"])
def test_capacity_is_the_largest_fitting_length(device, attention, checkpointing):
    cfg = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
               num_attention_heads=32, num_key_value_heads=8, head_dim=128, qk_norm=True)
    cost = CostModel.from_config(cfg, dtype="bfloat16", checkpointing=checkpointing, optimizer="adamw",
                                 device=device, attention=attention)
    for budget in (100e9, 141e9, 1e12):
        c = cost.capacity(budget)
        assert cost.peak_bytes(c) <= budget < cost.peak_bytes(c + 1), (budget, c)


def test_checkpointing_raises_the_capacity():
    cfg = _config("qwen3-deep")
    plain = CostModel.from_config(cfg, dtype="bfloat16", checkpointing="none")
    ckpt = CostModel.from_config(cfg, dtype="bfloat16", checkpointing="layer")
    assert ckpt.capacity(1e9) > plain.capacity(1e9)


def test_budget_below_one_token_names_the_static_memory():
    cost = CostModel.from_config(_config("llama-head"), dtype="float32", optimizer="adamw")
    static = cost.static_bytes()
    with pytest.raises(BudgetError, match=r"parameters, gradients and optimizer state .* alone need"):
        cost.capacity(static // 2)


def test_unknown_options_list_the_valid_ones():
    with pytest.raises(BudgetError, match="valid: adamw"):
        CostModel.from_config(_config("llama-head"), optimizer="lion")
    with pytest.raises(BudgetError, match="valid: none, layer"):
        CostModel.from_config(_config("llama-head"), checkpointing="selective")
    with pytest.raises(BudgetError, match="lacks intermediate_size"):
        CostModel.from_config({"vocab_size": 8, "hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 1})


def test_explain_lists_every_term():
    cost = CostModel.from_config(_config("qwen3-attention"), dtype="float32", device="cpu")
    text = cost.explain()
    for needle in ("parameters", "adamw state", "layers", "log-probabilities", "call mask", "peak(S) = max("):
        assert needle in text, needle


def turns_batch(vocab: int, prompt: int, turn: int, leaf: int):
    """A packed tree of random tokens: a prompt, 3 turns, 3 leaves on each."""
    import treecompile
    from treecompile import TrajectoryTree

    gen = torch.Generator().manual_seed(0)
    root = torch.randint(0, vocab, (prompt,), generator=gen).tolist()
    seqs = []
    for _ in range(3):
        mid = torch.randint(0, vocab, (turn,), generator=gen).tolist()
        seqs += [root + mid + torch.randint(0, vocab, (leaf,), generator=gen).tolist() for _ in range(3)]
    return treecompile.pack(TrajectoryTree.from_sequences(seqs), warn_por=False)


def cpu_training(name: str, dtype: str = "float32", checkpointing: str = "none"):
    """``(config, model, AdamW, cost model)`` of config ``name`` (`CONFIGS`) in ``dtype`` on
    CPU, with seeded random weights and, for ``checkpointing="layer"``, Hugging Face's
    gradient checkpointing of every decoder layer: what the measured peaks are taken of."""
    cfg = _config(name)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).to(getattr(torch, dtype))
    if checkpointing == "layer":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return cfg, model, opt, CostModel.from_config(cfg, dtype=dtype, device="cpu", optimizer="adamw",
                                                  checkpointing=checkpointing)


def one_path(vocab: int, length: int):
    """A packed batch of one path of ``length`` random tokens (every key live: the cost
    model's worst case)."""
    import treecompile
    from treecompile import TrajectoryTree

    ids = torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(length)).tolist()
    return treecompile.pack(TrajectoryTree.from_sequences([ids]), warn_por=False)


def measured_step_peak(compiled, batch, model, opt) -> int:
    """Peak bytes of one step (forward, backward into existing gradients, the optimizer's step)
    after a first one, the live parameters, gradients and optimizer state included."""

    def step():
        compiled(batch).loss.backward()
        opt.step()

    step()  # the gradients and the optimizer state exist before the measured step
    gc.collect()
    return _live_bytes(model, opt) + measure_peak_bytes(step)


def _live_bytes(model, opt):
    ts = [*model.parameters(), *(p.grad for p in model.parameters() if p.grad is not None),
          *(t for st in opt.state.values() for t in st.values() if torch.is_tensor(t))]
    return sum(t.untyped_storage().nbytes() for t in ts)


@pytest.mark.parametrize("name,lengths", [("qwen3-attention", (512, 1024)), ("llama-head", (256,)),
                                          ("qwen3-deep", (64,)), ("qwen3-tied", (16, 32))], ids=lambda v: str(v))
@pytest.mark.full
def test_prediction_bounds_the_measured_cpu_peak(name, lengths):
    """One accumulation micro-step (forward, backward into existing grads) plus AdamW's step,
    on one path of S tokens (every key live: the model's worst case), float32 on CPU."""
    _check_measured_peaks(name, lengths, OVERESTIMATE[name])


# Measured +0.8% to +5.0%: at S=32 the backward's end sets the peak, at S=64 the first
# layer's backward (with checkpointing, its input's checkpoint alive; in bfloat16 the
# parameters take half the bytes and the float32 attention terms weigh more).
@pytest.mark.full
@pytest.mark.parametrize("dtype,checkpointing", [("float32", "layer"), ("bfloat16", "none")])
def test_prediction_bounds_the_measured_cpu_peak_with_checkpointing_or_bfloat16(dtype, checkpointing):
    _check_measured_peaks("qwen3-tied", (32, 64), 0.06, dtype, checkpointing)


def _check_measured_peaks(name, lengths, overestimate, dtype="float32", checkpointing="none"):
    from treecompile.compile.wrapper import tree_compile

    cfg, model, opt, cost = cpu_training(name, dtype, checkpointing)
    compiled = tree_compile(model)
    for s in lengths:
        measured = measured_step_peak(compiled, one_path(cfg.vocab_size, s), model, opt)
        predicted = cost.peak_bytes(s)
        rel = predicted / measured - 1
        assert 0 <= rel <= overestimate, (
            f"{name} {dtype} checkpointing={checkpointing} S={s}: predicted {predicted:,} bytes, measured "
            f"{measured:,} ({rel:+.1%}); terms {cost.breakdown(s)}"
        )


def test_dims_object_is_accepted():
    dims = ModelDims(layers=2, hidden=64, intermediate=128, heads=4, kv_heads=4, head_dim=16, vocab=100)
    assert CostModel.from_config(dims, dtype="float32").capacity(1e8) > 0


# (config, tree sizes: prompt, turn, leaf; (mode, rows per part) cases)
STREAMED_CASES = {
    # Attention-bound: parts under one attention block (many parts, a deep stack) and over it.
    "qwen3-attention": ((96, 64, 32), [("keep", 24), ("recompute", 160)]),
    # Six layers, 8 rows a part: the end of a part's backward holds every new parameter
    # gradient and each prefix key and value gradient twice (the attention's, and the prefix
    # leaves' copies); counting them once predicts 0.02% under the measured peak.
    "qwen3-deep": ((24, 16, 8), [("recompute", 8)]),
}


@pytest.mark.full
@pytest.mark.parametrize("name", list(STREAMED_CASES))
def test_streamed_prediction_bounds_the_measured_cpu_peak(name):
    """`stream_peak_bytes` against the CPU allocator's peak of one streamed step (forward,
    backward into existing gradients, AdamW's step), float32, in both modes."""
    from treecompile.compile.wrapper import tree_compile
    from treecompile.stream.options import StreamOptions, plan_stream
    from treecompile.stream.plan import stream_peak_bytes

    cfg, model, opt, cost = cpu_training(name)
    sizes, cases = STREAMED_CASES[name]
    batch = turns_batch(cfg.vocab_size, *sizes)
    compiled = tree_compile(model, stream=StreamOptions(budget_rows=24))
    for mode, rows in cases:
        compiled._stream.options = StreamOptions(budget_rows=rows, mode=mode)  # one compiled graph for all
        measured = measured_step_peak(compiled, batch, model, opt)
        plan = plan_stream(batch, rows)
        predicted = stream_peak_bytes(plan, cost, mode)
        rel = predicted / measured - 1
        print(f"{mode} C={rows}: {plan.num_parts} parts, depth {plan.stack_depth}, measured {measured:,}, {rel:+.1%}")
        assert 0 <= rel <= 0.35, (f"{mode} C={rows} ({plan.num_parts} parts, stack depth {plan.stack_depth}): "
                                  f"predicted {predicted:,} bytes, measured {measured:,} ({rel:+.1%})")
