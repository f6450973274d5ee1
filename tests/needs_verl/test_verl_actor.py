"""The tree engine (`treecompile.integrations.verl_actor`) against verl's own FSDP actor engine.

verl 0.9's actor is ``FSDPEngineWithLMHead``: ``compute_log_prob`` is its ``infer_batch``,
``update_actor`` runs its ``train_batch`` per mini-batch. Both engines here are verl's class
(the tree one with ``forward_step`` replaced), built with verl's configs, optimizer and
scheduler builders, and fed what verl's trainer feeds them: a ``DataProto`` in the
left/right-padded rollout layout, through ``to_tensordict`` and ``left_right_2_no_padding``,
with the trainer's and worker's meta keys. The loss is verl's ``ppo_loss`` with an actor
config. Compared: log-probs and entropies (``compute_log_prob``), then per micro-batch
losses, every metric, the gradient norm, every parameter's gradient and every parameter
after the optimizer step (``update_actor``).

Setting: CPU, float64, a tiny Qwen3 with perturbed weights (`testing.perturbed_hf_model`),
gradient checkpointing as verl enables it. verl's engine builder would make a float32 module
and wrap it in FSDP, so both engines get the same float64 module unsharded instead; two tests
shard both with verl's own FSDP2 build (in float64; on one rank and on two data-parallel
ranks) and compare again, and FSDP1 is refused. verl 0.9 has no CPU platform;
`CpuPlatform` is one, set before verl's engine modules are imported.

Needs verl 0.9.1 (which pins transformers < 5.11): scripts/test_verl.sh builds a venv with it
and runs this folder.
"""

from __future__ import annotations

import copy
import os
import re
import tempfile
from functools import partial
from pathlib import Path

import pytest
import torch

pytest.importorskip("verl", reason="verl is not installed; scripts/test_verl.sh runs these tests in a venv with "
                                   "verl 0.9.1")

from treecompile.integrations.verl_platform import use_cpu_platform  # noqa: E402

use_cpu_platform()  # verl's device lookup finds the CPU (the docs page's example does the same)

import torch.distributed as dist  # noqa: E402
import transformers  # noqa: E402
from testing import TOLERANCES, assert_grads_close, perturbed_hf_model  # noqa: E402
from verl import DataProto  # noqa: E402
from verl.trainer.config import CheckpointConfig  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.utils.metric import Metric  # noqa: E402
from verl.workers.config import FSDPActorConfig, FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig  # noqa: E402
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead  # noqa: E402
from verl.workers.utils.losses import ppo_loss  # noqa: E402
from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding  # noqa: E402

from treecompile.core.errors import TreeInputError, UnsupportedModelError  # noqa: E402
from treecompile.integrations.verl_actor import micro_batch_tree, register_tree_engine, tree_engine_class  # noqa: E402

RTOL, ATOL = TOLERANCES[("float64", "hf")]
VOCAB = 64
LR = 0.5
DOCS_PAGE = Path(__file__).resolve().parents[2] / "docs" / "integrations-verl.md"


@pytest.fixture(scope="module")
def process_group():
    """One gloo rank, as a verl worker's process group (the engine asks for ranks and meshes)."""
    if not dist.is_initialized():
        with tempfile.TemporaryDirectory() as tmp:
            dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
    yield dist.group.WORLD


@pytest.fixture(scope="module")
def model_dir():
    config = transformers.Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                      architectures=["Qwen3ForCausalLM"])
    with tempfile.TemporaryDirectory() as tmp:
        config.save_pretrained(tmp)
        yield tmp, config


def _verl_module(config) -> torch.nn.Module:
    """What verl's ``_build_module`` makes of the model, in float64, with gradient checkpointing
    as it enables it. (Its monkey patch swaps flash-attention-2's forward, for Ulysses
    sequence parallelism; this model runs SDPA.)"""
    model = perturbed_hf_model(config, eval=False)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


