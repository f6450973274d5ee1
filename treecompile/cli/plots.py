"""Pictures for the CLI: the tree attention mask with axes and a legend, and the POR / depth /
branching distribution of a file's trees.

    treecompile inspect ./qwen3-tiny --png mask.png
    treecompile stats sample:tau_bench --plot stats.png

Drawn with matplotlib's object API on an Agg canvas (no pyplot, no global backend switch), so
it works without a display and leaves the caller's matplotlib state alone. matplotlib is the
``[plot]`` extra; without it these functions raise an ImportError that says so.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["mask_figure", "save_png", "stats_figure"]

# The colours of `treecompile.compile.maskview.png_bytes`, so both pictures read the same.
_VISIBLE = "#264696"
_HIDDEN = "#f4f4f4"
_NODE = "#aaaaaa"
_TREE = "#c82828"


def _figure(width_in: float, height_in: float) -> Any:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ImportError("pictures need matplotlib: pip install 'treecompile[plot]'") from exc
    fig = Figure(figsize=(width_in, height_in), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def save_png(fig: Any, path: str | Path) -> Path:
    """Writes ``fig`` as a PNG; returns the path."""
    path = Path(path).expanduser()
    fig.savefig(path, format="png")
    return path


def mask_figure(batch: Any, mask: str = "interval", cell: int = 12) -> Any:
    """The tree mask of ``batch`` as a labelled figure.

    Rows are queries (down), columns keys (across); a cell is filled where the query sees the
    key. Grey lines start nodes, red lines start trees; ticks show each row's node and its
    position on its own path. The legend names the colours and the rule.

    Args:
        batch: a packed :class:`~treecompile.TreeBatch` (``path_bits`` for ``"bitmask"``).
        mask: ``"interval"`` or ``"bitmask"``.
        cell: pixels per token (at least 1; the figure is at least 5 inches wide).
    """
    from matplotlib.colors import ListedColormap
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    from treecompile.compile.maskview import MASK_RULES, boundary_rows, mask_matrix

    if cell < 1:
        raise ValueError(f"PNG cell size must be at least 1 pixel, got {cell}")
    m = mask_matrix(batch, mask).to(dtype=int).numpy()
    s = m.shape[0]
    side = max(5.0, s * cell / 100 + 2.5)
    fig = _figure(side + 2.5, side)
    ax = fig.add_subplot()
    ax.imshow(m, cmap=ListedColormap([_HIDDEN, _VISIBLE]), vmin=0, vmax=1, interpolation="nearest")
    node_starts, tree_starts = boundary_rows(batch)
    for i in sorted(node_starts - tree_starts):
        ax.axhline(i - 0.5, color=_NODE, lw=0.8)
        ax.axvline(i - 0.5, color=_NODE, lw=0.8)
    for i in sorted(tree_starts):
        ax.axhline(i - 0.5, color=_TREE, lw=1.6)
        ax.axvline(i - 0.5, color=_TREE, lw=1.6)
    node_of = []
    for n, (a, b) in enumerate(zip(batch.node_start.tolist(), batch.node_end.tolist())):
        node_of += [n] * (b - a)
    pos = batch.position_ids.tolist()
    step = max(1, s // 40)  # at most about 40 labelled ticks per axis
    ticks = list(range(0, s, step))
    ax.set_xticks(ticks, [str(k) for k in ticks], fontsize=7)
    ax.set_yticks(ticks, [f"{q}  n{node_of[q]} p{pos[q]}" for q in ticks], fontsize=7)
    ax.xaxis.set_ticks_position("top")
    ax.xaxis.set_label_position("top")
    ax.set_xlabel("key row k (packed order)")
    ax.set_ylabel("query row q  (node n, position p on its path)")
    ax.set_title(f"tree mask ({mask}): {MASK_RULES[mask]}", fontsize=9, loc="left")
    ax.legend(
        handles=[
            Patch(facecolor=_VISIBLE, label="q sees k"),
            Patch(facecolor=_HIDDEN, edgecolor="#999999", label="hidden"),
            Line2D([], [], color=_NODE, lw=0.8, label="node starts"),
            Line2D([], [], color=_TREE, lw=1.6, label="tree starts"),
        ],
        loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=8, frameon=False,
    )
    return fig


def stats_figure(names: list[str], stats: list[Any], total: dict[str, Any], title: str = "") -> Any:
    """Histograms of the trees' POR, depth (tokens of the longest path) and largest branching.

    Args:
        names: tree names (the annotation names the tree of highest POR).
        stats: :class:`~treecompile.TreeStats` of each tree.
        total: the totals ``treecompile stats`` prints (``por``, ``n_trees``, ``n_paths``).
        title: a line above the charts (the file).
    """
    if not stats:
        raise ValueError("no trees to plot")
    pors = [s.por for s in stats]
    depths = [s.depth_tokens for s in stats]
    branching = [s.max_branching for s in stats]
    fig = _figure(12, 3.8)
    axes = fig.subplots(1, 3)
    bins = min(30, max(5, len(stats) // 2))

    ax = axes[0]
    ax.hist(pors, bins=bins, range=(0, 1), color=_VISIBLE, edgecolor="white")
    ax.axvline(total["por"], color=_TREE, lw=1.5, label=f"total POR {total['por']:.3f}")
    ax.set_xlabel("POR = 1 - tree tokens / path tokens")
    ax.set_ylabel("trees")
    ax.set_title("prefix overlap per tree")
    best = max(range(len(pors)), key=pors.__getitem__)
    ax.legend(title=f"highest: {names[best]} ({pors[best]:.3f})", fontsize=8, title_fontsize=8)

    ax = axes[1]
    ax.hist(depths, bins=bins, color=_VISIBLE, edgecolor="white")
    ax.set_xlabel("depth: tokens of the longest path")
    ax.set_ylabel("trees")
    ax.set_title("depth per tree")

    ax = axes[2]
    lo, hi = min(branching), max(branching)
    ax.hist(branching, bins=[b - 0.5 for b in range(lo, hi + 2)], color=_VISIBLE, edgecolor="white")
    ax.set_xlabel("largest number of children of a node")
    ax.set_ylabel("trees")
    ax.set_title("branching per tree")
    ax.xaxis.get_major_locator().set_params(integer=True)
    for ax in axes:
        ax.yaxis.get_major_locator().set_params(integer=True)

    fig.suptitle(
        f"{title}  ({total['n_trees']} trees, {total['n_paths']} paths)" if title else
        f"{total['n_trees']} trees, {total['n_paths']} paths",
        fontsize=10,
    )
    return fig
