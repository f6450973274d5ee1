"""The Hugging Face adapter: how transformers' models reach treecompile's marker ops.

``hf_causal_attention`` and ``hf_experts`` are registered (by `treecompile.capture.dynamo`)
in transformers' attention and experts interfaces: a model configured with them emits
``treecompile::causal_attention`` and the experts markers (`treecompile.passes.markers`)
carrying the call's semantics. ``has_own_attention`` and ``uses_attention_interface`` tell
how a model computes attention; ``refuse_label_smoothing`` guards Hugging Face's
``Trainer.compute_loss``.
"""

from __future__ import annotations

import functools
import inspect
import math
import sys
from dataclasses import dataclass
from typing import Any

import torch

from treecompile.core.errors import TreeInputError, UnsupportedModelError
from treecompile.passes import markers  # noqa: F401  (registers the marker ops emitted below)

__all__ = ["MaskRead", "TreeMask", "hf_causal_attention", "hf_experts", "has_own_attention", "uses_attention_interface",
           "refuse_label_smoothing"]

Tensor = torch.Tensor


class MaskRead(UnsupportedModelError):
    """The model's own code read the attention mask a Hugging Face layer was handed (a
    `TreeMask`). The wrapper captures such a model again with its own attention implementation
    and Hugging Face's mask (`treecompile.capture.call.AttentionRoute.read_by_the_model`); it
    reaches the caller only where that is not possible."""


@dataclass(frozen=True)
class TreeMask:
    """The attention mask a Hugging Face layer asked for, in place of the mask tensor.

    Attributes:
        kind: ``"causal"``, ``"sliding"``, ``"chunked"``, ``"bidirectional"``, ...
        builder: the ``masking_utils`` function the model called.
        size: the window (sliding) or chunk (chunked) size, else None.
    """

    kind: str
    builder: str
    size: int | None = None

    def __getitem__(self, index: Any):
        raise MaskRead(
            f"the model's own code reads the attention mask built by {self.builder} (e.g. a sparse-attention "
            "indexer slicing it): that mask is not built on a tree, so such code cannot be made exact"
        )

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        raise MaskRead(
            f"the model's own code reads the attention mask built by {self.builder} (.{name}): that mask is not "
            "built on a tree, so such code cannot be made exact"
        )


_IGNORED_HF_KWARGS = {"position_ids", "cache_position", "output_attentions", "use_cache", "layer_idx", "is_causal"}


