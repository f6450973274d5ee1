"""The row rules on their own: one small captured graph per rule (passes/rows/).

Each case is a function of ``x [1, S, 8]`` (the rows on dim 1), ``ids [1, S]`` and tables
without rows, captured by Dynamo with S dynamic, then judged by
:func:`treecompile.passes.rows.row_states` alone (no rewrite pass runs): either every node
is proven row-local and the result's rows are where the case says, or the first refused
node's reason matches. Unknown ops are refused when they see rows and accepted when they
do not.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from treecompile.passes._graph import PassContext, value
from treecompile.passes.rows import RULES, Rows, row_states

S = 5  # no other dim of the cases is 5


def _capture(fn, args):
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    rows = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.dim() >= 2 and a.shape[1] == S]

    def tied(*a):
        for i in rows[1:]:  # one S for every input with rows, as the wrapper's marker op ties them
            torch._check(a[i].shape[1] == a[rows[0]].shape[1])
        return fn(*a)

    torch._dynamo.reset()
    for i in rows:
        torch._dynamo.mark_dynamic(args[i], 1)
    torch.compile(tied, backend=backend, fullgraph=True)(*args)
    assert len(graphs) == 1
    return graphs[0]


def judge(fn, *args):
    """``(refusals, states, gm)`` of ``fn`` captured on ``args``."""
    gm = _capture(fn, args)
    x = next(n for n in gm.graph.nodes if n.op == "placeholder" and isinstance(value(n), torch.Tensor)
             and value(n).dim() >= 2 and not isinstance(value(n).shape[1], int))
    ctx = PassContext(mask="interval", input_ids=x, positions=None, mask_buffers=[], block_tensors=[], layout=None,
                      chunks=0, seq_len=value(x).shape[1], example_inputs=[])
    env, refusals = row_states(gm, ctx, trusted=set())
    return refusals, env.states, gm


def _inputs():
    torch.manual_seed(0)
    x = torch.randn(1, S, 8)
    return dict(x=x, xg=x.clone().requires_grad_(), ids=torch.randint(0, S, (1, S)), w=torch.randn(8, 8),
                table=torch.randn(64, 8), w3=torch.randn(8, 8, 3))


SQUARE = r"\[\.\., S, S\]"
LENGTH = r"changes the sequence length"
ROW_MATH = r"computes with row indices as values"


class _Cumsum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.cumsum(1)

    @staticmethod
    def backward(ctx, g):
        return g.flip(1).cumsum(1).flip(1)


def _nonzero_moe(x):
    h = x[0]
    idx = (h[:, 0] > 0).nonzero().squeeze(-1)
    out = torch.zeros_like(h)
    out.index_add_(0, idx, h[idx] * 2.0)
    return out


def _where_moe(x, w):
    h = x[0]
    top = (h @ w).topk(2, dim=-1).indices
    out = torch.zeros_like(h)
    for e in range(2):
        rows, slot = torch.where(top == e)
        out.index_add_(0, rows, h[rows] * (slot[:, None] + 1.0))
    return out


def _setitem_moe(x):
    h = x[0].clone()
    idx = torch.nonzero(h[:, 1] > 0, as_tuple=True)[0]
    h[idx] = h[idx] * 3.0
    return h


def _index_put_moe(x):
    idx = (x[0, :, 0] > 0).nonzero().squeeze(-1)
    return torch.zeros_like(x[0]).index_put_((idx,), x[0][idx] * 2)


# (id, function of the inputs by name, expected: an int (the result's rows dim), None (no
# rows), or a regex the first refusal matches)
CASES = [
    # pointwise and casts
    ("pointwise", lambda x, w: (x * 2 + x.sin()).relu() + w[0], 1),
    ("pointwise-two-row-dims", lambda x: x[:, :, None, :1] + x[:, None, :, :1], SQUARE),
    ("cast", lambda x: x.double().float().contiguous(), 1),
    # random ops: the rows of what they compute (whether a call draws is verify's refusal)
    ("dropout", lambda x: torch.nn.functional.dropout(x, 0.0, training=False) * 2, 1),
    ("random-draw", lambda x: torch.rand_like(x) + x.sigmoid().bernoulli(), 1),
    ("where-masked-fill", lambda x: torch.where(x > 0, x, -x).masked_fill(x < -1, 0.0), 1),
    ("length-as-value", lambda x: x * (x.shape[1] - 1), r"uses the sequence length as a value \(s\d+ - 1"),
    ("length-fill", lambda x: torch.full((1, x.shape[1], 1), x.shape[1]) + x, r"uses the sequence length as a value"),
    # views
    ("view-split-heads", lambda x: x.view(1, x.shape[1], 2, 4), 1),
    ("reshape-merge-rows", lambda x: x.reshape(-1, 4) * 2, 0),
    ("reshape-merge-and-back", lambda x: x.reshape(-1, 4).view(1, x.shape[1], 8), 1),
    ("view-scrambles-rows", lambda x: x.view(1, 8, -1), r"reshapes the rows"),
    ("merged-back-to-wrong-dim", lambda x: x.reshape(-1, 4).view(1, 2, x.shape[1], 4), r"reshapes the rows"),
    ("permute", lambda x: x.transpose(1, 2).permute(0, 2, 1).mT, 2),
    ("unsqueeze-squeeze-expand", lambda x: x.unsqueeze(0).squeeze(0)[:, :, None].expand(1, x.shape[1], 3, 8), 1),
    ("expand-without-rows", lambda x, w: w[0].expand(1, x.shape[1], 8) + x, 1),
    ("repeat-interleave", lambda x: x.repeat_interleave(2, dim=1), 1),
    ("movedim", lambda x: x.movedim(1, 0), 0),
    # indexing
    ("slice-features", lambda x: x[:, :, :4], 1),
    ("slice-rows-shift", lambda x: x[:, 1:], LENGTH),
    ("int-index-row", lambda x: x[:, 0], r"takes one row of the sequence"),
    ("ellipsis", lambda x: x[..., 0], 1),
    ("table-slice", lambda x, table: table[: x.shape[1]] + x[0], r"slices a tensor by the sequence length"),
    ("identity-arange-index", lambda x: x[:, torch.arange(x.shape[1])], 1),
    ("shift-by-arange", lambda x: x[:, (torch.arange(x.shape[1]) - 1).clamp(min=0)], ROW_MATH),
    ("data-index-rows", lambda x, ids: x[:, ids[0]], r"gathers or scatters rows of the sequence"),
    ("select-row", lambda x: x.select(1, 2), r"takes one row"),
    ("narrow-identity", lambda x: x.narrow(1, 0, x.shape[1]), 1),
    ("narrow-shift", lambda x: x.narrow(1, 0, x.shape[1] - 1), LENGTH),
    ("setitem-shift", lambda x: x.clone().__setitem__((slice(None), slice(1, None)), x[:, :-1]), LENGTH),
    ("gather-features", lambda x: x.gather(2, (x > 0).long()), 1),
    ("gather-rows", lambda x: x.gather(1, torch.zeros_like(x, dtype=torch.long)), r"gathers or scatters rows"),
    ("scatter-features", lambda x: torch.zeros_like(x).scatter(2, (x > 0).long(), x), 1),
    ("index-select-shift", lambda x: x.index_select(1, (torch.arange(x.shape[1]) - 1).clamp(min=0)), ROW_MATH),
    # selections of rows (a token-wise mixture of experts)
    ("nonzero-moe", _nonzero_moe, 0),
    ("where-moe", _where_moe, 0),
    ("setitem-moe", _setitem_moe, 0),
    ("selection-capacity", lambda x: x[0][(x[0, :, 0] > 0).nonzero().squeeze(-1)[:2]], LENGTH),
    ("selection-count", lambda x: x * (x[0, :, 0] > 0).nonzero().shape[0], r"count of rows chosen by the data"),
    ("broadcast-tensors", lambda x, w: torch.broadcast_tensors(x, w[0])[1] + x, 1),
    ("masked-select", lambda x: torch.masked_select(x[0, :, 0], x[0, :, 0] > 0) * 2, 0),
    ("index-put-selection", _index_put_moe, 0),
    ("two-selections-mixed", lambda x: x[0][(x[0, :, 0] > 0).nonzero().squeeze(-1)]
     + x[0][(x[0, :, 0] > 0).nonzero().squeeze(-1)], r"do not line up"),
    # along a dim
    ("reduce-features", lambda x: x.sum(-1) + x.mean(-1) + x.amax(-1), 1),
    ("reduce-rows", lambda x: x.sum(1), r"reduces or reorders \(sum\) along the sequence"),
    ("reduce-all", lambda x: x.sum() + x, r"reduces or reorders \(sum\)"),
    ("scan-rows", lambda x: x.cumsum(1), r"is a scan \(cumsum\) along the sequence"),
    ("softmax-features", lambda x: x.softmax(-1), 1),
    ("softmax-rows", lambda x: x.softmax(1), r"\(softmax\) along the sequence"),
    ("sort-rows", lambda x: x.sort(1).values, r"\(sort\) along the sequence"),
    ("topk-features", lambda x: x.topk(2, -1).values, 1),
    ("flip-rows", lambda x: x.flip(1), r"\(flip\)"),
    ("roll-rows", lambda x: torch.roll(x, 1, dims=1), r"\(roll\)"),
    ("diff-rows", lambda x: torch.diff(x, dim=1, prepend=x), r"takes differences along the sequence"),
    ("max-elementwise", lambda x: torch.max(x, x * 2), 1),
    ("max-rows", lambda x: x.max(1).values, r"\(max\)"),
    # norms
    ("layer-norm", lambda x: F.layer_norm(x, (8,)), 1),
    ("rms-norm", lambda x: F.rms_norm(x, (8,)), 1),
    ("layer-norm-rows", lambda x: F.layer_norm(x, x.shape[1:]), r"normalises over the sequence"),
    ("group-norm-rows", lambda x: F.group_norm(x.transpose(1, 2), 2), r"normalises over the sequence"),
    ("normalize", lambda x: F.normalize(x, dim=-1), 1),
    ("batch-norm-train", lambda x: F.batch_norm(x, None, None, training=True), r"normalises over the sequence"),
    # contractions
    ("matmul-features", lambda x, w: x @ w, 1),
    ("matmul-over-rows", lambda x: x.transpose(1, 2) @ x, r"contracts over the sequence"),
    ("scores", lambda x: x @ x.transpose(1, 2), SQUARE),
    ("einsum", lambda x, w: torch.einsum("bsd,de->bse", x, w), 1),
    ("einsum-over-rows", lambda x: torch.einsum("bsd,bse->bde", x, x), r"contracts over the sequence"),
    ("linear-bmm", lambda x, w: torch.bmm(F.linear(x, w), w[None]), 1),
    ("baddbmm", lambda x, w: torch.baddbmm(x, x, w[None]), 1),
    ("sdpa-over-rows", lambda x: F.scaled_dot_product_attention(x[:, None], x[:, None], x[:, None]),
     r"scaled_dot_product_attention that is not provably causal"),
    ("sdpa-rows-as-batch", lambda x: F.scaled_dot_product_attention(*(x.view(1, -1, 2, 4),) * 3), 1),
    # joins and splits
    ("cat-features", lambda x: torch.cat([x, x * 2], -1), 1),
    ("cat-rows", lambda x: torch.cat([x[:, :1] * 0, x], 1), LENGTH),
    ("stack", lambda x: torch.stack([x, x], 0), 2),
    ("split-features", lambda x: x.split(4, -1)[1], 1),
    ("chunk-rows", lambda x: x.chunk(2, 1)[0], r"splits the rows"),
    ("unbind-features", lambda x: x.unbind(2)[0], 1),
    # lookups, convolutions, padding
    ("embedding", lambda ids, table: F.embedding(ids, table), 1),
    ("embedding-by-row-index", lambda ids, table: F.embedding(torch.arange(ids.shape[1])[None], table) + ids[..., None],
     r"reads a table at row indices"),
    ("one-hot", lambda ids: F.one_hot(ids, 16).float(), 1),
    ("conv-over-rows", lambda x, w3: F.conv1d(x.transpose(1, 2), w3), r"is a convolution over the sequence"),
    ("conv-rows-as-batch", lambda x, w3: F.conv1d(x[0, :, None, :].expand(-1, 8, 8), w3), 0),
    ("pad-features", lambda x: F.pad(x, (0, 1)), 1),
    ("pool-rows-as-channels", lambda x: F.avg_pool1d(x, 2), 1),
    ("pool-over-rows", lambda x: F.avg_pool1d(x.transpose(1, 2), 2), r"pools over the sequence"),
    ("pad-rows", lambda x: F.pad(x, (0, 0, 1, 0)), LENGTH),
    ("pad-shift-rows", lambda x: F.pad(x, (0, 0, 1, -1)), r"pads or shifts along the sequence"),
    ("unfold-rows", lambda x: x.unfold(1, 2, 1), LENGTH),
    ("tril-rows", lambda x: torch.tril(x.transpose(1, 2)), r"triangular mask"),
    ("complex", lambda x: torch.view_as_real(torch.view_as_complex(x.view(1, x.shape[1], 4, 2)) * 1j), 1),
    # creation
    ("zeros-like", lambda x: torch.zeros_like(x) + x, 1),
    ("zeros-rows", lambda x: torch.zeros(1, x.shape[1], 8) + x, 1),
    ("ones-square", lambda x: torch.ones(x.shape[1], x.shape[1]).tril() @ x[0], SQUARE),
    ("arange-as-value", lambda x: x * torch.arange(x.shape[1])[None, :, None], ROW_MATH),
    ("arange-offset", lambda x: x * torch.arange(1, x.shape[1] + 1)[None, :, None], r"is an index over the packed row"),
    ("table-read-at-positions", lambda x, ids: torch.cos(torch.arange(2 * x.shape[1]) * 0.1).index_select(0, ids[0])
     * x[0, :, 0], 0),
    ("table-reduced", lambda x: torch.arange(2 * x.shape[1]).float().sum() * x, r"reduces or reorders \(sum\)"),
    ("table-with-rows", lambda x: torch.arange(2 * x.shape[1]).float()[None, : x.shape[1], None] * x, LENGTH),
    # in place
    ("inplace-add", lambda x: x.clone().add_(x).mul_(2), 1),
    ("inplace-copy-flipped", lambda x: x.clone().copy_(x.flip(1)), r"\(flip\)"),
    ("uniform-then-written", lambda x: torch.zeros_like(x).copy_(x).reshape(-1, 4), 0),
    # vmap
    ("vmap-over-rows", lambda x: torch.vmap(lambda r: r.sum(), in_dims=1)(x), 0),
    ("vmap-over-features", lambda x: torch.vmap(lambda c: c * 2, in_dims=2, out_dims=2)(x), 1),
    # subgraphs and the unknown
    ("autograd-function", lambda xg: _Cumsum.apply(xg), r"torch\.autograd\.Function whose body has .*cumsum"),
    ("unknown-op", lambda x: torch.renorm(x, 2, 1, 1.0), r"no row rule of treecompile covers"),
    ("histogram-of-rows", lambda x: torch.histc(x, bins=4), r"counts values over the sequence \(histc\)"),
    ("unknown-op-without-rows", lambda x, w: x + torch.histc(w, bins=8)[:8], 1),
    ("loss-inside", lambda x, ids: F.cross_entropy(x[0], ids[0]) + x, r"computes a loss over the rows"),
    # one step of a recurrent cell over the rows as its batch (x-transformers' GRU gating)
    ("rnn-cell", lambda x: torch._VF.gru_cell(x[0], x[0], torch.randn(24, 8), torch.randn(24, 8)), 0),
]


def _expect_ok(expected, refusals, states, gm):
    assert not refusals, f"refused: {refusals[0][0].format_node()}: {refusals[0][1]}"
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    out = out[0] if isinstance(out, (tuple, list)) else out
    st = states.get(out)
    if expected is None:
        assert st is None, st
    else:
        assert isinstance(st, Rows) and st.dim == expected, st


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_row_rule(case):
    _, fn, expected = case
    inputs = _inputs()
    names = fn.__code__.co_varnames[: fn.__code__.co_argcount]
    refusals, states, gm = judge(fn, *(inputs[n] for n in names))
    if isinstance(expected, str):
        assert refusals, "accepted, expected a refusal matching " + expected
        reason = refusals[0][1]
        assert re.search(expected, reason), f"{refusals[0][0].format_node()}: {reason}"
    else:
        _expect_ok(expected, refusals, states, gm)


def test_every_family_has_a_case():
    """Each rule family of the table has an op that the cases above call (read from this file,
    without capturing every case again)."""
    import inspect
    import re as _re
    import sys

    words = {w.rstrip("_") for w in _re.findall(r"[A-Za-z_][A-Za-z_0-9]*", inspect.getsource(sys.modules[__name__]))}
    words |= {"getitem", "setitem"} | ({"_add_batch_dim"} if "vmap" in words else set())  # x[i], x[i] = v, vmap
    ops: dict[str, set[str]] = {}
    for name, rule in RULES.items():
        ops.setdefault(rule.family, set()).add(name.split("::")[-1])
    untested = sorted(f for f, names in ops.items() if not names & words)
    assert not untested, f"rule families without a case: {untested}"


@pytest.mark.parametrize("op, args, expected", [
    ("item", (), r"reads a value of the rows on the host"),
    ("tolist", (), r"reads a value of the rows on the host"),
], ids=["item", "tolist"])
def test_host_reads_of_rows_are_refused(op, args, expected):
    """Dynamo breaks the graph at ``.item()`` / ``.tolist()`` on a tensor of rows; a graph
    that still holds one (built by hand here) is refused."""
    inputs = _inputs()
    gm = _capture(lambda x: x * 2, [inputs["x"]])
    out = next(n for n in gm.graph.nodes if n.op == "output")
    mul = out.args[0][0] if isinstance(out.args[0], (tuple, list)) else out.args[0]
    with gm.graph.inserting_before(out):
        gm.graph.call_method(op, (mul, *args))
    x = next(n for n in gm.graph.nodes if n.op == "placeholder" and isinstance(value(n), torch.Tensor))
    ctx = PassContext(mask="interval", input_ids=x, positions=None, mask_buffers=[], block_tensors=[], layout=None,
                      chunks=0, seq_len=value(x).shape[1], example_inputs=[])
    _, refusals = row_states(gm, ctx, trusted=set())
    assert refusals and re.search(expected, refusals[0][1]), refusals


@pytest.mark.parametrize("attr, ok", [("mT", True), ("real", True), ("grad_fn", False)])
def test_tensor_attributes(attr, ok):
    """``getattr(x, name)`` nodes: transposes and views keep the rows; another attribute of a
    tensor with rows is refused (no rule proves it)."""
    import builtins

    inputs = _inputs()
    gm = _capture(lambda x: x * 2, [inputs["x"]])
    out = next(n for n in gm.graph.nodes if n.op == "output")
    mul = out.args[0][0] if isinstance(out.args[0], (tuple, list)) else out.args[0]
    with gm.graph.inserting_before(out):
        node = gm.graph.call_function(builtins.getattr, (mul, attr))
    fake = value(mul)
    node.meta["example_value"] = fake.mT if attr == "mT" else fake
    x = next(n for n in gm.graph.nodes if n.op == "placeholder" and isinstance(value(n), torch.Tensor))
    ctx = PassContext(mask="interval", input_ids=x, positions=None, mask_buffers=[], block_tensors=[], layout=None,
                      chunks=0, seq_len=value(x).shape[1], example_inputs=[])
    env, refusals = row_states(gm, ctx, trusted=set())
    if ok:
        assert not refusals and isinstance(env.states[node], Rows), refusals
    else:
        assert refusals and "no row rule covers" in refusals[0][1] or "attribute" in refusals[0][1], refusals


def test_the_rule_table_in_the_passes_readme_is_current():
    from pathlib import Path

    from treecompile.passes.rows import FAMILIES, rule_table

    assert {r.family for r in RULES.values()} == set(FAMILIES)
    readme = (Path(__file__).resolve().parents[1] / "passes" / "README.md").read_text()
    table = readme.split("<!-- row-rules -->\n")[1].split("<!-- /row-rules -->")[0]
    assert table == rule_table(), "passes/README.md's row rules are out of date: run python scripts/row_rules_table.py"


#: How torch >= 2.14 records the transposes (``x.T`` as ``aten.numpy_T``, ...), where 2.13 records
#: ``getattr(x, "T")``: (aten op, the attribute it stands for).
ATEN_TRANSPOSES = [("numpy_T", "T"), ("mT", "mT"), ("matrix_H", "H"), ("mH", "mH")]


@pytest.mark.parametrize("op, attr", ATEN_TRANSPOSES, ids=[a for a, _ in ATEN_TRANSPOSES])
@pytest.mark.parametrize("spelling", ["aten", "getattr"])
def test_transposes_in_both_spellings(op, attr, spelling):
    """``x.T`` / ``x.mT`` / ``x.H`` / ``x.mH`` move the rows as the view they are, whether the
    graph records an aten op (torch >= 2.14) or ``getattr`` (2.13): on ``x [S, 8]`` (``T``,
    ``H``: of a matrix) and on ``x [1, S, 8]`` (``mT``, ``mH``)."""
    import builtins

    inputs = _inputs()
    matrix = attr in ("T", "H")
    gm = _capture((lambda x: x[0] * 2) if matrix else (lambda x: x * 2), [inputs["x"]])
    out = next(n for n in gm.graph.nodes if n.op == "output")
    mul = out.args[0][0] if isinstance(out.args[0], (tuple, list)) else out.args[0]
    with gm.graph.inserting_before(out):
        if spelling == "aten":
            node = gm.graph.call_function(getattr(torch.ops.aten, op).default, (mul,))
        else:
            node = gm.graph.call_function(builtins.getattr, (mul, attr))
    node.meta["example_value"] = getattr(value(mul), attr)
    x = next(n for n in gm.graph.nodes if n.op == "placeholder" and isinstance(value(n), torch.Tensor))
    ctx = PassContext(mask="interval", input_ids=x, positions=None, mask_buffers=[], block_tensors=[], layout=None,
                      chunks=0, seq_len=value(x).shape[1], example_inputs=[])
    env, refusals = row_states(gm, ctx, trusted=set())
    assert not refusals, refusals
    shape = [S, 8] if matrix else [1, S, 8]
    expected = list(getattr(torch.empty(shape), attr).shape).index(S)
    assert isinstance(env.states[node], Rows) and env.states[node].dim == expected, (env.states[node], expected)
