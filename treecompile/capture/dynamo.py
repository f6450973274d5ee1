"""Model surgery for the duration of a capture: everything treecompile changes in a model
before Dynamo sees it, and restores after each call.

* Hugging Face attention and experts interfaces routed to the tree markers
  (:func:`hf_interfaces`), and HF's output-capturing hooks installed up front.
* Module-level sequence kernels of hybrid models swapped for treecompile's ops
  (:data:`SEQUENCE_KERNELS`, :func:`sequence_kernels`, :func:`swapped_kernels`).
* Hugging Face's attention-mask builders swapped for ones that say which mask each layer
  asked for (:func:`mask_builder_swaps`), described below.

The user's model is unchanged outside a call: running it per path, saving or generating
sees the original functions and settings.

Attention masks
---------------

Hugging Face models build their attention masks with ``transformers.masking_utils``
(``create_causal_mask``, ``create_sliding_window_causal_mask``, ``create_chunked_causal_mask``,
``create_bidirectional_mask`` ...) and hand each layer the mask of its kind. Some features
live only there: Llama-4's chunked attention, a sliding window some families express only in
the mask, bidirectional spans, extra ``or_mask_function`` / ``and_mask_function`` rules. The
tree rewrite replaces every attention by the tree rule, so a mask the rewrite does not
reproduce would be dropped silently.

For each call, the builders a model's modules reference are swapped for ones that return a
:class:`TreeMask` saying which kind of mask the layer asked for. The attention marker
(:func:`treecompile.capture.hf_interfaces.hf_causal_attention`) reads it: a causal or sliding-window
mask becomes the tree rule (with the window), anything else is refused naming the mask kind.
A mask tensor that reaches the attention from anywhere else (built by the model's own code)
is refused too.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import types
import weakref

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from treecompile.core.errors import UnsupportedModelError
from treecompile.kernels import grouped_mm as _grouped_mm_op  # noqa: F401  (registers treecompile::grouped_mm)
from treecompile.capture.kernel_table import SEQUENCE_KERNELS
from treecompile.capture.hf_interfaces import TreeMask, has_own_attention, hf_causal_attention, hf_experts
from treecompile.passes import markers
from treecompile.passes._graph import version_of

if TYPE_CHECKING:
    from treecompile.capture.router_aux import RouterAux

__all__ = [
    "TreeMask", "mask_builder_swaps", "HF_ATTENTION_NAME", "SEQUENCE_KERNELS", "hf_interfaces", "install_output_hooks",
    "sequence_kernels", "swapped_kernels", "plain_experts", "is_hf_model", "model_vocab_size", "call_kwargs",
]

#: Name under which the Hugging Face attention and experts interfaces route to the tree markers.
HF_ATTENTION_NAME = "treecompile"


# masking_utils builder -> the kind of mask it builds. Builders not named here are refused when called.
_BUILDERS = {
    "create_causal_mask": "causal",
    "create_sliding_window_causal_mask": "sliding",
    "create_chunked_causal_mask": "chunked",
    "create_bidirectional_mask": "bidirectional",
    "create_bidirectional_sliding_window_mask": "bidirectional",
    "create_recurrent_attention_mask": "recurrent",
}


def _size_of(config: Any, kind: str) -> int | None:
    if kind == "sliding":
        return getattr(config, "sliding_window", None)
    if kind == "chunked":
        return getattr(config, "attention_chunk_size", None)
    return None


def _replacement(name: str, kind: str, masks: dict[tuple[int, str], TreeMask]):
    """A drop-in for builder ``name``: returns the pre-built `TreeMask` for the config."""

    def build(config=None, *args: Any, or_mask_function=None, and_mask_function=None, block_sequence_ids=None,
              **kwargs: Any):
        # Positional calls: (config, inputs_embeds, attention_mask, past_key_values, position_ids,
        # or_mask_function, and_mask_function, ...).
        extra = args[4:6] if len(args) > 4 else ()
        if or_mask_function is not None or and_mask_function is not None or any(f is not None for f in extra):
            raise UnsupportedModelError(
                f"{name} with an extra mask function (or_mask_function / and_mask_function, e.g. bidirectional "
                "image tokens): treecompile reproduces only causal and sliding-window masks on a tree"
            )
        if block_sequence_ids is not None:
            raise UnsupportedModelError(f"{name} with block_sequence_ids: block-wise masks are not reproduced on a tree")
        if kind == "recurrent":
            return None  # a padding mask for recurrent layers; tree batches have no padding
        return masks[(id(config), kind)]

    build.__name__ = f"tree_{name}"
    return build


def _configs(model: nn.Module) -> list[Any]:
    from transformers import PretrainedConfig

    seen: dict[int, Any] = {}
    for m in model.modules():
        cfg = getattr(m, "config", None)
        stack = [cfg] if isinstance(cfg, PretrainedConfig) else []
        while stack:
            c = stack.pop()
            if id(c) in seen:
                continue
            seen[id(c)] = c
            stack.extend(getattr(c, k, None) for k in getattr(c, "sub_configs", {}) if getattr(c, k, None))
    return list(seen.values())


def _builder_sites(model: nn.Module) -> list[tuple[types.ModuleType, str, str]]:
    """``(module, attribute, builder name)`` for each masking_utils builder the model's modules reference."""
    masking_utils = sys.modules.get("transformers.masking_utils")
    if masking_utils is None:
        return []
    originals = {getattr(masking_utils, n): n for n in _BUILDERS if hasattr(masking_utils, n)}
    sites: dict[tuple[str, str], tuple[types.ModuleType, str, str]] = {}
    for m in model.modules():
        module = sys.modules.get(type(m).__module__)
        if module is None or module is masking_utils:
            continue
        for attr, val in vars(module).items():
            if callable(val) and val in originals:
                sites[(module.__name__, attr)] = (module, attr, originals[val])
    return list(sites.values())


