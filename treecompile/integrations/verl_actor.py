"""verl's FSDP actor on tree batches: a drop-in for verl 0.9's actor engine.

    from treecompile.integrations.verl_actor import tree_engine_class
    TreeEngine = tree_engine_class()   # verl's FSDPEngineWithLMHead, forward_step on trees
    engine = TreeEngine(model_config=..., engine_config=..., optimizer_config=..., checkpoint_config=...)

verl 0.9 trains the actor through an engine, ``FSDPEngineWithLMHead``
(``verl.workers.engine.fsdp.transformer_impl``): the worker's ``compute_log_prob`` is the
engine's ``infer_batch`` and its ``update_actor`` calls ``train_batch`` once per mini-batch.
Both cut their batch into micro-batches (``ppo_micro_batch_size_per_gpu``, or token budgets
with ``use_dynamic_bsz``) and run ``forward_step`` on each. The tree engine is that class with
``forward_step`` replaced. It merges the micro-batch's sequences (prompt + response) into one
prefix tree, so a prompt shared by a GRPO group is computed once, and runs
`treecompile.tree_compile` of the engine's module on it. verl's loss function (``ppo_loss``)
then gets the log-probs (and entropies) in the layout verl's own forward gives it. Everything
else is verl's: micro-batching, ``loss_agg_mode``, clipping, ``entropy_coeff``, the KL loss,
metrics, gradient clipping, optimizer and scheduler. A shared token has one log-probability,
and its gradient is the sum of what each sequence's loss sends it, so log-probs, losses and
gradients equal verl's. `register_tree_engine` puts the class in verl's engine registry, where
verl's workers look their engines up.

What a tree cannot reproduce is refused, naming the option (`UNSUPPORTED`): fused kernels
(``use_fused_kernels``; ``tree_compile(lm_head="fused")`` is the tree's memory-saving head),
Ulysses sequence parallelism, ``calculate_sum_pi_squared``, top-k distillation, router replay,
multi-modal inputs, 3-D (mRoPE) position ids and per-sample temperatures that differ within a
micro-batch. ``use_remove_padding``, ``pad_to_length`` and the entropy-chunking options only
change how verl lays out its own forward; the tree ignores them. ``use_dynamic_bsz`` works
as in verl (it only decides which sequences share a micro-batch).

verl's engine build (``initialize``) wraps the module in FSDP2 (strategy ``fsdp2``) or FSDP1
(``fsdp``). FSDP2 works: each tree call gathers the full parameters once (FSDP2's own
``unshard``), runs the one captured graph, and at the end of its backward reduce-scatters
every gradient into its shard as FSDP2 would (`treecompile.distributed.unsharded`); verl's gradient
clipping and optimizer then act on the shards. The full parameters and full gradients of a
call live together until its backward ends (FSDP2's per-layer gathering does not apply to one
graph). verl's ``set_requires_gradient_sync(False)`` on non-final micro-batches defers the
reduce-scatter to the final one, as in FSDP2. FSDP1 (``strategy``) is refused.

This module imports verl only inside the functions that need it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from treecompile.compile.wrapper import TreeCompiledModel, tree_compile
from treecompile.core.batch import TreeBatch, pack
from treecompile.core.errors import TreeInputError, UnsupportedModelError
from treecompile.core.tree import TrajectoryTree
from treecompile.core.preorder import root_path_rows

__all__ = [
    "UNSUPPORTED",
    "VerlMicroBatchTree",
    "TreeForwardStep",
    "micro_batch_tree",
    "tree_engine_class",
    "register_tree_engine",
]

UNSUPPORTED: dict[str, str] = {
    "use_fused_kernels": "verl's fused kernels compute the log-probs inside the model's forward "
                         "(tree_compile(lm_head='fused') is the tree's memory-saving head)",
    "calculate_sum_pi_squared": "sum of squared probabilities: not computed on trees",
    "distillation_use_topk": "top-k distillation reads the full logits of every position",
    "distillation_only": "top-k distillation reads the full logits of every position",
    "enable_routing_replay": "MoE router replay records and replays routes per padded position",
    "multi_modal_inputs": "multi-modal inputs (pixel values) are not packed into trees",
    "ulysses_sequence_parallel_size": "Ulysses sequence parallelism splits a packed sequence across ranks",
    "mtp": "multi-token prediction heads",
    "strategy": "FSDP1 gathers its flat parameters in hooks outside the one graph a tree call captures; "
                "use verl's strategy=fsdp2 (FSDP2: each call runs the module unsharded and reduce-scatters every "
                "gradient into its shard)",
}
"""Options of verl's actor that the tree engine refuses, with the reason."""


