"""Partial attention blocks of real trees under different serialization layouts.

    python benchmarks/block_layout.py              # text tables
    python benchmarks/block_layout.py --markdown   # the same as Markdown (docs/benchmarks.md)
    python benchmarks/block_layout.py --full       # also every layout's counts, one line each

FlexAttention splits the S x S tree mask into (query block, key block) pairs of
``block_size`` rows and classifies each as empty (skipped), full (no mask evaluated) or
partial (``mask_mod`` evaluated on every pair, masked pairs computed and thrown away).
For each workload and layout this script packs the trees as `treecompile.pack` does and
reports, per block size (128, and 64 for comparison):

* ``live``: non-empty block pairs in the causal lower triangle (full + partial), the
  attention work in units of ``block_size^2`` pairs;
* ``partial``: how many of them are partial, their share, and how many of those are
  off the diagonal (a diagonal block is partial under any layout: ``k <= q``);
* ``masked``: pairs computed inside partial blocks that no real row needs (masked pairs,
  and pairs that involve padding rows), in units of block pairs.

Blocks are classified here from per-block counts of visible pairs (full iff all
``block_size^2`` pairs are visible), independently of `treecompile.kernels.attention.blockmask`; the tests
check that both agree.

Layouts (the tree content, every path's tokens, weight and loss mask, and so the loss, are
the same under each):

* ``insertion``: children in first-insertion order (``from_sequences(child_order="insertion")``);
* ``largest-first``: every node's children sorted by subtree size in tokens, descending
  (stable), as `TrajectoryTree.from_sequences` builds by default; ``smallest-first``: the
  children, and a tree's roots, ascending;
* ``align-trees`` / ``align-subtrees`` / ``align-nodes``: the insertion order with padding
  rows inserted so that every tree start / every subtree boundary (a tree start or a child
  that is not the first) / every node start falls on a block boundary. A padding row has
  target weight 0, no real row sees it (its ``subtree_end`` is itself + 1), and as a query
  it sees what the row before it sees, so every real row's outputs are unchanged. The
  inserted rows are reported as ``+pad``.

Workloads: real trees from ``../shared/data`` (tau-bench: one tree per task of each file;
tau2: one per task; Tree-of-Thoughts game of 24: one search tree per problem; ToT text
CoT: one tree of 10 samples per prompt; GSM8K: one tree of 4 solutions per question) built
with the loaders and options ``treecompile stats`` uses (tokenizer cl100k, or the bundled
sample tokenizer when tiktoken is missing), and synthetic trees from
`treecompile.bench.trees.synthetic_tree`. Each workload is measured three ways: every tree in
its own row (summed over trees), and trees packed in file order into rows of at most
16k and 32k tokens (a tree larger than the row gets a row of its own).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from treecompile.core.batch import TreeBatch, pack
from treecompile.core.tree import TrajectoryTree

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
BLOCK_SIZES = (128, 64)
ROW_TOKENS = (16384, 32768)

# ---------------------------------------------------------------------------- layouts: child order


def subtree_tokens(tree: TrajectoryTree) -> np.ndarray:
    """``[N]`` tokens in each node's subtree (preorder: its subtree is nodes ``[n, subtree_end_node[n])``)."""
    offs = tree.node_offsets
    return offs[tree.subtree_end_node] - offs[:-1]


def reorder_children(tree: TrajectoryTree, key: Callable[[int], float]) -> TrajectoryTree:
    """The same tree with every node's children, and the roots, sorted by ``key(node)`` (stable).

    Nodes are renumbered in the new preorder; each path keeps its index, tokens, weight and
    loss mask (node masks move with their nodes, mask exceptions are renumbered).
    """
    n = tree.num_nodes
    children: list[list[int]] = [[] for _ in range(n)]
    roots: list[int] = []
    for v in range(n):
        p = int(tree.parent[v])
        (children[p] if p >= 0 else roots).append(v)
    order: list[int] = []
    stack = sorted(roots, key=key)[::-1]
    while stack:
        v = stack.pop()
        order.append(v)
        stack.extend(sorted(children[v], key=key)[::-1])
    new_id = np.empty(n, dtype=np.int64)
    new_id[order] = np.arange(n)
    spans = [slice(int(tree.node_offsets[v]), int(tree.node_offsets[v + 1])) for v in order]
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum([s.stop - s.start for s in spans], out=offsets[1:])
    old_parent = tree.parent[order]
    return TrajectoryTree(
        tokens=np.concatenate([tree.tokens[s] for s in spans]),
        node_offsets=offsets,
        parent=np.where(old_parent >= 0, new_id[np.maximum(old_parent, 0)], -1),
        path_node=new_id[tree.path_node],
        path_weight=tree.path_weight.copy(),
        node_mask=np.concatenate([tree.node_mask[s] for s in spans]),
        mask_exceptions={(p, int(new_id[v])): m.copy() for (p, v), m in tree.mask_exceptions.items()},
        metadata=tree.metadata,
    )


