"""Reinforcement learning on trees: policy losses, rollout records, advantages.

`losses` (``treecompile.rl.policy_loss`` and its aggregation modes), `data` (rollout
records to trees), `records` (records read from TRL and chat formats).

Layer 9: imports the layers below it.
"""


def __getattr__(name: str):
    """The names of `treecompile.rl.losses` (what ``treecompile.rl`` was before it became a
    sub-package), imported on first use: importing a sibling module stays as light as it was."""
    import importlib

    try:
        return getattr(importlib.import_module("treecompile.rl.losses"), name)
    except AttributeError:
        raise AttributeError(f"module 'treecompile.rl' has no attribute {name!r}") from None
