"""The documentation cannot rot: every Python example on every page runs, and the site builds.

Each ```python block of each Markdown page under ``docs/`` is executed in page order; the
blocks of one page share a namespace, as a reader running the page top to bottom would.
A block opts out only with a marker on the line right before its fence that says why:

    <!-- docs-test: skip (needs a GPU) -->

Tracebacks point at the Markdown file and line, because each block is compiled with the
page's path as file name and padded to its line in the page.
"""

from __future__ import annotations

import argparse
import importlib.util
import linecache
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from html.parser import HTMLParser
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


@pytest.fixture
def eager_lowering():
    """The examples call ``tree_compile(model)``; here its default lowering runs the rewritten
    graph as it is (`testing.eager_default_lowering`). What a page shows and checks (the API,
    the outputs, exactness where it asserts it) does not depend on the lowering, which the
    equivalence tests cover on the pages' model families (test_compile_hf's Qwen3,
    test_compile_hybrid's Qwen3-Next, test_stream's streamed Qwen3)."""
    from testing import eager_default_lowering

    with eager_default_lowering():
        yield


@pytest.mark.full
@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_page_examples_run(page: Path, tmp_path, monkeypatch, capsys, eager_lowering):
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


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The site, built once with ``mkdocs build --strict`` for every test that reads it."""
    if importlib.util.find_spec("mkdocs") is None:
        pytest.skip("mkdocs is not installed (pip install -e '.[docs]')")
    if importlib.util.find_spec("mkdocstrings_handlers") is None or importlib.util.find_spec("material") is None:
        pytest.skip("mkdocs-material or mkdocstrings[python] is not installed (pip install -e '.[docs]')")
    out = tmp_path_factory.mktemp("site")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"),
         "--site-dir", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    return out


@pytest.mark.full
def test_mkdocs_build_strict(site: Path):
    """The site builds with no warning: broken links, bad cross-references, failed imports."""
    assert (site / "index.html").is_file()


class _Text(HTMLParser):
    """A page's text, split into what is inside ``<pre>``/``<code>`` and what is not, and the
    text of each ``<blockquote>``."""

    SKIP = {"script", "style"}

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.stack: list[str] = []
        self.prose: list[str] = []
        self.code: list[str] = []
        self.quotes: list[str] = []
        self.ids: set[str] = set()
        self.refs: list[tuple[str, str]] = []  # (tag, url) of every src= and stylesheet/script href=
        self.hrefs: list[str] = []
        self.nested_quotes = 0  # a blockquote opened inside another: how `>>> x` renders as Markdown

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if a.get("id"):
            self.ids.add(a["id"])
        if tag == "a" and a.get("href"):
            self.hrefs.append(a["href"])
        if tag in ("img", "script") and a.get("src"):
            self.refs.append((tag, a["src"]))
        if tag == "link" and a.get("rel") in ("stylesheet", "preconnect") and a.get("href"):
            self.refs.append((tag, a["href"]))
        if tag == "blockquote" and "blockquote" in self.stack:
            self.nested_quotes += 1
        if tag not in ("br", "img", "input", "link", "meta", "hr", "source", "wbr"):
            self.stack.append(tag)

    def handle_endtag(self, tag):
        if tag in self.stack:
            while self.stack and self.stack.pop() != tag:
                pass

    def handle_data(self, data):
        if any(t in self.SKIP for t in self.stack):
            return
        (self.code if {"pre", "code"} & set(self.stack) else self.prose).append(data)
        if "blockquote" in self.stack:
            self.quotes.append(data)


def _pages(site: Path) -> dict[str, _Text]:
    pages = {}
    for path in sorted(site.rglob("*.html")):
        rel = path.relative_to(site).as_posix()
        if rel.startswith(("assets/", "search/")):
            continue
        parser = _Text()
        parser.feed(path.read_text(encoding="utf-8"))
        pages[rel] = parser
    return pages


@pytest.fixture(scope="module")
def site_pages(site: Path) -> dict[str, _Text]:
    return _pages(site)


RAW_MATH = re.compile(r"\$\$|(?<![\w$])\$[^\s$][^$\n]*?\$(?![\w$])")
# A role as rendered: Markdown turns its backticks into <code>, leaving ":class:" before the name.
ROLE = re.compile(r"(?<![\w:]):(?:py:)?(?:class|func|meth|mod|attr|data|exc|obj|const):(?!:)")


@pytest.mark.full
def test_site_has_no_raw_math_roles_or_doctest_quotes(site_pages):
    """What rendered wrong before: LaTeX left as ``$...$``, Sphinx roles shown as text, and
    ``>>>`` examples turned into block quotes or prose."""
    problems = []
    for name, page in site_pages.items():
        prose = "".join(page.prose)
        if m := RAW_MATH.search(prose):
            problems.append(f"{name}: raw math {m.group(0)[:60]!r}")
        text = prose + "".join(page.code)
        if m := ROLE.search(text):
            problems.append(f"{name}: Sphinx role {text[m.start():m.start() + 40]!r}")
        if any(">>>" in q for q in page.quotes) or page.nested_quotes:
            problems.append(f"{name}: a '>>>' example rendered as block quotes")
        if ">>>" in prose:
            problems.append(f"{name}: '>>>' outside a code block")
        if m := re.search(r"\S::(?=\s|$)", prose):
            problems.append(f"{name}: reStructuredText '::' left in {prose[max(0, m.start() - 40):m.end()]!r}")
    assert not problems, "\n".join(problems)


@pytest.mark.full
def test_rl_page_math_is_rendered(site_pages):
    """The RL page's formulas reach KaTeX: arithmatex spans, no dollar signs left."""
    page = site_pages["rl/index.html"]
    math = [t for t in page.prose if t.startswith(("\\(", "\\["))]
    assert len(math) >= 40, f"only {len(math)} formulas found on the RL page"
    assert "$" not in "".join(page.prose)