def largest_first(tree: TrajectoryTree) -> TrajectoryTree:
    """Children sorted by subtree size in tokens, largest first: what `TrajectoryTree.from_sequences`
    builds by default (roots keep their order)."""
    return rebuilt(tree, "largest_first")


def smallest_first(tree: TrajectoryTree) -> TrajectoryTree:
    """Children sorted by subtree size in tokens, smallest first."""
    size = subtree_tokens(tree)
    return reorder_children(tree, lambda v: int(size[v]))


# ---------------------------------------------------------------------------- layouts: alignment


def boundaries(batch: TreeBatch, what: str) -> np.ndarray:
    """Rows to align to a block boundary: starts of ``"trees"``, ``"subtrees"`` or ``"nodes"``.

    A subtree boundary is a row where some earlier row's visibility ends: a tree start or
    the first row of a child that is not its parent's first (the rows ``subtree_end`` takes).
    """
    s = batch.num_tokens
    if what == "trees":
        rows = batch.tree_offsets[:-1].numpy()
    elif what == "subtrees":
        rows = np.union1d(batch.subtree_end.numpy(), batch.tree_offsets[:-1].numpy())
    elif what == "nodes":
        rows = batch.node_start.numpy()
    else:
        raise ValueError(f"unknown alignment {what!r}; expected trees, subtrees or nodes")
    return np.unique(rows[(rows > 0) & (rows < s)])