def hf_causal_attention(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """A Hugging Face attention-interface function that emits ``treecompile::causal_attention``.

    Registered under the name ``"treecompile"``; the wrapper selects it for the duration of
    each call. Whatever kernel the model was configured with (eager, sdpa, flex, flash),
    the call's meaning is "causal attention over the sequence with this scale, window and
    soft-cap", which is what the marker records. ``attention_mask`` is what the model's
    ``masking_utils`` builders returned during the call, a :class:`TreeMask`
    (see :mod:`treecompile.capture.dynamo`): causal, or a sliding window (its size is used when the
    call passes none); any other kind, and a mask tensor built by the model's own code,
    are refused, since the tree rule would drop them.

    Returns:
        ``([B, S, Hq, Dv], None)`` like HF's implementations.
    """
    name = type(module).__name__
    if dropout:
        raise UnsupportedModelError(
            f"{name}: attention dropout {dropout} is random per call and cannot match per-path "
            "training; call model.eval() or set the attention dropout to 0"
        )
    if not getattr(module, "is_causal", True) and not _causal_by_its_mask(module, attention_mask):
        if attention_mask is None and not any(isinstance(d, torch.SymInt) for d in (query.shape[-2], key.shape[-2])):
            # Over a fixed axis, not the tokens (Inkling 2's attention over the blocks' states at each
            # token): token-local, computed as Hugging Face's eager attention computes it.
            return _token_local_attention(query, key, value, scaling)
        raise UnsupportedModelError(f"{name}: non-causal attention cannot be trained on a tree")
    sinks = None
    bias = kwargs.get("position_bias")
    extra = {k for k, v in kwargs.items() if isinstance(v, Tensor) and k not in _IGNORED_HF_KWARGS} - {
        "position_bias", "sinks", "s_aux"}
    if isinstance(bias, Tensor) and not extra:
        sink = kwargs.get("sinks", kwargs.get("s_aux"))
        return _with_pair_bias(module, query, key, value, attention_mask, scaling, sliding_window, softcap, bias,
                               sink)
    for key_name, val in kwargs.items():
        if key_name in _IGNORED_HF_KWARGS or val is None:
            continue
        if key_name in ("s_aux", "sinks") and isinstance(val, Tensor) and val.dim() == 1:
            sinks = val  # one learned logit per head, in every softmax denominator
            continue
        if key_name in ("s_aux", "sinks") or isinstance(val, Tensor):
            raise UnsupportedModelError(
                f"{name}: attention argument {key_name!r} is not supported by treecompile yet"
            )
    _check_kept_by_the_model(module, softcap, sinks)
    chunk = attention_mask.size if isinstance(attention_mask, TreeMask) and attention_mask.kind == "chunked" else None
    sliding_window = _window_from_mask(name, attention_mask, sliding_window)
    scale = scaling if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
    out = torch.ops.treecompile.causal_attention(query, key, value, float(scale), sliding_window, softcap, sinks,
                                                 chunk)
    return out.transpose(1, 2).contiguous(), None


#: The attention implementations whose result follows the mask they are handed, not the module's
#: ``is_causal`` (flash attention takes ``is_causal`` instead of a causal mask).
_MASK_DRIVEN = {"eager", "sdpa", "flex_attention"}


def _causal_by_its_mask(module: torch.nn.Module, mask: Any) -> bool:
    """A module marked ``is_causal=False`` that its causal mask makes causal: BigBird-Pegasus's
    decoder self-attention leaves ``is_causal`` unset and is causal by the mask
    ``create_causal_mask`` builds, under every implementation that reads the mask."""
    config = getattr(module, "config", None)
    impl = getattr(config, "treecompile_routed_from", None) or "eager"  # what the model was configured with
    return isinstance(mask, TreeMask) and mask.kind in ("causal", "sliding", "chunked") and impl in _MASK_DRIVEN


def _token_local_attention(query: Tensor, key: Tensor, value: Tensor, scaling: float | None) -> tuple[Tensor, None]:
    """Unmasked attention over a fixed-size axis (dim -2 of ``[B, X, L, D]``), as HF's eager attention:
    the row rules judge it (each token's row alone when the tokens are in ``X``)."""
    scores, value = _eager_scores(query, key, value, scaling)
    probs = torch.softmax(scores, dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32)).to(query.dtype)
    return torch.matmul(probs, value).transpose(1, 2).contiguous(), None


def _eager_scores(query: Tensor, key: Tensor, value: Tensor, scaling: float | None) -> tuple[Tensor, Tensor]:
    """Hugging Face's eager attention's scores ``q k^T * scale`` (keys and values repeated over the
    query heads they serve), and the values so repeated."""
    if key.shape[1] != query.shape[1]:
        groups = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scale = scaling if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
    return torch.matmul(query, key.transpose(2, 3)) * scale, value


def _with_pair_bias(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor, mask: Any,
                    scaling: float | None, window: int | None, softcap: float | None, bias: Tensor,
                    sink: Tensor | None) -> tuple[Tensor, None]:
    """A call with a ``position_bias`` ``[B, H, S, S]`` the model computed (Inkling's relative logits
    read from the tokens): Hugging Face's eager attention written out (scores, soft-cap, the bias,
    the causal or sliding-window mask as a structural ``[S, S]`` tensor, a softmax in at least
    float32; a sink logit, per head ``[H]`` or per query ``[B, H, S, 1]``, as one more term of each
    softmax denominator), so that the attention pass keeps it on dense ``[S, S]`` tensors with the
    mask read on the tree (`treecompile.passes.attention.dense_pairs`, which proves the bias exact
    or refuses it)."""
    name = type(module).__name__
    if query.shape[2] != key.shape[2] or bias.shape[-2:] != (query.shape[2], key.shape[2]):
        raise UnsupportedModelError(f"{name}: a position_bias over other than the (query, key) pairs of one sequence")
    window = _window_from_mask(name, mask, window)
    if isinstance(mask, TreeMask) and mask.kind == "chunked":
        raise UnsupportedModelError(f"{name}: a position_bias beside a chunked attention mask is not supported")
    _check_kept_by_the_model(module, softcap, None)
    scores, value = _eager_scores(query, key, value, scaling)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores + bias
    rows = torch.arange(query.shape[2], device=query.device)
    allowed = rows[:, None] >= rows[None, :]
    if window is not None:
        allowed = allowed & (rows[:, None] - rows[None, :] < window)
    scores = scores.masked_fill(~allowed, float("-inf")).to(torch.promote_types(scores.dtype, torch.float32))
    if sink is None:
        probs = torch.softmax(scores, dim=-1)
    else:
        sink = (sink.view(1, -1, 1, 1) if sink.dim() == 1 else sink).to(scores.dtype)
        top = torch.maximum(scores.amax(dim=-1, keepdim=True), sink)
        weights = torch.exp(scores - top)
        probs = weights / (weights.sum(dim=-1, keepdim=True) + torch.exp(sink - top))
    return torch.matmul(probs.to(query.dtype), value).transpose(1, 2).contiguous(), None