@pytest.mark.full
def test_site_loads_nothing_from_outside(site_pages, site: Path):
    """Works offline: scripts, stylesheets (KaTeX, fonts) and images are files of the site."""
    problems = []
    for name, page in site_pages.items():
        for tag, url in page.refs:
            if re.match(r"^(https?:)?//", url):
                problems.append(f"{name}: <{tag}> loads {url}")
            elif not url.startswith("data:"):
                path = url.split("#")[0].split("?")[0]
                # 404.html links from the site root; every other page relatively
                target = site / path.lstrip("/") if path.startswith("/") else (site / name).parent / path
                if not target.resolve().is_file():
                    problems.append(f"{name}: <{tag}> {url} is not in the site")
    assert not problems, "\n".join(problems)
    for figure in ("tree-row-mask.svg", "partition.svg", "sharding.svg", "speedup.svg"):
        assert (site / "figures" / figure).stat().st_size > 1000, f"figures/{figure} was not drawn"


@pytest.mark.full
def test_every_public_name_is_on_an_api_page(site_pages):
    import treecompile

    api = {name: page for name, page in site_pages.items() if name.startswith("api/")}
    ids = set().union(*(page.ids for page in api.values()))
    missing = [n for n in treecompile.__all__ if f"{treecompile._EXPORTS[n]}.{n}" not in ids]
    assert not missing, f"no API page documents {missing}"
    links = api["api/index.html"].hrefs
    unlinked = [n for n in treecompile.__all__ if not any(h.endswith(f"#{treecompile._EXPORTS[n]}.{n}") for h in links)]
    assert not unlinked, f"the API index page does not link {unlinked}"


@pytest.mark.full
def test_every_cli_subcommand_and_option_is_on_the_cli_page(site_pages):
    from treecompile.cli.main import build_parser

    page = site_pages["cli/index.html"]
    text = "".join(page.prose + page.code)
    subs = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    assert set(subs) >= {"stats", "plan", "bench", "inspect"}
    for name, parser in subs.items():
        assert f"treecompile-{name}" in page.ids, f"the CLI page has no section for `treecompile {name}`"
        for action in parser._actions:
            for flag in action.option_strings:
                assert flag in text, f"the CLI page does not list `treecompile {name} {flag}`"


def test_home_page_speedups_are_the_measured_ones():
    """The speedups quoted on the home page are rows of the tables in docs/benchmarks.md."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from docs_figures import measured_speedups

    measured = measured_speedups((DOCS / "benchmarks.md").read_text(encoding="utf-8"))
    interval = {(r["workload"].split()[0].lower(), round(r["por"], 2)): r["speedup"] for r in measured
                if r["method"] == "interval" and r["section"].startswith("CPU")}
    rows = re.findall(r"^\| (synthetic|GSM8K|tau-bench)[^|]* \| ([\d.]+) \| ([\d.]+)x",
                      (DOCS / "index.md").read_text(encoding="utf-8"), re.M)
    assert len(rows) >= 5, rows
    for workload, por, speedup in rows:
        key = (workload.lower(), round(float(por), 2))
        close = [v for (w, p), v in interval.items() if w == key[0] and abs(p - key[1]) < 0.01]
        assert close == [float(speedup)], f"home page: {workload} POR {por} {speedup}x; benchmarks.md: {close}"


def test_readme_examples_run(tmp_path, monkeypatch, capsys, eager_lowering):
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


def test_docstring_conversion_reads_rest_habits_as_markdown():
    """scripts/docs_griffe.py: literal blocks become fences, '>>>' examples an Examples section,
    roles links (optional ones, so a name on no page stays code)."""
    pytest.importorskip("griffe")
    sys.path.insert(0, str(ROOT / "scripts"))
    import griffe
    from docs_griffe import SphinxToMarkdown

    doc = (
        "Summary.\n\nExample::\n\n    treecompile stats x.jsonl\n\nRendered as::\n\n    a = 1\n\n"
        "See :class:`~treecompile.core.batch.TreeBatch` and :func:`nowhere_at_all`.\n\n"
        "Example:\n    >>> 1 + 1\n    2\n"
    )
    module = griffe.Module("treecompile")
    text = SphinxToMarkdown().rewrite(module, doc)
    assert "Example:\n\n    ```bash\n    treecompile stats x.jsonl\n    ```" in text
    assert "Rendered as:\n\n```python\na = 1\n```" in text
    assert '<autoref identifier="treecompile.core.batch.TreeBatch" optional><code>TreeBatch</code></autoref>' in text
    assert "`nowhere_at_all`" in text and ":func:" not in text and ":class:" not in text
    assert "Examples:\n    >>> 1 + 1\n    2" in text
