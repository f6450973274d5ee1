"""The ``treecompile`` command line.

Example::

    treecompile stats sample:tau_bench --tokenizer sample
    treecompile stats trajectories.json --samples assistant_turns --json

Each subcommand is a module of this package with two functions, ``add_command(subparsers)``
(its arguments) and ``run(args) -> int`` (the work), named in :data:`COMMANDS`. Errors in the
input (:class:`TreeInputError`, a bad option, a missing optional package) print one line
and exit with status 2, not a traceback; Ctrl-C prints ``treecompile CMD: interrupted`` and exits
with status 130. Result files are written whole or not at all (`treecompile.data.io.write_json`).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from treecompile.core.errors import TreeInputError
from treecompile.core.interrupt import interrupts_kept

__all__ = ["COMMANDS", "build_parser", "main"]

class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line: ``treecompile CMD: error: ...``, status 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


#: The subcommands, in ``--help`` order: each a module of this package with ``add_command(sub)``
#: (its arguments, ``func=run``) and ``run(args) -> int`` (the work).
COMMANDS = ("stats", "plan", "inspect_cmd", "bench", "tune")


def build_parser() -> argparse.ArgumentParser:
    from treecompile.core.version import __version__

    parser = _Parser(
        prog="treecompile", description="Exact language-model training on prefix trees of trajectories."
    )
    parser.add_argument("--version", action="version", version=f"treecompile {__version__}")
    # Each command's arguments are checked while parsing, before it imports torch: a bad value
    # costs no start-up time.
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in COMMANDS:
        importlib.import_module(f"treecompile.cli.{name}").add_command(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line; returns the exit status (0 ok, 2 bad input, 130 interrupted)."""
    command = "treecompile"
    try:
        args = build_parser().parse_args(argv)
        command = f"treecompile {args.command}"
        with interrupts_kept():
            return args.func(args)
    except (TreeInputError, ValueError, ImportError, OSError) as exc:
        print(f"{command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: one line, the shell's status for SIGINT, no traceback
        print(f"\n{command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
