"""The layer contract: no module imports from a layer above its own (docs/architecture.md).

Every import of a treecompile module is checked, function-local ones included; imports only
for type checking (under ``if TYPE_CHECKING:``) run nothing and are not. Modules are named
as pyproject's ``package-dir`` installs them (``passes/`` is ``treecompile.passes``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: Bottom to top. A module may import from its own layer and the layers below it.
LAYERS = ["kernels", "core", "passes", "capture", "planning", "stream", "compile", "data", "rl", "integrations",
          "bench", "cli", "api"]
#: Rooms (or a room's modules) that stand on a layer's floor: chat conversations sit beside the tree
#: (`TrajectoryTree.from_messages` renders them; rendering builds trees); the distributed room holds every
#: kind of parallelism, each module on the floor of the layer it serves (the data loader shards, the
#: stream runner runs FSDP2 units unsharded, context parallelism runs stream parts).
FLOORS = {"chat": "core", "distributed.unsharded": "core", "distributed.shard": "planning",
          "distributed.cp_split": "planning", "distributed.context_parallel": "stream",
          "distributed.stream_cp": "stream", "distributed.data_parallel": "compile", "distributed": "core"}
#: Folder in the checkout -> package name.
PACKAGE_DIRS = {"treecompile": "treecompile", "passes": "treecompile.passes", "kernels": "treecompile.kernels"}


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT)
    parts = [PACKAGE_DIRS[rel.parts[0]], *rel.parts[1:]]
    parts[-1] = parts[-1].removesuffix(".py")
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer_of(module: str) -> str:
    """``treecompile.X...`` -> X's layer; the package root and its private helpers are the API."""
    parts = module.split(".")
    if len(parts) == 1 or (len(parts) == 2 and parts[1] not in LAYERS and parts[1] not in FLOORS):
        return "api"
    return parts[1]


def _modules() -> dict[str, Path]:
    out = {}
    for folder in PACKAGE_DIRS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            out[module_name(path)] = path
    return out


def _type_checking_only(tree: ast.Module) -> set[int]:
    """Line numbers of imports inside ``if TYPE_CHECKING:`` blocks."""
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for sub in node.body:
                for n in ast.walk(sub):
                    if isinstance(n, (ast.Import, ast.ImportFrom)):
                        lines.add(n.lineno)
    return lines


def imports(path: Path, name: str) -> list[tuple[int, str]]:
    """``(line, imported treecompile module)`` for every runtime import in ``path``."""
    tree = ast.parse(path.read_text())
    skip = _type_checking_only(tree)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            # `from treecompile.x import y`: y may be a module of x, or a name defined in x.
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        if node.lineno in skip:
            continue
        out += [(node.lineno, t) for t in targets if t == "treecompile" or t.startswith("treecompile.")]
    return out


MODULES = _modules()


def floor_of(module: str) -> str:
    """The layer whose floor ``module`` stands on: its room's, or its own entry in `FLOORS`."""
    parts = module.split(".")
    for key in (".".join(parts[1:3]), ".".join(parts[1:2])):
        if key in FLOORS:
            return FLOORS[key]
    return layer_of(module)


def violations(modules: dict[str, Path]) -> list[str]:
    out = []
    for name, path in modules.items():
        mine = LAYERS.index(floor_of(name))
        for line, target in imports(path, name):
            theirs = LAYERS.index(floor_of(target))
            if theirs > mine:
                where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
                out.append(f"{where}:{line}: {name} ({floor_of(name)}) imports {target} "
                           f"({floor_of(target)}), a layer above")
    return out


def test_every_module_has_a_layer():
    unknown = sorted(n for n in MODULES if n.count(".") >= 2 and n.split(".")[1] not in [*LAYERS, *FLOORS])
    assert not unknown, unknown
    assert all(f"treecompile.{key}" in MODULES for key in FLOORS), "a FLOORS entry names no module"
    assert all(floor in LAYERS for floor in FLOORS.values())


def test_no_module_imports_from_a_layer_above():
    assert violations(MODULES) == []


@pytest.mark.parametrize("source, expect", [
    ("from treecompile.compile.wrapper import tree_compile\n", ["treecompile.compile.wrapper"]),
    ("def f():\n    from treecompile.cli.main import main\n", ["treecompile.cli.main"]),
    ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from treecompile.cli.main import main\n", []),
    ("import treecompile\n", ["treecompile"]),
], ids=["module-level", "function-local", "type-checking-only", "package-root"])
def test_the_checker_sees_each_import_form(tmp_path, source, expect):
    """A checker that missed a form would pass a violating tree: each form is seen (or, for
    typing-only imports, deliberately not)."""
    path = tmp_path / "probe.py"
    path.write_text(source)
    assert [t for _, t in imports(path, "treecompile.core.probe")] == expect


def test_an_upward_import_is_reported(tmp_path):
    source = tmp_path / "fake.py"
    source.write_text("def f():\n    from treecompile.cli.main import main\n")
    found = violations({"treecompile.core.fake": source})
    assert found == [f"{source}:2: treecompile.core.fake (core) imports treecompile.cli.main (cli), a layer above"]
