"""TRL's SFTTrainer and GRPOTrainer with tree packing against the stock trainers, step for step.

Each comparison trains 3 optimizer steps twice from the same weights on the same data, once
with the stock trainer and once with its tree-packing twin, and records the loss and every
parameter's gradient at each step (before the optimizer) and the parameters after it.

* float64: the tree trainer must match the stock one to the float64 HF floor (the project's
  equivalence bar, `testing.SCALED_GRAD_TOLERANCE[("float64", "hf")]`).
* float32 (and bf16 autocast with gradient checkpointing): the stock trainer is
  deterministic on the CPU (two runs agree bit for bit), so its run-to-run error is 0 and
  cannot be the bar. The bar is the stock trainer's own rounding error instead: the distance
  of a stock float32 (or bf16) run from the stock float64 run. The tree run must be as close
  to the float64 run, within `TRL_NOISE_FACTOR` times that distance (the largest over the 3
  steps, per quantity).

Measured (tree / stock, largest over the steps; CPU, torch 2.13, transformers 5.23, TRL 1.16):
SFT float32 with AdamW: gradients 1.4e-6 / 6.7e-7 (2.0x), parameters by norm 5.1e-7 / 2.0e-7
(2.5x; element by element 1.8e-5 / 6.2e-6 on one CPU and 2.5e-5 / 6.2e-6 on an AVX-512 one,
which is why parameters are compared by norm), loss 1.3e-7 / 0 (one float32 ulp); SFT bf16 + checkpointing: loss 5.2e-6 / 6.8e-6, gradients
3.4e-2 / 2.7e-2 (1.3x), parameters 3.8e-2 / 3.5e-2 (1.1x); GRPO float32 with SGD (grpo, dapo,
cispo, sapo): gradients at most 1.5x, parameters 1.0x, loss at most 2x; GRPO dapo bf16 +
checkpointing: loss 1.1e-3 / 5.7e-4 (2.0x), gradients 4.5e-2 / 1.8e-2 (2.5x), parameters
3.2e-4 / 1.6e-4 (2.0x).
"""

from __future__ import annotations

import json
import zlib
from importlib import resources

import numpy as np
import pytest
import torch

trl = pytest.importorskip("trl", reason="TRL is not installed (pip install 'treecompile[trl]')")
transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

from testing import (  # noqa: E402
    SCALED_GRAD_TOLERANCE,
    TRL_KL_RTOL,
    TRL_LOSS_RESOLUTION,
    TRL_NOISE_FACTOR,
    assert_grads_close,
)

from treecompile.core.errors import TreeInputError  # noqa: E402
from treecompile.integrations.trl import TreeGRPOTrainer, TreeSFTTrainer, rows_to_tree  # noqa: E402


class EagerSFT(TreeSFTTrainer):
    """The float64 comparisons run the rewritten graph as it is: what they check is the trainer
    glue, which the lowering does not touch; the float32 and bf16 runs keep the default lowering
    (GRPO's bf16 run excepted: see `EagerGRPO`)."""

    tree_compile_options = {"backend": "eager"}


class EagerGRPO(TreeGRPOTrainer):
    """As `EagerSFT`, for GRPO; also GRPO's bf16 + checkpointing run: the default lowering of
    GRPO is test_grpo_float32_within_stock_noise's, and of bf16 autocast with checkpointing
    test_sft_bf16_checkpointing_within_stock_noise's (the same model under the SFT trainer)."""

    tree_compile_options = {"backend": "eager"}

pytestmark = [pytest.mark.xdist_group("trl"), pytest.mark.full]

EOS, PAD = 2, 0
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}<|im_end|>{% endgeneration %}"
    "{% else %}{{ m['content'] }}<|im_end|>{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _tokenizer():
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(resources.files("treecompile") / "samples" / "sample-tokenizer.json"),
        eos_token="<|im_end|>", pad_token="<|endoftext|>",
    )
    tok.chat_template = CHATML
    return tok


