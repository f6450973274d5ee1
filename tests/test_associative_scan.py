"""Hand-ported associative scans (JAX's ``lax.associative_scan``) swapped for the path scan by
pointer jumping (`treecompile.capture.library_drop_ins.associative_scan_for`,
`treecompile.kernels.scans.associative`, `treecompile.passes.path_jumps`).

The zoo checks GateLoop (``gateloop``) against per-path training; here the drop-in on a plain row,
which functions it takes for a scan, and a scan it refuses.
"""

from __future__ import annotations

import pytest
import torch
import zoo
from torch import nn
from zoo_repos import gateloop

import treecompile as tc
from treecompile.capture.library_drop_ins import associative_scan_for
from treecompile.core.errors import UnsupportedModelError
from treecompile.kernels.scans.associative import associative_scan_reference


def _matrix_op(a, b):
    """Composition of affine maps ``x -> A x + c``: associative, not commutative."""
    (a_mat, a_off), (b_mat, b_off) = a, b
    return b_mat @ a_mat, (b_mat @ a_off[..., None])[..., 0] + b_off


def _with_axis(operator, elems, axis=0, reverse=False):
    """A port with an ``axis`` parameter: the loop, along ``axis``."""
    return associative_scan_reference(lambda a, b: list(operator(a, b)), list(elems), axis)


def _not_a_scan(operator, elems):
    return elems


def _exclusive(operator, elems):
    """Each row folded with the rows before it, not itself."""
    out = associative_scan_reference(lambda a, b: list(operator(a, b)), list(elems), 1)
    return [torch.cat([e[:, :1], o[:, :-1]], 1) for e, o in zip(elems, out)]


@pytest.mark.parametrize("n", [1, 2, 7, 16])
def test_the_drop_in_on_a_plain_row_is_the_scan(n):
    g = torch.Generator().manual_seed(n)
    mats = torch.randn(3, n, 2, 2, generator=g, dtype=torch.float64)
    offs = torch.randn(3, n, 2, generator=g, dtype=torch.float64)
    drop_in = associative_scan_for(gateloop.associative_scan)
    got = drop_in(_matrix_op, (mats, offs))
    want = associative_scan_reference(lambda a, b: list(_matrix_op(a, b)), [mats, offs], 1)
    for x, y in zip(got, want):
        torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12)


def test_a_function_is_swapped_only_where_it_is_an_inclusive_scan():
    assert associative_scan_for(gateloop.associative_scan) is not None  # axis 1, fixed
    assert associative_scan_for(_with_axis) is not None  # the axis it is called with
    assert associative_scan_for(_not_a_scan) is None
    assert associative_scan_for(_exclusive) is None


