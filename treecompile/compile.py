"""``tree_compile(model)``: train any causal LM on a packed tree batch, exactly.

    model = tree_compile(model)            # keeps the model's parameters
    out = model(treecompile.pack(trees))   # out.loss, out.logprobs
    out.loss.backward()                    # grads land on the original parameters

The model is captured with Dynamo as one graph, rewritten by the passes in
:mod:`treecompile.passes.pipeline` (attention, positions, loss, MoE, verify) and lowered
with AOTAutograd (CPU) or Inductor (CUDA). The tree tensors of each batch reach the graph
as inputs through a marker op; the BlockMask is built once per batch, outside the model.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import sys
import types
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from treecompile.batch import TreeBatch
from treecompile.reference import logits_of
from treecompile.tree import TrajectoryTree
from treecompile.errors import TreeInputError, UnsupportedModelError
from treecompile.kernels.conv import hf_causal_conv1d_fn
from treecompile.kernels.flex import BLOCK_SIZE, MASK_KINDS, interval_block_mask, split_block_mask
from treecompile.kernels.gdn import fla_chunk_gated_delta_rule, hf_chunk_gated_delta_rule
from treecompile.kernels.mamba2 import hf_mamba2_chunk_scan, hf_mamba2_split_conv1d_scan_combined
from treecompile.passes import markers  # noqa: F401  (registers the treecompile:: ops)
from treecompile.passes.moe import RouterAux, router_aux_of
from treecompile.passes.pipeline import LOWERINGS, PASSES, CompileRecord, make_backend, passes_for

__all__ = [
    "tree_compile", "TreeCompiledModel", "TreeOutput", "VerifyReport", "verify_tree_compile", "MASKS", "BACKENDS",
    "OUTPUTS",
]

#: Mask encodings ``tree_compile(mask=...)`` accepts.
MASKS = tuple(MASK_KINDS)
#: Extra outputs ``tree_compile(outputs=...)`` can add to `TreeOutput`.
OUTPUTS = ("entropy",)
#: Backends ``tree_compile(backend=...)`` accepts (None picks inductor on CUDA, aot_eager on CPU).
BACKENDS = tuple(LOWERINGS)

#: Fewest rows a compiled call runs (shorter batches are padded; see `TreeBatch.padded`).
MIN_ROWS = 2

#: Name under which the Hugging Face attention and experts interfaces route to the tree markers.
HF_ATTENTION_NAME = "treecompile"

#: Module-level sequence kernels of hybrid models (Hugging Face's, behind
#: ``use_kernel_func_from_hub_with_fallback``, and flash-linear-attention's), by name: the
#: leading parameters a function of that name must take to be swapped, and its drop-in,
#: which calls a treecompile custom op with the same linear-sequence semantics (one node
#: per layer for the passes to find).
SEQUENCE_KERNELS = {
    "torch_chunk_gated_delta_rule": (("query", "key", "value", "g", "beta"), hf_chunk_gated_delta_rule),
    "torch_recurrent_gated_delta_rule": (("query", "key", "value", "g", "beta"), hf_chunk_gated_delta_rule),
    "chunk_gated_delta_rule": (("q", "k", "v", "g", "beta"), fla_chunk_gated_delta_rule),
    "fused_recurrent_gated_delta_rule": (("q", "k", "v", "g", "beta"), fla_chunk_gated_delta_rule),
    "causal_conv1d_fn": (("hidden_states", "weight", "bias", "activation"), hf_causal_conv1d_fn),
    "mamba2_chunk_scan": (("hidden_states", "dt", "A", "B", "C"), hf_mamba2_chunk_scan),
    "mamba2_split_conv1d_scan_combined": (("zxbcdt", "conv1d_weight"), hf_mamba2_split_conv1d_scan_combined),
}

@dataclass
class TreeOutput:
    """What a tree-compiled model returns.

    Attributes:
        loss: scalar, ``-(target_weight * logprobs).sum()``, plus ``coef * aux_loss`` for a
            model with a router auxiliary loss; backward fills the model's grads.
        logprobs: ``[S]`` log-probability of each row's token given its path prefix,
            aligned with ``target_weight``; 0 where ``pred_index`` is -1.
        aux_loss: scalar router load-balancing loss over all tokens of all paths (each row
            weighted by ``path_count``), unscaled, as per-path training computes it; None for
            a model without one (see :mod:`treecompile.passes.moe`).
    """

    loss: torch.Tensor
    logprobs: torch.Tensor
    aux_loss: torch.Tensor | None = None
    entropy: torch.Tensor | None = None


def tree_compile(
    model: nn.Module,
    *,
    mask: str = "interval",
    backend: str | None = None,
    verify: bool = False,
    outputs: tuple[str, ...] = (),
    lm_head: str = "gather",
) -> TreeCompiledModel:
    """Wraps a causal LM so that it trains on packed tree batches exactly.

    Args:
        model: a Hugging Face causal LM or any module ``model(ids[1, S]) -> logits`` (a
            tensor, a tuple starting with logits, or an object with ``.logits``).
        mask: ``"interval"`` (``subtree_end``, default) or ``"bitmask"`` (``path_bits``;
            pack with ``path_bits=True``).
        backend: ``"aot_eager"``, ``"inductor"`` or ``"eager"``; None picks inductor on
            CUDA and aot_eager on CPU.
        verify: on the first call, check the compiled model on a small random tree against
            the unmodified model run on each path: loss and every parameter's gradient, in
            float64 on a CPU copy of the model (or, for a model over 2 GiB in float64, on
            the model itself in its dtype). Raises `UnsupportedModelError` naming the
            parameter that differs most. Cheap enough to leave on: one small tree, once.
        outputs: extra per-row outputs: ``("entropy",)`` adds `TreeOutput.entropy`, the
            entropy of each target's predicting distribution (differentiable, for entropy
            bonuses; the vocabulary projection then runs on every predicting row).
        lm_head: ``"gather"`` (default): the LM head runs on the predicting rows only;
            ``"fused"``: a plain LM head (a ``linear``) is fused with the log-softmax and
            computed in row chunks, forward and backward, so the ``[rows, vocab]`` logits are
            never formed (other heads, e.g. with final soft-capping, fall back to gather).

    Returns:
        A :class:`TreeCompiledModel` sharing ``model``'s parameters.

    Raises:
        ValueError: an unknown ``mask`` or ``backend``.
        UnsupportedModelError: (at the first call) the model mixes the sequence in a way
            that cannot be made exact on a tree; the message names the op and source line.
            (Here already) a Hugging Face MoE model's router auxiliary loss cannot be counted
            per path (see :func:`treecompile.passes.moe.router_aux_of`).
    """
    if mask not in MASKS:
        raise ValueError(f"unknown mask {mask!r}; valid masks: {', '.join(MASKS)}")
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; valid backends: {', '.join(BACKENDS)}")
    unknown = [o for o in outputs if o not in OUTPUTS]
    if unknown or isinstance(outputs, str):
        raise ValueError(f"unknown outputs {outputs!r}; valid outputs: {', '.join(OUTPUTS)} (a tuple)")
    return TreeCompiledModel(
        model, mask=mask, backend=backend, verify=verify, outputs=tuple(outputs), passes=passes_for(lm_head)
    )


class TreeCompiledModel(nn.Module):
    """A causal LM that takes a :class:`~treecompile.TreeBatch` and returns a :class:`TreeOutput`.

    The wrapped model is not registered as a submodule: ``parameters()``,
    ``state_dict()``, ``load_state_dict()``, ``train()``, ``to()`` and attribute access
    go straight to it, so optimizers, checkpoints and keys are unchanged (no prefix).

    Attributes:
        compile_records: one :class:`~treecompile.passes.pipeline.CompileRecord` per
            (re)compile, with the per-pass rewrite counters.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        mask: str,
        backend: str | None,
        verify: bool,
        passes: tuple = PASSES,
        outputs: tuple[str, ...] = (),
    ) -> None:
        super().__init__()
        object.__setattr__(self, "_inner", model)
        self.mask = mask
        self.verify = verify
        self._backend_name = backend
        self.compile_records: list[CompileRecord] = []
        self._layout = None
        self._chunks = 0
        self._is_hf = _is_hf_model(model)
        # Read once, here: the router auxiliary loss the model adds to its loss (from
        # config.output_router_logits and router_aux_loss_coef); refuses one it cannot count per path.
        self._router_aux = router_aux_of(model) if self._is_hf else None
        # Sequence kernels swapped for treecompile ops during each call (hybrid models).
        self._kernels = _sequence_kernels(model)
        # Whether the passes need the path structure: scan kernels or convolutions over the sequence.
        self._structure = bool(self._kernels) or any(isinstance(m, nn.Conv1d) for m in model.modules())
        self._call_kwargs = _call_kwargs(model, self._is_hf, self._router_aux)
        self._compiled = None
        self._passes = passes
        self._outputs = outputs
        self.verified: VerifyReport | None = None

    # ------------------------------------------------------------------ delegation

    @property
    def model(self) -> nn.Module:
        """The wrapped model (its parameters are the ones trained)."""
        return self._inner

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(object.__getattribute__(self, "_inner"), name)

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        return self._inner.parameters(recurse)

    def named_parameters(self, *args, **kwargs):
        return self._inner.named_parameters(*args, **kwargs)

    def buffers(self, recurse: bool = True):
        return self._inner.buffers(recurse)

    def named_buffers(self, *args, **kwargs):
        return self._inner.named_buffers(*args, **kwargs)

    def children(self):
        return self._inner.children()

    def named_children(self):
        return self._inner.named_children()

    def modules(self):
        return self._inner.modules()

    def named_modules(self, *args, **kwargs):
        return self._inner.named_modules(*args, **kwargs)

    def state_dict(self, *args, **kwargs):
        return self._inner.state_dict(*args, **kwargs)

    def load_state_dict(self, *args, **kwargs):
        return self._inner.load_state_dict(*args, **kwargs)

    def train(self, mode: bool = True) -> TreeCompiledModel:
        self._inner.train(mode)
        return self

    def _apply(self, fn, recurse=True):
        self._inner._apply(fn, recurse)
        return self

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._inner.zero_grad(set_to_none)

    @property
    def counters(self) -> dict[str, Counter]:
        """Rewrite counters of the latest compile, per pass (empty before the first call)."""
        return self.compile_records[-1].counters if self.compile_records else {}

    # ------------------------------------------------------------------ forward

    def forward(self, batch: TreeBatch) -> TreeOutput:
        """Runs the model on a packed tree batch.

        Args:
            batch: from :func:`treecompile.pack`, on the model's device.

        Returns:
            :class:`TreeOutput` with ``loss`` and ``logprobs`` ``[S]``.
        """
        if not isinstance(batch, TreeBatch):
            raise TypeError(f"expected a TreeBatch (treecompile.pack), got {type(batch).__name__}")
        device = _device_of(self._inner)
        batch = batch.to(device) if batch.device != device else batch
        rows = batch.num_tokens
        # Torch specialises a size-1 dimension as a constant, which would both recompile and
        # blur the sequence axis with the batch axis of size 1: run at least 2 rows (an
        # isolated padding row of weight 0 changes nothing else).
        batch = batch.padded(MIN_ROWS)
        args = self._inputs(batch)
        if self._compiled is None:
            self._compiled = self._build(device)
        # No duck shaping: S, M and R must not be assumed equal because they once were.
        with _hf_interfaces(self._inner) if self._is_hf else contextlib.nullcontext(), _swapped(self._kernels):
            with torch.fx.experimental._config.patch(use_duck_shape=False), torch._dynamo.config.patch(_DYNAMO_CONFIG):
                try:
                    loss, logprobs, aux, entropy = self._compiled(*args)
                except torch._dynamo.exc.BackendCompilerFailed as e:
                    # Our passes' refusals reach the user as themselves, not wrapped by Dynamo.
                    if isinstance(e.inner_exception, UnsupportedModelError):
                        raise e.inner_exception from None
                    raise
                except (torch._dynamo.exc.Unsupported, torch._dynamo.exc.UserError) as e:
                    # A graph break (or data-dependent control flow) would run part of the
                    # model outside the rewritten graph.
                    raise UnsupportedModelError(
                        f"treecompile needs the model as one graph, but Dynamo cannot capture part of it: {e}"
                    ) from None
        out = TreeOutput(
            loss=loss, logprobs=logprobs[:rows], aux_loss=aux, entropy=None if entropy is None else entropy[:rows]
        )
        if self.verify and self.verified is None:
            self.verified = verify_tree_compile(self, batch)
        return out

    def _build(self, device: torch.device):
        lowering = self._backend_name or ("inductor" if device.type == "cuda" else "aot_eager")
        backend = make_backend(
            mask=self.mask,
            layout_of=lambda: self._layout,
            chunks_of=lambda: self._chunks,
            lowering=lowering,
            records=self.compile_records,
            passes=self._passes,
        )
        inner, kwargs_of, router = self._inner, self._call_kwargs, self._router_aux
        want_entropy = "entropy" in self._outputs
        if router is not None:
            _install_output_hooks(inner)

        def tree_forward(ids, positions, mask_buffers, block_tensors, structure, rows, slot, target, dest, weight,
                         path_count):
            ids = torch.ops.treecompile.tree_inputs(
                ids, [positions, *mask_buffers], list(block_tensors), list(structure)
            )
            out = inner(ids, **kwargs_of(positions))
            logits = logits_of(out)
            logprobs = torch.ops.treecompile.tree_logprobs(logits, rows, slot, target, dest)
            loss = -(weight.to(logprobs.dtype) * logprobs).sum()
            aux = None
            if router is not None:
                # Per-path training counts each token once per path through it: path_count
                # weights each row's router statistics (see passes/moe.py).
                aux = router.tree_aux_loss(out.router_logits, path_count)
                loss = loss + router.coef * aux.to(loss.dtype)
            entropy = _gathered_entropy(logits, rows, slot, dest, positions) if want_entropy else None
            return loss, logprobs, aux, entropy

        # Dynamo caches compiled graphs per code object; a code object of its own per
        # wrapper keeps wrappers of different models from sharing one recompile budget.
        code = tree_forward.__code__.replace(co_name=f"tree_forward_{id(self):x}")
        fn = types.FunctionType(code, tree_forward.__globals__, code.co_name, None, tree_forward.__closure__)
        return torch.compile(fn, backend=backend, fullgraph=True)

    def _inputs(self, batch: TreeBatch) -> tuple:
        """The compiled function's arguments for one batch (block mask built here, once)."""
        if self.mask == "interval":
            buffers = [batch.subtree_end]
            block_mask = interval_block_mask(batch.subtree_end, BLOCK_SIZE)
            self._chunks = 0
        else:
            if batch.path_bits is None:
                raise TreeInputError("mask='bitmask' needs path bits: pack the batch with pack(..., path_bits=True)")
            buffers = [batch.tree_ids, batch.path_bits]
            # The bitmask rule is the same relation as the interval rule, so the block classes
            # from subtree_end are its exact classes (what create_block_mask would find); the
            # bitmask mask_mod decides the pairs inside partial blocks.
            block_mask = interval_block_mask(batch.subtree_end, BLOCK_SIZE)
            self._chunks = int(batch.path_bits.shape[1])
            # The chunk loop is unrolled in the mask_mod: a new chunk count must recompile.
            torch._dynamo.mark_static(batch.path_bits, 1)
        block_tensors, self._layout = split_block_mask(block_mask)
        pred = batch.pred_index
        dest = torch.nonzero(pred >= 0).flatten()
        rows, slot = torch.unique(pred[dest], return_inverse=True)
        target = batch.input_ids[dest]
        ids = batch.input_ids[None]
        # The path structure, for the conv context and SSM state passes (hybrid models only).
        # The node table lives on the CPU: the scan ops read it on the host, without a device sync.
        structure = (
            [batch.pred_index, torch.stack([batch.node_start, batch.node_end, batch.node_parent], 1).cpu()]
            if self._structure else []
        )
        # S, the number of targets M and of predicting rows R vary per batch: one graph
        # for all (no recompile per batch size).
        for t, d in [(ids, 1), (batch.position_ids, 0), (rows, 0), (slot, 0), (target, 0), (dest, 0),
                     (batch.target_weight, 0), (batch.path_count, 0), *[(b, 0) for b in buffers],
                     *[(b, 0) for b in structure],
                     # The block tables' sizes follow S too ([1, 1, nb] and [1, 1, nb, nb]): dynamic
                     # from the first call, so a second batch size does not recompile.
                     *[(b, d) for b in block_tensors for d in range(2, b.dim())]]:
            torch._dynamo.maybe_mark_dynamic(t, d)
        return (ids, batch.position_ids, buffers, block_tensors, structure, rows, slot, target, dest,
                batch.target_weight, batch.path_count)


