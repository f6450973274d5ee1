"""Import paths of modules that moved into sub-packages, kept working.

treecompile's modules live in layered sub-packages (``treecompile.core``, ``.capture``,
``.planning``, ``.stream``, ``.compile``, ``.data``, ``.rl``, ``.bench``, ``.cli``; see
docs/architecture.md). Code written against the earlier flat layout (``treecompile.batch``,
``python -m treecompile.bench_cuda``) still runs: an old name imports the module under its
new one, as the same module object, so its classes, functions and state are shared.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from types import ModuleType

__all__ = ["MOVED", "install"]

#: Old module (under ``treecompile.``) -> where it lives now. Names that are now a sub-package
#: (``compile``, ``stream``, ``rl``, ``bench``, ``cli``, ``capture``, ``data``) are not here:
#: each sub-package's ``__init__`` re-exports what the old module's users import.
MOVED: dict[str, str] = {
    "errors": "core.errors",
    "preorder": "core.preorder",
    "tree_build": "core.tree_build",
    "tree": "core.tree",
    "path_sets": "core.path_sets",
    "weights": "core.weights",
    "batch": "core.batch",
    "loss": "core.loss",
    "advice": "core.advice",
    "reference": "core.reference",
    "messages": "core.messages",
    "conversation": "core.conversation",
    "tokenizer": "core.tokenizer",
    "drop_ins": "capture.drop_ins",
    "router_aux": "capture.router_aux",
    "model_loader": "capture.model_loader",
    "call": "capture.call",
    "budget": "planning.budget",
    "peak_memory": "planning.peak_memory",
    "partition": "planning.partition",
    "shard": "planning.shard",
    "grouping": "planning.grouping",
    "dataloader": "planning.dataloader",
    "stream_runner": "stream.runner",
    "stream_parts": "stream.parts",
    "stream_stack": "stream.stack",
    "stream_plan": "stream.plan",
    "probe": "compile.probe",
    "selfcheck": "compile.selfcheck",
    "inspection": "compile.inspection",
    "maskview": "compile.maskview",
    "extract": "compile.extract",
    "distributed": "compile.distributed",
    "io": "data.io",
    "datasets": "data.datasets",
    "chat": "data.chat",
    "rl_data": "rl.data",
    "rl_records": "rl.records",
    "bench_cuda": "bench.cuda",
    "bench_hf": "bench.hf",
    "profile_cuda": "bench.profile_cuda",
    "cli_args": "cli.args",
    "cli_inputs": "cli.inputs",
    "cli_inspect": "cli.inspect_cmd",
    "plots": "cli.plots",
    "plan": "cli.plan",
    "demo": "cli.demo",
}


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``treecompile.OLD`` and returns the module ``treecompile.NEW``."""

    def find_spec(self, fullname, path=None, target=None):
        new = _new_name(fullname)
        if new is None:
            return None
        real = importlib.util.find_spec(new)
        return None if real is None else importlib.util.spec_from_loader(fullname, self, origin=real.origin)

    def create_module(self, spec) -> ModuleType:
        return importlib.import_module(_new_name(spec.name))

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run: the module ran under its new name."""

    def get_code(self, fullname):
        """``python -m treecompile.OLD`` runs the new module's code as ``__main__``."""
        new = _new_name(fullname)
        return importlib.util.find_spec(new).loader.get_code(new)


def _new_name(fullname: str) -> str | None:
    head, _, old = fullname.partition(".")
    return f"treecompile.{MOVED[old]}" if head == "treecompile" and old in MOVED else None


def install() -> None:
    """Adds the finder (once)."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.append(_Finder())