def mask_builder_swaps(model: nn.Module) -> list[tuple[types.ModuleType, str, Any]]:
    """``(module, attribute, drop-in)`` for each ``masking_utils`` builder the model's modules
    reference: the drop-in returns the `TreeMask` for the layer's config. Built once per
    wrapped model and applied for each call by `swapped_kernels`, like the sequence kernels
    (Dynamo guards on the module globals, which hold the same functions on every call; the
    model run outside the wrapper sees the originals)."""
    masks: dict[tuple[int, str], TreeMask] = {}
    for cfg in _configs(model):
        for name, kind in _BUILDERS.items():
            masks[(id(cfg), kind)] = TreeMask(kind, name, _size_of(cfg, kind))
    return [(module, attr, _replacement(name, _BUILDERS[name], masks)) for module, attr, name in _builder_sites(model)]


def eager_mask_skips() -> list[tuple[types.ModuleType, str, Any]]:
    """``(module, attribute, drop-in)`` for transformers' test whether SDPA's causal mask may be
    skipped (``masking_utils._ignore_causal_mask_sdpa``), deciding as it does outside a capture.

    Under a capture it keeps the mask that a model run eagerly skips (``None``, SDPA's
    ``is_causal`` instead); a model whose own code adds to the mask it is handed (Doge before
    transformers 5.18 did not ask for the mask to be kept) computes another function eagerly,
    per path, than captured. Swapped in for every call of a Hugging Face model whose attention
    reads the masks Hugging Face builds (not routed to the tree markers). The wrapper passes a
    padding mask of ones, so the eager decision depends on the lengths alone: skipped for one
    query or as many queries as keys, unless a local window is no longer than the keys."""
    from transformers import masking_utils

    original = getattr(masking_utils, "_ignore_causal_mask_sdpa", None)
    if original is None:
        return []
    signature = inspect.signature(original)

    def skip(*args, **kwargs) -> bool:
        given = signature.bind(*args, **kwargs).arguments
        q = given.get("q_length", given.get("query_length"))
        kv, local = given.get("kv_length"), given.get("local_attention_size")
        return bool((q == 1 or kv == q) and (local is None or kv < local))

    return [(masking_utils, "_ignore_causal_mask_sdpa", skip)]


