"""Reinforcement learning on trees: policy losses, rollout records, advantages.

`losses` (``treecompile.rl.losses.policy_loss`` and its aggregation modes), `data` (rollout
records to trees), `records` (records read from TRL and chat formats).

Layer 9: imports the layers below it.
"""
