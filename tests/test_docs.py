"""The documentation cannot rot: every Python example on every page runs, and the site builds.

Each ```python block of each Markdown page under ``docs/`` is executed in page order; the
blocks of one page share a namespace, as a reader running the page top to bottom would.
A block opts out only with a marker on the line right before its fence that says why:

    <!-- docs-test: skip (needs a GPU) -->

Tracebacks point at the Markdown file and line, because each block is compiled with the
page's path as file name and padded to its line in the page.
"""

from __future__ import annotations

import importlib.util
import linecache
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.rglob("*.md"))

SKIP_MARKER = re.compile(r"^<!--\s*docs-test:\s*skip\b(.*?)-->\s*$")
FENCE = re.compile(r"^(`{3,}|~{3,})\s*([\w+-]*)")


@dataclass
class Block:
    lang: str
    code: str
    line: int  # 1-based line of the first code line in the page
    skip_reason: str | None


def parse_blocks(text: str) -> list[Block]:
    """Fenced code blocks of a page, with their language, first line and skip marker."""
    lines = text.splitlines()
    blocks = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, lang = m.group(1), m.group(2).lower()
        skip_reason = None
        prev = lines[i - 1].strip() if i > 0 else ""
        marker = SKIP_MARKER.match(prev)
        if marker:
            skip_reason = marker.group(1).strip().strip("()").strip()
        start = i + 1
        j = start
        while j < len(lines) and not lines[j].startswith(fence[0] * len(fence)):
            j += 1
        blocks.append(Block(lang, "\n".join(lines[start:j]) + "\n", start + 1, skip_reason))
        i = j + 1
    return blocks


def _page_id(path: Path) -> str:
    return str(path.relative_to(DOCS))


def test_pages_are_found():
    names = {_page_id(p) for p in PAGES}
    for required in ("index.md", "concepts.md", "loss-modes.md", "data-format.md", "reference-baseline.md"):
        assert required in names, f"docs/{required} is missing; found {sorted(names)}"


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_page_starts_with_a_runnable_example(page: Path):
    """Each page's first code block is Python, it runs, and it comes before the first section."""
    text = page.read_text(encoding="utf-8")
    blocks = parse_blocks(text)
    assert blocks, f"{_page_id(page)} has no code block"
    first = blocks[0]
    assert first.lang == "python" and first.skip_reason is None, (
        f"{_page_id(page)}: the first code block (line {first.line}) must be a runnable python example"
    )
    first_section = next((n for n, line in enumerate(text.splitlines(), 1) if line.startswith("## ")), None)
    assert first_section is None or first.line < first_section, (
        f"{_page_id(page)}: the example at line {first.line} comes after the first section (line {first_section})"
    )


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_page_examples_run(page: Path, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # an example that writes files writes them here
    namespace: dict = {"__name__": f"docs_{page.stem.replace('-', '_')}"}
    ran = 0
    for n, block in enumerate(parse_blocks(page.read_text(encoding="utf-8"))):
        if block.lang != "python":
            continue
        if block.skip_reason is not None:
            assert block.skip_reason, (
                f"{_page_id(page)} line {block.line - 1}: a docs-test skip marker must give its reason, "
                "e.g. <!-- docs-test: skip (needs a GPU) -->"
            )
            continue
        # Padding puts the code at its line in the page, so tracebacks name the Markdown line.
        source = "\n" * (block.line - 1) + block.code
        # A made-up file name whose lines linecache serves: tools that read a function's source
        # (Dynamo, inspect) then see this block's Python, not the Markdown page around it.
        filename = f"<{page.name}:block{n}>"
        linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
        code = compile(source, filename, "exec")
        try:
            exec(code, namespace)
        except ModuleNotFoundError as exc:
            if exc.name and exc.name.split(".")[0] in ("transformers", "trl", "datasets"):
                pytest.skip(f"{_page_id(page)} block {n} (line {block.line}) needs {exc.name.split('.')[0]}")
            raise
        ran += 1
    capsys.readouterr()  # examples print; keep the test output quiet
    has_python = any(b.lang == "python" for b in parse_blocks(page.read_text(encoding="utf-8")))
    assert ran or not has_python, f"{_page_id(page)}: every python block is skipped"


def test_parse_blocks_reads_fences_and_skip_markers():
    text = (
        "# T\n\n```python\nx = 1\n```\n\n<!-- docs-test: skip (needs a GPU) -->\n```python\ncuda()\n```\n"
        "\n```text\nnot python\n```\n"
    )
    blocks = parse_blocks(text)
    assert [(b.lang, b.line, b.skip_reason) for b in blocks] == [
        ("python", 4, None),
        ("python", 9, "needs a GPU"),
        ("text", 13, None),
    ]
    assert blocks[0].code == "x = 1\n"


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None, reason="mkdocs is not installed (pip install -e '.[docs]')")
def test_mkdocs_build_strict(tmp_path):
    """The site builds with no warning: broken links, bad cross-references, failed imports."""
    if importlib.util.find_spec("mkdocstrings_handlers") is None or importlib.util.find_spec("material") is None:
        pytest.skip("mkdocs-material or mkdocstrings[python] is not installed (pip install -e '.[docs]')")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"),
         "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    assert (tmp_path / "site" / "index.html").is_file()


def test_readme_examples_run(tmp_path, monkeypatch, capsys):
    readme = ROOT / "README.md"
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "docs_readme"}
    blocks = [b for b in parse_blocks(readme.read_text(encoding="utf-8")) if b.lang == "python"]
    assert blocks, "README.md has no python example"
    for n, block in enumerate(blocks):
        filename = f"<README.md:block{n}>"
        source = "\n" * (block.line - 1) + block.code
        linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
        exec(compile(source, filename, "exec"), namespace)
    capsys.readouterr()
