"""Writes the row rules' table into passes/README.md (between the ``row-rules`` markers).

    python scripts/row_rules_table.py

The table comes from ``treecompile.passes.rows.RULES`` and ``FAMILIES``;
tests/test_row_rules.py checks that the page holds the current one.
"""

from __future__ import annotations

from pathlib import Path

from treecompile.passes.rows import rule_table

README = Path(__file__).resolve().parents[1] / "passes" / "README.md"
START, END = "<!-- row-rules -->\n", "<!-- /row-rules -->"


def main() -> None:
    text = README.read_text()
    head, _, rest = text.partition(START)
    _, _, tail = rest.partition(END)
    README.write_text(head + START + rule_table() + END + tail)
    print(f"wrote the row rules into {README}")


if __name__ == "__main__":
    main()
