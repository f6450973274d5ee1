"""Model surgery for the duration of a capture: Hugging Face's attention masks.

Hugging Face models build their attention masks with ``transformers.masking_utils``
(``create_causal_mask``, ``create_sliding_window_causal_mask``, ``create_chunked_causal_mask``,
``create_bidirectional_mask`` ...) and hand each layer the mask of its kind. Some features
live only there: Llama-4's chunked attention, a sliding window some families express only in
the mask, bidirectional spans, extra ``or_mask_function`` / ``and_mask_function`` rules. The
tree rewrite replaces every attention by the tree rule, so a mask the rewrite does not
reproduce would be dropped silently.

For each call, the builders a model's modules reference are swapped for ones that return a
:class:`TreeMask` saying which kind of mask the layer asked for. The attention marker
(:func:`treecompile.passes.markers.hf_causal_attention`) reads it: a causal or sliding-window
mask becomes the tree rule (with the window), anything else is refused naming the mask kind.
A mask tensor that reaches the attention from anywhere else (built by the model's own code)
is refused too.
"""

from __future__ import annotations

import contextlib
import sys
import types
from dataclasses import dataclass
from typing import Any

from torch import nn

from treecompile.errors import UnsupportedModelError

__all__ = ["TreeMask", "hf_mask_builders"]


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


@contextlib.contextmanager
def hf_mask_builders(model: nn.Module):
    """Swaps the model's ``masking_utils`` builders for `TreeMask` builders for one call.

    Dynamo guards on the module globals, which hold the same functions on every call; the
    model run outside the wrapper (per path, saved, generating) sees the originals.
    """
    sites = _builder_sites(model)
    masks: dict[tuple[int, str], TreeMask] = {}
    for cfg in _configs(model):
        for name, kind in _BUILDERS.items():
            masks[(id(cfg), kind)] = TreeMask(kind, name, _size_of(cfg, kind))
    saved = [(module, attr, getattr(module, attr)) for module, attr, _ in sites]
    try:
        for module, attr, name in sites:
            setattr(module, attr, _replacement(name, _BUILDERS[name], masks))
        yield
    finally:
        for module, attr, original in saved:
            setattr(module, attr, original)