# --------------------------------------------------------------------------- interfaces and kernels

_HF_REGISTERED = False
# transformers' own ``_grouped_mm`` and its test, read once before any call swaps them.
_ORIGINAL_GROUPED_MM = None
_HF_CAN_USE_GROUPED_MM = None


def register_hf_interfaces() -> None:
    global _HF_REGISTERED
    if _HF_REGISTERED:
        return
    from transformers import AttentionInterface
    from transformers.integrations.moe import ExpertsInterface

    AttentionInterface.register(HF_ATTENTION_NAME, hf_causal_attention)
    ExpertsInterface.register(HF_ATTENTION_NAME, hf_experts)
    site = _hf_grouped_mm_site()
    if site is not None:
        global _ORIGINAL_GROUPED_MM, _HF_CAN_USE_GROUPED_MM
        _ORIGINAL_GROUPED_MM = site._grouped_mm
        _HF_CAN_USE_GROUPED_MM = getattr(site, "_can_use_grouped_mm", None)
    _HF_REGISTERED = True


def install_output_hooks(model: nn.Module) -> None:
    """Installs HF's output-capturing hooks (which record the router logits) before capture:
    HF installs them lazily under a thread lock, which Dynamo cannot trace."""
    from transformers.utils import output_capturing

    install = getattr(output_capturing, "maybe_install_capturing_hooks", None)
    if install is not None:
        install(model)


#: Per model, the frozen copy of transformers' output-capturing registry its calls read.
_REGISTRY_SNAPSHOTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@contextlib.contextmanager
def output_registry_snapshot(model: nn.Module):
    """For one call, transformers' output-capturing registry (``_CAN_RECORD_REGISTRY``, the
    recordable outputs of every model class built so far, which a compiled HF forward
    reads) is a copy holding only the classes of ``model``'s modules, the same object on
    every call. Dynamo guards on the registry's keys: against the live one, building any
    new model class (a reward model, a reference model) would recapture the graph.
    Refreshed when one of those classes' entries changes."""
    oc = sys.modules.get("transformers.utils.output_capturing")
    live = getattr(oc, "_CAN_RECORD_REGISTRY", None)
    if not isinstance(live, dict):
        yield
        return
    keys = {str(type(m)) for m in model.modules()}
    wanted = {k: live[k] for k in keys if dict.__contains__(live, k)}
    snapshot = _REGISTRY_SNAPSHOTS.get(model)
    if snapshot is None or dict(snapshot) != wanted:
        snapshot = type(live)()
        dict.update(snapshot, wanted)
        _REGISTRY_SNAPSHOTS[model] = snapshot
    oc._CAN_RECORD_REGISTRY = snapshot
    try:
        yield
    finally:
        oc._CAN_RECORD_REGISTRY = live


#: transformers' ``enable_input_require_grads`` hook (``output.requires_grad_(True)`` on the input
#: embeddings' output), by its function's qualified name.
_REQUIRE_GRADS_HOOK = "PreTrainedModel.enable_input_require_grads.<locals>.make_inputs_require_grads"


def _is_require_grads_hook(hook: Any) -> bool:
    return (getattr(hook, "__qualname__", None) == _REQUIRE_GRADS_HOOK
            and getattr(hook, "__module__", "").startswith("transformers."))