# --------------------------------------------------------------------------- helpers


def _gathered_entropy(
    logits: torch.Tensor, rows: torch.Tensor, slot: torch.Tensor, dest: torch.Tensor, like: torch.Tensor
) -> torch.Tensor:
    """``[S]`` entropies of the ``R`` predicting rows' distributions, put at each target's row.

    Every op acts along the vocabulary dimension of one row, so the verify pass accepts them.
    """
    z = markers._upcast(logits[0].index_select(0, rows))
    logp = torch.log_softmax(z, dim=-1)
    ent = -(logp.exp() * logp).sum(dim=-1)
    return ent.new_zeros(like.shape[0]).index_put((dest,), ent[slot])


def _device_of(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def _is_hf_model(model: nn.Module) -> bool:
    tf = sys.modules.get("transformers")
    return tf is not None and isinstance(model, tf.PreTrainedModel)


def _call_kwargs(model: nn.Module, is_hf: bool, router: RouterAux | None = None):
    """``positions -> kwargs`` for calling the model: tree position ids where it takes them,
    and the router logits when the model has a router auxiliary loss (off otherwise)."""
    params = inspect.signature(model.forward).parameters
    takes_pos = is_hf or "position_ids" in params
    takes_cache = is_hf or "use_cache" in params
    takes_router = "output_router_logits" in params

    # Attention in the model's own code reads HF's mask: have HF build it from sizes alone.
    own_attention = is_hf and "attention_mask" in params and markers.has_own_attention(model)

    def kwargs(positions: torch.Tensor) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if own_attention:
            out["attention_mask"] = positions.new_ones(positions.shape)[None]
        if takes_pos:
            out["position_ids"] = positions[None]
        if takes_cache:
            # A cache changes nothing here but HF would build one (and a plain causal mask).
            out["use_cache"] = False
        if takes_router:
            out["output_router_logits"] = router is not None
        return out

    return kwargs


# Dynamo settings for our calls only:
# - allow_rnn: capture recurrent layers so the verify pass can name them;
# - fail_on_recompile_limit_hit: past the limit Dynamo would run the model uncompiled,
#   i.e. with per-sequence attention on the packed row: silently wrong, so fail instead.
_DYNAMO_CONFIG = {
    k: v
    for k, v in {"allow_rnn": True, "fail_on_recompile_limit_hit": True}.items()
    if k in torch._dynamo.config._config
}

_HF_REGISTERED = False


def _register_hf_interfaces() -> None:
    global _HF_REGISTERED
    if _HF_REGISTERED:
        return
    from transformers import AttentionInterface
    from transformers.integrations.moe import ExpertsInterface

    AttentionInterface.register(HF_ATTENTION_NAME, markers.hf_causal_attention)
    ExpertsInterface.register(HF_ATTENTION_NAME, markers.hf_experts)
    _HF_REGISTERED = True


def _install_output_hooks(model: nn.Module) -> None:
    """Installs HF's output-capturing hooks (which record the router logits) before capture:
    HF installs them lazily under a thread lock, which Dynamo cannot trace."""
    from transformers.utils import output_capturing

    install = getattr(output_capturing, "maybe_install_capturing_hooks", None)
    if install is not None:
        install(model)


@contextlib.contextmanager
def _hf_interfaces(model: nn.Module):
    """Routes the model's HF attention and experts interfaces to the tree markers for one
    call, then restores them.

    The user's model keeps its own ``attn_implementation`` / ``experts_implementation``
    outside calls (so running it per path afterwards, or saving it, sees no change). Dynamo
    guards on the values, which are the same on every call.
    """
    _register_hf_interfaces()
    from transformers import PretrainedConfig

    configs: dict[int, PretrainedConfig] = {}
    for m in model.modules():
        cfg = getattr(m, "config", None)
        if isinstance(cfg, PretrainedConfig):
            stack = [cfg]
            while stack:
                c = stack.pop()
                if id(c) in configs:
                    continue
                configs[id(c)] = c
                stack.extend(getattr(c, k, None) for k in getattr(c, "sub_configs", {}) if getattr(c, k, None))
    saved = {k: c._attn_implementation_internal for k, c in configs.items()}
    # Only configs of models with experts have an experts implementation to route.
    saved_experts = {
        k: c._experts_implementation_internal
        for k, c in configs.items()
        if getattr(c, "_experts_implementation_internal", None) is not None
    }
    # A model whose attention does not use the interface keeps its implementation (and mask).
    attention = markers.uses_attention_interface(model)
    try:
        for k, c in configs.items():
            if attention:
                c._attn_implementation_internal = HF_ATTENTION_NAME
            if k in saved_experts:
                c._experts_implementation_internal = HF_ATTENTION_NAME
        yield
    finally:
        for k, c in configs.items():
            c._attn_implementation_internal = saved[k]
            if k in saved_experts:
                c._experts_implementation_internal = saved_experts[k]


def _sequence_kernels(model: nn.Module) -> list[tuple[types.ModuleType, str, Any]]:
    """``(module, name, drop-in)`` for each known sequence kernel the model's modules call.

    Looked up in the modules defining the model's layer classes; a function is swapped only
    if it takes the expected leading parameters (a same-named function of another kind is
    left alone, and the verify pass judges what it does).
    """
    found: dict[tuple[str, str], tuple[types.ModuleType, str, Any]] = {}
    for m in model.modules():
        module = sys.modules.get(type(m).__module__)
        if module is None:
            continue
        for name, (params, replacement) in SEQUENCE_KERNELS.items():
            fn = getattr(module, name, None)
            if not callable(fn) or (module.__name__, name) in found:
                continue
            try:
                names = tuple(inspect.signature(fn).parameters)
            except (TypeError, ValueError):
                continue
            if names[: len(params)] == params:
                found[(module.__name__, name)] = (module, name, replacement)
    return list(found.values())


@contextlib.contextmanager
def _swapped(kernels: list[tuple[types.ModuleType, str, Any]]):
    """Swaps the model's sequence kernels for treecompile's drop-ins for one call, then
    restores them (the model run outside the wrapper, e.g. per path, is unchanged). Dynamo
    guards on the globals, which hold the same drop-ins on every call."""
    saved = [(module, name, getattr(module, name)) for module, name, _ in kernels]
    try:
        for module, name, replacement in kernels:
            setattr(module, name, replacement)
        yield
    finally:
        for module, name, original in saved:
            setattr(module, name, original)


def _plain_experts(model: nn.Module) -> None:
    """Sets HF's ``eager`` experts on a model copy: the per-path reference runs it uncompiled,
    and HF's ``grouped_mm`` has no float64 kernel on CPU (the tree side routes the experts
    itself, whatever is set)."""
    for m in model.modules():
        cfg = getattr(m, "config", None)
        if getattr(cfg, "_experts_implementation_internal", None) not in (None, "eager"):
            cfg._experts_implementation_internal = "eager"


@dataclass
class VerifyReport:
    """What ``verify=True`` checked.

    Attributes:
        dtype: the dtype the check ran in.
        paths: paths of the check tree.
        loss_diff: ``|tree loss - per-path loss|``.
        worst_param: the parameter whose gradient differs most (relative to its largest entry).
        worst_grad_diff: that relative difference.
        tolerance: the relative tolerance applied.
    """

    dtype: torch.dtype
    paths: int
    loss_diff: float
    worst_param: str
    worst_grad_diff: float
    tolerance: float


# verify=True: largest gradient difference allowed, relative to the gradient's largest entry,
# by the dtype the check runs in. float64: HF norms compute in float32 (a ~1e-7 floor), with
# margin; a structural error (wrong mask, position or weight) shows as 1e-4 or worse.
VERIFY_GRAD_TOLERANCE = {torch.float64: 1e-5, torch.float32: 1e-3, torch.bfloat16: 5e-2, torch.float16: 2e-2}
# A float64 copy larger than this is not made; the check then runs on the model itself.
VERIFY_COPY_LIMIT_BYTES = 2 << 30


def _check_tree(batch: TreeBatch, seed: int = 0) -> TrajectoryTree:
    """A small tree with every awkward feature: a branch point, a 1-token node, a path that
    ends inside another, a duplicate path and a second root. Tokens are drawn from the batch,
    so they are valid ids for the model."""
    g = torch.Generator().manual_seed(seed)
    ids = batch.input_ids.cpu()

    def draw(n: int) -> list[int]:
        return ids[torch.randint(0, ids.shape[0], (n,), generator=g)].tolist()

    root, a, b, c = draw(5), draw(1), draw(4), draw(3)
    if len({a[0], b[0], c[0]}) < 3:  # children must start differently to branch
        a, b, c = [0], [1], [2]
    seqs = [root + a + draw(3), root + b, root + b + draw(2), root + c, root + c, draw(4)]
    return TrajectoryTree.from_sequences(seqs, weights=[1.0, 0.5, 2.0, 1.0, 1.0, 1.5])


def verify_tree_compile(compiled: TreeCompiledModel, batch: TreeBatch) -> VerifyReport:
    """Checks a tree-compiled model against per-path training on a small random tree.

    Runs the model's compiled form and the unmodified model on each path (a hybrid model's
    sequence kernels swapped, on both sides, for treecompile's ops of the same
    linear-sequence semantics), compares the loss and every parameter's gradient, and
    raises `UnsupportedModelError` naming the parameter that differs most. The user's model, its gradients and its train/eval mode are left as
    they were.
    """
    from treecompile.batch import pack
    from treecompile.reference import per_path_loss

    model = compiled.model
    n_bytes = sum(p.numel() for p in model.parameters()) * 8
    tree = _check_tree(batch)
    check_batch = pack(tree, loss_mode=batch.loss_mode, path_bits=compiled.mask == "bitmask")
    if n_bytes <= VERIFY_COPY_LIMIT_BYTES:
        subject = copy.deepcopy(model).to(device="cpu", dtype=torch.float64)
        _plain_experts(subject)
    else:
        subject = model
    was_training = model.training
    saved = {n: p.grad for n, p in model.named_parameters()}
    dtype = next(subject.parameters()).dtype
    try:
        subject.eval()  # dropout would make the two runs differ for no fault of the tree
        for p in subject.parameters():
            p.grad = None
        twin = compiled if subject is model else type(compiled)(
            subject, mask=compiled.mask, backend=None, verify=False, passes=compiled._passes,
            outputs=compiled._outputs,
        )
        loss = twin(check_batch.to(_device_of(subject))).loss
        loss.backward()
        tree_grads = {n: p.grad for n, p in subject.named_parameters()}
        for p in subject.parameters():
            p.grad = None
        router = compiled._router_aux
        # A hybrid model's per-path run uses the same linear-sequence kernels the tree side was
        # swapped to (tested against HF's): HF's GDN fallback computes in float32 even in a
        # float64 model, which would put a float32 floor under this float64 check.
        with _swapped(compiled._kernels):
            ref = per_path_loss(subject, tree, router_aux_loss_coef=None if router is None else router.coef)
        ref.loss.backward()
        worst, worst_name = 0.0, ""
        for n, p in subject.named_parameters():
            r, t = p.grad, tree_grads[n]
            if r is None and t is None:
                continue
            r = torch.zeros_like(p) if r is None else r
            t = torch.zeros_like(p) if t is None else t
            err = ((t - r).abs().max() / r.abs().max().clamp_min(1e-30)).item()
            if err >= worst:
                worst, worst_name = err, n
        tol = VERIFY_GRAD_TOLERANCE.get(dtype, 1e-3)
        loss_diff = abs(loss.item() - ref.loss.item())
        report = VerifyReport(dtype, tree.num_paths, loss_diff, worst_name, worst, tol)
        if worst > tol or not loss_diff <= tol * max(1.0, abs(ref.loss.item())):
            raise UnsupportedModelError(
                f"verify: the tree-compiled model disagrees with per-path training on a {tree.num_paths}-path "
                f"check tree ({dtype}): loss differs by {loss_diff:.3g}; gradient of {worst_name!r} differs by "
                f"{worst:.3g} of its largest entry (tolerance {tol:g}). The model does something the passes do "
                f"not make tree-exact; inspect the rewritten graph with `treecompile inspect`."
            )
        return report
    finally:
        for n, p in model.named_parameters():
            p.grad = saved[n]
        model.train(was_training)
