"""``python -m treecompile``: the command line (``treecompile --help``)."""

from treecompile.cli.main import main

raise SystemExit(main())
