import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import treecompile

PUBLIC = [
    "LOSS_MODES",
    "Path",
    "TrajectoryTree",
    "TreeBatch",
    "TreeCompiledModel",
    "TreeInputError",
    "TreeOutput",
    "TreeStats",
    "UnsupportedModelError",
    "Verify",
    "gather_logprobs",
    "logprobs",
    "pack",
    "tree_compile",
    "tree_loss",
]


def test_public_api_is_pinned():
    assert sorted(treecompile.__all__) == sorted(PUBLIC)
    for name in PUBLIC:
        assert getattr(treecompile, name) is not None


def test_unknown_name_is_an_attribute_error():
    try:
        treecompile.no_such_thing
    except AttributeError as exc:
        assert "no_such_thing" in str(exc)
    else:
        raise AssertionError("expected AttributeError")


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_import_does_not_load_torch():
    r = _run("import sys, treecompile; print('torch' in sys.modules)")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"


@pytest.mark.full
def test_works_without_transformers():
    # A meta path finder that refuses transformers, as if it were not installed.
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'transformers' or name.startswith('transformers.'):\n"
        "            raise ModuleNotFoundError(name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "from treecompile import TrajectoryTree, pack, tree_loss, gather_logprobs, tree_compile\n"
        "b = pack(TrajectoryTree.from_sequences([[1, 2, 3], [1, 2, 4]]))\n"
        "print(b.num_tokens)\n"
    )
    r = _run(code)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "4"


def test_version_is_the_package_version(capsys):
    from treecompile.cli.main import main

    root = Path(__file__).resolve().parents[1]
    version = tomllib.loads((root / "pyproject.toml").read_text())["project"]["version"]
    assert treecompile.__version__ == version
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0 and capsys.readouterr().out == f"treecompile {version}\n"
    assert f"## [{version}]" in (root / "CHANGELOG.md").read_text(), "CHANGELOG.md has no entry for this version"


def test_the_version_is_pyprojects():
    import tomllib
    from pathlib import Path

    import treecompile

    project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
    assert treecompile.__version__ == project["version"]


def test_every_module_path_the_docs_name_imports_and_the_flat_layouts_paths_are_gone():
    """Each ``treecompile.a.b`` a page, the README or a docstring names (the API pages link by
    them) is a module or a name in one, reached statically; the flat layout's paths
    (CHANGELOG.md, "Moved") are not modules any more, and a name moved to another module is
    only there (no re-export left behind)."""
    import importlib
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    texts = [p.read_text(encoding="utf-8") for p in [root / "README.md", *sorted((root / "docs").glob("*.md"))]]
    texts += [p.read_text(encoding="utf-8") for p in sorted((root / "treecompile").rglob("*.py"))]
    named = {m for t in texts for m in re.findall(r"(?<![\w.:/])treecompile(?:\.[a-z_][a-z0-9_]*)+", t)}
    assert len(named) > 50, sorted(named)
    for dotted in sorted(named):
        parts = dotted.split(".")
        for k in range(len(parts), 0, -1):  # the longest importable prefix, then attributes
            try:
                obj = importlib.import_module(".".join(parts[:k]))
            except ModuleNotFoundError:
                continue
            for name in parts[k:]:
                assert hasattr(obj, name), f"{dotted}: {'.'.join(parts[:k])} has no {name!r}"
                obj = getattr(obj, name)
            break
    changelog = (root / "CHANGELOG.md").read_text(encoding="utf-8")
    moved = re.findall(r"^\| `treecompile\.([a-z_.]+)` \| `treecompile\.([a-z_.]+)` \|$", changelog, re.M)
    assert len(moved) >= 46, moved
    for old, new in moved:
        try:
            importlib.import_module(f"treecompile.{new}")
        except ModuleNotFoundError:  # a name moved between modules (the kernels' references)
            (module, _, name), (old_module, _, old_name) = new.rpartition("."), old.rpartition(".")
            assert hasattr(importlib.import_module(f"treecompile.{module}"), name), f"{new} is not there"
            assert not hasattr(importlib.import_module(f"treecompile.{old_module}"), old_name), f"{old} is still there"
            continue
        if new.startswith(f"{old}."):  # the old module's name is now the room (a package) that holds it
            assert importlib.import_module(f"treecompile.{old}").__file__.endswith("__init__.py")
            continue
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(f"treecompile.{old}")