def aligned_subtree_end(subtree_end: np.ndarray, starts: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """``subtree_end`` with padding rows inserted so that each row in ``starts`` begins a block.

    Args:
        subtree_end: ``[S]`` int64 of a packed row.
        starts: sorted rows in ``(0, S)`` to move to a multiple of ``block_size``.
        block_size: rows per block.

    Returns:
        ``(subtree_end', real)``: ``[S']`` int64 and ``[S']`` bool (False on padding rows).
        Real row ``r`` moves to ``r + (padding inserted at starts <= r)``. A real key's range
        ends at its old end's new row, so padding just before that end sees the key (as the
        row before the padding does); a padding key's range is itself only, so no real row
        sees it.
    """
    s = subtree_end.shape[0]
    pads = np.zeros(s + 1, dtype=np.int64)  # padding inserted right before each old row
    shift = 0
    for r in starts.tolist():
        p = -(r + shift) % block_size
        pads[r] = p
        shift += p
    new_row = np.arange(s + 1) + np.cumsum(pads)  # old row (or S) -> new row
    total = s + shift
    out = np.arange(1, total + 1, dtype=np.int64)  # padding: sees only itself
    real = np.zeros(total, dtype=bool)
    real[new_row[:-1]] = True
    out[new_row[:-1]] = new_row[subtree_end]
    return out, real


# ---------------------------------------------------------------------------- counting


@dataclass
class BlockCounts:
    """Block classes of one packed row at one block size."""

    rows: int
    pad_rows: int
    live: int
    partial: int
    partial_diag: int
    masked: float  # block pairs computed in partial blocks that no real row needs

    def __add__(self, o: BlockCounts) -> BlockCounts:
        return BlockCounts(self.rows + o.rows, self.pad_rows + o.pad_rows, self.live + o.live,
                           self.partial + o.partial, self.partial_diag + o.partial_diag, self.masked + o.masked)

    @property
    def full(self) -> int:
        return self.live - self.partial


def _key_block_counts(subtree_end: np.ndarray, block_size: int, real: np.ndarray | None):
    """Per key block ``kb``: ``(kb, visible, real_visible)`` over query blocks ``kb, kb + 1, ...`` it reaches.

    Pair ``(q, k)`` is visible iff ``k <= q < subtree_end[k]`` (rows past S see nothing);
    ``real_visible`` counts only pairs of two real rows. Key ``k`` sees the queries
    ``[k, subtree_end[k])``, so a key block reaches query blocks ``kb`` up to the one holding
    its largest ``subtree_end - 1``, and the counts are interval overlaps: O(live blocks x
    block_size), never S x S.
    """
    s = subtree_end.shape[0]
    nb = -(-s // block_size)
    real = np.ones(s, dtype=bool) if real is None else real
    n_real = np.concatenate([[0], np.cumsum(real)])  # real rows before each row
    for kb in range(nb):
        k = np.arange(kb * block_size, min((kb + 1) * block_size, s))
        end = np.minimum(subtree_end[k], s)
        last = int(end.max() - 1) // block_size  # end > k: a key always sees itself
        q0 = np.arange(kb, last + 1) * block_size
        q1 = np.minimum(q0 + block_size, s)
        a = np.maximum(k[:, None], q0[None, :])
        b = np.maximum(a, np.minimum(end[:, None], q1[None, :]))
        visible = (b - a).sum(axis=0)
        real_visible = ((n_real[b] - n_real[a]) * real[k][:, None]).sum(axis=0)
        yield kb, visible, real_visible


def block_pair_counts(
    subtree_end: np.ndarray, block_size: int, real: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """``(visible, real_visible)``: ``[nb, nb]`` int64 visible pairs per (query block, key block).

    Dense tables, for checking against `treecompile.kernels.attention.blockmask` on small rows; `count_blocks`
    streams the same counts.
    """
    nb = -(-subtree_end.shape[0] // block_size)
    visible = np.zeros((nb, nb), dtype=np.int64)
    real_visible = np.zeros((nb, nb), dtype=np.int64)
    for kb, vis, rvis in _key_block_counts(subtree_end, block_size, real):
        visible[kb : kb + vis.shape[0], kb] = vis
        real_visible[kb : kb + vis.shape[0], kb] = rvis
    return visible, real_visible


def count_blocks(subtree_end: np.ndarray, block_size: int, real: np.ndarray | None = None) -> BlockCounts:
    """Live, partial and wasted block pairs of one row's ``subtree_end`` (``[S]``).

    A block pair is live if it holds a visible pair, full if all ``block_size^2`` pairs are
    visible (so a block holding rows past S is never full), partial otherwise.
    """
    area = block_size * block_size
    live = partial = partial_diag = wasted = 0
    for _, vis, rvis in _key_block_counts(subtree_end, block_size, real):
        is_live = vis > 0
        is_partial = is_live & (vis < area)
        live += int(is_live.sum())
        partial += int(is_partial.sum())
        partial_diag += int(is_partial[0])
        wasted += int((area - rvis[is_partial]).sum())
    return BlockCounts(
        rows=int(subtree_end.shape[0]),
        pad_rows=0 if real is None else int((~real).sum()),
        live=live,
        partial=partial,
        partial_diag=partial_diag,
        masked=wasted / area,
    )


# ---------------------------------------------------------------------------- workloads


def _tokenizer() -> tuple[object, str]:
    """cl100k as ``treecompile stats`` uses by default; the bundled sample BPE without tiktoken."""
    from treecompile.chat.tokenizer import load_tokenizer

    try:
        return load_tokenizer("cl100k"), "cl100k (the `treecompile stats` default)"
    except ImportError:
        return load_tokenizer("sample"), "sample (bundled 2,048-id BPE: tiktoken is not installed)"


def real_workloads(data: Path, tokenizer: object) -> list[tuple[str, list[TrajectoryTree]]]:
    """``(name, trees)`` per source file, built as ``treecompile stats`` builds them."""
    from treecompile.chat import to_tree as chat
    from treecompile.data import datasets
    from treecompile.rl.data import tot_search_samples

    def tree(convs: list) -> TrajectoryTree:
        return chat.tree_from_messages(convs, tokenizer, on_drift="ignore", weights=[1.0] * len(convs))

    out = []
    for f in sorted((data / "tau_bench").glob("*.json")):
        out.append((f"tau-bench {f.stem}", [tree(c) for c in datasets.load_tau_bench(f).values()]))
    tau2 = [tree(c) for f in sorted((data / "tau2").glob("*.json")) for c in datasets.load_tau2(f).values()]
    if tau2:
        out.append(("tau2 airline", tau2))
    game24 = data / "tot" / "game24-search-tree-gpt-4.json"
    if game24.is_file():
        out.append(("ToT game24 search", [s.tree for s in tot_search_samples(game24, tokenizer)]))
    cot = data / "tot" / "text-cot-10-samples-gpt-4.json"
    if cot.is_file():
        # Completions only (the prompts are not in the log): each sample is one assistant message.
        records = json.loads(cot.read_text(encoding="utf-8"))
        out.append(("ToT text CoT", [tree([[{"role": "assistant", "content": y}] for y in r["ys"]]) for r in records]))
    gsm8k = data / "gsm8k_example_model_solutions.jsonl"
    if gsm8k.is_file():
        out.append(("GSM8K", [tree(c) for c in datasets.load_gsm8k_solutions(gsm8k).values()]))
    return out


def synthetic_workloads() -> list[tuple[str, list[TrajectoryTree]]]:
    """`synthetic_tree` at the bench's shape (16 paths x 128) and 16 paths x 1024, 8 seeds each."""
    from treecompile.bench.trees import synthetic_tree

    out = []
    for path_len in (128, 1024):
        for por in (0.5, 0.92):
            trees = [synthetic_tree(16, path_len, por, vocab=2048, seed=s) for s in range(8)]
            out.append((f"synthetic 16x{path_len} POR {por:g}", trees))
    return out


def rebuilt(tree: TrajectoryTree, child_order: str) -> TrajectoryTree:
    """The same tree built again from its paths (in path order) with ``child_order``."""
    paths = tree.paths()
    return TrajectoryTree.from_sequences(
        [p.tokens for p in paths], weights=[p.weight for p in paths], loss_masks=[p.loss_mask for p in paths],
        metadata=tree.metadata, child_order=child_order,
    )


def insertion_order(tree: TrajectoryTree) -> TrajectoryTree:
    """The same tree with children in first-insertion order."""
    return rebuilt(tree, "insertion")


def rows_of(trees: Sequence[TrajectoryTree], row_tokens: int | None) -> list[list[TrajectoryTree]]:
    """Trees in order, each alone (``row_tokens`` None) or greedily filled into rows of at most ``row_tokens``."""
    if row_tokens is None:
        return [[t] for t in trees]
    rows: list[list[TrajectoryTree]] = []
    used = row_tokens
    for t in trees:
        if used + t.num_tokens > row_tokens:
            rows.append([])
            used = 0
        rows[-1].append(t)
        used += t.num_tokens
    return rows


ORDERS: dict[str, Callable[[TrajectoryTree], TrajectoryTree]] = {
    "insertion": lambda t: t,
    "largest-first": largest_first,
    "smallest-first": smallest_first,
}
ALIGNMENTS = ("trees", "subtrees", "nodes")
LAYOUTS = (*ORDERS, *(f"align-{a}" for a in ALIGNMENTS))


def measure(rows: list[list[TrajectoryTree]], block_size: int) -> dict[str, BlockCounts]:
    """Summed block counts of ``rows`` under each layout in `LAYOUTS`."""
    totals: dict[str, BlockCounts] = {}

    def add(name: str, c: BlockCounts) -> None:
        totals[name] = totals[name] + c if name in totals else c

    for trees in rows:
        for name, order in ORDERS.items():
            batch = pack([order(t) for t in trees])
            add(name, count_blocks(batch.subtree_end.numpy(), block_size))
            if name == "insertion":
                for a in ALIGNMENTS:
                    se, real = aligned_subtree_end(batch.subtree_end.numpy(), boundaries(batch, a), block_size)
                    add(f"align-{a}", count_blocks(se, block_size, real))
    return {name: totals[name] for name in LAYOUTS}


# ---------------------------------------------------------------------------- output

Result = tuple[str, str, dict[str, BlockCounts]]  # (workload, rows of, counts per layout)

DETAIL_COLUMNS = ("workload", "rows of", "layout", "rows", "+pad", "live", "vs insertion", "partial", "off-diag",
                  "partial %", "masked")
SUMMARY_COLUMNS = ("workload", "rows of", "tokens", "live", "partial", "partial %", "masked", *LAYOUTS[1:])


def detail_table(results: list[Result]) -> list[list[str]]:
    """One line per (workload, rows of, layout) with every count."""
    out = []
    for workload, packing, by_layout in results:
        base = by_layout["insertion"]
        for layout, c in by_layout.items():
            out.append([
                workload, packing, layout, str(c.rows), str(c.pad_rows), str(c.live),
                f"{c.live / base.live - 1:+.1%}", str(c.partial), str(c.partial - c.partial_diag),
                f"{c.partial / c.live:.1%}", f"{c.masked:.0f}",
            ])
    return out


def summary_table(results: list[Result]) -> list[list[str]]:
    """One line per (workload, rows of): the insertion layout's counts, then each other layout's
    change in live and in partial blocks (and its padding rows as a share of the tokens)."""
    out = []
    for workload, packing, by_layout in results:
        base = by_layout["insertion"]
        cells = [workload, packing, str(base.rows), str(base.live), str(base.partial),
                 f"{base.partial / base.live:.1%}", f"{base.masked:.0f}"]
        for layout in LAYOUTS[1:]:
            c = by_layout[layout]
            cell = f"{c.live / base.live - 1:+.1%} / {c.partial / base.partial - 1:+.1%}"
            if layout.startswith("align-"):
                cell += f" / {c.pad_rows / base.rows:+.1%} rows"
            cells.append(cell)
        out.append(cells)
    return out


def render(columns: Sequence[str], lines: list[list[str]], markdown: bool) -> str:
    """A Markdown table, or aligned text (the first columns left-aligned, counts right-aligned)."""
    if markdown:
        return "\n".join(["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
                         + ["| " + " | ".join(r) + " |" for r in lines])
    widths = [max(len(c), *(len(r[i]) for r in lines)) for i, c in enumerate(columns)]
    left = 3 if columns[2] == "layout" else 2
    fmt = "  ".join(f"{{:<{w}}}" if i < left else f"{{:>{w}}}" for i, w in enumerate(widths))
    return "\n".join([fmt.format(*columns), *(fmt.format(*r) for r in lines)])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", action="store_true", help="print Markdown tables")
    parser.add_argument("--full", action="store_true", help="also print every layout's counts, one line each")
    parser.add_argument("--data", type=Path, default=DATA, help=f"the shared data folder (default {DATA})")
    args = parser.parse_args(argv)

    tokenizer, tok_note = _tokenizer()
    workloads = real_workloads(args.data, tokenizer) if args.data.is_dir() else []
    workloads += synthetic_workloads()
    # The baseline layout: first-insertion order (the loaders build largest-first).
    workloads = [(name, [insertion_order(t) for t in trees]) for name, trees in workloads]
    bullet = "- " if args.markdown else ""
    argv = sys.argv[1:] if argv is None else list(argv)
    print(f"{bullet}machine: {platform.machine()}; python {platform.python_version()}, torch {torch.__version__} "
          "(block counts only, no kernel runs)")
    print(f"{bullet}command: python {' '.join(['benchmarks/block_layout.py', *argv])}")
    print(f"{bullet}date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}")
    print(f"{bullet}tokenizer: {tok_note}")
    if not args.data.is_dir():
        print(f"{bullet}real data: {args.data} not found, synthetic trees only")
    for name, trees in workloads:
        s = [t.num_tokens for t in trees]
        print(f"{bullet}{name}: {len(trees)} trees, {sum(s)} tokens (per tree {min(s)} to {max(s)}, "
              f"median {int(np.median(s))}), {sum(t.num_nodes for t in trees)} nodes")
    print(f"{bullet}columns live, partial, partial %, masked: the insertion layout; each other layout: change in "
          "live blocks / change in partial blocks (/ padding rows inserted, as a share of the tokens)")
    for bs in BLOCK_SIZES:
        results = []
        for name, trees in workloads:
            for row_tokens in (None, *ROW_TOKENS):
                rows = rows_of(trees, row_tokens)
                packing = "1 tree" if row_tokens is None else f"{row_tokens // 1024}k"
                results.append((name, f"{packing} ({len(rows)} rows)", measure(rows, bs)))
        title = f"block size {bs}"
        print(f"\n{f'**{title}**' if args.markdown else title + ':'}\n")
        print(render(SUMMARY_COLUMNS, summary_table(results), args.markdown))
        if args.full:
            print()
            print(render(DETAIL_COLUMNS, detail_table(results), args.markdown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
