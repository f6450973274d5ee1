"""A griffe extension for the API pages: reads the reStructuredText habits of the docstrings
(Sphinx roles, ``::`` literal blocks, ``Example:`` sections of ``>>>`` lines) as Markdown.

The docstrings stay as they are in the source (they read well in ``help()``); mkdocstrings
sees them rewritten:

* ``:class:`~treecompile.TreeBatch```, ``:func:`pack``` and the other roles become
  cross-references, resolved in the docstring's own scope; a name that is not on any page is
  shown as code rather than as a broken link (an *optional* autorefs reference);
* a single-backticked name that resolves to a treecompile object becomes such a link too;
* ``Text::`` followed by an indented block becomes ``Text:`` and a fenced code block
  (``bash`` for ``treecompile ...`` commands, ``python`` for code that parses, else ``text``);
* an ``Example:`` section of ``>>>`` lines becomes an ``Examples:`` section, which griffe
  renders as code;
* methods of an ``nn.Module`` subclass without a docstring (the forwarded ``parameters``,
  ``state_dict``, ...) are left out of the page;
* an ``Attributes:`` entry becomes its attribute's docstring (and a constructor argument's text
  that of the attribute it sets), Sphinx ``#:`` comments document constants, and a constant
  built from a literal shows its value;
* ``docs/NAME.md`` and the papers' short names link to their page and reference;
* ``treecompile.kernels`` and ``treecompile.passes``, which live beside ``treecompile/``
  (pyproject's package-dir), are attached so that pages can document them.

mkdocs.yml loads it through the python handler's ``extensions`` option.
"""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path
from typing import Any