@dataclass
class VerlMicroBatchTree:
    """A verl micro-batch as one tree batch, with the map back to verl's layout.

    Attributes:
        batch: the packed tree; path ``b`` is sequence ``b`` of the micro-batch.
        index: ``[N]`` for entry ``i`` of sequence ``b`` in verl's packed layout (``N`` real
            tokens in all), the tree row of token ``i + 1`` of that sequence (the row whose
            log-prob entry ``i`` holds); 0 on each sequence's last entry.
        valid: ``[N]`` false on each sequence's last entry, which predicts nothing.
        offsets: ``[B + 1]`` int64 first entry of each sequence, then ``N``.
    """

    batch: TreeBatch
    index: torch.Tensor
    valid: torch.Tensor
    offsets: torch.Tensor

    def to_verl(self, values: torch.Tensor) -> torch.Tensor:
        """Per-row tree values (log-probs, entropies) in verl's layout (differentiable).

        Args:
            values: ``[S]`` per-row values, ``compiled(self.batch).logprobs`` or ``.entropy``.

        Returns:
            Nested (jagged) ``[B, j]`` with the offsets of verl's ``input_ids``: entry ``i``
            of sequence ``b`` is the value for token ``i + 1`` given tokens ``0..i``, as verl's
            forward returns it; 0 on each sequence's last entry.
        """
        if values.shape != (self.batch.num_tokens,):
            raise ValueError(f"values has shape {tuple(values.shape)}, expected ({self.batch.num_tokens},)")
        flat = torch.where(self.valid, values[self.index], values.new_zeros(()))
        return torch.nested.nested_tensor_from_jagged(flat, self.offsets)


def micro_batch_tree(input_ids: torch.Tensor, position_ids: torch.Tensor) -> VerlMicroBatchTree:
    """One tree batch from a verl micro-batch's nested ``input_ids`` and ``position_ids``.

    Args:
        input_ids: nested (jagged) ``[B, j]``: each sequence's real tokens, prompt then
            response (verl's ``left_right_2_no_padding`` layout).
        position_ids: nested ``[B, j]`` with the same offsets.

    Returns:
        `VerlMicroBatchTree`.

    Raises:
        TreeInputError: tensors that are not nested, 3-D (mRoPE) position ids, or position
            ids that are not ``0, 1, ...`` along each sequence (the tree's positions are the
            depth of each token on its path).
    """
    if not (getattr(input_ids, "is_nested", False) and getattr(position_ids, "is_nested", False)):
        raise TreeInputError("input_ids and position_ids must be nested (jagged) tensors, as verl's "
                             "left_right_2_no_padding makes them (pad_mode 'no_padding')")
    if position_ids.dim() != 2:
        raise TreeInputError(f"position_ids are {position_ids.dim()}-D ({UNSUPPORTED['multi_modal_inputs']}; "
                             "mRoPE position ids are not the depth of a token on its path)")
    offsets = input_ids.offsets().to(torch.int64)
    if not torch.equal(position_ids.offsets().to(torch.int64), offsets):
        raise TreeInputError("position_ids and input_ids have different sequence lengths")
    ids, pos = input_ids.values(), position_ids.values()
    lengths = offsets.diff()
    starts = torch.repeat_interleave(offsets[:-1], lengths)
    depth = torch.arange(int(offsets[-1]), device=offsets.device) - starts
    if not torch.equal(pos.to(torch.int64), depth):
        bad = int(torch.nonzero(pos.to(torch.int64) != depth)[0, 0])
        b = int(torch.searchsorted(offsets, bad, right=True)) - 1
        raise TreeInputError(f"sequence {b}: position id {int(pos[bad])} at token {bad - int(offsets[b])}; "
                             "the tree engine needs position ids 0, 1, ... along each sequence")
    ids_np, offsets_np = ids.cpu().numpy(), offsets.cpu().numpy()
    seqs = [ids_np[offsets_np[b]:offsets_np[b + 1]] for b in range(len(offsets_np) - 1)]
    batch = pack(TrajectoryTree.from_sequences(seqs), device=ids.device, warn_por=False)

    # Entry i of sequence b is verl's value for token i + 1 (its logits are rolled by one).
    node_start, node_end = batch.node_start.cpu().numpy(), batch.node_end.cpu().numpy()
    node_parent, path_node = batch.node_parent.cpu().numpy(), batch.path_node.cpu().numpy()
    index = np.zeros(int(offsets_np[-1]), dtype=np.int64)
    valid = np.zeros(int(offsets_np[-1]), dtype=bool)
    for b, seq in enumerate(seqs):
        rows = root_path_rows(node_start, node_end, node_parent, int(path_node[b]))
        first, last = offsets_np[b], offsets_np[b + 1]
        index[first:last - 1] = rows[1:]
        valid[first:last - 1] = True
    return VerlMicroBatchTree(batch=batch, index=torch.from_numpy(index).to(ids.device),
                              valid=torch.from_numpy(valid).to(ids.device), offsets=offsets)


