"""The ``MODEL`` argument of ``treecompile inspect``: a Hugging Face config or ``module:factory``, built.

Example::

    model, source = load_model("./qwen3-tiny")               # a directory with a HF config.json
    model, source = load_model("mypkg.models:make_lm")       # any callable returning an nn.Module

A HF config is built with small random weights after its parameters are counted on the meta
device (refused above :data:`MAX_PARAMS` unless ``allow_large``); a factory is imported from
the current directory or ``sys.path`` and called. :mod:`treecompile.compile.inspection` re-exports
:func:`load_model`. Nothing heavy is imported until a model is built.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from pathlib import Path
from typing import Any

__all__ = ["DTYPES", "MAX_PARAMS", "WARN_PARAMS", "load_model"]

#: Above this many parameters a model is refused unless ``allow_large`` (``--allow-large``).
MAX_PARAMS = 1_000_000_000
#: Above this many parameters building the model prints a warning (it takes a while on CPU).
WARN_PARAMS = 100_000_000
#: Parameter dtypes a model can be built in.
DTYPES = ("float32", "float64", "bfloat16")


def load_model(
    spec: str, *, dtype: str | None = None, allow_large: bool = False, seed: int = 0
) -> tuple[Any, str]:
    """Builds the model a ``MODEL`` argument names.

    Args:
        spec: a directory holding a Hugging Face ``config.json``, such a JSON file, or
            ``module:factory`` (``module`` importable from the current directory or
            ``sys.path``; ``factory`` a callable, or dotted attribute path to one, that
            takes no arguments and returns an ``nn.Module``).
        dtype: ``"float32"``, ``"float64"`` or ``"bfloat16"``; None keeps a factory's dtype
            and builds HF configs in float32.
        allow_large: build a HF config above :data:`MAX_PARAMS` parameters anyway.
        seed: seeds the random weights.

    Returns:
        ``(model, source)`` with ``source`` ``"hf-config"`` or ``"factory"``; the model is
        in eval mode (dropout would make the graph random per call, and is refused).

    Raises:
        ValueError: the spec is neither, the factory fails, or the config is too large.
        ImportError: transformers (HF configs) or the factory's module cannot be imported.
    """
    import torch

    path = Path(spec).expanduser()
    if path.is_dir() or path.is_file():
        model = _model_from_config(path, dtype=dtype or "float32", allow_large=allow_large, seed=seed)
        return model.eval(), "hf-config"
    if ":" in spec:
        torch.manual_seed(seed)
        model = _model_from_factory(spec)
        if dtype is not None:
            model = model.to(getattr(torch, dtype))
        return model.eval(), "factory"
    raise ValueError(
        f"MODEL {spec!r} is not a directory with a config.json, a JSON config file, or module:factory "
        "(e.g. ./qwen3-tiny, ./config.json, mypkg.models:make_lm)"
    )


def _model_from_config(path: Path, *, dtype: str, allow_large: bool, seed: int) -> Any:
    import torch

    config_file = path / "config.json" if path.is_dir() else path
    if not config_file.is_file():
        raise ValueError(f"{path} has no config.json (MODEL must be a Hugging Face config directory or file)")
    try:
        raw = json.loads(config_file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{config_file} is not valid JSON: {exc}") from None
    if not isinstance(raw, dict) or "model_type" not in raw:
        raise ValueError(f"{config_file} is not a Hugging Face model config (it has no 'model_type')")
    try:
        import transformers
    except ImportError:
        raise ImportError("a Hugging Face config needs transformers: pip install 'treecompile[hf]'") from None
    config = transformers.AutoConfig.from_pretrained(str(config_file))
    # Count parameters on the meta device first: no memory, no time, and a clear refusal
    # before a config meant for a GPU cluster fills this machine's RAM.
    with torch.device("meta"):
        shell = transformers.AutoModelForCausalLM.from_config(config)
    n = sum(p.numel() for p in shell.parameters())
    del shell
    if n > MAX_PARAMS and not allow_large:
        raise ValueError(
            f"{config_file} describes a {n / 1e9:.1f}B-parameter model; inspect builds it on CPU with random "
            f"weights, which is refused above {MAX_PARAMS / 1e9:.0f}B parameters. The passes do not depend on "
            "the width: shrink hidden_size / num_hidden_layers, or pass --allow-large"
        )
    if n > WARN_PARAMS:
        print(
            f"treecompile inspect: warning: building a {n / 1e6:.0f}M-parameter model in {dtype} on CPU "
            "(a smaller config shows the same graph rewrites)",
            file=sys.stderr,
        )
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))


def _model_from_factory(spec: str) -> Any:
    from torch import nn

    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"MODEL {spec!r}: expected module:factory, e.g. mypkg.models:make_lm")
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)  # a user's module beside them, as `python -m` would find it
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ImportError(f"MODEL {spec!r}: cannot import module {module_name!r}: {exc}") from None
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"MODEL {spec!r}: module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if isinstance(obj, nn.Module):
        return obj
    if not callable(obj):
        raise ValueError(f"MODEL {spec!r}: {attr!r} is a {type(obj).__name__}, not a callable returning a module")
    try:
        model = obj()
    except TypeError as exc:
        raise ValueError(f"MODEL {spec!r}: calling {attr}() with no arguments failed: {exc}") from None
    if not isinstance(model, nn.Module):
        raise ValueError(f"MODEL {spec!r}: {attr}() returned a {type(model).__name__}, not a torch.nn.Module")
    return model