class Engines:
    """verl's engine and the tree engine on copies of one float64 module, reset per test."""

    def __init__(self, model_dir: str, config) -> None:
        self.model_config = HFModelConfig(path=model_dir, load_tokenizer=False)
        module = _verl_module(config)
        self.start = copy.deepcopy(module.state_dict())
        # SGD: the step is linear in the gradient, so parameters after it are compared as
        # tightly as gradients (AdamW's first step, g / (|g| + eps), amplifies the float32
        # rounding of near-zero gradients).
        optimizer_config = FSDPOptimizerConfig(optimizer="SGD", lr=LR, weight_decay=0.01, clip_grad=1.0,
                                               total_training_steps=4)
        self.verl = self._engine(FSDPEngineWithLMHead, module, optimizer_config)
        self.tree = self._engine(tree_engine_class(), copy.deepcopy(module), optimizer_config)

    def _engine(self, cls, module, optimizer_config):
        engine = cls(model_config=self.model_config, engine_config=FSDPEngineConfig(strategy="fsdp2"),
                     optimizer_config=optimizer_config, checkpoint_config=CheckpointConfig())
        engine.module = module
        engine._autocast_dtype = torch.float32  # verl's setting for float32 parameters: no autocast
        return engine

    def reset(self):
        for engine in (self.verl, self.tree):
            engine.module.load_state_dict(self.start)
            engine.optimizer = engine._build_optimizer(engine.module)
            engine.lr_scheduler = engine._build_lr_scheduler(engine.optimizer)
        return self


@pytest.fixture(scope="module")
def built(process_group, model_dir):
    return Engines(*model_dir)


@pytest.fixture
def engines(built):
    return built.reset()


# --------------------------------------------------------------------------- the batches


def rollout(groups: int, group_size: int, tp: int, tr: int, seed: int) -> dict[str, torch.Tensor]:
    """GRPO groups in verl's rollout layout: left-padded prompts ``[B, Tp]``, right-padded
    responses ``[B, Tr]``, one response with a tool output (response_mask 0) inside it, prompts
    sharing their first two tokens across groups, responses of one token up to ``Tr``."""
    g = torch.Generator().manual_seed(seed)
    b = groups * group_size
    prompts, responses = torch.zeros(b, tp, dtype=torch.int64), torch.zeros(b, tr, dtype=torch.int64)
    attention = torch.zeros(b, tp + tr, dtype=torch.int64)
    for i in range(b):
        grp = i // group_size
        n_prompt = 3 + grp % (tp - 2)
        prompt = torch.cat([torch.tensor([5, 6]), torch.randint(1, VOCAB, (n_prompt - 2,), generator=g)])
        if i % group_size:
            prompt = prompts[i - 1, tp - n_prompt:]  # the group's prompt
        n_response = 1 + (i * 5 + seed) % tr
        prompts[i, tp - n_prompt:] = prompt
        responses[i, :n_response] = torch.randint(1, VOCAB, (n_response,), generator=g)
        attention[i, tp - n_prompt:tp + n_response] = 1
    response_mask = attention[:, tp:].clone()
    tool = int(torch.argmax(response_mask.sum(1)))
    response_mask[tool, 1] = 0
    rewards = torch.rand(groups, group_size, generator=g, dtype=torch.float64)
    adv = (rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-6)
    position_ids = (attention.cumsum(-1) - 1).clamp(min=0)
    return {"prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], 1),
            "attention_mask": attention, "response_mask": response_mask, "position_ids": position_ids,
            "advantages": adv.reshape(b, 1) * response_mask}


BATCHES = {
    # name: (groups, group size, Tp, Tr, seed, micro-batch size)
    "B8-Tp6-Tr7-micro4": (2, 4, 6, 7, 1, 4),    # a micro-batch is a group: its prompt computed once
    "B12-Tp9-Tr13-micro3": (4, 3, 9, 13, 2, 3),  # longer, groups of 3
}


