"""Benchmarks: tree training against what a user runs today.

`trees` (``treecompile bench``, CPU and GPU, against per-path training with packing),
`cuda` (``treecompile bench --device cuda``: Qwen3 shapes against the unmodified Hugging
Face model), `hf` (those models and baselines written out as a user runs them),
`profile_cuda` (one step under the profiler).

Layer 11: imports the layers below it.
"""


def __getattr__(name: str):
    """The names of `treecompile.bench.trees` (what ``treecompile.bench`` was before it became a
    sub-package), imported on first use: importing a sibling module stays as light as it was."""
    import importlib

    try:
        return getattr(importlib.import_module("treecompile.bench.trees"), name)
    except AttributeError:
        raise AttributeError(f"module 'treecompile.bench' has no attribute {name!r}") from None
