"""``python -m treecompile.cli``."""

from treecompile.cli.main import main

raise SystemExit(main())