def worker_batch(tensors, *, temperature=1.0, micro=4, train=True, entropy=True, use_remove_padding=True,
                 dynamic_max_tokens=None, **meta):
    """The TensorDict verl's trainer and worker hand the engine (``_update_actor`` /
    ``_compute_old_log_prob`` and ``TrainingWorker.train_batch`` / ``infer_batch``)."""
    data = DataProto.from_dict(tensors={k: v.clone() for k, v in tensors.items()},
                               meta_info={"temperature": temperature}).to_tensordict()
    data = left_right_2_no_padding(data)
    b = data.batch_size[0]
    tu.assign_non_tensor(data, calculate_entropy=entropy, compute_loss=train, global_batch_size=b,
                         mini_batch_size=b, use_remove_padding=use_remove_padding,
                         use_dynamic_bsz=dynamic_max_tokens is not None,
                         max_token_len_per_gpu=dynamic_max_tokens or 16384, micro_batch_size_per_gpu=micro,
                         use_fused_kernels=False, **meta)
    return data


def actor_config(mode: str, micro: int, group_size: int) -> FSDPActorConfig:
    """verl's PPO/GRPO actor settings: clip-higher, dual-clip, an entropy bonus, a KL loss."""
    return FSDPActorConfig(strategy="fsdp2", rollout_n=group_size, ppo_mini_batch_size=2,
                           ppo_micro_batch_size_per_gpu=micro, loss_agg_mode=mode, clip_ratio_low=0.2,
                           clip_ratio_high=0.28, clip_ratio_c=3.0, entropy_coeff=0.01, use_kl_loss=True,
                           kl_loss_coef=0.05, kl_loss_type="low_var_kl")


def with_log_probs(engines, name: str) -> tuple[dict, int]:
    """The batch with old and reference log-probs: verl's own, moved off the current policy so
    that the ratios clip on both sides and dual-clip acts."""
    groups, size, tp, tr, seed, micro = BATCHES[name]
    tensors = rollout(groups, size, tp, tr, seed)
    data = worker_batch(tensors, train=False, entropy=False, micro=micro)
    with engines.verl.eval_mode():
        out = engines.verl.infer_batch(data)
    behaviour = no_padding_2_padding(out["model_output"]["log_probs"], data).detach()
    g = torch.Generator().manual_seed(seed + 10)
    mask = tensors["response_mask"]
    tensors["old_log_probs"] = (behaviour + 0.8 * torch.randn(behaviour.shape, generator=g, dtype=torch.float64)) * mask
    tensors["ref_log_prob"] = (behaviour + 0.2 * torch.randn(behaviour.shape, generator=g, dtype=torch.float64)) * mask
    return tensors, micro


def close(got, want, what):
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {m}")


# --------------------------------------------------------------------------- compute_log_prob


@pytest.mark.parametrize("verl_remove_padding", [True, False], ids=["verl-packed", "verl-padded"])
@pytest.mark.parametrize("temperature", [1.0, 0.7], ids=["T1", "T0.7"])
@pytest.mark.parametrize("name", list(BATCHES))
def test_compute_log_prob_gives_verls_log_probs_and_entropy(engines, name, temperature, verl_remove_padding):
    groups, size, tp, tr, seed, micro = BATCHES[name]
    tensors = rollout(groups, size, tp, tr, seed)
    outs = {}
    for kind, engine in (("verl", engines.verl), ("tree", engines.tree)):
        data = worker_batch(tensors, temperature=temperature, train=False, micro=micro,
                            use_remove_padding=verl_remove_padding)
        with engine.eval_mode():
            outs[kind] = (engine.infer_batch(data)["model_output"], data)
    (want, data), (got, _) = outs["verl"], outs["tree"]
    real = tensors["attention_mask"][:, tp:].bool()
    for key in ("log_probs", "entropy"):
        # What the trainer reads: the response positions, through verl's own slicing.
        w, g = no_padding_2_padding(want[key], data), no_padding_2_padding(got[key], data)
        close(g[real], w[real], f"{key} of the response tokens")
        assert (g[~real] == 0).all()
        # Every entry but each sequence's last (which predicts nothing: verl's holds the log-prob
        # of the next sequence's first token, the tree's holds 0).
        tree = micro_batch_tree(data["input_ids"], data["position_ids"])
        close(got[key].values()[tree.valid], want[key].values()[tree.valid], f"{key} of every predicted token")
        assert (got[key].values()[~tree.valid] == 0).all()
    assert tree.batch.num_tokens < int(tensors["attention_mask"].sum())  # the prompts computed once


