"""The ``treecompile`` command: one module per subcommand family and their shared parts.

`main` (the parser and the subcommands), `args` and `inputs` (options and inputs every
subcommand shares), `inspect_cmd` (``treecompile inspect``), `plan` (``treecompile
plan``), `plots` (``--plot`` / ``--png``), `demo` (``scripts/demo.sh``).

Layer 12: imports the layers below it.
"""


def main(argv=None) -> int:
    """``treecompile``'s entry point (`treecompile.cli.main.main`)."""
    from treecompile.cli.main import main as run

    return run(argv)
