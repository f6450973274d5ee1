"""treecompile: exact language-model training on prefix trees.

Every distinct prefix token is computed once, and the loss and gradients equal
those of training on each root-to-leaf path separately.

Names are imported on first use, so that ``import treecompile`` (and the CLI) start
without loading torch until something needs it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from treecompile.core.version import __version__

_EXPORTS = {
    "LOSS_MODES": "treecompile.core.loss",
    "Path": "treecompile.core.tree",
    "TrajectoryTree": "treecompile.core.tree",
    "TreeBatch": "treecompile.core.batch",
    "TreeInputError": "treecompile.core.errors",
    "TreeStats": "treecompile.core.tree",
    "UnsupportedModelError": "treecompile.core.errors",
    "gather_logprobs": "treecompile.core.loss",
    "pack": "treecompile.core.batch",
    "tree_loss": "treecompile.core.loss",
    "tree_compile": "treecompile.compile.wrapper",
    "TreeCompiledModel": "treecompile.compile.wrapper",
    "TreeOutput": "treecompile.compile.wrapper",
    "Verify": "treecompile.compile.options",
    "logprobs": "treecompile.compile.extract",
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
    from treecompile.core.batch import TreeBatch, pack
    from treecompile.compile.wrapper import TreeCompiledModel, TreeOutput, tree_compile
    from treecompile.compile.extract import logprobs
    from treecompile.compile.options import Verify
    from treecompile.core.errors import TreeInputError, UnsupportedModelError
    from treecompile.core.loss import LOSS_MODES, gather_logprobs, tree_loss
    from treecompile.core.tree import Path, TrajectoryTree, TreeStats