# --------------------------------------------------------------------------- update_actor


def _train(engine, data, loss_fn):
    grads = {}

    def keep_grads(optimizer, args, kwargs):  # after verl's clipping, before the step
        grads.update({n: p.grad.detach().clone() for n, p in engine.module.named_parameters()})

    hook = engine.optimizer.register_step_pre_hook(keep_grads)
    try:
        with engine.train_mode():
            out = engine.train_batch(data, loss_fn)
    finally:
        hook.remove()
    params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    return out, grads, params


def _metrics(out) -> dict:
    return {k: v.aggregate() if isinstance(v, Metric) else v for k, v in out["metrics"].items()}


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("name", list(BATCHES))
def test_update_actor_gives_verls_losses_metrics_gradients_and_step(engines, name, mode):
    tensors, micro = with_log_probs(engines, name)
    groups, size = BATCHES[name][:2]
    config = actor_config(mode, micro, size)
    results = {}
    for kind, engine in (("verl", engines.verl), ("tree", engines.tree)):
        data = worker_batch(tensors, micro=micro, entropy=True)
        results[kind] = _train(engine, data, partial(ppo_loss, config=config))
    (want, want_grads, want_params), (got, got_grads, got_params) = results["verl"], results["tree"]

    assert len(got["loss"]) == len(want["loss"]) == groups * size // micro  # micro-batched
    close(torch.tensor(got["loss"]), torch.tensor(want["loss"]), "loss per micro-batch")
    want_metrics, got_metrics = _metrics(want), _metrics(got)
    assert got_metrics.keys() == want_metrics.keys()
    for key, value in want_metrics.items():
        close(torch.tensor(got_metrics[key], dtype=torch.float64), torch.tensor(value, dtype=torch.float64), key)
    assert {"actor/pg_loss", "actor/entropy_loss", "kl_loss", "actor/pg_clipfrac", "grad_norm"} <= want_metrics.keys()
    # The batch makes every part of the loss matter: clipping on both sides, a non-zero KL.
    assert want_metrics["actor/pg_clipfrac"] > 0 and want_metrics["actor/pg_clipfrac_lower"] > 0
    assert want_metrics["kl_loss"] > 0

    assert_grads_close(got_grads, want_grads, ("float64", "hf"))
    assert all(g.abs().max() > 0 for g in want_grads.values())
    # The step: SGD on those gradients; the update (parameter - start) compared to its own size.
    for n, want_p in want_params.items():
        start = engines.start[n]
        upd, want_upd = got_params[n] - start, want_p - start
        err = (upd - want_upd).abs().max().item() / max(want_upd.abs().max().item(), 1e-30)
        assert err <= 2e-6, f"{n}: update error {err:.3e}"


def test_dynamic_batch_sizes_give_verls_gradients(engines):
    """``use_dynamic_bsz``: verl groups sequences into micro-batches by a token budget and
    restores their order; the tree engine runs whatever micro-batches it is given."""
    name = "B12-Tp9-Tr13-micro3"
    tensors, micro = with_log_probs(engines, name)
    config = actor_config("token-mean", micro, BATCHES[name][1])
    results = {}
    for kind, engine in (("verl", engines.verl), ("tree", engines.tree)):
        data = worker_batch(tensors, train=False, dynamic_max_tokens=40)
        with engine.eval_mode():
            out = engine.infer_batch(data)
        log_probs = no_padding_2_padding(out["model_output"]["log_probs"], data)
        results[kind] = (*_train(engine, worker_batch(tensors, micro=micro, dynamic_max_tokens=40),
                                 partial(ppo_loss, config=config)), log_probs)
    (want, want_grads, _, want_lp), (got, got_grads, _, got_lp) = results["verl"], results["tree"]
    assert len(want["loss"]) >= 3  # several micro-batches, of sizes verl chose
    close(torch.tensor(got["loss"]), torch.tensor(want["loss"]), "loss per micro-batch")
    close(got_lp, want_lp, "log-probs in the original order")
    assert_grads_close(got_grads, want_grads, ("float64", "hf"))


