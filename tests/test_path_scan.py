"""Running sums along each row's root path (kernels/path_scan.py) against the definition."""

from __future__ import annotations

import pytest
import torch

import treecompile as tc
from treecompile.kernels.path_scan import path_cumsum, path_cumsum_reference

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