def _scalar_temperature(temperature: Any) -> float:
    """verl's ``temperature`` (a number, or ``[B]`` per sample) as one number."""
    if isinstance(temperature, torch.Tensor):
        flat = temperature.detach().reshape(-1)
        if flat.numel() and not bool((flat == flat[0]).all()):
            raise TreeInputError(f"per-sample temperatures differ within a micro-batch ({flat.unique().tolist()}); "
                                 "the tree engine divides every row's logits by one temperature")
        return float(flat[0]) if flat.numel() else 1.0
    return float(temperature)


def _refuse_fsdp1(module: torch.nn.Module) -> None:
    from treecompile.compile.model_checks import fsdp1_unit

    unit = fsdp1_unit(module)
    if unit is not None:
        raise UnsupportedModelError(f"the engine's module is sharded by FSDP1 ({unit}; verl's strategy 'fsdp'): "
                                    f"{UNSUPPORTED['strategy']}")


class TreeForwardStep:
    """The tree engine's ``forward_step``, mixed into verl's ``FSDPEngineWithLMHead``.

    Attributes:
        tree_compile_options: keyword arguments for `treecompile.tree_compile` (``backend``,
            ``mask``, ``lm_head``, ``verify``); ``temperature`` and ``outputs`` come from
            each micro-batch.
    """

    tree_compile_options: dict[str, Any] = {}

    def _tree_compiled(self, temperature: float, entropy: bool) -> TreeCompiledModel:
        """One compiled wrapper of the engine's module per (temperature, entropy), kept."""
        cache = self.__dict__.setdefault("_tree_wrappers", {})
        key = (id(self.module), temperature, entropy)
        if key not in cache:
            _refuse_fsdp1(self.module)
            cache[key] = tree_compile(self.module, temperature=temperature,
                                      outputs=("entropy",) if entropy else (), **self.tree_compile_options)
        return cache[key]

    def _refuse_unsupported(self, micro_batch: Any) -> None:
        from verl.utils import tensordict_utils as tu

        for key in ("use_fused_kernels", "calculate_sum_pi_squared", "distillation_use_topk", "distillation_only",
                    "enable_routing_replay"):
            if tu.get_non_tensor_data(data=micro_batch, key=key, default=False):
                raise TreeInputError(f"{key}=True is not supported by the tree engine: {UNSUPPORTED[key]}")
        if "multi_modal_inputs" in micro_batch.keys():
            raise TreeInputError(f"multi_modal_inputs: {UNSUPPORTED['multi_modal_inputs']}")
        if getattr(self, "ulysses_sequence_parallel_size", 1) > 1:
            raise TreeInputError(f"ulysses_sequence_parallel_size={self.ulysses_sequence_parallel_size} is not "
                                 f"supported by the tree engine: {UNSUPPORTED['ulysses_sequence_parallel_size']}")
        mtp = getattr(self.model_config, "mtp", None)
        if mtp is not None and getattr(mtp, "enable", False):
            raise TreeInputError(f"mtp.enable=True is not supported by the tree engine: {UNSUPPORTED['mtp']}")

    def forward_step(self, micro_batch: Any, loss_function: Any, forward_only: bool) -> tuple[torch.Tensor, dict]:
        """verl's ``forward_step`` on one prefix tree of the micro-batch.

        Returns what verl's returns: the loss to backpropagate and ``{"model_output",
        "loss", "metrics"}``, with ``model_output["log_probs"]`` (and ``["entropy"]`` when
        the micro-batch asks for it) nested like verl's ``input_ids``.
        """
        from verl.utils import tensordict_utils as tu
        from verl.utils.device import get_device_id, get_device_name
        from verl.workers.engine.utils import detach_tree

        micro_batch = micro_batch.to(get_device_id())
        self._refuse_unsupported(micro_batch)
        tree = micro_batch_tree(micro_batch["input_ids"], micro_batch["position_ids"])
        entropy = bool(tu.get_non_tensor_data(data=micro_batch, key="calculate_entropy", default=False))
        compiled = self._tree_compiled(_scalar_temperature(micro_batch["temperature"]), entropy)

        # The same autocast as verl's forward_step (none when the parameters are float32).
        device_name = get_device_name()
        autocast_dtype = getattr(self, "_autocast_dtype", torch.bfloat16)
        autocast = (contextlib.nullcontext() if autocast_dtype == torch.float32
                    else torch.autocast(device_type=device_name, dtype=autocast_dtype))
        with autocast:
            out = compiled(tree.batch)
            model_output = {"log_probs": tree.to_verl(out.logprobs)}
            if entropy:
                model_output["entropy"] = tree.to_verl(out.entropy)
            if loss_function is not None:
                loss, metrics = loss_function(model_output=model_output, data=micro_batch,
                                              dp_group=self.get_data_parallel_group())
            else:
                assert forward_only, "forward_only must be True when loss_function is None"
                loss, metrics = torch.tensor(1.0, device=device_name), {}
        return loss, {"model_output": detach_tree(model_output), "loss": loss.detach().item(), "metrics": metrics}