@contextlib.contextmanager
def require_grads_hooks_once(model: nn.Module):
    """For one call, each module's forward hooks hold transformers' input-require-grads hook at
    most once. ``gradient_checkpointing_enable`` registers it on the input embeddings and
    ``gradient_checkpointing_disable`` leaves it there (without PEFT), so code that turns
    checkpointing off and on around each generation (TRL's GRPO trainer) adds one more every
    step. Dynamo guards on the number of hooks: each step would capture the graph again, and
    the ninth would hit Dynamo's recompile limit. The hook only sets ``requires_grad`` on the
    output, so running it once is running it any number of times."""
    swapped = []
    for m in model.modules():
        hooks = m._forward_hooks
        if sum(map(_is_require_grads_hook, hooks.values())) > 1:
            first = next(k for k, h in hooks.items() if _is_require_grads_hook(h))
            once = type(hooks)((k, h) for k, h in hooks.items() if k == first or not _is_require_grads_hook(h))
            swapped.append((m, hooks))
            m._forward_hooks = once
    try:
        yield
    finally:
        for m, hooks in swapped:
            m._forward_hooks = hooks


@contextlib.contextmanager
def hf_interfaces(model: nn.Module, route_attention: bool):
    """Routes the model's HF attention and experts interfaces to the tree markers for one
    call, then restores them.

    The user's model keeps its own ``attn_implementation`` / ``experts_implementation``
    outside calls (so running it per path afterwards, or saving it, sees no change). Dynamo
    guards on the values, which are the same on every call.
    """
    register_hf_interfaces()
    configs = {id(c): c for c in _configs(model)}
    saved = {k: c._attn_implementation_internal for k, c in configs.items()}
    # Only configs of models with experts have an experts implementation to route.
    saved_experts = {
        k: c._experts_implementation_internal
        for k, c in configs.items()
        if getattr(c, "_experts_implementation_internal", None) is not None
    }
    moe = _hf_grouped_mm_site() if saved_experts else None
    original_grouped_mm = moe._grouped_mm if moe is not None else None
    with output_registry_snapshot(model), require_grads_hooks_once(model):
        try:
            if moe is not None:
                moe._grouped_mm = _grouped_mm
            for k, c in configs.items():
                # A model whose attention does not use the interface keeps its implementation (and mask).
                if route_attention:
                    c._attn_implementation_internal = HF_ATTENTION_NAME
                    # What the model would have run: the attention marker refuses arguments that
                    # implementation drops (see hf_causal_attention).
                    c.treecompile_routed_from = saved[k]
                if k in saved_experts:
                    c._experts_implementation_internal = HF_ATTENTION_NAME
            yield
        finally:
            if moe is not None:
                moe._grouped_mm = original_grouped_mm
            for k, c in configs.items():
                c._attn_implementation_internal = saved[k]
                c.__dict__.pop("treecompile_routed_from", None)
                if k in saved_experts:
                    c._experts_implementation_internal = saved_experts[k]


def _hf_grouped_mm_site() -> types.ModuleType | None:
    """transformers' MoE module, whose ``_grouped_mm`` its ``grouped_mm`` experts call."""
    from transformers.integrations import moe

    return moe if callable(getattr(moe, "_grouped_mm", None)) else None


