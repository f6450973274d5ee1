"""Drop-ins for the training frameworks people already use.

Each submodule imports its framework when it is itself imported, never before:
``import treecompile`` (and ``import treecompile.integrations``) imports neither
transformers nor trl nor verl.

- :mod:`treecompile.integrations.hf`: Hugging Face ``Trainer`` (a collator).
- :mod:`treecompile.integrations.trl`: TRL's ``SFTTrainer`` and ``GRPOTrainer``.
- :mod:`treecompile.integrations.verl`: verl rollout batches to tree batches and back.
- :mod:`treecompile.integrations.verl_actor`: verl's FSDP actor engine with its forward on trees.
"""

from __future__ import annotations

import importlib
from types import ModuleType

_SUBMODULES = ("hf", "trl", "verl", "verl_actor")


def __getattr__(name: str) -> ModuleType:
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
