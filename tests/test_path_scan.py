"""Running sums along each row's root path (kernels/scans/path_scan.py) against the definitions
(kernels/scans/naive.py)."""

from __future__ import annotations

import pytest
import torch

import treecompile as tc
from treecompile.kernels.scans.naive import path_cumsum_reference
from treecompile.kernels.scans.path_scan import path_cumsum

TREES = {
    "branchy": [[1, 2, 3, 4], [1, 2, 5], [1, 2, 3, 4, 6], [1, 2, 5], [1, 7, 8, 9, 10, 11]],
    "one-token-nodes": [[1, 2], [1, 3], [1, 3, 4], [1, 3, 5, 6]],
    "single": [[5, 6, 7, 8, 9]],
}


@pytest.mark.parametrize("name", list(TREES))
@pytest.mark.parametrize("dtype", [torch.bool, torch.int32, torch.int64])
def test_path_cumsum_matches_the_definition(name, dtype):
    batch = tc.pack([tc.TrajectoryTree.from_sequences(TREES[name]), tc.TrajectoryTree.from_sequences([[3, 1, 4]])])
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 3, (2, batch.num_tokens, 3), generator=g).to(dtype)
    got = path_cumsum(x, 1, batch.subtree_end)
    assert got.dtype == torch.int64
    assert torch.equal(got, path_cumsum_reference(x, 1, batch.subtree_end))


def test_path_cumsum_is_the_cumsum_on_each_path():
    """Row r's value is the running sum of the path through it, computed on the path alone."""
    batch = tc.pack([tc.TrajectoryTree.from_sequences(TREES["branchy"])])
    x = (batch.input_ids % 3 == 0).long()
    got = path_cumsum(x, 0, batch.subtree_end)
    for p in range(batch.num_paths):
        rows = batch.path_rows(p)
        assert torch.equal(got[rows], x[rows].cumsum(0))


def _batch(name):
    return tc.pack([tc.TrajectoryTree.from_sequences(TREES[name]), tc.TrajectoryTree.from_sequences([[3, 1, 4]])])


@pytest.mark.parametrize("op", ["cumsum", "cumprod", "logcumsumexp", "cummax", "cummin"])
@pytest.mark.parametrize("name", list(TREES))
def test_path_scan_matches_the_definition_forward_and_backward(name, op):
    """``treecompile::path_scan`` (pointer jumping along pred_index) against each root path
    gathered and scanned by torch's own op: values to float64 rounding, cummax / cummin's rows
    exactly, and the gradient of a non-linear function of the values."""
    from treecompile.kernels.scans.naive import path_scan_reference
    from treecompile.kernels.scans.path_scan import path_scan

    batch = _batch(name)
    torch.manual_seed(0)
    x = torch.randn(2, batch.num_tokens, 3, dtype=torch.float64)
    if op in ("cummax", "cummin"):
        x[:, ::3] = x[:, 1:2]  # ties: the later of equal values wins, as in torch
    x.requires_grad_(True)
    got = path_scan(x, 1, batch.pred_index, batch.node_table(), op)
    ref = path_scan_reference(x, 1, batch.pred_index, op)
    torch.testing.assert_close(got[0], ref[0], rtol=1e-12, atol=1e-12)
    if len(ref) > 1:
        assert torch.equal(got[1], ref[1])
    (g_got,) = torch.autograd.grad((got[0] ** 2).sum(), x)
    (g_ref,) = torch.autograd.grad((ref[0] ** 2).sum(), x)
    torch.testing.assert_close(g_got, g_ref, rtol=1e-12, atol=1e-12)


def test_path_scan_without_a_node_table_runs_enough_levels():
    """Without the node table the levels are bounded by the row count: the same result."""
    from treecompile.kernels.scans.path_scan import path_scan

    batch = _batch("branchy")
    x = torch.randn(batch.num_tokens, 2, dtype=torch.float64)
    torch.testing.assert_close(path_scan(x, 0, batch.pred_index, None, "cumsum")[0],
                               path_scan(x, 0, batch.pred_index, batch.node_table(), "cumsum")[0], rtol=1e-12, atol=1e-12)


def test_logcumsumexp_over_minus_infinity_has_the_gradient_torch_gives():
    """Masked scores (-inf) before a finite one: the gradient there is 0, as torch's own
    logcumsumexp gives on each root path (`path_scan_reference`), not NaN (-inf - -inf)."""
    from treecompile.kernels.scans.naive import path_scan_reference
    from treecompile.kernels.scans.path_scan import path_scan

    batch = tc.pack([tc.TrajectoryTree.from_sequences([[1, 2, 3, 4, 5], [1, 2, 3, 6]])])
    assert batch.num_tokens == 6
    x = torch.tensor([0.5, float("-inf"), float("-inf"), 1.0, -0.3, 2.0], dtype=torch.float64, requires_grad=True)
    (g,) = torch.autograd.grad(path_scan(x, 0, batch.pred_index, batch.node_table(), "logcumsumexp")[0].sum(), x)
    (want,) = torch.autograd.grad(path_scan_reference(x, 0, batch.pred_index, "logcumsumexp")[0].sum(), x)
    assert not want.isnan().any() and want[1:3].eq(0).all()
    torch.testing.assert_close(g, want, rtol=1e-12, atol=1e-12)
