"""Softmax maps combined across a group of heads before ``@ v`` (`passes/attention/grouped.py`):
the Differential Transformer as its reference writes it is exact at float64 rounding (its
float32-cast spelling is in the zoo, tests/zoo.py ``diff-transformer``), and what the
combination may not be is refused."""

from __future__ import annotations

import pytest
import torch
import zoo
import zoo_custom as zc
from testing import ZOO_F64_TOLERANCE

import treecompile as tc
from treecompile.core.errors import UnsupportedModelError


def test_the_differential_transformer_is_exact_at_float64_rounding():
    model = zoo._custom(zc.DiffLM, exact=True)()
    compiled = tc.tree_compile(model, backend="eager")
    for _, batch, trees in zoo.batches():
        zoo.compare(model, compiled, batch, trees, rel=ZOO_F64_TOLERANCE)
    assert compiled.counters["rewrite_attention_pass"] == {"softmax_attention": 2}


class _RowCoefficient(zc.DiffAttn):
    """The second map weighted per query row (``[B, H, T, 1]`` read from the tokens): not a
    factor of the group's maps alone."""

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(self.ln(x)).split(zc.DIM, dim=-1)
        q = q.view(b, t, 2 * self.h, self.d).transpose(1, 2) * self.d ** -0.5
        k = k.view(b, t, 2 * self.h, self.d).transpose(1, 2)
        v = v.view(b, t, self.h, 2 * self.d).transpose(1, 2)
        w = torch.matmul(q, k.transpose(-1, -2)).masked_fill(self.causal[:, :, :t, :t] == 0, float("-inf"))
        w = w.softmax(-1).view(b, self.h, 2, t, t)
        gate = torch.sigmoid(x.sum(-1))[:, None, :, None]
        y = torch.matmul(w[:, :, 0] - gate * w[:, :, 1], v)
        x = x + self.o(y.transpose(1, 2).reshape(b, t, zc.DIM))
        return x + self.mlp(self.ln2(x))


def test_a_combination_weighted_per_row_is_refused():
    model = zoo._custom(zc._spelling(_RowCoefficient))()
    compiled = tc.tree_compile(model, backend="eager")
    with pytest.raises(UnsupportedModelError, match=r"\[\.\., S, S\]"):
        compiled(zoo.batches()[0][1])
