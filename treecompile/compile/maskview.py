"""The tree mask of a packed batch as a matrix, a text grid and a PNG.

`mask_matrix` evaluates the rule functions of `treecompile.kernels.attention.masks` densely (an
``[S, S]`` reference, for pictures of small examples); `mask_picture` draws it with
``█``/``·`` and node and tree boundaries, `png_bytes` as an RGB PNG without matplotlib.
`treecompile inspect` prints them and `treecompile.cli.plots.mask_figure` draws the same
matrix with axes and a legend.
"""

from __future__ import annotations

import struct
import zlib
from typing import Any

__all__ = ["PNG_CELL", "MASK_RULES", "boundary_rows", "mask_matrix", "mask_picture", "png_bytes"]

#: Default pixels per token in the PNG.
PNG_CELL = 16


def mask_matrix(batch: Any, mask: str = "interval") -> Any:
    """``[S, S]`` bool, ``[q, k]`` true iff query row ``q`` sees key row ``k`` under ``mask``.

    Evaluates the same rule functions the FlexAttention ``mask_mod`` calls
    (:mod:`treecompile.kernels.attention.masks`) densely, so the picture is the kernel's rule, not a redrawing.
    """
    import torch

    from treecompile.kernels.attention.masks import bitmask_rule, interval_rule

    idx = torch.arange(batch.num_tokens)
    q, k = idx[:, None], idx[None, :]
    if mask == "interval":
        return interval_rule(q, k, batch.subtree_end.cpu())
    if mask == "bitmask":
        if batch.path_bits is None:
            raise ValueError("mask='bitmask' needs a batch packed with path_bits=True")
        bits = batch.path_bits.cpu()
        return bitmask_rule(q, k, batch.tree_ids.cpu(), bits, int(bits.shape[1]))
    raise ValueError(f"unknown mask {mask!r}; valid masks: interval, bitmask")


MASK_RULES = {
    "interval": "row q sees row k iff k <= q < subtree_end[k]",
    "bitmask": "row q sees row k iff k <= q, same tree, and path_bits[k] is a subset of path_bits[q]",
}


def boundary_rows(batch: Any) -> tuple[set[int], set[int]]:
    """Rows that start a node, and rows that start a tree (row 0 excluded)."""
    nodes = {int(x) for x in batch.node_start.tolist()} - {0}
    trees = {int(x) for x in batch.tree_offsets[:-1].tolist()} - {0}
    return nodes, trees


def mask_picture(batch: Any, mask: str = "interval") -> str:
    """The tree mask as text: ``█`` where row ``q`` (down) sees row ``k`` (across), ``·`` not.

    Node boundaries are drawn as ``│``/``─`` and tree boundaries as ``║``/``═``. Each row
    is labelled with its node, its position on its own path and its token.
    """
    m = mask_matrix(batch, mask).tolist()
    s = len(m)
    node_starts, tree_starts = boundary_rows(batch)
    node_of = []
    for n, (a, b) in enumerate(zip(batch.node_start.tolist(), batch.node_end.tolist())):
        node_of += [n] * (b - a)
    pos, tok = batch.position_ids.tolist(), batch.input_ids.tolist()
    tok_w = max(3, len(str(max(tok))))

    def sep(k: int, vertical: bool = True) -> str:
        """What follows column ``k``: a boundary mark if column ``k + 1`` starts a node or tree."""
        if k + 1 in tree_starts:
            return "║"
        if k + 1 in node_starts:
            return "│"
        return " "

    head = f"{'row':>4} {'node':>4} {'pos':>3} {'tok':>{tok_w}}  "
    lines = [
        f"tree mask ({mask}): {MASK_RULES[mask]}",
        "█ sees, · hidden; │ ─ node boundaries, ║ ═ tree boundaries",
        "",
        " " * len(head) + "".join(str(k % 10) + sep(k) for k in range(s)).rstrip(),
    ]
    for q in range(s):
        if q in node_starts:
            h = "═" if q in tree_starts else "─"
            cells = []
            for k in range(s):
                c = sep(k)
                cross = {" ": h, "│": "╪" if h == "═" else "┼", "║": "╬" if h == "═" else "╫"}[c]
                cells.append(h + cross)
            lines.append(" " * len(head) + "".join(cells)[:-1])
        row = "".join(("█" if m[q][k] else "·") + sep(k) for k in range(s)).rstrip()
        lines.append(f"{q:>4} {'n' + str(node_of[q]):>4} {pos[q]:>3} {tok[q]:>{tok_w}}  {row}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- PNG


_PNG_COLORS = {
    "visible": (38, 70, 150),
    "hidden": (244, 244, 244),
    "node": (170, 170, 170),
    "tree": (200, 40, 40),
}


def png_bytes(batch: Any, mask: str = "interval", cell: int = PNG_CELL) -> bytes:
    """The tree mask as an RGB PNG of ``S * cell`` pixels square (pure Python, zlib).

    Visible pairs are blue, hidden ones light grey; a grey line starts each node and a red
    line each tree, on both axes.
    """
    if cell < 1:
        raise ValueError(f"PNG cell size must be at least 1 pixel, got {cell}")
    m = mask_matrix(batch, mask).tolist()
    s = len(m)
    node_starts, tree_starts = boundary_rows(batch)
    colors = {k: bytes(v) for k, v in _PNG_COLORS.items()}

    def line_color(i: int) -> bytes | None:
        # The first pixel of a cell that starts a node or tree carries its boundary line.
        if cell < 3:
            return None  # lines would hide the cells
        return colors["tree"] if i in tree_starts else colors["node"] if i in node_starts else None

    raw = bytearray()
    for y in range(s * cell):
        q, first_y = divmod(y, cell)
        h_line = line_color(q) if first_y == 0 else None
        raw.append(0)  # filter type 0 (none) for this scanline
        for x in range(s * cell):
            k, first_x = divmod(x, cell)
            v_line = line_color(k) if first_x == 0 else None
            if v_line is not None and (h_line is None or v_line == colors["tree"]):
                raw += v_line
            elif h_line is not None:
                raw += h_line
            else:
                raw += colors["visible"] if m[q][k] else colors["hidden"]
    return _png(s * cell, s * cell, bytes(raw))


def _png(width: int, height: int, scanlines: bytes) -> bytes:
    """A PNG file: 8-bit RGB, no interlace; ``scanlines`` already carry their filter bytes."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(scanlines, 9)) + chunk(b"IEND", b"")
