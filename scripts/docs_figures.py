"""The diagrams of the docs site, drawn from the library itself so they stay true.

    python scripts/docs_figures.py OUTDIR         # writes the SVGs; the docs build calls make_figures()
    python scripts/docs_figures.py --png OUTDIR   # PNGs, to look at

* ``tree-row-mask.svg``: three sequences -> their prefix tree (`TrajectoryTree.from_sequences`)
  -> the packed depth-first row (`pack`: tokens and position ids) -> the attention mask of that
  row (`treecompile.compile.inspection.mask_matrix`), with axes and a legend;
* ``partition.svg``: a tree split into parts under a token capacity (`partition_tree`), the
  nodes each part computes and the duplicated ones;
* ``sharding.svg``: the paths of a small forest split across 2 ranks (`shard_paths`), in
  contiguous depth-first groups and greedily by token count, with the tokens both ranks compute;
* ``speedup.svg``: the measured speedups over per-path packing against POR, read from the
  tables of ``docs/benchmarks.md`` (no number is typed here), with the bound ``1 / (1 - POR)``.

matplotlib's object API on SVG canvases, text kept as text, no dates in the files: the output
is the same on every run.
"""

from __future__ import annotations

import io
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import matplotlib  # noqa: E402
from matplotlib.backends.backend_svg import FigureCanvasSVG  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.patches import FancyBboxPatch, Patch  # noqa: E402

# One colour per node (or part), colour-blind safe (Okabe-Ito), and the mask colours of treecompile.cli.plots.
PALETTE = ["#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#F0E442", "#000000"]
VISIBLE, HIDDEN = "#264696", "#f4f4f4"
SEQUENCES = [[1, 2, 3, 4, 5], [1, 2, 3, 6, 7], [1, 2, 8]]  # the example of the home page and Concepts
PARTITIONED = [[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 6, 7], [1, 8, 9]]  # treecompile.planning.partition's example
SHARDED = [[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 6], [1, 7, 8, 9], [10, 11, 12], [10, 11, 13]]
BENCHMARKS = ROOT / "docs" / "benchmarks.md"


def _figure(w: float, h: float) -> Figure:
    fig = Figure(figsize=(w, h), layout="constrained")
    FigureCanvasSVG(fig)
    return fig


def _svg(fig: Figure) -> bytes:
    buf = io.BytesIO()
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "treecompile"}):
        fig.savefig(buf, format="svg", metadata={"Date": None, "Creator": "scripts/docs_figures.py"})
    return buf.getvalue()


def _layout(tree) -> dict[int, tuple[float, float]]:
    """(x, depth) of each node: leaves spread in depth-first order, parents centred above."""
    children: dict[int, list[int]] = {v: [] for v in range(tree.num_nodes)}
    for v, p in enumerate(tree.parent.tolist()):
        if p >= 0:
            children[p].append(v)
    pos: dict[int, tuple[float, float]] = {}
    next_x = [0.0]

    def place(v: int, depth: int) -> float:
        if not children[v]:
            x = next_x[0]
            next_x[0] += 1.0
        else:
            xs = [place(c, depth + 1) for c in children[v]]
            x = sum(xs) / len(xs)
        pos[v] = (x, depth)
        return x

    for v in range(tree.num_nodes):
        if tree.parent[v] < 0:
            place(v, 0)
    return pos


def _draw_tree(ax, tree, colours, *, hatched=(), labels=None) -> None:
    pos = _layout(tree)
    for v, p in enumerate(tree.parent.tolist()):
        if p >= 0:
            (x0, y0), (x1, y1) = pos[p], pos[v]
            ax.plot([x0, x1], [-y0, -y1], color="#888888", lw=1.2, zorder=1)
    for v, (x, y) in pos.items():
        text = " ".join(str(t) for t in tree.node_tokens(v).tolist())
        w = 0.11 * len(text) + 0.32
        box = FancyBboxPatch((x - w / 2, -y - 0.2), w, 0.4, boxstyle="round,pad=0.02,rounding_size=0.08",
                             facecolor=colours[v], edgecolor="#333333", lw=1.0, zorder=2,
                             hatch="///" if v in hatched else None)
        ax.add_patch(box)
        ax.text(x, -y, text, ha="center", va="center", fontsize=10, color="white", fontweight="bold", zorder=3)
        if labels is not None:
            ax.text(x + w / 2 + 0.06, -y, labels[v], ha="left", va="center", fontsize=8, color="#444444")
    xs = [x for x, _ in pos.values()]
    depth = max(y for _, y in pos.values())
    ax.set_xlim(min(xs) - 0.9, max(xs) + 0.9)
    ax.set_ylim(-depth - 0.5, 0.5)
    ax.set_axis_off()


