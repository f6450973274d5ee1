"""The FlexAttention kernel-options table (kernels/attention/flex_options.py) and `treecompile tune` on CPU."""

from __future__ import annotations

import pytest
import torch

from treecompile.cli.main import main
from treecompile.kernels.attention import flex_options as fo
from treecompile.kernels.attention.flex import BLOCK_SIZE


def test_every_table_entry_fits_the_tree_block_mask():
    assert fo.MASK_BLOCK == BLOCK_SIZE
    for (arch, head_dim, dtype), opts in fo.FLEX_OPTIONS.items():
        assert arch.startswith("sm") and head_dim > 0 and hasattr(torch, dtype)
        kw = opts.as_kernel_options()
        for key in ("fwd_BLOCK_M", "fwd_BLOCK_N", "bwd_BLOCK_M1", "bwd_BLOCK_N1", "bwd_BLOCK_M2", "bwd_BLOCK_N2"):
            assert BLOCK_SIZE % kw[key] == 0, (arch, head_dim, dtype, key)


@pytest.mark.parametrize("fwd, bwd", [((96, 64, 4, 3), (64, 128, 128, 64, 8, 3)),
                                      ((128, 64, 4, 3), (64, 32, 128, 64, 8, 3))], ids=["tile-not-dividing", "bwd-order"])
def test_options_that_cannot_run_are_refused(fwd, bwd):
    with pytest.raises(ValueError):
        fo.FlexOptions(fwd=fwd, bwd=bwd)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_candidates_are_valid_and_distinct(head_dim, dtype):
    cands = fo.candidates(head_dim, dtype)
    assert len(cands) >= 4 and len(set(cands)) == len(cands)


def test_cpu_tensors_get_torch_defaults():
    q = torch.zeros(1, 2, 128, 128, dtype=torch.bfloat16)
    assert fo.flex_kernel_options(q) == {}


TABLE = {("sm90", 128, "bfloat16"): fo.FlexOptions(fwd=(128, 128, 8, 3), bwd=(64, 128, 128, 64, 8, 3)),
         ("sm90", 64, "float32"): fo.FlexOptions(fwd=(64, 64, 4, 3), bwd=(16, 16, 16, 16, 4, 1))}


@pytest.mark.parametrize("table", [fo.FLEX_OPTIONS, TABLE], ids=["package", "two-entries"])
def test_printed_table_is_the_literal_it_replaces(table):
    text = fo.format_table(table, note="test")
    scope = {"FlexOptions": fo.FlexOptions}
    exec(text, scope)
    assert scope["FLEX_OPTIONS"] == table


class _CudaQueries:
    """Stands in for CUDA queries: only the device type, the head dim and the dtype are read."""

    device = torch.device("cuda")
    shape = (1, 16, 256, 128)
    dtype = torch.bfloat16


def test_a_saved_table_replaces_the_package_one_through_the_environment(tmp_path, monkeypatch):
    path = tmp_path / "options.json"
    fo.save_table(TABLE, str(path), note="measured somewhere")
    assert fo.load_table(str(path)) == TABLE
    monkeypatch.setattr(fo, "arch_of", lambda device: "sm90")
    monkeypatch.delenv(fo.TABLE_ENV, raising=False)
    assert fo.flex_kernel_options(_CudaQueries()) == {}  # the package table has no entry: torch's choice
    monkeypatch.setenv(fo.TABLE_ENV, str(path))
    assert fo.flex_kernel_options(_CudaQueries()) == TABLE[("sm90", 128, "bfloat16")].as_kernel_options()


def test_a_file_that_is_not_a_table_is_named(tmp_path, monkeypatch):
    path = tmp_path / "options.json"
    path.write_text('{"note": "x"}')
    monkeypatch.setattr(fo, "arch_of", lambda device: "sm90")
    monkeypatch.setenv(fo.TABLE_ENV, str(path))
    with pytest.raises(ValueError, match="TREECOMPILE_FLEX_OPTIONS=.*options.json: not a FlexAttention options"):
        fo.flex_kernel_options(_CudaQueries())


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA exit")
def test_tune_without_cuda_exits_2(capsys):
    assert main(["tune"]) == 2
    assert "no CUDA" in capsys.readouterr().err
    with pytest.raises(RuntimeError, match="no CUDA"):
        fo.tune()


@pytest.mark.parametrize("rows, paths", [(64, 8), (100, 8), (33, 4), (1024, 8)], ids=lambda x: f"{x}")
def test_tuning_tree_is_the_packed_tree(rows, paths):
    """The tuning tree's subtree_end, written down directly, is what pack gives for its paths."""
    from treecompile import TrajectoryTree, pack

    prefix = rows // 2
    leaf = (rows - prefix) // paths
    seqs = [list(range(prefix)) + [prefix + i] * leaf for i in range(paths)]
    want = pack([TrajectoryTree.from_sequences(seqs)]).subtree_end
    assert torch.equal(fo._synthetic_subtree_end(rows, paths, "cpu"), want)


def test_cuda_calls_ask_for_the_main_triton_kernel_with_the_table_tiles(tmp_path, monkeypatch):
    """On CUDA every call names FlexAttention's main kernel: left to choose, Inductor takes its
    decoding kernel below 128 query rows, which with grouped heads can have no configuration at
    all (a compile error on an H200). Off CUDA nothing is asked for; the table's tiles ride along."""
    from treecompile.kernels.attention import flex
    from torch.nn.attention import flex_attention as fa

    monkeypatch.setattr(fo, "arch_of", lambda device: "sm90")
    monkeypatch.delenv(fo.TABLE_ENV, raising=False)
    main = flex.main_kernel_option()
    assert main in ({"BACKEND": "TRITON"}, {"FORCE_USE_FLEX_ATTENTION": True})
    assert flex.call_kernel_options(_CudaQueries()) == main
    assert flex.call_kernel_options(torch.zeros(1, 4, 100, 16)) is None
    path = tmp_path / "options.json"
    fo.save_table(TABLE, str(path))
    monkeypatch.setenv(fo.TABLE_ENV, str(path))
    assert flex.call_kernel_options(_CudaQueries()) == {**main, **TABLE[("sm90", 128, "bfloat16")].as_kernel_options()}
    # the installed torch accepts the option (it validates BACKEND's value)
    q = torch.zeros(1, 4, 100, 16)
    options = fa._apply_kernel_options(q, q, q, True, dict(main))
    assert all(options[k] == v for k, v in main.items())
    # and what call_flex_hop hands the op is what call_kernel_options asked for
    monkeypatch.setattr(flex, "call_kernel_options", lambda q: dict(main))
    options = flex._kernel_options_fn()(q, q, q)
    assert all(options[k] == v for k, v in main.items()) and options["OUTPUT_LOGSUMEXP"]
