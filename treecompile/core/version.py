"""treecompile's version (pyproject.toml's ``version``; a test keeps the two equal)."""

__version__ = "0.1.0"
