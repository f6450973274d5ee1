"""`tree_compile`: the wrapper, its first-call probe and checks, and what shows its work.

`wrapper` (`tree_compile`, `TreeCompiledModel`), `probe` (the metamorphic first-call
check), `selfcheck` (the full check against per-path training), `extract` (log-probs of
a batch), `inspection` and `maskview` (what `treecompile inspect` shows), `distributed`
(DDP and FSDP2 over trees).

Layer 7: imports every layer below it (kernels, core, passes, capture, planning, stream).
"""


def __getattr__(name: str):
    """The names of `treecompile.compile.wrapper` (what ``treecompile.compile`` was before it became a
    sub-package), imported on first use: importing a sibling module stays as light as it was."""
    import importlib

    try:
        return getattr(importlib.import_module("treecompile.compile.wrapper"), name)
    except AttributeError:
        raise AttributeError(f"module 'treecompile.compile' has no attribute {name!r}") from None