def tree_row_mask() -> Figure:
    """Sequences -> tree -> packed row -> mask."""
    from treecompile import TrajectoryTree, pack
    from treecompile.compile.inspection import mask_matrix

    tree = TrajectoryTree.from_sequences(SEQUENCES)
    batch = pack(tree)
    colours = [PALETTE[v % len(PALETTE)] for v in range(tree.num_nodes)]
    node_of = []
    for v, (a, b) in enumerate(zip(batch.node_start.tolist(), batch.node_end.tolist())):
        node_of += [v] * (b - a)
    ids, pos = batch.input_ids.tolist(), batch.position_ids.tolist()
    s = len(ids)

    fig = _figure(11.0, 4.6)
    grid = fig.add_gridspec(2, 2, width_ratios=[1.25, 1.0], height_ratios=[1.35, 1.0])
    ax_tree = fig.add_subplot(grid[0, 0])
    ax_row = fig.add_subplot(grid[1, 0])
    ax_mask = fig.add_subplot(grid[:, 1])

    seqs = "   ".join("[" + " ".join(map(str, q)) + "]" for q in SEQUENCES)
    ax_tree.set_title(f"1. sequences {seqs} -> prefix tree ({tree.num_nodes} nodes)", fontsize=10, loc="left")
    _draw_tree(ax_tree, tree, colours)

    ax_row.set_title(f"2. packed depth-first: {s} rows instead of {tree.stats().path_tokens} path tokens",
                     fontsize=10, loc="left")
    for i in range(s):
        ax_row.add_patch(FancyBboxPatch((i + 0.06, 0.06), 0.88, 0.88, boxstyle="round,pad=0,rounding_size=0.08",
                                        facecolor=colours[node_of[i]], edgecolor="#333333"))
        ax_row.text(i + 0.5, 0.5, str(ids[i]), ha="center", va="center", color="white", fontsize=11,
                    fontweight="bold")
        ax_row.text(i + 0.5, -0.35, str(pos[i]), ha="center", va="center", fontsize=10)
        ax_row.text(i + 0.5, 1.3, str(i), ha="center", va="center", fontsize=9, color="#666666")
    ax_row.text(-0.15, 0.5, "token", ha="right", va="center", fontsize=9)
    ax_row.text(-0.15, -0.35, "position_ids", ha="right", va="center", fontsize=9)
    ax_row.text(-0.15, 1.3, "row", ha="right", va="center", fontsize=9, color="#666666")
    ax_row.set_xlim(-2.2, s + 0.2)
    ax_row.set_ylim(-0.8, 1.7)
    ax_row.set_aspect("equal")
    ax_row.set_axis_off()

    m = mask_matrix(batch, "interval").to(dtype=int).numpy()
    from matplotlib.colors import ListedColormap

    ax_mask.imshow(m, cmap=ListedColormap([HIDDEN, VISIBLE]), vmin=0, vmax=1, interpolation="nearest")
    for i in batch.node_start.tolist()[1:]:
        ax_mask.axhline(i - 0.5, color="#aaaaaa", lw=0.8)
        ax_mask.axvline(i - 0.5, color="#aaaaaa", lw=0.8)
    labels = [f"{r}:{t}" for r, t in zip(range(s), ids)]
    ax_mask.set_xticks(range(s), labels, fontsize=8, rotation=90)
    ax_mask.set_yticks(range(s), labels, fontsize=8)
    for tick, r in zip(ax_mask.get_xticklabels(), range(s)):
        tick.set_color(colours[node_of[r]])
    for tick, r in zip(ax_mask.get_yticklabels(), range(s)):
        tick.set_color(colours[node_of[r]])
    ax_mask.set_xlabel("key (row:token)")
    ax_mask.set_ylabel("query (row:token)")
    ax_mask.set_title("3. attention mask: a row sees its own root path", fontsize=10, loc="left")
    ax_mask.legend(handles=[Patch(facecolor=VISIBLE, label="query sees key (key on its root path)"),
                            Patch(facecolor=HIDDEN, edgecolor="#cccccc", label="masked"),
                            Patch(facecolor="white", edgecolor="#aaaaaa", label="node boundary")],
                   loc="upper center", bbox_to_anchor=(0.5, -0.2), fontsize=8, ncols=1, frameon=False)
    return fig


