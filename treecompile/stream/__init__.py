"""Trees larger than one call: parts run in DFS order with a stack of K/V and states.

`options` (`StreamOptions`) is what a user passes; `plan` chooses the parts and the
stack's policy under a budget; `parts` cuts a batch into parts; `stack` holds and
gathers the prefix K/V; `runner` runs the parts through the rewritten graphs.

Layer 6: imports kernels, core, passes, capture and planning.
"""


def __getattr__(name: str):
    """The names of `treecompile.stream.options` (what ``treecompile.stream`` was before it became a
    sub-package), imported on first use: importing a sibling module stays as light as it was."""
    import importlib

    try:
        return getattr(importlib.import_module("treecompile.stream.options"), name)
    except AttributeError:
        raise AttributeError(f"module 'treecompile.stream' has no attribute {name!r}") from None
