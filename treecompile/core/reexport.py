"""A sub-package's names from one of its modules, imported on first use.

Four sub-packages took the name of a flat module (``treecompile.compile``, ``.stream``,
``.rl``, ``.bench``); each package keeps answering for that module's names without importing
it with the package, so a sibling module imports as lightly as it did.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

__all__ = ["names_of"]


def names_of(package: str, module: str) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package`` that looks names up in ``package.module``."""

    def __getattr__(name: str) -> Any:
        try:
            return getattr(importlib.import_module(f"{package}.{module}"), name)
        except AttributeError:
            raise AttributeError(f"module {package!r} has no attribute {name!r}") from None

    return __getattr__