def partition() -> Figure:
    """A tree split into parts of at most C tokens: which nodes each part computes."""
    from treecompile import TrajectoryTree
    from treecompile.planning.partition import partition_tree

    tree = TrajectoryTree.from_sequences(PARTITIONED)
    capacity = 6
    part = partition_tree(tree, capacity=capacity)
    used: dict[int, list[int]] = {v: [] for v in range(tree.num_nodes)}
    for k, paths in enumerate(part.path_ids):
        nodes = set()
        for p in paths.tolist():
            nodes.update(int(v) for v in tree.path_nodes(p))
        for v in nodes:
            used[v].append(k)
    colours = [PALETTE[used[v][0]] if len(used[v]) == 1 else "#777777" for v in range(tree.num_nodes)]
    shared = {v for v in used if len(used[v]) > 1}
    labels = {v: "parts " + ", ".join(str(k + 1) for k in used[v]) if len(used[v]) > 1 else f"part {used[v][0] + 1}"
              for v in used}

    fig = _figure(9.0, 3.2)
    grid = fig.add_gridspec(1, 1 + len(part.parts), width_ratios=[1.6] + [1.0] * len(part.parts))
    ax = fig.add_subplot(grid[0, 0])
    ax.set_title(f"{tree.num_paths} paths, {tree.num_tokens} tree tokens; capacity C = {capacity}",
                 fontsize=10, loc="left")
    _draw_tree(ax, tree, colours, hatched=shared, labels=labels)
    for k, sub in enumerate(part.parts):
        a = fig.add_subplot(grid[0, 1 + k])
        a.set_title(f"part {k + 1}: {sub.num_tokens} tokens", fontsize=10, color=PALETTE[k])
        _draw_tree(a, sub, [PALETTE[k]] * sub.num_nodes)
    fig.suptitle(f"partition_tree(tree, capacity={capacity}): {part.duplicated_tokens} duplicated tokens "
                 f"(grey, hatched: computed in both parts)", fontsize=10)
    return fig


def sharding() -> Figure:
    """The paths of a forest split across 2 ranks: contiguous DFS groups against greedy by tokens."""
    from treecompile import TrajectoryTree
    from treecompile.distributed.shard import shard_paths

    tree = TrajectoryTree.from_sequences(SHARDED)
    ranks = 2
    fig = _figure(9.0, 3.2)
    axes = fig.subplots(1, 2)
    for ax, method, label in zip(axes, ("dfs", "greedy_tokens"), ("contiguous DFS groups",
                                                                    "longest path first")):
        s = shard_paths([tree], ranks=ranks, method=method)
        used: dict[int, set[int]] = {v: set() for v in range(tree.num_nodes)}
        for rank, shard in enumerate(s.shards):
            for _, paths in shard.pieces:
                for p in paths.tolist():
                    for v in tree.path_nodes(p):
                        used[int(v)].add(rank)
        colours = [PALETTE[min(used[v])] if len(used[v]) == 1 else "#777777" for v in range(tree.num_nodes)]
        _draw_tree(ax, tree, colours, hatched={v for v in used if len(used[v]) > 1})
        ax.set_title(f"shard_paths(..., method=\"{method}\"): {label}\n"
                     f"tokens per rank {s.rank_tokens}, {s.duplicated_tokens} computed twice", fontsize=10, loc="left")
    fig.legend(handles=[Patch(facecolor=PALETTE[0], label="rank 0"), Patch(facecolor=PALETTE[1], label="rank 1"),
                        Patch(facecolor="#777777", hatch="///", label="computed on both ranks")],
               loc="lower center", ncols=3, fontsize=9, frameon=False, bbox_to_anchor=(0.5, -0.02))
    fig.get_layout_engine().set(rect=(0, 0.08, 1, 0.92))
    return fig