def _check_kept_by_the_model(module: torch.nn.Module, softcap: float | None, sinks: Tensor | None) -> None:
    """Refuses a soft-cap or attention sinks that the model's own attention implementation
    would not apply: Hugging Face's ``sdpa`` attention has neither (transformers 5.10 drops a
    soft-cap without a word, later versions raise), so the model trained per path runs
    without them while the tree's attention would apply them."""
    routed_from = getattr(getattr(module, "config", None), "treecompile_routed_from", None)
    if not (isinstance(routed_from, str) and "sdpa" in routed_from):
        return
    what = [f"soft-capping (softcap={softcap})"] if softcap is not None else []
    what += ["attention sinks"] if sinks is not None else []
    if what:
        raise UnsupportedModelError(
            f"{type(module).__name__}: attention {' and '.join(what)} under attn_implementation={routed_from!r}, "
            "which does not apply it: the model trained per path runs without it, the tree would run with it. "
            "Load the model with attn_implementation='eager' (or another implementation that applies it, "
            "e.g. 'flex_attention')"
        )


def _window_from_mask(name: str, mask: Any, window: int | None) -> int | None:
    """The sliding window a Hugging Face attention call means, from its mask and its argument."""

    if mask is None:
        return window
    if isinstance(mask, TreeMask):
        if mask.kind == "causal" or mask.kind == "chunked" and mask.size is not None and window is None:
            return window  # (chunks: carried by the marker's chunk argument)
        if mask.kind == "sliding" and mask.size is not None:
            if window is not None and window != mask.size:
                raise UnsupportedModelError(
                    f"{name}: the attention call's sliding_window={window} differs from the mask's "
                    f"{mask.builder} window {mask.size}"
                )
            return mask.size
        raise UnsupportedModelError(
            f"{name}: {mask.kind} attention mask ({mask.builder}"
            + (f", size {mask.size}" if mask.size else "")
            + ") is not reproduced on a tree; treecompile supports causal, sliding-window and chunked attention"
        )
    raise UnsupportedModelError(
        f"{name}: receives an attention mask {type(mask).__name__} built by the model's own code (a custom causal "
        "mask, or a bias such as ALiBi carried in the mask), not by transformers.masking_utils; treecompile cannot "
        "reproduce it on a tree"
    )