# --------------------------------------------------------------------------- what is refused


@pytest.mark.parametrize("edit, error, match", [
    (lambda d: tu.assign_non_tensor(d, use_fused_kernels=True), TreeInputError, "use_fused_kernels=True"),
    (lambda d: tu.assign_non_tensor(d, calculate_sum_pi_squared=True), TreeInputError,
     "calculate_sum_pi_squared=True"),
    (lambda d: tu.assign_non_tensor(d, distillation_use_topk=True), TreeInputError, "distillation_use_topk=True"),
    (lambda d: d.__setitem__("temperature", torch.tensor([1.0, 0.7] * 4)), TreeInputError,
     "per-sample temperatures differ"),
], ids=["fused-kernels", "sum-pi-squared", "topk-distillation", "per-sample-temperature"])
def test_options_a_tree_cannot_reproduce_are_refused_by_name(engines, edit, error, match):
    tensors = rollout(*BATCHES["B8-Tp6-Tr7-micro4"][:5])
    data = worker_batch(tensors, train=False)
    edit(data)
    with pytest.raises(error, match=match), engines.tree.eval_mode():
        engines.tree.infer_batch(data)


def _fsdp2_engine(cls, model_config, optimizer_config, config):
    """An engine of class ``cls`` on a fresh `_verl_module`, sharded as verl's engine build
    shards it for strategy 'fsdp2' (``apply_fsdp2``: every decoder layer, then the root, on the
    engine's device mesh), in float64 (verl's precision config has no float64: its policy's
    dtypes are given here), with verl's optimizer and scheduler on the shards."""
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from verl.utils.fsdp_utils import apply_fsdp2

    engine = cls(model_config=model_config, engine_config=FSDPEngineConfig(strategy="fsdp2"),
                 optimizer_config=optimizer_config, checkpoint_config=CheckpointConfig())
    module = _verl_module(config)
    policy = MixedPrecisionPolicy(param_dtype=torch.float64, reduce_dtype=torch.float64, cast_forward_inputs=True)
    apply_fsdp2(module, {"mesh": engine.device_mesh, "mp_policy": policy, "reshard_after_forward": True},
                engine.engine_config)
    engine.module = module
    engine._autocast_dtype = torch.float32  # verl's setting for float32 parameters: no autocast
    engine.optimizer = engine._build_optimizer(engine.module)
    engine.lr_scheduler = engine._build_lr_scheduler(engine.optimizer)
    return engine


