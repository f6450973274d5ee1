"""The long convolution by FFT per tree node against its dense definition (float64)."""

import pytest
import torch
from hypothesis import given, settings
from strategies import path_sets
from testing import examples

from treecompile import TrajectoryTree, pack
from treecompile.kernels.long_conv import tree_long_conv, tree_long_conv_reference


def _check(batch, width: int, channels: int = 3, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    s = batch.num_tokens
    u = torch.randn(channels, s, dtype=torch.float64, generator=g, requires_grad=True)
    k = torch.randn(channels, width, dtype=torch.float64, generator=g, requires_grad=True)
    got = tree_long_conv(u, k, batch.node_table())
    want = tree_long_conv_reference(u, k, batch.pred_index)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    dout = torch.randn(got.shape, dtype=torch.float64, generator=g)
    for a, b in zip(torch.autograd.grad(got, (u, k), dout), torch.autograd.grad(want, (u, k), dout)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("width", [1, 3, 40])
def test_matches_the_sum_over_ancestors(width):
    """A forest with shared prefixes, a one-token node, a duplicate path; kernels shorter than a
    path, and longer than every path (its far end never read)."""
    trees = [TrajectoryTree.from_sequences([[1, 2, 3, 4, 5], [1, 2, 3, 6, 7, 8, 9], [1, 2, 10], [1, 2, 10], [1, 11]]),
             TrajectoryTree.from_sequences([[5, 6, 7], [5, 8]])]
    _check(pack(trees), width)


@settings(max_examples=examples(20))
@given(path_sets(max_paths=5))
def test_matches_the_sum_over_ancestors_on_generated_trees(case):
    seqs, _, _ = case
    _check(pack(TrajectoryTree.from_sequences(seqs)), width=6)


def test_opcheck():
    batch = pack(TrajectoryTree.from_sequences([[1, 2, 3], [1, 4]]))
    u = torch.randn(2, batch.num_tokens, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 4, dtype=torch.float64, requires_grad=True)
    torch.library.opcheck(torch.ops.treecompile.tree_long_conv.default, (u, k, batch.node_table()))
