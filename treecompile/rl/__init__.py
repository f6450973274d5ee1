"""Reinforcement learning on trees: policy losses, rollout records, advantages.

`losses` (``treecompile.rl.policy_loss`` and its aggregation modes), `data` (rollout
records to trees), `records` (records read from TRL and chat formats).

Layer 9: imports the layers below it.
"""

from treecompile.core.reexport import names_of

# What ``treecompile.rl`` was before it became a sub-package: `treecompile.rl.losses`'s names.
__getattr__ = names_of("treecompile.rl", "losses")