def test_fsdp2_sharded_modules_give_verls_log_probs_gradients_and_step(engines, model_dir):
    """Both engines on modules sharded by verl's own FSDP2 build (one gloo rank): the tree
    engine's calls run the module unsharded and reduce-scatter each gradient into its shard;
    log-probs, losses, metrics, gradients (verl clips them as DTensors) and the step equal
    verl's. Non-final micro-batches run under verl's ``set_requires_gradient_sync(False)``."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    # The same start as `engines.start`: `_verl_module` is seeded.
    sharded = {kind: _fsdp2_engine(cls, engines.model_config, engines.verl.optimizer_config, model_dir[1])
               for kind, cls in (("verl", FSDPEngineWithLMHead), ("tree", tree_engine_class()))}
    assert isinstance(sharded["tree"].module, FSDPModule)

    name = "B8-Tp6-Tr7-micro4"
    groups, size, tp, tr, seed, micro = BATCHES[name]
    tensors = rollout(groups, size, tp, tr, seed)
    log_probs = {}
    for kind, engine in sharded.items():
        data = worker_batch(tensors, train=False, micro=micro)
        with engine.eval_mode():
            log_probs[kind] = no_padding_2_padding(engine.infer_batch(data)["model_output"]["log_probs"], data)
    close(log_probs["tree"], log_probs["verl"], "log-probs")

    tensors["old_log_probs"] = log_probs["verl"].detach() * tensors["response_mask"]
    tensors["ref_log_prob"] = tensors["old_log_probs"] + 0.1 * tensors["response_mask"]
    config = actor_config("token-mean", micro=2, group_size=size)
    results = {kind: _train(engine, worker_batch(tensors, micro=2, entropy=True), partial(ppo_loss, config=config))
               for kind, engine in sharded.items()}
    (want, want_grads, want_params), (got, got_grads, got_params) = results["verl"], results["tree"]
    assert len(want["loss"]) == groups * size // 2  # micro-batched: gradients accumulate in the shards
    close(torch.tensor(got["loss"]), torch.tensor(want["loss"]), "loss per micro-batch")
    close(torch.tensor(_metrics(got)["grad_norm"]), torch.tensor(_metrics(want)["grad_norm"]), "grad_norm")
    assert all(isinstance(g, DTensor) for g in got_grads.values())  # in the shards, as FSDP2 keeps them
    full = lambda d: {n: t.full_tensor() if isinstance(t, DTensor) else t for n, t in d.items()}  # noqa: E731
    assert_grads_close(full(got_grads), full(want_grads), ("float64", "hf"))
    for n, p in full(want_params).items():
        upd, want_upd = full(got_params)[n] - engines.start[n], p - engines.start[n]
        err = (upd - want_upd).abs().max().item() / max(want_upd.abs().max().item(), 1e-30)
        assert err <= 2e-6, f"{n}: update error {err:.3e}"


def _two_rank_worker(rank: int, init_file: str, model_dir: str, out_dir: str) -> None:
    """One of two gloo ranks: verl's engine and the tree engine on modules sharded by verl's
    FSDP2 build over both ranks; this rank trains on its own GRPO group (data parallel)."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        config = transformers.AutoConfig.from_pretrained(model_dir)
        model_config = HFModelConfig(path=model_dir, load_tokenizer=False)
        optimizer_config = FSDPOptimizerConfig(optimizer="SGD", lr=LR, weight_decay=0.01, clip_grad=1.0,
                                               total_training_steps=4)
        groups, size, tp, tr, seed, _ = BATCHES["B8-Tp6-Tr7-micro4"]
        tensors = rollout(groups, size, tp, tr, seed)
        mine = {k: v[rank * size:(rank + 1) * size] for k, v in tensors.items()}  # this rank's group
        mine["old_log_probs"] = -2.0 * mine["response_mask"]
        mine["ref_log_prob"] = -1.9 * mine["response_mask"]
        results = {}
        for kind, cls in (("verl", FSDPEngineWithLMHead), ("tree", tree_engine_class())):
            engine = _fsdp2_engine(cls, model_config, optimizer_config, config)
            data = worker_batch(mine, micro=2, entropy=True)
            tu.assign_non_tensor(data, global_batch_size=groups * size)
            out, grads, params = _train(engine, data, partial(ppo_loss, config=actor_config("token-mean", 2, size)))
            results[kind] = (out["loss"], _metrics(out)["grad_norm"],
                             {n: g.full_tensor() for n, g in grads.items()},
                             {n: q.full_tensor() for n, q in params.items()})
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_fsdp2_over_two_ranks_gives_verls_gradients_and_step(model_dir):
    """Two gloo ranks, each with its own GRPO group, both engines sharded by verl's FSDP2 build
    over both: the gradients FSDP2's reduce-scatter divides over the ranks (verl's loss is
    normalised by the global token count) and the step equal verl's on every rank."""
    from testing import spawn_ranks

    with tempfile.TemporaryDirectory() as tmp:
        spawn_ranks(_two_rank_worker, (os.path.join(tmp, "init"), model_dir[0], tmp), 2)
        ranks = [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False) for r in range(2)]
    for rank, results in enumerate(ranks):
        (want_loss, want_norm, want_grads, want_params), (loss, norm, grads, params) = results["verl"], results["tree"]
        close(torch.tensor(loss), torch.tensor(want_loss), f"rank {rank}: loss per micro-batch")
        close(torch.tensor(norm), torch.tensor(want_norm), f"rank {rank}: grad_norm")
        assert_grads_close(grads, want_grads, ("float64", "hf"))
        assert all(g.abs().max() > 0 for g in want_grads.values())
        for n, want in want_params.items():
            torch.testing.assert_close(params[n], want, rtol=0, atol=2e-6 * LR, msg=lambda m, n=n: f"rank {rank} {n}: {m}")
    # Both ranks hold the same model after the step (one reduction, not two local updates).
    for n, want in ranks[0]["tree"][3].items():
        assert torch.equal(ranks[1]["tree"][3][n], want), n
    assert not torch.allclose(torch.tensor(ranks[0]["verl"][0]), torch.tensor(ranks[1]["verl"][0]))  # own data