def hf_experts(module: torch.nn.Module, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
    """A Hugging Face experts-interface function that brackets the experts with markers.

    Registered under the name ``"treecompile"``; the wrapper selects it for the duration of
    each call. Between the markers it runs HF's ``grouped_mm`` implementation: tokens
    sorted by expert, one grouped matmul per projection, scattered back. That sort and
    scatter move rows around, but the result is token-wise (row ``t`` of the output is
    ``sum_j top_k_weights[t, j] * expert[top_k_index[t, j]](hidden[t])``; HF's experts have
    no capacity limit that would let one token's routing displace another's), which the
    MoE pass relies on. ``grouped_mm`` rather than the model's configured implementation:
    HF's ``eager`` experts loop over the experts present, a data-dependent loop that Dynamo
    cannot capture as one graph.

    Args:
        hidden_states: ``[T, D]``; top_k_index, top_k_weights: ``[T, k]``.

    Returns:
        ``[T, D]``.
    """
    from transformers.integrations.moe import grouped_mm_experts_forward

    h, idx, w = torch.ops.treecompile.experts_begin(hidden_states, top_k_index, top_k_weights)
    return torch.ops.treecompile.experts_end(grouped_mm_experts_forward(module, h, idx, w))


@functools.lru_cache(maxsize=None)
def _calls_attention_interface(cls: type) -> bool:
    try:
        src = inspect.getsource(cls.forward)
    except (OSError, TypeError, AttributeError):
        return False
    return "ALL_ATTENTION_FUNCTIONS" in src


@functools.lru_cache(maxsize=None)
def _computes_attention(cls: type) -> bool:
    try:
        src = inspect.getsource(cls)  # the whole class: GPT-J's forward calls its own _attn
    except (OSError, TypeError):
        return False
    src = src.lower()  # nn.Softmax(dim=-1)(scores) too (CodeGen)
    return "softmax(" in src or "scaled_dot_product_attention(" in src


def has_own_attention(model: torch.nn.Module) -> bool:
    """Whether the model computes attention in its own code and never through Hugging
    Face's attention interface (see `uses_attention_interface`): some module's class calls
    ``softmax`` or ``scaled_dot_product_attention`` itself. Models without attention
    (Mamba, RWKV) are neither."""
    modules = list(model.modules())
    return not any(_calls_attention_interface(type(m)) for m in modules) and any(
        _computes_attention(type(m)) for m in modules
    )


def uses_attention_interface(model: torch.nn.Module) -> bool:
    """Whether the model's attention goes through Hugging Face's attention interface.

    True if some module's ``forward`` looks its attention function up in
    ``ALL_ATTENTION_FUNCTIONS`` (most families since transformers 4.48). Older families
    (GPT-J, CodeGen, Falcon, MPT, Bloom, GPT-Neo, XGLM ...) compute attention in their own
    code from the mask HF builds; for them the wrapper leaves the attention implementation
    as it is and passes an all-ones ``attention_mask`` (so HF builds its plain causal mask
    from sizes alone, not a packed-sequence mask from the tree's position ids), and the
    attention pass recognises their attention like a custom model's.
    """
    return any(_calls_attention_interface(type(m)) for m in model.modules())


_CALLER_DEPTH = 16


def refuse_label_smoothing() -> None:
    """Raises `TreeInputError` when the running call comes from Hugging Face's
    ``Trainer.compute_loss`` with label smoothing (``label_smoothing_factor > 0``).

    Label smoothing is computed from the logits, which a tree-compiled model never forms (its
    LM head gathers only each target's log-prob). With a ``token-mean`` `TreeCollator` the
    ``Trainer`` would fail in its own code, finding a scalar where it expects logits; with
    another loss mode the collator returns no labels and the ``Trainer`` would skip the
    smoothing, training without it silently. The ``Trainer`` takes the labels out of the
    inputs before the call and does not pass its options, so this looks at the calling
    ``compute_loss`` (a subclass's own ``compute_loss`` is not looked into)."""
    trainer_module = sys.modules.get("transformers.trainer")
    trainer_class = getattr(trainer_module, "Trainer", None)
    code = getattr(getattr(trainer_class, "compute_loss", None), "__code__", None)
    if code is None:
        return
    frame = sys._getframe(1)
    try:
        for _ in range(_CALLER_DEPTH):
            if frame is None or frame.f_code is code:
                break
            frame = frame.f_back
        else:
            return
        trainer = None if frame is None else frame.f_locals.get("self")
        if getattr(trainer, "label_smoother", None) is None:
            return
        factor = getattr(getattr(trainer, "args", None), "label_smoothing_factor", "?")
        raise TreeInputError(
            f"Trainer(args.label_smoothing_factor={factor}): label smoothing is computed from the logits, which a "
            "tree-compiled model never forms (its LM head gathers only each target's log-prob); train with "
            "label_smoothing_factor=0, or with the stock model"
        )
    finally:
        del frame


#: Hugging Face forward arguments a wrapper around a model passes along unset (PEFT's
#: ``PeftModelForCausalLM.forward`` passes each of them, None when its caller did not).
_UNSET_OK = ("inputs_embeds", "output_attentions", "output_hidden_states", "return_dict", "use_cache",
             "past_key_values", "cache_position", "logits_to_keep")


def check_unset(kwargs: dict[str, Any]) -> None:
    """Refuses forward arguments a tree call cannot honour: any not in `_UNSET_OK`, and any
    of those that is set (``return_dict=True`` aside: the output is always one object)."""
    unknown = sorted(k for k in kwargs if k not in _UNSET_OK)
    if unknown:
        raise TypeError(f"a tree-compiled model's forward takes no argument {', '.join(map(repr, unknown))}: it runs a "
                        "packed TreeBatch (treecompile.pack) or padded input_ids")
    unsupported = sorted(k for k, v in kwargs.items() if v is not None and not (k == "return_dict" and v is True)
                         and not (k == "use_cache" and v is False) and not (k == "logits_to_keep" and v == 0))
    if unsupported:
        raise TreeInputError(f"a tree-compiled model ignores {', '.join(map(repr, unsupported))}: it computes each "
                             "target's log-probability from input ids, without a cache or hidden-state outputs; "
                             "leave them unset")
