"""Pictures: the labelled tree-mask figure of `inspect --png` and the charts of `stats --plot`."""

from __future__ import annotations

import json
import struct
import sys

import pytest

pytest.importorskip("matplotlib")

from treecompile import pack  # noqa: E402
from treecompile.cli.main import main  # noqa: E402
from treecompile.compile.inspection import example_trees, mask_matrix  # noqa: E402
from treecompile.cli.plots import mask_figure, save_png, stats_figure  # noqa: E402


def png_size(path) -> tuple[int, int]:
    blob = path.read_bytes()
    assert blob[:8] == b"\x89PNG\r\n\x1a\n" and blob[12:16] == b"IHDR"
    return struct.unpack(">II", blob[16:24])


@pytest.mark.parametrize("mask", ["interval", "bitmask"])
def test_mask_figure_has_axes_labels_and_a_legend(mask, tmp_path):
    batch = pack(example_trees(), path_bits=mask == "bitmask")
    fig = mask_figure(batch, mask, cell=10)
    ax = fig.axes[0]
    assert ax.get_xlabel() == "key row k (packed order)"
    assert ax.get_ylabel() == "query row q  (node n, position p on its path)"
    assert ax.get_title(loc="left").startswith(f"tree mask ({mask}): row q sees row k iff")
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["q sees k", "hidden", "node starts", "tree starts"]
    # The image is the kernel's rule, cell for cell; row labels name node and path position.
    image = ax.get_images()[0].get_array()
    assert image.tolist() == mask_matrix(batch, mask).int().tolist()
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert labels[0] == "0  n0 p0" and len(labels) == batch.num_tokens
    width, height = png_size(save_png(fig, tmp_path / "mask.png"))
    assert width > height >= 500


def test_stats_plot_from_the_cli(tmp_path, capsys):
    out = tmp_path / "stats.png"
    assert main(["stats", "sample:gsm8k", "--tokenizer", "bytes", "--plot", str(out), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["plot"] == str(out) and png_size(out) == (1200, 380)
    assert main(["stats", "sample:gsm8k", "--tokenizer", "bytes", "--plot", str(out)]) == 0
    assert f"charts of POR, depth and branching written to {out}" in " ".join(capsys.readouterr().out.split())


def test_stats_figure_counts_every_tree():
    from treecompile import TrajectoryTree

    trees = [TrajectoryTree.from_sequences([[1, 2, 3], [1, 2, 4]]), TrajectoryTree.from_sequences([[5, 6], [5, 7], [8]])]
    stats = [t.stats() for t in trees]
    total = {"por": 0.25, "n_trees": 2, "n_paths": 5}
    fig = stats_figure(["a", "b"], stats, total, title="file.jsonl")
    por_ax, depth_ax, branch_ax = fig.axes
    assert [ax.get_xlabel() for ax in fig.axes] == [
        "POR = 1 - tree tokens / path tokens", "depth: tokens of the longest path", "largest number of children of a node"
    ]
    for ax in fig.axes:
        assert ax.get_ylabel() == "trees" and sum(p.get_height() for p in ax.patches) == 2
    assert por_ax.get_legend().get_title().get_text() == f"highest: a ({stats[0].por:.3f})"
    assert fig._suptitle.get_text() == "file.jsonl  (2 trees, 5 paths)"
    with pytest.raises(ValueError, match="no trees"):
        stats_figure([], [], total)


def test_without_matplotlib_the_extra_is_named(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main(["stats", "sample:gsm8k", "--plot", str(tmp_path / "x.png")]) == 2
    assert capsys.readouterr().err == (
        "treecompile stats: error: --plot draws with matplotlib: pip install 'treecompile[plot]'\n"
    )
    # inspect refuses before it builds the model (the model does not even exist here).
    assert main(["inspect", "no_such_module:make", "--png", str(tmp_path / "m.png")]) == 2
    assert capsys.readouterr().err == (
        "treecompile inspect: error: --png draws with matplotlib: pip install 'treecompile[plot]'\n"
    )
    assert not (tmp_path / "x.png").exists()