def test_an_fsdp1_sharded_module_is_refused_naming_the_strategy(engines, model_dir):
    """FSDP1 gathers its flat parameters in hooks outside the one captured graph: refused,
    pointing to strategy 'fsdp2'. (FSDP1 needs an accelerator to build one: a stand-in with
    its class name, as torch names it, is what the check reads.)"""
    module = perturbed_hf_model(model_dir[1], eval=False)
    module.model.layers[0] = type("FullyShardedDataParallel", (torch.nn.Module,),
                                  {"__module__": "torch.distributed.fsdp.fully_sharded_data_parallel"})()
    engine = engines._engine(tree_engine_class(), module, engines.verl.optimizer_config)
    data = worker_batch(rollout(*BATCHES["B8-Tp6-Tr7-micro4"][:5]), train=False)
    with pytest.raises(UnsupportedModelError, match=r"sharded by FSDP1 .*strategy 'fsdp'.*strategy=fsdp2"), \
            engine.eval_mode():
        engine.infer_batch(data)


def test_ulysses_sequence_parallelism_is_refused(engines):
    engines.tree.ulysses_sequence_parallel_size = 2  # what verl's engine sets from its config
    try:
        data = worker_batch(rollout(*BATCHES["B8-Tp6-Tr7-micro4"][:5]), train=False)
        with pytest.raises(TreeInputError, match="ulysses_sequence_parallel_size=2"), engines.tree.eval_mode():
            engines.tree.infer_batch(data)
    finally:
        engines.tree.ulysses_sequence_parallel_size = 1


# --------------------------------------------------------------------------- plugging it into verl


def test_registered_engine_is_what_verls_registry_builds(process_group):
    from verl.workers.engine.base import EngineRegistry

    registry = EngineRegistry._engines["language_model"]
    try:
        cls = register_tree_engine(backend="eager")
        assert register_tree_engine() is cls
        for backend in ("fsdp", "fsdp2"):
            assert EngineRegistry.get_engine_cls("language_model", backend) is cls
        assert issubclass(cls, FSDPEngineWithLMHead) and cls.tree_compile_options == {"backend": "eager"}
    finally:
        for backend in ("fsdp", "fsdp2"):
            registry.get(backend, {}).pop(("cpu", "cpu"), None)


def test_the_docs_example_runs(process_group, monkeypatch, tmp_path):
    """docs/integrations-verl.md's verl example, run here (the main suite has no verl)."""
    text = DOCS_PAGE.read_text()
    blocks = re.findall(r"<!-- docs-test: skip \(needs verl[^\n]*-->\n```python\n(.*?)```", text, re.DOTALL)
    assert len(blocks) == 1, "docs/integrations-verl.md has one verl example, marked to skip without verl"
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "docs_integrations_verl_actor"}
    exec(compile(blocks[0], str(DOCS_PAGE), "exec"), namespace)
    assert namespace["out"]["metrics"]["grad_norm"] > 0
