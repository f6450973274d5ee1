"""treecompile: exact language-model training on prefix trees.

Every distinct prefix token is computed once, and the loss and gradients equal
those of training on each root-to-leaf path separately.

Names are imported on first use, so that ``import treecompile`` (and the CLI) start
without loading torch until something needs it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "LOSS_MODES": "treecompile.loss",
    "Path": "treecompile.tree",
    "TrajectoryTree": "treecompile.tree",
    "TreeBatch": "treecompile.batch",
    "TreeInputError": "treecompile.errors",
    "TreeStats": "treecompile.tree",
    "UnsupportedModelError": "treecompile.errors",
    "gather_logprobs": "treecompile.loss",
    "pack": "treecompile.batch",
    "tree_loss": "treecompile.loss",
    "tree_compile": "treecompile.compile",
    "TreeCompiledModel": "treecompile.compile",
    "TreeOutput": "treecompile.compile",
    "logprobs": "treecompile.extract",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'treecompile' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:
    from treecompile.batch import TreeBatch, pack
    from treecompile.compile import TreeCompiledModel, TreeOutput, tree_compile
    from treecompile.extract import logprobs
    from treecompile.errors import TreeInputError, UnsupportedModelError
    from treecompile.loss import LOSS_MODES, gather_logprobs, tree_loss
    from treecompile.tree import Path, TrajectoryTree, TreeStats
