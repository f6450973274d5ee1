"""Exceptions raised by treecompile."""

__all__ = ["TreeInputError", "UnsupportedModelError"]


class TreeInputError(ValueError):
    """Input data (sequences, masks, weights, trees, batches) that cannot be trained on exactly."""


class UnsupportedModelError(RuntimeError):
    """A model contains an operation that treecompile cannot make exact on a tree."""