import griffe

ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|attr|data|exc|obj|const):`(~?)([^`<>]+?)`")
BACKTICK = re.compile(r"(?<![`\w])`([A-Za-z_][\w.]*)(\(\))?`(?![`\w])")
LITERAL_INTRO = re.compile(r"^(?P<indent>\s*)(?P<text>.*?)(?P<sp>\s?)::\s*$")
FENCE = re.compile(r"^\s*(```|~~~)")
DOCS_PAGE = re.compile(r"``?docs/([\w-]+)\.md``?")
MODULE_BASES = {"nn.Module", "torch.nn.Module", "Module", "torch.nn.modules.module.Module"}


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def _language(block: list[str]) -> str:
    text = "\n".join(block)
    if all(line.lstrip().startswith(("treecompile ", "python ", "pip ", "bash ", "torchrun ", "#")) or not line.strip()
           for line in block):
        return "bash"
    try:
        ast.parse(text)
    except SyntaxError:
        return "text"
    return "python"


def _fence_literal_blocks(lines: list[str]) -> list[str]:
    """``Intro::`` + blank line + indented block -> ``Intro:`` + a fenced block at the intro's indent."""
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        m = LITERAL_INTRO.match(line)
        if m and not line.lstrip().startswith((">>>", "...")):
            # the literal block: the next non-blank lines indented deeper than the intro
            j = i + 1
            while j < len(lines) and not lines[j].strip():
                j += 1
            base = _indent(line)
            if j < len(lines) and _indent(lines[j]) > base:
                k = j
                block: list[str] = []
                while k < len(lines) and (not lines[k].strip() or _indent(lines[k]) > base):
                    block.append(lines[k])
                    k += 1
                while block and not block[-1].strip():
                    block.pop()
                    k -= 1
                inner = min(_indent(b) for b in block if b.strip())
                body = [b[inner:] if b.strip() else "" for b in block]
                text = m.group("text")
                header = text.rstrip() + ":" if text.strip() else ""
                # "Example::" reads as a section title; "see this::" as the end of a sentence.
                pad = " " * m.group("indent").__len__()
                if header:
                    out.append(pad + header)
                    out.append("")
                lang = _language(body)
                # Inside a Google section title ("Example:") the block must be indented under it.
                sub = pad + ("    " if re.fullmatch(r"\s*Examples?:", pad + header) else "")
                out.append(sub + "```" + lang)
                out.extend(sub + b if b else "" for b in body)
                out.append(sub + "```")
                i = k
                continue
        out.append(line)
        i += 1
    return out


def _examples_sections(lines: list[str]) -> list[str]:
    """``Example:`` whose body starts with ``>>>`` -> ``Examples:`` (griffe's code section)."""
    out = list(lines)
    for n, line in enumerate(lines):
        if line.strip() == "Example:":
            nxt = next((x for x in lines[n + 1:] if x.strip()), "")
            if nxt.lstrip().startswith(">>>"):
                out[n] = line.replace("Example:", "Examples:")
    return out


class SphinxToMarkdown(griffe.Extension):
    """Rewrites every docstring of the loaded package (see the module docstring)."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        if pkg.name == "treecompile":
            _attach_mapped_subpackages(pkg)
        objects = list(_walk(pkg))
        for obj in objects:  # first every docstring, once, so that the texts moved below are Markdown
            if obj.is_attribute and obj.docstring is None:
                _comment_docstring(obj)
            if obj.docstring is not None:
                obj.docstring.value = self.rewrite(obj, obj.docstring.value)
        for obj in objects:
            if obj.is_class:
                _attributes_to_members(obj)
                for name, member in list(obj.members.items()):
                    if member.is_alias or member.docstring is not None:
                        continue
                    if member.is_function and _is_module_subclass(obj):
                        del obj.members[name]
            if obj.is_attribute and obj.parent is not None and obj.parent.is_module:
                _show_value(obj)
            if obj.is_attribute and obj.parent is not None and obj.parent.is_class and str(obj.value) == obj.name:
                obj.value = None  # `self.mask = mask` says nothing

    def rewrite(self, obj: griffe.Object, text: str) -> str:
        lines = _examples_sections(_fence_literal_blocks(text.split("\n")))
        out = []
        in_fence = False
        for line in lines:
            if FENCE.match(line):
                in_fence = not in_fence
                out.append(line)
                continue
            if in_fence or line.lstrip().startswith((">>>", "... ")):
                out.append(line)
                continue
            line = ROLE.sub(lambda m: self.ref(obj, m.group(2), short=bool(m.group(1)), required=True), line)
            line = BACKTICK.sub(lambda m: self.ref(obj, m.group(1), call=m.group(2) or "", required=False), line)
            line = DOCS_PAGE.sub(lambda m: _page_ref(m.group(1)), line)
            line = _cite(line)
            out.append(line)
        return "\n".join(out)

    def ref(self, obj: griffe.Object, name: str, *, short: bool = False, call: str = "", required: bool) -> str:
        name = name.strip()
        title = (name.rsplit(".", 1)[-1] if short else name) + call
        target = _resolve(obj, name)
        if target is None:
            return f"`{title}`"
        if not required and not target.startswith("treecompile"):
            return f"`{title}`"
        return f'<autoref identifier="{target}" optional><code>{title}</code></autoref>'


ITEM = re.compile(r"^    (\w+)(?: \(([^)]*)\))?:\s?(.*)$")


def _attributes_to_members(cls: griffe.Class) -> None:
    """Each entry of the class docstring's ``Attributes:`` section becomes the docstring of the
    attribute it names, so every attribute is documented once, under its own heading with its
    type; the section is dropped when all its names are members. An attribute that is also a
    constructor argument (``Args:``, in the class or ``__init__`` docstring) gets that text."""
    _args_to_members(cls)
    if cls.docstring is None:
        return
    lines = cls.docstring.value.split("\n")
    try:
        start = lines.index("Attributes:")
    except ValueError:
        return
    end = start + 1
    while end < len(lines) and (not lines[end].strip() or lines[end].startswith(" ")):
        end += 1
    items = _items(lines[start + 1:end])
    members = {n: m for n, m in cls.members.items() if not m.is_alias and m.is_attribute}
    if not items or not set(items) <= set(members):
        return
    for name, text in items.items():
        member = members[name]
        if member.docstring is None:
            body = " ".join(text).strip()
            member.docstring = griffe.Docstring(body[:1].upper() + body[1:], parent=member, lineno=member.lineno)
    cls.docstring.value = "\n".join(lines[:start] + lines[end:]).strip()


def _section_items(text: str, title: str) -> dict[str, str]:
    """``name: text`` entries of a Google-style section, continuation lines joined."""
    lines = text.split("\n")
    if title not in lines:
        return {}
    start = lines.index(title)
    end = start + 1
    while end < len(lines) and not (lines[end].strip() and not lines[end].startswith(" ")):
        end += 1
    return {k: " ".join(v).strip() for k, v in _items(lines[start + 1:end]).items()}


def _items(lines: list[str]) -> dict[str, list[str]]:
    """``name: text`` entries of a section's lines: each name with its text lines, stripped."""
    items: dict[str, list[str]] = {}
    current = None
    for line in lines:
        m = ITEM.match(line)
        if m:
            current = m.group(1)
            items[current] = [m.group(3)]
        elif current is not None and line.strip():
            items[current].append(line.strip())
    return items


def _args_to_members(cls: griffe.Class) -> None:
    args: dict[str, str] = {}
    init = cls.members.get("__init__")
    for doc in (cls.docstring, getattr(init, "docstring", None) if init is not None and not init.is_alias else None):
        if doc is not None:
            args.update(_section_items(doc.value, "Args:"))
    for name, text in args.items():
        member = cls.members.get(name)
        if member is not None and not member.is_alias and member.is_attribute and member.docstring is None and text:
            member.docstring = griffe.Docstring(text[:1].upper() + text[1:], parent=member, lineno=member.lineno)


def _comment_docstring(attr: griffe.Attribute) -> None:
    """Sphinx's ``#:`` comments above an attribute become its docstring."""
    try:
        lines = attr.parent.lines if attr.parent is not None else []
    except Exception:
        return
    n = (attr.lineno or 0) - 2  # the line above, 0-based
    comment: list[str] = []
    while 0 <= n < len(lines) and lines[n].strip().startswith("#:"):
        comment.insert(0, lines[n].strip()[2:].strip())
        n -= 1
    if comment:
        attr.docstring = griffe.Docstring("\n".join(comment), parent=attr, lineno=n + 2)


def _show_value(attr: griffe.Attribute) -> None:
    """A module constant built from another one (``MASKS = tuple(MASK_KINDS)``) shows its value.

    Evaluated statically, without importing the library: ``tuple``/``list``/``sorted`` of a
    literal, or of the keys of a dict display, and integer arithmetic (``2 << 30``).
    """
    value = attr.value
    if value is None or attr.docstring is None:
        return
    text = str(value)
    try:
        tree = ast.parse(text, mode="eval").body
    except SyntaxError:
        return
    shown = None
    if isinstance(tree, ast.BinOp):
        try:
            shown = repr(eval(compile(ast.Expression(tree), "<value>", "eval"), {"__builtins__": {}}))
        except Exception:
            return
    elif (isinstance(tree, ast.Call) and isinstance(tree.func, ast.Name) and tree.func.id in {"tuple", "list", "sorted"}
          and len(tree.args) == 1 and not tree.keywords and isinstance(tree.args[0], ast.Name)):
        items = _literal_items(attr, tree.args[0].id)
        if items is not None:
            shown = repr(tuple(items) if tree.func.id == "tuple" else sorted(items) if tree.func.id == "sorted" else list(items))
    if shown is not None and len(shown) <= 200:
        attr.value = shown


def _literal_items(scope: griffe.Object, name: str) -> list | None:
    """The elements of the literal tuple/list/set named ``name``, or the keys of its dict display.

    The defining module's source is read with ``ast`` (found with ``importlib.util.find_spec``,
    which imports no torch), as the ``treecompile.kernels`` and ``treecompile.passes`` packages
    live outside the ``treecompile/`` folder that griffe scans.
    """
    try:
        target = _canonical(scope, scope.parent.resolve(name))
        module, _, attr = target.rpartition(".")
        spec = importlib.util.find_spec(module)
        source = Path(spec.origin).read_text(encoding="utf-8")
        for node in ast.parse(source).body:
            targets = [node.target] if isinstance(node, ast.AnnAssign) else getattr(node, "targets", [])
            if any(isinstance(t, ast.Name) and t.id == attr for t in targets) and node.value is not None:
                if isinstance(node.value, ast.Dict):
                    return [ast.literal_eval(k) for k in node.value.keys]
                return list(ast.literal_eval(node.value))
    except Exception:
        return None
    return None


PAPERS = {"Tree Training": "ref-tree-training", "AReaL-DTA": "ref-areal-dta", "Prompt Trees": "ref-prompt-trees"}
CITE = re.compile("|".join(re.escape(p) for p in PAPERS))


def _cite(line: str) -> str:
    """A paper named outside code links to the home page's reference list."""
    out, last = [], 0
    for m in CITE.finditer(line):
        if line[:m.start()].count("`") % 2:
            continue
        out.append(line[last:m.start()])
        out.append(f'<autoref identifier="{PAPERS[m.group(0)]}" optional>{m.group(0)}</autoref>')
        last = m.end()
    return "".join(out) + line[last:]


def _page_ref(name: str) -> str:
    """``docs/NAME.md`` in a docstring: a link to that page (``scripts/docs_hooks.py`` registers
    each page under that identifier)."""
    return f'<autoref identifier="docs/{name}.md" optional><code>docs/{name}.md</code></autoref>'


ROOT = Path(__file__).resolve().parents[1]
# pyproject.toml's package-dir: these subpackages of treecompile live beside treecompile/, not in it.
MAPPED_SUBPACKAGES = {"kernels": ROOT / "kernels", "passes": ROOT / "passes"}


def _attach_mapped_subpackages(pkg: griffe.Module) -> None:
    """``treecompile.kernels`` and ``treecompile.passes``, loaded from their folders, so that API
    pages and cross-references can name them."""
    for name, folder in MAPPED_SUBPACKAGES.items():
        if name in pkg.members or not (folder / "__init__.py").is_file():
            continue
        try:
            sub = griffe.load(name, search_paths=[str(folder.parent)], docstring_parser="google",
                              resolve_aliases=False)
        except Exception:  # noqa: BLE001 - a folder griffe cannot read is simply not documented
            continue
        pkg.set_member(name, sub)


def _walk(obj: griffe.Object):
    yield obj
    for member in obj.members.values():
        if member.is_alias:
            continue
        yield from _walk(member)


def _is_module_subclass(cls: griffe.Class) -> bool:
    return any(str(base) in MODULE_BASES for base in cls.bases)


def _resolve(obj: griffe.Object, name: str) -> str | None:
    """The canonical path of ``name`` as written in ``obj``'s docstring, or None."""
    first, _, rest = name.partition(".")
    root = obj
    while root.parent is not None:
        root = root.parent
    if first == root.name:
        return _canonical(obj, name)
    scope = obj
    path = None
    while scope is not None and path is None:
        try:
            path = scope.resolve(first)
        except Exception:  # griffe.NameResolutionError and friends: try the enclosing scope
            scope = scope.parent
    if path is None:
        return None
    path = f"{path}.{rest}" if rest else path
    return _canonical(obj, path)


def _canonical(obj: griffe.Object, path: str) -> str:
    """Follows aliases (``treecompile.TreeBatch`` -> ``treecompile.core.batch.TreeBatch``)."""
    root = obj
    while root.parent is not None:
        root = root.parent
    if not path.startswith(root.path):
        return path
    try:
        found = root[path[len(root.path) + 1:]] if path != root.path else root
    except Exception:
        return path
    for _ in range(5):
        if not found.is_alias:
            break
        try:
            found = found.final_target
        except Exception:
            return found.target_path
    return found.path
