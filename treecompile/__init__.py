"""treecompile: exact language-model training on prefix trees.

Every distinct prefix token is computed once, and the loss and gradients equal
those of training on each root-to-leaf path separately.
"""

from treecompile.batch import TreeBatch, pack
from treecompile.errors import TreeInputError, UnsupportedModelError
from treecompile.loss import LOSS_MODES, gather_logprobs, tree_loss
from treecompile.tree import Path, TrajectoryTree, TreeStats

__version__ = "0.1.0"

__all__ = [
    "LOSS_MODES",
    "Path",
    "TrajectoryTree",
    "TreeBatch",
    "TreeInputError",
    "TreeStats",
    "UnsupportedModelError",
    "gather_logprobs",
    "pack",
    "tree_loss",
]
