"""Warnings about batches that train exactly but not well: paths past the model's position
range, and overlap too low for the tree to pay off.

Example:
    >>> from treecompile import TrajectoryTree
    >>> tree = TrajectoryTree.from_sequences([[1, 2, 3, 4], [1, 5, 6, 7]])
    >>> round(tree.stats().por, 3)
    0.125
    >>> print(low_por_advice(tree.stats().por))  # doctest: +ELLIPSIS
    POR 0.125 is low: ... per-path training with sequence packing may be as fast or faster; ...
    >>> print(position_overflow([tree], max_positions=3))  # doctest: +ELLIPSIS
    the longest path has 4 tokens (tree 0, path 0), more than the model's max_position_embeddings = 3; ...

Each check has a pure function that returns the message (or None) and a ``warn_*`` wrapper
that raises it as a :class:`TreeWarning` through :mod:`warnings`, so callers can filter or
escalate it. Neither changes the batch or the result: the gradients stay exact either way.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Any

from treecompile.core.errors import TreeWarning  # beside the errors: building a tree warns too

__all__ = [
    "MEASURED_SPEEDUP",
    "TreeWarning",
    "low_por_advice",
    "measured_speedup",
    "position_overflow",
    "warn_low_por",
    "warn_low_por_value",
    "warn_position_overflow",
    "warn_untrained",
]


#: ``(POR, speedup of the tree over per-path packing)``, interval mask, from the CPU table of
#: ``docs/benchmarks.md`` (``treecompile bench --quick``: Qwen3-shaped, 2 layers, hidden 128,
#: 2,048 path tokens, 2 threads, 2026-11-29). GPU speedups are not measured yet.
MEASURED_SPEEDUP: tuple[tuple[float, float], ...] = (
    (0.000, 1.03),
    (0.198, 1.12),
    (0.498, 1.72),
    (0.798, 4.07),
    (0.923, 7.45),
)

# Below this measured speedup the tree is not faster than packing within the spread of the
# bench's repeats (the four methods at POR 0, which do the same work, measured 0.91x to 1.03x).
_NO_GAIN = 1.1


def measured_speedup(por: float) -> float:
    """The speedup over per-path packing at ``por``, linearly interpolated in :data:`MEASURED_SPEEDUP`."""
    if not 0.0 <= por <= 1.0:
        raise ValueError(f"POR must be in [0, 1], got {por}")
    pts = MEASURED_SPEEDUP
    if por >= pts[-1][0]:
        return pts[-1][1]
    for (p0, s0), (p1, s1) in zip(pts, pts[1:]):
        if p0 <= por <= p1:
            return s0 + (s1 - s0) * (por - p0) / (p1 - p0)
    return pts[0][1]


def low_por_advice(por: float) -> str | None:
    """A message if at ``por`` tree training measured no faster than per-path packing, else None."""
    speedup = measured_speedup(por)
    if speedup >= _NO_GAIN:
        return None
    below = [f"{s:.2f}x at POR {p:.2f}" for p, s in MEASURED_SPEEDUP if s < _NO_GAIN]
    return (
        f"POR {por:.3f} is low: tree training measured about {speedup:.2f}x the speed of per-path packing here "
        f"({', '.join(below)} in docs/benchmarks.md, CPU), so per-path training with sequence packing may be as "
        # Rounded up, so that a POR shown as low is never shown as the point it pays off from.
        f"fast or faster; the tree pays off above about POR {math.ceil(_break_even() * 1000) / 1000:.3f}"
    )


def _break_even() -> float:
    """The lowest POR from which the interpolated measured speedup stays at least ``_NO_GAIN``."""
    pts = MEASURED_SPEEDUP
    for i in range(len(pts) - 1, 0, -1):
        (p0, s0), (p1, s1) = pts[i - 1], pts[i]
        if s0 < _NO_GAIN <= s1:
            return p0 + (p1 - p0) * (_NO_GAIN - s0) / (s1 - s0)
    return pts[0][0]


def _path_lengths(data: Any) -> list[tuple[int, int, int]]:
    """``(length, tree, path)`` of every path of a TreeBatch or a sequence of trees."""
    from treecompile.core.path_sets import path_lengths

    if hasattr(data, "longest_path"):  # a TreeBatch: from its check, without reading the device
        length, tree = data.longest_path()
        return [(length, tree, -1)]
    out = []
    for t, tree in enumerate(data):
        lengths = path_lengths(tree)
        p = int(lengths.argmax())
        out.append((int(lengths[p]), t, p))
    return out


def position_overflow(data: Any, max_positions: int | None) -> str | None:
    """A message if a path is longer than ``max_positions`` tokens, else None.

    Args:
        data: a :class:`~treecompile.TreeBatch` or a sequence of trees.
        max_positions: the model's ``config.max_position_embeddings``; None checks nothing.
    """
    if max_positions is None:
        return None
    longest, tree, path = max(_path_lengths(data))
    if longest <= max_positions:
        return None
    where = f"tree {tree}, path {path}" if path >= 0 else f"tree {tree}"
    return (
        f"the longest path has {longest} tokens ({where}), more than the model's max_position_embeddings = "
        f"{max_positions}; positions past it were never trained (rotary embeddings extrapolate, learned "
        "position tables fail): truncate the paths or use a model with a longer context"
    )


def _max_positions(model: Any) -> int | None:
    config = getattr(model, "config", None)
    for source in (config, getattr(config, "text_config", None)):
        value = getattr(source, "max_position_embeddings", None)
        if isinstance(value, int):
            return value
    return None


def warn_position_overflow(data: Any, model: Any, *, stacklevel: int = 2) -> bool:
    """Warns (:class:`TreeWarning`) if a path of ``data`` is longer than ``model.config.max_position_embeddings``.

    Meant for the compiled model's call: cheap (one argmax over ``[S]`` positions). A model
    without that config field is not checked. Returns whether it warned.
    """
    message = position_overflow(data, _max_positions(model))
    if message is not None:
        warnings.warn(message, TreeWarning, stacklevel=stacklevel + 1)
    return message is not None


def warn_low_por(trees: Sequence[Any], *, stacklevel: int = 2) -> bool:
    """Warns (:class:`TreeWarning`) if the batch's POR is so low that per-path training may be
    faster (`treecompile.pack` does this for every batch it packs)."""
    path_tokens = tree_tokens = 0
    for tree in trees:
        s = tree.stats()
        path_tokens += s.path_tokens
        tree_tokens += s.tree_tokens
    return warn_low_por_value(1.0 - tree_tokens / path_tokens if path_tokens else 0.0, stacklevel=stacklevel + 1)


def warn_low_por_value(por: float, *, stacklevel: int = 2) -> bool:
    """Warns (:class:`TreeWarning`) if at ``por`` per-path training may be faster; whether it warned."""
    message = low_por_advice(por)
    if message is not None:
        warnings.warn(message, TreeWarning, stacklevel=stacklevel + 1)
    return message is not None


def warn_untrained(trees: Sequence[Any], per_tree: Sequence[Any]) -> None:
    """Warns once per batch (`TreeWarning`, at the caller of the function calling it) when trees train no token
    (a conversation without an assistant turn, masks that are all 0), naming them: they add
    nothing to the loss, which is what per-path training gives too, but rarely what was meant.
    A tree marked ``metadata["padding"]`` (a data loader's empty micro-step) is meant so."""
    idle = [i for i, c in enumerate(per_tree) if (not c.size or int(c.sum()) == 0)
            and not (isinstance(trees[i].metadata, dict) and trees[i].metadata.get("padding"))]
    if not idle:
        return

    def name(i: int) -> str:
        meta = trees[i].metadata if isinstance(trees[i].metadata, dict) else {}
        label = next((f"{k}={meta[k]!r}" for k in ("id", "name", "group", "record", "source", "task_id") if k in meta),
                     "")
        return f"#{i}" + (f" ({label})" if label else "")

    shown = ", ".join(name(i) for i in idle[:5]) + (f" and {len(idle) - 5} more" if len(idle) > 5 else "")
    whole = " (the whole batch: its loss is 0 and no gradient flows)" if len(idle) == len(trees) else ""
    warnings.warn(f"treecompile: {len(idle)} tree(s) of the batch train no token: {shown}{whole}. A conversation "
                  "without an assistant turn, or loss masks that are all 0, give such a tree.", TreeWarning,
                  stacklevel=3)