class _Scanned(nn.Module):
    """Embeddings, ``scan(x)``, a head."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(zoo.VOCAB, 8)
        self.head = nn.Linear(8, zoo.VOCAB)

    def forward(self, idx):
        x = self.emb(idx)
        _, y = self.scan(lambda a, b: (a[0] * b[0], b[0] * a[1] + b[1]), (torch.sigmoid(x), x))
        return self.head(y)


class _ReversedScan(_Scanned):
    """``associative_scan(op, elems, axis=1, reverse=True)``: a scan from the end."""

    def scan(self, op, elems):
        return associative_scan(op, elems, axis=1, reverse=True)


def associative_scan(operator, elems, axis=0, reverse=False):
    out = _with_axis(operator, [e.flip(axis) for e in elems] if reverse else elems, axis)
    return [o.flip(axis) for o in out] if reverse else out


def test_a_scan_from_the_end_is_refused_by_name():
    model = zoo.perturb(_ReversedScan().double().eval())
    with pytest.raises(UnsupportedModelError, match=r"reverse=True"):
        tc.tree_compile(model, backend="eager")(zoo.batches()[0][1])


class _ScanOverChannels(_Scanned):
    """An associative scan over the channels of each token (a fixed axis, not the tokens')."""

    def scan(self, op, elems):
        return associative_scan(op, elems, axis=2)


def test_a_scan_over_a_fixed_axis_is_that_axis_scan():
    zoo.run(zoo.Case("channel-scan", _ScanOverChannels.__doc__, lambda: zoo.perturb(_ScanOverChannels().double())))


def _jax_order(fn, elems, reverse=False, axis=0):
    """JAX's own signature: ``reverse`` before ``axis``."""
    return associative_scan(fn, elems, axis=axis, reverse=reverse)


def test_the_original_parameters_bind_the_call():
    """JAX's order binds a positional ``True`` to ``reverse`` (refused), not to the axis."""
    drop_in = associative_scan_for(_jax_order)
    assert drop_in is not None
    x = torch.randn(1, 5, 2, dtype=torch.float64)
    with pytest.raises(UnsupportedModelError, match=r"reverse=True"):
        drop_in(lambda a, b: (a[0] * b[0], b[0] * a[1] + b[1]), (torch.sigmoid(x), x), True, 1)
    out = drop_in(lambda a, b: (a[0] * b[0], b[0] * a[1] + b[1]), (torch.sigmoid(x), x), False, 1)
    want = associative_scan_reference(lambda a, b: [a[0] * b[0], b[0] * a[1] + b[1]], [torch.sigmoid(x), x], 1)
    torch.testing.assert_close(out[1], want[1], rtol=1e-12, atol=1e-12)


def _positive_axes_only(operator, elems, axis=0, reverse=False):
    """A port whose ``axis`` must be positive (a negative one scans the wrong dim)."""
    return _with_axis(operator, elems, axis if axis >= 0 else 0)


def test_a_call_on_an_axis_the_original_failed_is_refused():
    drop_in = associative_scan_for(_positive_axes_only)
    x = torch.randn(1, 5, 2, dtype=torch.float64)
    op = lambda a, b: (a[0] * b[0], b[0] * a[1] + b[1])  # noqa: E731
    drop_in(op, (torch.sigmoid(x), x), axis=1)
    with pytest.raises(UnsupportedModelError, match=r"axis=-2, where the function was not checked"):
        drop_in(op, (torch.sigmoid(x), x), axis=-2)
    assert associative_scan_for(len) is None  # a builtin: no signature to bind


@pytest.mark.parametrize("hop", [0, 2])
def test_a_step_along_the_row_has_its_gradient(hop):
    from treecompile.kernels.scans.associative import row_earlier

    x = torch.randn(2, 6, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: row_earlier(t, 1, hop), (x,))
    want = torch.cat([x[:, : min(1 << hop, 6)], x[:, : max(6 - (1 << hop), 0)]], 1)
    torch.testing.assert_close(row_earlier(x, 1, hop), want)


def _loop_scan(A, X):
    """``H_t = A_t * H_{t-1} + X_t`` along dim 1, by a loop."""
    h, out = torch.zeros_like(X[:, 0]), []
    for t in range(X.shape[1]):
        h = A[:, t] * h + X[:, t]
        out.append(h)
    return torch.stack(out, 1)


def _exclusive_linear(A, X):
    """The scan of the tokens before each token only."""
    h = _loop_scan(A, X)
    return torch.cat([torch.zeros_like(h[:, :1]), h[:, :-1]], 1)


def _positive_decay_only(A, X):
    """Right where ``A > 0`` (a scan written with log A); NaN elsewhere."""
    return torch.where(A > 0, _loop_scan(A.abs(), X), torch.nan)


def test_a_parallel_scan_is_swapped_only_where_it_is_the_linear_recurrence():
    """mamba.py's ``pscan(A, X)`` (tests/zoo_repos/mambapy.py, exact in the zoo) and a loop are the
    recurrence at every sign of A; an exclusive scan, one right only for positive A, or the
    identity are not, and are left to the checks of the graph."""
    from zoo_repos.mambapy import pscan

    from treecompile.capture.library_drop_ins import parallel_scan_for

    for scan in (pscan, _loop_scan):
        drop_in = parallel_scan_for(scan)
        assert drop_in is not None
        g = torch.Generator().manual_seed(3)
        A = torch.rand(2, 13, 3, 4, generator=g, dtype=torch.float64) * 2 - 1
        X = torch.randn(2, 13, 3, 4, generator=g, dtype=torch.float64)
        torch.testing.assert_close(drop_in(A, X), _loop_scan(A, X), rtol=1e-12, atol=1e-12)
    for not_it in (_exclusive_linear, _positive_decay_only, lambda A, X: X):
        assert parallel_scan_for(not_it) is None


class _NoSignature:
    """A scan whose signature cannot be read (torch >= 2.14's ``PScan.apply`` shows none)."""

    @property
    def __signature__(self):
        raise ValueError("no signature found")

    def __call__(self, A, X):
        return _loop_scan(A, X)


def test_a_scan_judged_by_running_it_is_looked_up_whatever_its_signature_shows():
    import inspect

    from treecompile.capture.dynamo import _takes
    from treecompile.capture.library_drop_ins import parallel_scan_for

    scan = _NoSignature()
    with pytest.raises(ValueError):
        inspect.signature(scan)
    assert _takes(scan, ()) and parallel_scan_for(scan) is not None
    assert not _takes(scan, ("A", "X"))  # an entry that names parameters still needs to see them