def _grouped_mm(input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """transformers' ``_grouped_mm`` for the experts marker: its own where it runs
    ``torch._grouped_mm`` (bfloat16), else ``treecompile::grouped_mm``, whose backward is an op
    too (transformers' fallback backward in 5.10 to 5.17 loops over ``offs.tolist()`` under
    tracing, which AOTAutograd refuses: float32 and float64 MoE models failed to compile)."""
    # No import here: Dynamo traces this function, and torch 2.11's cannot trace an import.
    if _HF_CAN_USE_GROUPED_MM is not None and _HF_CAN_USE_GROUPED_MM(input, weight, offs):
        return _ORIGINAL_GROUPED_MM(input, weight, offs=offs)
    return torch.ops.treecompile.grouped_mm(input, weight, offs)


def _takes(fn: Any, params: tuple[str, ...]) -> bool:
    """Whether ``fn`` is callable with ``params`` as its leading parameters (any callable for
    none: an entry that runs the function first to judge it, whose signature torch >= 2.14 may
    not expose, as for an autograd Function's ``apply``)."""
    if not callable(fn):
        return False
    if not params:
        return True
    try:
        names = tuple(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return False
    return names[: len(params)] == params


def sequence_kernels(model: nn.Module) -> list[tuple[Any, str, Any]]:
    """``(owner, name, drop-in)`` for each known sequence kernel the model's modules call.

    Looked up in the modules defining the model's layer classes, and in the layers' own
    attributes where a layer keeps the kernel it picked (transformers before 5.15:
    ``self.chunk_gated_delta_rule = chunk_gated_delta_rule or torch_chunk_gated_delta_rule``);
    a function is swapped only if it takes the expected leading parameters (a same-named
    function of another kind is left alone, and the verify pass judges what it does).
    """
    found: dict[tuple, tuple[Any, str, Any]] = {}
    for m in model.modules():
        module = sys.modules.get(type(m).__module__)
        if module is not None:
            for name, (params, replacement) in SEQUENCE_KERNELS.items():
                if (module.__name__, name) not in found and _takes(getattr(module, name, None), params):
                    found[(module.__name__, name)] = (module, name, _for(replacement, getattr(module, name)))
        for attr, fn in vars(m).items():
            params, replacement = SEQUENCE_KERNELS.get(getattr(fn, "__name__", None), (None, None))
            if inspect.isfunction(fn) and params is not None and _takes(fn, params):
                found[(id(m), attr)] = (m, attr, _for(replacement, fn))
    return [k for k in found.values() if k[2] is not None]


def _for(replacement: Any, original: Any) -> Any:
    """The drop-in for ``original`` (built for it where the table's entry is ``per_original``)."""
    return replacement(original) if getattr(replacement, "per_original", False) else replacement


@contextlib.contextmanager
def swapped_kernels(kernels: list[tuple[Any, str, Any]]):
    """Swaps the model's sequence kernels for treecompile's drop-ins for one call, then
    restores them (the model run outside the wrapper, e.g. per path, is unchanged). Dynamo
    guards on the globals and attributes, which hold the same drop-ins on every call."""
    saved = [(module, name, getattr(module, name)) for module, name, _ in kernels]
    try:
        for module, name, replacement in kernels:
            setattr(module, name, replacement)
        yield
    finally:
        for module, name, original in saved:
            setattr(module, name, original)


def short_buffers(model: nn.Module, rows: int, longest: int, equal: bool = False) -> list[tuple[nn.Module, str, int]]:
    """``(module, name, size)`` for each buffer with a dim shorter than ``rows`` but at least
    ``longest`` long: a model slicing it by the row count (``tril[:T, :T]``, ``cos[:T]``) cannot
    be captured on a packed row that long, though every path fits it (parameters are never
    extended: their gradients must reach them). With ``equal``, those exactly ``rows`` long
    instead: sliced by the row count, Dynamo takes the row count for the buffer's fixed size."""
    out = []
    for module in model.modules():
        for name, buf in module._buffers.items():
            if buf is None or buf.dim() < 1:
                continue
            # The table's length is its longest dim: a shorter one in the range (the head dim of a
            # [16, 8] rotary table beside a packed row of 16) is not what the row count slices.
            size = max(buf.shape)
            if size == rows if equal else longest <= size < rows:
                out.append((module, name, size))
    return out


@contextlib.contextmanager
def extended_buffers(short: list[tuple[nn.Module, str, int]], rows: int):
    """For one call, each of ``short``'s buffers with its dims of that size grown to the next
    power of two >= ``rows`` (a capture per doubling; twice that for a buffer already that
    long), the new entries zero. What a pass proves
    exact reads no entry past the longest path (positions are below it, masks are judged no
    longer than the buffer, see ``PassContext.judge_cap``); the model outside the call sees
    its own buffers."""
    target = 1 << max(rows - 1, 1).bit_length()
    saved = []
    try:
        for module, name, size in short:
            buf = module._buffers[name]
            grown_to = target if target > size else 2 * target
            shape = [grown_to if d == size else d for d in buf.shape]
            grown = _grown(buf, shape)
            saved.append((module, name, buf))
            module._buffers[name] = grown
        yield
    finally:
        for module, name, buf in saved:
            module._buffers[name] = buf


#: Per buffer (by id, while it lives): ``(buffer version, data pointer, shape, extension, its version)``.
_GROWN: dict[int, tuple] = {}


def _grown(buf: torch.Tensor, shape: list[int]) -> torch.Tensor:
    """``buf`` extended to ``shape`` with zeros; the same tensor as the last call's while neither
    was written (the compiled graph guards the tensors whose values its passes judged, see
    `treecompile.passes.pipeline.JudgedInputChanged`: a new one every call would compile again)."""
    key = (version_of(buf), buf.data_ptr(), tuple(shape))  # no version under torch.inference_mode
    kept = _GROWN.get(id(buf))
    if kept is not None and kept[:3] == key and kept[3]._version == kept[4]:
        return kept[3]
    grown = buf.new_zeros(shape)
    grown[tuple(slice(0, d) for d in buf.shape)] = buf
    if kept is None:  # (a tensor's == is elementwise: no WeakKeyDictionary)
        weakref.finalize(buf, _GROWN.pop, id(buf), None)
    _GROWN[id(buf)] = (*key, grown, grown._version)
    return grown


def plain_experts(model: nn.Module) -> None:
    """Sets HF's ``eager`` experts on a model copy: the per-path reference runs it uncompiled,
    and HF's ``grouped_mm`` has no float64 kernel on CPU (the tree side routes the experts
    itself, whatever is set)."""
    for m in model.modules():
        cfg = getattr(m, "config", None)
        if getattr(cfg, "_experts_implementation_internal", None) not in (None, "eager"):
            cfg._experts_implementation_internal = "eager"


# --------------------------------------------------------------------------- calling the model


def model_vocab_size(model: nn.Module, is_hf: bool) -> int | None:
    """The number of token ids the model's input embedding takes, where it is known."""
    if is_hf and hasattr(model, "get_input_embeddings"):
        emb = model.get_input_embeddings()
        if isinstance(emb, nn.Embedding):
            return emb.num_embeddings
    embeddings = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    # Only one embedding: it must be the token embedding (with more, one may be a position table).
    return embeddings[0].num_embeddings if len(embeddings) == 1 else None


def is_hf_model(model: nn.Module) -> bool:
    """A Hugging Face model, or a PEFT model (LoRA adapters) around one: PEFT passes
    ``position_ids`` and ``use_cache`` through to it and its attention keeps HF's interface."""
    tf = sys.modules.get("transformers")
    peft = type(model).__module__.startswith("peft.") and hasattr(model, "get_base_model")
    base = model.get_base_model() if peft else model
    return tf is not None and isinstance(base, tf.PreTrainedModel)


def _positions_from_ids(model: nn.Module) -> bool:
    """Whether the model derives position ids from the token ids when given none (Hugging
    Face's RoBERTa family: an embeddings module with ``create_position_ids_from_input_ids``)."""
    return any(callable(getattr(type(m), "create_position_ids_from_input_ids", None)) for m in model.modules())


def call_kwargs(model: nn.Module, is_hf: bool, router: RouterAux | None = None, own_attention: bool = False):
    """``positions -> kwargs`` for calling the model: tree position ids where it takes them,
    and the router logits when the model has a router auxiliary loss (off otherwise).
    ``own_attention``: a Hugging Face model whose attention is not routed to the tree markers
    although it uses the attention interface (its own code reads the mask, see
    `treecompile.capture.call.AttentionRoute`)."""
    params = inspect.signature(model.forward).parameters
    # A model that numbers tokens from its ids (RoBERTa's padding_idx + running count of
    # non-pad tokens) computes them itself: its running sum becomes one along each path.
    takes_pos = (is_hf or "position_ids" in params) and not _positions_from_ids(model)
    takes_cache = is_hf or "use_cache" in params
    takes_router = "output_router_logits" in params

    # Attention in the model's own code reads HF's mask: have HF build it from sizes alone.
    own_attention = is_hf and "attention_mask" in params and (own_attention or has_own_attention(model))

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