def tree_engine_class(base: type | None = None, **tree_compile_options: Any) -> type:
    """verl's FSDP actor engine class with the tree ``forward_step``.

    Args:
        base: the verl engine class to extend (default: verl's ``FSDPEngineWithLMHead``).
        **tree_compile_options: for `treecompile.tree_compile` (``backend``, ``mask``,
            ``lm_head``, ``verify``).

    Returns:
        A subclass of ``base``, built like it: ``cls(model_config=..., engine_config=...,
        optimizer_config=..., checkpoint_config=...)``.

    Raises:
        ImportError: verl is not installed.
    """
    if base is None:
        from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead as base
    for key in ("temperature", "outputs"):
        if key in tree_compile_options:
            raise ValueError(f"{key} is not an option here: each micro-batch gives it (verl's temperature, "
                             "calculate_entropy)")
    name = f"Tree{base.__name__}"
    return type(name, (TreeForwardStep, base), {"tree_compile_options": dict(tree_compile_options),
                                                "__module__": __name__, "__qualname__": name})


def register_tree_engine(**tree_compile_options: Any) -> type:
    """Makes the tree engine verl's actor (and reference) engine on this machine's accelerator.

    Registers `tree_engine_class` in verl's ``EngineRegistry`` for language models on the
    ``fsdp`` and ``fsdp2`` backends, under this platform's device and vendor: the registry
    prefers a vendor's engine to the device's default one. Value models (the critic) keep
    verl's engine. Call it in every process that builds engines (verl's workers), e.g. from a
    module named in ``actor_rollout_ref.model.external_lib``, which verl imports in each
    worker before it builds the actor.

    Args:
        **tree_compile_options: for `treecompile.tree_compile`.

    Returns:
        The registered class. Calling again returns the class registered first.

    Raises:
        ImportError: verl is not installed.
        ValueError: another engine is already registered for this device and vendor.
    """
    from verl.utils.device import get_device_name, get_vendor
    from verl.workers.engine.base import EngineRegistry

    device, vendor = get_device_name(), get_vendor()
    registry = EngineRegistry._engines.setdefault("language_model", {})
    found = {registry.get(b, {}).get((device, vendor)) for b in ("fsdp", "fsdp2")} - {None}
    if found:
        (cls,) = found
        if issubclass(cls, TreeForwardStep):
            return cls
        raise ValueError(f"{cls.__name__} is already registered for {device}/{vendor}; the tree engine would replace it")
    cls = tree_engine_class(**tree_compile_options)
    return EngineRegistry.register(model_type="language_model", backend=["fsdp", "fsdp2"], device=device,
                                   vendor=vendor)(cls)
