"""mkdocs hooks: the pages and pictures that are made from the library at build time, so that
they cannot drift from it.

* ``cli.md``: the command-line reference, from the argparse parsers of ``treecompile.cli.main``;
* ``figures/*.svg``: the diagrams of ``scripts/docs_figures.py`` (a tree, its packed row and
  its mask; a partition; the measured speedups of ``docs/benchmarks.md``).

Both are added to the site's files in memory; nothing is written to ``docs/``.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
import time
from pathlib import Path

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(1, str(ROOT))  # the checkout's treecompile, also when it is not installed

import docs_figures  # noqa: E402

FIGURES = "figures"
log = logging.getLogger("mkdocs.hooks.treecompile")


def on_files(files: Files, config, **kwargs) -> Files:
    files.append(File.generated(config, "cli.md", content=cli_page()))
    start = time.perf_counter()
    for name, data in docs_figures.make_figures().items():
        files.append(File.generated(config, f"{FIGURES}/{name}", content=data))
    log.info("diagrams drawn in %.1f s (scripts/docs_figures.py)", time.perf_counter() - start)
    return files


def on_page_content(html: str, page, config, **kwargs) -> str:
    """Registers each page as ``docs/<path>.md`` for cross-references from docstrings."""
    autorefs = config.plugins.get("autorefs")
    if autorefs is not None and page.toc.items:
        autorefs.register_anchor(page, f"docs/{page.file.src_uri}", anchor=page.toc.items[0].id, primary=True)
    if autorefs is not None:  # the home page's reference list, for citations in docstrings
        for anchor in re.findall(r'<span id="(ref-[\w-]+)"></span>', html):
            autorefs.register_anchor(page, anchor, anchor=anchor, primary=True)
    return html


# ------------------------------------------------------------------------------ CLI page


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """The subcommand parsers of ``parser``, by name, in the order they were added."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _option_line(action: argparse.Action) -> str:
    if action.option_strings:
        flags = ", ".join(action.option_strings)
        if action.nargs == 0:
            name = f"`{flags}`"
        else:
            metavar = action.metavar or (
                "{" + ",".join(map(str, action.choices)) + "}" if action.choices else action.dest.upper()
            )
            more = " ..." if action.nargs in ("+", "*") else ""
            name = f"`{flags} {metavar}{more}`"
    else:
        name = f"`{action.metavar or action.dest}`"
    help_text = (action.help or "").replace("%(default)s", str(action.default)).replace("%%", "%")
    facts = []
    if action.choices and action.option_strings and action.metavar:
        facts.append("one of " + ", ".join(f"`{c}`" for c in action.choices))
    if action.option_strings and action.nargs != 0 and action.default not in (None, argparse.SUPPRESS) \
            and "default" not in help_text:
        default = " ".join(map(str, action.default)) if isinstance(action.default, (list, tuple)) else action.default
        facts.append(f"default `{default}`")
    tail = f" ({'; '.join(facts)})" if facts else ""
    return f"- {name}: {help_text}{tail}".rstrip(": ")


def cli_page() -> str:
    """The Markdown of the command-line reference."""
    columns = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "92"  # argparse wraps the usage lines to the page's code column
    try:
        return _cli_page()
    finally:
        if columns is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = columns


def _cli_page() -> str:
    from treecompile.cli.main import build_parser

    parser = build_parser()
    out = [
        "# Command line",
        "",
        "Installing treecompile (`pip install .` in a checkout) adds the `treecompile` command. This page is generated from its",
        "argparse definitions (`treecompile/cli/main.py` and the modules it registers) when the site is built,",
        "so it lists exactly the options the installed version takes. Every command also answers `--help`.",
        "Errors in the input print one line and exit with status 2.",
        "",
        "```bash",
        "treecompile stats sample:tau_bench --tokenizer sample   # overlap (POR) of the bundled tau-bench trials",
        "treecompile plan sample:gsm8k --capacity 2048 --ranks 2 # parts and ranks under a token budget",
        "treecompile inspect config.json --png mask.png           # what the passes do to one model (a HF config)",
        "treecompile bench --quick                               # tree against per-path training",
        "```",
        "",
        "| command | what it does |",
        "|---|---|",
    ]
    subs = subcommands(parser)
    helps = {a.dest: a.help for a in parser._subparsers._group_actions[0]._choices_actions} if parser._subparsers else {}
    for name in subs:
        out.append(f"| [`treecompile {name}`](#treecompile-{name}) | {helps.get(name, '')} |")
    out.append("")
    for name, sub in subs.items():
        out += [f"## `treecompile {name}` {{#treecompile-{name}}}", ""]
        if sub.description:
            out += [sub.description, ""]
        usage = sub.format_usage().strip().removeprefix("usage: ").split("\n")
        usage = [usage[0]] + [line[len("usage: "):] if line.startswith(" " * 7) else line for line in usage[1:]]
        out += ["```text", *usage, "```", ""]
        positionals = [a for a in sub._actions if not a.option_strings]
        options = [a for a in sub._actions if a.option_strings and not isinstance(a, argparse._HelpAction)]
        if positionals:
            out += ["Arguments:", ""] + [_option_line(a) for a in positionals] + [""]
        if options:
            out += ["Options:", ""] + [_option_line(a) for a in options] + [""]
    return "\n".join(out) + "\n"