def measured_speedups(text: str) -> list[dict]:
    """The rows of every measured table of ``docs/benchmarks.md`` that has POR, method and speedup
    columns, with the section they belong to."""
    rows, section, header = [], "", None
    for line in text.splitlines():
        if line.startswith("## "):
            section, header = line[3:].strip(), None
            continue
        if not line.startswith("|"):
            header = None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if header is None:
            header = cells
            continue
        if set("".join(cells)) <= set("-: "):
            continue
        if {"workload", "POR", "method", "speedup"} <= set(header):
            row = dict(zip(header, cells))
            m = re.fullmatch(r"~?\s*([\d.]+)x(?:\s*~)?", row["speedup"])  # "~" marks one within the spread
            if m:
                rows.append({"section": section, "workload": row["workload"], "por": float(row["POR"]),
                             "method": row["method"], "speedup": float(m.group(1))})
    return rows


def speedup() -> Figure:
    rows = measured_speedups(BENCHMARKS.read_text(encoding="utf-8"))
    if not rows:
        raise ValueError(f"no measured speedup table found in {BENCHMARKS}")
    sections = list(dict.fromkeys(r["section"] for r in rows))
    fig = _figure(5.2 * len(sections), 4.0)
    axes = fig.subplots(1, len(sections), sharey=True, squeeze=False)[0]
    top = max(r["speedup"] for r in rows)
    for ax, section in zip(axes, sections):
        mine = [r for r in rows if r["section"] == section and r["method"] != "packed"]
        xs = [i / 200 for i in range(0, 186)]
        ax.plot(xs, [1 / (1 - x) for x in xs], color="#999999", ls="--", lw=1.2, label="bound 1 / (1 - POR)")
        ax.axhline(1.0, color="#333333", lw=0.8)
        for k, method in enumerate(dict.fromkeys(r["method"] for r in mine)):
            synth = sorted((r["por"], r["speedup"]) for r in mine if r["method"] == method
                           and r["workload"].startswith("synthetic"))
            real = [(r["por"], r["speedup"]) for r in mine if r["method"] == method
                    and not r["workload"].startswith("synthetic")]
            c = PALETTE[k]
            if synth:
                ax.plot([p for p, _ in synth], [v for _, v in synth], "o-", color=c, lw=1.5, ms=5,
                        label=f"{method} (synthetic)")
            if real:
                ax.plot([p for p, _ in real], [v for _, v in real], "D", color=c, ms=7, mfc="white", mew=1.8,
                        label=f"{method} (tau-bench, GSM8K)")
        ax.set_title(section, fontsize=10)
        ax.set_xlabel("POR (share of path tokens the tree removes)")
        ax.set_xlim(0, 0.95)
        ax.set_ylim(0, min(top * 1.6, 14))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7.5, loc="upper left")
    axes[0].set_ylabel("speedup over per-path packing (x)")
    return fig


FIGURES = {"tree-row-mask": tree_row_mask, "partition": partition, "sharding": sharding, "speedup": speedup}


def make_figures(fmt: str = "svg") -> dict[str, bytes]:
    """Every diagram, by file name, as SVG (or ``fmt="png"`` to look at them in an image viewer)."""
    out = {}
    for name, draw in FIGURES.items():
        fig = draw()
        if fmt == "svg":
            out[f"{name}.svg"] = _svg(fig)
        else:
            buf = io.BytesIO()
            fig.savefig(buf, format=fmt, dpi=110)
            out[f"{name}.{fmt}"] = buf.getvalue()
    return out


def main(argv: list[str]) -> int:
    fmt = "png" if "--png" in argv else "svg"
    argv = [a for a in argv if a != "--png"]
    if len(argv) != 1:
        print("usage: python scripts/docs_figures.py [--png] OUTDIR", file=sys.stderr)
        return 2
    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    for name, data in make_figures(fmt).items():
        (out / name).write_bytes(data)
        print(out / name)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