def _gsm8k(n: int) -> list[dict]:
    path = resources.files("treecompile") / "samples" / "gsm8k_sample.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()[:n]]


def _model(dtype: torch.dtype):
    cfg = transformers.Qwen3Config(
        vocab_size=2048, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, pad_token_id=PAD, eos_token_id=EOS, bos_token_id=None,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():  # no identity norms; drawn in float32, so every dtype gets the same weights
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model.to(dtype)


class _Record(transformers.TrainerCallback):
    """Per optimizer step: every parameter's gradient before the step, the parameters after."""

    def __init__(self, model):
        self.model, self.grads, self.params = model, [], []

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.grads.append({n: p.grad.detach().double().clone() for n, p in self.model.named_parameters()})

    def on_step_end(self, args, state, control, **kwargs):
        self.params.append({n: p.detach().double().clone() for n, p in self.model.named_parameters()})


def _train(cls, model, init, args, **kwargs):
    """Trains from ``init``; returns (losses, grads, params, trainer) per step."""
    model.load_state_dict(init)
    rec = _Record(model)
    trainer = cls(model=model, args=args, callbacks=[rec], **kwargs)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == len(rec.grads) == len(rec.params) == args.max_steps
    return losses, rec.grads, rec.params, trainer


def _max_scaled(a: dict, b: dict) -> float:
    """Largest ``max |a - b| / max |b|`` over the parameters."""
    return max(((a[n] - b[n]).abs().max() / b[n].abs().max().clamp_min(1e-30)).item() for n in b)


def _norm_scaled(a: dict, b: dict) -> float:
    """Largest ``||a - b|| / ||b||`` over the parameters."""
    return max(((a[n] - b[n]).norm() / b[n].norm().clamp_min(1e-30)).item() for n in b)


def _noise(run, ref) -> list[tuple[float, float, float]]:
    """Per step: (loss error, gradient error, parameter error) of ``run`` against ``ref``.

    Parameters are compared by norm, gradients element by element: after an Adam step a
    parameter's error is the sign of its near-zero gradient entries (``lr * g / (|g| + eps)``
    moves each entry by about ``lr`` whatever ``|g|`` is), so the largest entry error measures
    which entries' rounding happened to flip a sign, not how far the run is from float64.

    A step's loss error is relative to that step's loss, or to the run's largest loss where that
    is larger: a GRPO step whose advantages cancel logs a loss of rounding noise (measured: 3e-8,
    on terms of size 1), and a relative error against a loss of 0 measures nothing.
    """
    scale = max(abs(x) for x in ref[0])
    return [(abs(la - lb) / max(abs(lb), scale, 1e-30), _max_scaled(ga, gb), _norm_scaled(pa, pb))
            for la, lb, ga, gb, pa, pb in zip(run[0], ref[0], run[1], ref[1], run[2], ref[2])]


def _assert_within_stock_noise(tree, stock, ref, what: str) -> None:
    """``tree`` is as close to ``ref`` (float64 stock) as ``stock`` (stock, same precision) is.

    Compared per quantity (loss, gradients, parameters) over the run, the largest error of any
    step: a single step's rounding error is a draw (in bf16 the stock run's loss is 1e-7 from
    the float64 loss at one step and 7e-6 at the next), the run's largest is its error level.
    """
    t, s = _noise(tree, ref), _noise(stock, ref)
    print(f"\n{what}: per step (loss, grads, params) error vs float64 stock: tree {t}, stock {s}")
    for k, name in enumerate(("loss", "gradients", "parameters")):
        te, se = max(x[k] for x in t), max(x[k] for x in s)
        if k == 0:
            bar = max(TRL_NOISE_FACTOR * se, TRL_LOSS_RESOLUTION)
        else:
            assert se > 0, f"{what}: the stock run equals the float64 run ({name}): no noise measured"
            bar = TRL_NOISE_FACTOR * se
        assert te <= bar, (
            f"{what}, {name}: tree run {te:.3e} from the float64 stock run, stock run {se:.3e} "
            f"(bar {bar:.3e}: {TRL_NOISE_FACTOR} times the stock run's); per step: tree {[x[k] for x in t]}, "
            f"stock {[x[k] for x in s]}"
        )


def _assert_exact(tree, stock, what: str) -> None:
    tol = SCALED_GRAD_TOLERANCE[("float64", "hf")]
    for step in range(len(stock[0])):
        assert abs(tree[0][step] - stock[0][step]) <= tol * max(1.0, abs(stock[0][step])), (
            f"{what}, step {step}: loss {tree[0][step]!r} vs stock {stock[0][step]!r}")
        assert_grads_close(tree[1][step], stock[1][step], ("float64", "hf"))
        assert_grads_close(tree[2][step], stock[2][step], ("float64", "hf"))


@pytest.fixture(scope="module")
def models():
    """One float64 and one float32 model for every test of the module, with their initial weights.

    Each run starts from the initial weights; trainers are kept alive (``held``) so that the tree
    trainers of one model share one compiled graph (compiling dominates these tests' time).
    """
    ms = {torch.float64: _model(torch.float64), torch.float32: _model(torch.float32)}
    inits = {d: {k: v.clone() for k, v in m.state_dict().items()} for d, m in ms.items()}
    return ms, inits, []


# --------------------------------------------------------------------------- SFT

def _sft_args(**kw):
    base = dict(per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=3,
                learning_rate=1e-3, logging_steps=1, report_to=[], use_cpu=True, bf16=False,
                gradient_checkpointing=False, save_strategy="no", max_length=96, seed=0, disable_tqdm=True)
    base.update(kw)
    return trl.SFTConfig(**base)


def _sft_datasets():
    rows = _gsm8k(16)  # 4 questions x 4 solutions: every question a shared prompt
    pc = datasets.Dataset.from_list([{"prompt": r["messages"][0]["content"], "completion": r["messages"][1]["content"]}
                                     for r in rows])
    chat = datasets.Dataset.from_list([{"messages": r["messages"]} for r in rows])
    # Padding-free and packed batches are one row of sequences (positions restarting at 0): packing
    # puts samples of several questions in a row, and the tree shares each question's prompt.
    return {"prompt-completion": (pc, {}), "assistant-only": (chat, {"assistant_only_loss": True}),
            "padding-free": (pc, {"padding_free": True, "max_length": None}),
            "packing": (pc, {"packing": True, "max_length": 256, "per_device_train_batch_size": 2})}


@pytest.fixture(scope="module")
def sft_runs(models, tmp_path_factory):
    """Stock and tree runs: both data kinds in float64 (SGD), prompt-completion in float32
    (TRL's default AdamW) with its float64 AdamW reference."""
    ms, inits, held = models
    tok = _tokenizer()
    out = {}
    # float64 compares parameters to the HF floor: plain SGD, since Adam's first steps
    # (lr * g / (|g| + eps)) turn a 1e-7 relative difference of a near-zero gradient into a
    # visible parameter difference. The gradients are compared at every step.
    plan = [(kind, torch.float64, {"optim": "sgd"}, ("stock", "tree"))
            for kind in ("prompt-completion", "assistant-only", "padding-free", "packing")]
    plan += [("prompt-completion", torch.float64, {}, ("ref",)), ("prompt-completion", torch.float32, {}, ("stock", "tree"))]
    data = _sft_datasets()
    for kind, dtype, opt, names in plan:
        ds, extra = data[kind]
        args = _sft_args(output_dir=str(tmp_path_factory.mktemp("sft")), **extra, **opt)
        for name in names:
            cls = trl.SFTTrainer if name != "tree" else EagerSFT if dtype == torch.float64 else TreeSFTTrainer
            *run, trainer = _train(cls, ms[dtype], inits[dtype], args, train_dataset=ds, processing_class=tok)
            held.append(trainer)
            out[kind, dtype, name] = run
    return out


@pytest.mark.parametrize("kind", ["prompt-completion", "assistant-only", "padding-free", "packing"])
def test_sft_float64_matches_stock(sft_runs, kind):
    _assert_exact(sft_runs[kind, torch.float64, "tree"], sft_runs[kind, torch.float64, "stock"], f"SFT {kind}")


@pytest.mark.parametrize("kind", ["prompt-completion"])
def test_sft_float32_within_stock_noise(sft_runs, kind):
    _assert_within_stock_noise(sft_runs[kind, torch.float32, "tree"], sft_runs[kind, torch.float32, "stock"],
                               sft_runs[kind, torch.float64, "ref"], f"SFT {kind} float32")


def test_sft_masks_reach_the_tree(tmp_path):
    """The collator's labels are the tree's loss masks: prompt and padding are never targets."""
    tok = _tokenizer()
    ds, _ = _sft_datasets()["prompt-completion"]
    trainer = trl.SFTTrainer(model=_model(torch.float32), args=_sft_args(output_dir=str(tmp_path)), train_dataset=ds,
                             processing_class=tok)
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    tree = rows_to_tree(batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"])
    for p, path in enumerate(tree.paths()):
        row = batch["labels"][p][batch["attention_mask"][p].bool()]
        assert path.loss_mask.tolist() == (row != -100).tolist()
        assert 0 < path.loss_mask.sum() < len(path.tokens)  # some prompt tokens masked, some trained
    assert tree.num_tokens < int(batch["attention_mask"].sum())  # prompts shared


@pytest.mark.slow
def test_sft_bf16_checkpointing_within_stock_noise(sft_runs, tmp_path):
    """bf16 autocast and gradient checkpointing (TRL's defaults) on, float32 weights.

    Each run gets a model object of its own: accelerate wraps a model's forward in autocast
    only the first time a trainer prepares it, so a model reused from a full-precision run
    would silently train the stock run in float32.
    """
    ds, _ = _sft_datasets()["prompt-completion"]
    args = _sft_args(output_dir=str(tmp_path), bf16=True, gradient_checkpointing=True)
    runs = {}
    for name, cls in (("stock", trl.SFTTrainer), ("tree", TreeSFTTrainer)):
        model = _model(torch.float32)
        runs[name] = _train(cls, model, dict(model.state_dict()), args, train_dataset=ds,
                            processing_class=_tokenizer())[:3]
    _assert_within_stock_noise(runs["tree"], runs["stock"], sft_runs["prompt-completion", torch.float64, "ref"],
                               "SFT bf16 + checkpointing")


def test_packed_batch_is_its_sequences_and_bounds_must_agree(tmp_path):
    """TRL's packed batch (one row, positions restarting at 0, cu_seq_lens for the kernels) is the
    tree of its sequences; cu_seq_lens that disagree with the positions are refused."""
    ds, extra = _sft_datasets()["packing"]
    trainer = TreeSFTTrainer(model=_model(torch.float32), args=_sft_args(output_dir=str(tmp_path), **extra),
                             train_dataset=ds, processing_class=_tokenizer())
    rows = trainer.train_dataset
    batch = trainer.data_collator([rows[i] for i in range(len(rows) - 2, len(rows))])  # best-fit: short ones last
    assert batch["input_ids"].shape[0] == 1 and "cu_seq_lens_k" in batch
    tree = rows_to_tree(batch["input_ids"], labels=batch["labels"], position_ids=batch["position_ids"])
    bounds = batch["cu_seq_lens_k"].tolist()
    assert len(bounds) - 1 > 2  # several samples in each packed row
    assert tree.sequences() == [batch["input_ids"][0, a:b].tolist() for a, b in zip(bounds, bounds[1:])]
    wrong = dict(batch, cu_seq_lens_k=batch["cu_seq_lens_k"] + torch.tensor([0, 1] + [0] * (tree.num_paths - 1),
                                                                             dtype=torch.int32))
    with pytest.raises(ValueError, match="cu_seq_lens_k .* disagrees with the sequence starts of position_ids"):
        trainer.compute_loss(trainer.model, wrong)


def test_rows_to_tree_refuses_shifted_labels():
    ids = torch.tensor([[5, 6, 7, 8]])
    with pytest.raises(TreeInputError, match="neither -100 nor the token"):
        rows_to_tree(ids, labels=torch.tensor([[6, 7, 8, -100]]))
    with pytest.raises(TreeInputError, match="hole"):
        rows_to_tree(ids, attention_mask=torch.tensor([[1, 0, 1, 1]]))


def test_rows_to_tree_padding_free():
    ids = torch.tensor([[5, 6, 7, 5, 6, 9]])
    tree = rows_to_tree(ids, position_ids=torch.tensor([[0, 1, 2, 0, 1, 2]]),
                        labels=torch.tensor([[-100, 6, 7, -100, 6, 9]]))
    assert tree.sequences() == [[5, 6, 7], [5, 6, 9]] and tree.num_tokens == 4


# --------------------------------------------------------------------------- GRPO

LOSS_TYPES = {  # TRL's names; gspo is grpo with sequence-level importance sampling
    "grpo": {}, "bnpo": {}, "dr_grpo": {}, "dapo": {}, "cispo": {}, "sapo": {},
    "gspo": {"loss_type": "grpo", "importance_sampling_level": "sequence"},
}


def _rollout(prompts, trainer):
    """Deterministic completions: per group a shared head, then per completion its own tail,
    some ended by EOS (so completions differ in length and share prefixes)."""
    tok = trainer.processing_class
    prompt_ids, completion_ids = [], []
    for k, prompt in enumerate(prompts):
        ids = tok(prompt, add_special_tokens=False)["input_ids"]
        seed = zlib.crc32(f"{prompt}|{trainer.state.global_step}".encode())
        head = np.random.default_rng(seed).integers(3, 2048, size=3).tolist()
        rng = np.random.default_rng([seed, k % trainer.num_generations])
        tail = rng.integers(3, 2048, size=int(rng.integers(1, 8))).tolist()
        done = rng.random() < 0.5
        completion_ids.append((head + tail + [EOS] if done else head + tail)[: trainer.max_completion_length])
        prompt_ids.append(ids)
    return {"prompt_ids": prompt_ids, "completion_ids": completion_ids,
            "logprobs": [[0.0] * len(c) for c in completion_ids]}


def _reward(completions, completion_ids, **kwargs):
    return [float(sum(c) % 7) + 0.1 * len(c) for c in completion_ids]


def _grpo_args(out, **kw):
    base = dict(output_dir=out, per_device_train_batch_size=8, num_generations=4, max_completion_length=12,
                max_steps=3, num_iterations=2, learning_rate=3e-2, logging_steps=1, report_to=[], use_cpu=True,
                bf16=False, gradient_checkpointing=False, save_strategy="no", seed=0, disable_tqdm=True)
    base.update(kw)
    return trl.GRPOConfig(**base)


@pytest.fixture(scope="module")
def grpo_setup(models):
    import os

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    rows = _gsm8k(32)[::4][:4]
    ds = datasets.Dataset.from_list([{"prompt": r["messages"][0]["content"][:120]} for r in rows])
    return (ds, *models)


def _grpo_run(setup, cls, dtype, out, **kw):
    ds, ms, inits, held = setup
    *run, trainer = _train(cls, ms[dtype], inits[dtype], _grpo_args(out, **kw), reward_funcs=_reward,
                           train_dataset=ds, processing_class=_tokenizer(), rollout_func=_rollout)
    held.append(trainer)
    return run, trainer


@pytest.mark.parametrize("loss", [pytest.param(name, marks=pytest.mark.slow) if name in ("bnpo", "dr_grpo", "gspo")
                                  else name for name in LOSS_TYPES])
def test_grpo_float64_matches_stock(grpo_setup, loss, tmp_path):
    kw = {"loss_type": loss, **LOSS_TYPES[loss], "optim": "sgd"}
    stock, st = _grpo_run(grpo_setup, trl.GRPOTrainer, torch.float64, str(tmp_path), **kw)
    tree, _ = _grpo_run(grpo_setup, EagerGRPO, torch.float64, str(tmp_path), **kw)
    _assert_exact(tree, stock, f"GRPO {loss}")
    # The second iteration on each generation is off-policy: the clipping was exercised.
    assert any(v > 0 for h in st.state.log_history for k, v in h.items() if "clip" in k), "no token was clipped"


def test_grpo_with_a_reference_model_float64_matches_stock(grpo_setup, tmp_path):
    """``beta > 0``: TRL loads a reference model from the policy's ``config._name_or_path`` and
    runs it through the same log-prob method (on the tree side: a compiled graph of its own);
    the KL penalty then enters the loss. 2 steps (the second one's KL is away from 0)."""
    ds, ms, inits, held = grpo_setup
    model = ms[torch.float64]
    model.load_state_dict(inits[torch.float64])
    model.save_pretrained(tmp_path / "init")  # float64, as TRL loads the reference (the policy's dtype)
    name = model.config._name_or_path
    model.config._name_or_path = str(tmp_path / "init")
    try:
        kw = {"beta": 0.04, "optim": "sgd", "max_steps": 2}
        stock, st = _grpo_run(grpo_setup, trl.GRPOTrainer, torch.float64, str(tmp_path), **kw)
        tree, tt = _grpo_run(grpo_setup, EagerGRPO, torch.float64, str(tmp_path), **kw)
    finally:
        model.config._name_or_path = name
    assert tt.ref_model is not None and st.ref_model is not None
    _assert_exact(tree, stock, "GRPO beta=0.04")
    stock_kl = [h["kl"] for h in st.state.log_history if "kl" in h]
    tree_kl = [h["kl"] for h in tt.state.log_history if "kl" in h]
    assert len(stock_kl) == 2 and stock_kl[-1] > 0, stock_kl  # the reference model was used
    # The first step's KL is 0 up to rounding (the policy is the reference); the second is not.
    assert tree_kl[0] == pytest.approx(0, abs=1e-12) and stock_kl[0] == pytest.approx(0, abs=1e-12)
    assert tree_kl[1] == pytest.approx(stock_kl[1], rel=TRL_KL_RTOL), (tree_kl, stock_kl)


@pytest.mark.parametrize("loss", ["grpo", pytest.param("dapo", marks=pytest.mark.slow),
                                  pytest.param("cispo", marks=pytest.mark.slow), pytest.param("sapo", marks=pytest.mark.slow)])
def test_grpo_float32_within_stock_noise(grpo_setup, loss, tmp_path):
    # SGD: at this learning rate Adam's first steps (lr * g / (|g| + eps)) turn float32 noise on
    # near-zero gradients into parameter differences of order lr, in both runs alike, which
    # makes the parameter comparison a draw of a few flipped signs rather than a measurement.
    kw = {"loss_type": loss, **LOSS_TYPES[loss], "optim": "sgd"}
    ref, _ = _grpo_run(grpo_setup, trl.GRPOTrainer, torch.float64, str(tmp_path), **kw)
    stock, _ = _grpo_run(grpo_setup, trl.GRPOTrainer, torch.float32, str(tmp_path), **kw)
    tree, _ = _grpo_run(grpo_setup, TreeGRPOTrainer, torch.float32, str(tmp_path), **kw)
    _assert_within_stock_noise(tree, stock, ref, f"GRPO {loss} float32")


@pytest.mark.slow
def test_grpo_bf16_checkpointing_within_stock_noise(grpo_setup, tmp_path):
    """bf16 autocast and gradient checkpointing (TRL's defaults) on, float32 weights; a model
    object per run (see test_sft_bf16_checkpointing_within_stock_noise)."""
    ds = grpo_setup[0]
    kw = {"loss_type": "dapo", "optim": "sgd"}  # SGD: see test_grpo_float32_within_stock_noise
    ref, _ = _grpo_run(grpo_setup, trl.GRPOTrainer, torch.float64, str(tmp_path), **kw)
    runs = {}
    for name, cls in (("stock", trl.GRPOTrainer), ("tree", EagerGRPO)):
        model = _model(torch.float32)
        runs[name] = _train(cls, model, dict(model.state_dict()),
                            _grpo_args(str(tmp_path), bf16=True, gradient_checkpointing=True, **kw),
                            reward_funcs=_reward, train_dataset=ds, processing_class=_tokenizer(),
                            rollout_func=_rollout)[:3]
    _assert_within_stock_noise(runs["tree"], runs["stock"], ref, "GRPO dapo bf16 + checkpointing")


@pytest.mark.slow
def test_grpo_temperature_and_entropy(grpo_setup, tmp_path):
    """A non-default temperature divides the logits on the tree side too (log-probs and entropy)."""
    kw = {"temperature": 0.7, "optim": "sgd"}
    stock, st = _grpo_run(grpo_setup, trl.GRPOTrainer, torch.float64, str(tmp_path), **kw)
    tree, tt = _grpo_run(grpo_setup, EagerGRPO, torch.float64, str(tmp_path), **kw)
    _assert_exact(tree, stock, "GRPO temperature 0.7")
    for hs, ht in zip(st.state.log_history, tt.state.log_history):
        if "entropy" in hs:
            assert ht["entropy"] == pytest.approx(hs["entropy"], rel=1e-6)


# --------------------------------------------------------------------------- records_from_trl

def test_records_from_trl_chat_uses_the_template_and_its_assistant_mask():
    """Conversational prompt/completion rows from a datasets.Dataset: rendered by the
    tokenizer's own chat template; only the {% generation %} tokens are trained."""
    from treecompile.rl.data import RLCollator, records_from_trl

    tok = _tokenizer()
    rows = _gsm8k(8)
    ds = datasets.Dataset.from_list([{"prompt": r["messages"][:1], "completion": r["messages"][1:], "reward": k % 3}
                                     for k, r in enumerate(rows)])
    recs = records_from_trl(ds, tok, on_drift="error")
    for rec, r in zip(recs, rows):
        full = tok.apply_chat_template(r["messages"], tokenize=True, return_dict=True,
                                       return_assistant_tokens_mask=True)
        assert rec.prompt_ids + rec.completion_ids == list(full["input_ids"])
        assert rec.prompt_ids == list(tok.apply_chat_template(r["messages"][:1], add_generation_prompt=True,
                                                              tokenize=True, return_dict=True)["input_ids"])
        trained = [t for t, m in zip(rec.completion_ids, rec.completion_mask) if m]
        assert tok.decode(trained) == r["messages"][1]["content"] + "<|im_end|>"
    samples = RLCollator(max_tokens=4096).samples(recs)
    assert len(samples) == 2  # 2 questions x 4 solutions: one tree per question


def test_records_from_trl_text_and_drift():
    from treecompile.chat.to_tree import RetokenizationDriftWarning
    from treecompile.rl.data import records_from_trl

    tok = _tokenizer()
    [rec] = records_from_trl([{"prompt": "The answer is", "completion": " 42.", "reward": 1.0}], tok)
    assert tok.decode(rec.prompt_ids) == "The answer is" and tok.decode(rec.completion_ids) == " 42."
    # "Answer: 1" + "8" tokenizes "18" as one token: the prompt alone is not a prefix of the
    # whole. The record's prompt is cut to the common prefix and the drift is reported.
    row = {"prompt": "Answer: 1", "completion": "8", "reward": 0.0}
    alone, together = tok("Answer: 1")["input_ids"], tok("Answer: 18")["input_ids"]
    assert together[: len(alone)] != alone
    with pytest.warns(RetokenizationDriftWarning, match="record 0"):
        [rec] = records_from_trl([row], tok)
    assert rec.prompt_ids + rec.completion_ids == together
    with pytest.raises(TreeInputError, match="differs from its rendering"):
        records_from_trl([row], tok, on_drift="error")
