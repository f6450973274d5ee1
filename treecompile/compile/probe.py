"""The first-call probe: metamorphic runs of each new graph that catch what no rule saw.

``tree_compile`` proves every node of a captured graph row-local or refuses it
(:mod:`treecompile.passes.rows`). The probe checks the result as a black box, on the
first call and after every recompile, unless ``verify=False``. It runs the rewritten
graph (eagerly, without gradients) on a small forest built from the batch's own tokens,
twice more with a change that per-path training says must not matter, and compares:

1. **A branch edited.** The tokens of one subtree change. Every row outside it must come out
   identical, bit for bit: nothing outside a subtree reads it (the graph is the same, the
   shapes are the same, and each row's computation reads the same values). A bidirectional
   layer, a difference with the previous packed row or a statistic over the whole row
   changes rows of other branches. (Where an expert's matmul takes the rows a router sends
   it, an edit elsewhere changes its size and so the rounding; there, and for a kernel that
   varies from run to run, the comparison allows 64 units of rounding of the model's dtype.)
2. **A path alone.** The last path of the forest, packed alone, must give the rows it gets
   inside the forest, positions included, up to rounding (other shapes sum in another
   order). A position computed from the row index, or anything that depends on the packed
   row's length, changes them.

Both need no float64 copy and no second model: they hold in any dtype. On a mismatch the
graph is run again node by node to name the first op whose result differs, with its
module and source line, and the model is refused. ``verify=True`` adds the full check
against per-path training (:mod:`treecompile.compile.selfcheck`).
"""

from __future__ import annotations

import dataclasses
import time
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import fx

from treecompile.compile.graph_inputs import GRAPH_ARGS
from treecompile.core.batch import TreeBatch, pack
from treecompile.core.errors import BatchRefused, UnsupportedModelError
from treecompile.core.tree import TrajectoryTree
from treecompile.passes._graph import MATMUL

if TYPE_CHECKING:
    from treecompile.passes.pipeline import CompileRecord

__all__ = ["ProbeReport", "ProbeRefused", "probe_graph", "probe_hook", "probe_new_graphs", "probe_record", "PROBE_TOLERANCE",
           "downcast_dtype", "less_precise", "products_dtype", "rounding_dtype"]

#: The "path alone" check's tolerance, relative to ``max(1, |log-prob|)``, by the dtype the
#: model computes in: rounding of the same values summed in another order (other shapes),
#: through every layer. A row-index position or a length-dependent value moves log-probs by
#: far more in any model that reads them.
PROBE_TOLERANCE = {torch.float64: 1e-9, torch.float32: 2e-4, torch.bfloat16: 6e-2, torch.float16: 1e-2}


class ProbeRefused(UnsupportedModelError):
    """The probe's refusal of a graph: the wrapper keeps it and raises it at every later call
    (the graph stays in Dynamo's cache, so a later call would not probe it again)."""


@dataclass
class ProbeReport:
    """What the probe of one compiled graph checked.

    Attributes:
        rows: rows of the probe forest.
        edited_rows_compared: rows outside the edited subtree compared bit for bit (or to
            rounding, with data-dependent sizes).
        alone_rows_compared: rows of the path run alone compared; 0 if that check was skipped.
        edit_tolerance: 0.0 when the edited rows were compared bit for bit, else the relative
            tolerance used (rows chosen by the data, or a kernel that varies run to run).
        alone_tolerance: the path-alone check's relative tolerance (`PROBE_TOLERANCE`).
        alone_max_diff: the largest relative difference the path-alone check saw.
        skipped: why a check did not run (e.g. the model draws random numbers in this mode).
        seconds: wall time of the probe.
    """

    rows: int
    edited_rows_compared: int
    alone_rows_compared: int
    edit_tolerance: float = 0.0
    alone_tolerance: float = 0.0
    alone_max_diff: float = 0.0
    skipped: list[str] = field(default_factory=list)
    seconds: float = 0.0


@dataclass
class _Forest:
    """The probe batches: the forest, the forest with one subtree's tokens changed (rows
    ``edit`` of the packed row), and one of its paths alone (its rows ``alone_rows`` in the forest)."""

    batch: TreeBatch
    edited: TreeBatch | None
    edit: range
    alone: TreeBatch
    alone_rows: list[int]


def probe_forest(batch: TreeBatch, vocab_size: int | None, *, bitmask: bool) -> _Forest:
    """The probe forest from ``batch``'s tokens: a root with two children, the second with two
    children of its own, a path ending inside, and a second tree; no path is longer than the
    batch's longest."""
    ids = batch.input_ids.cpu().tolist()
    longest = int(batch.position_ids.max()) + 1
    seg = max(1, min(6, longest // 3))
    pool = ids or [0]

    def take(n: int, at: int) -> list[int]:
        return [pool[(at + i) % len(pool)] for i in range(n)]

    root, b1, b2 = take(seg, 0), take(seg, seg), take(seg, 2 * seg)
    c1, c2, other = take(seg, 3 * seg), take(seg, 4 * seg), take(seg, 5 * seg)
    # Children of one node must start differently to branch: change a first token if needed.
    b2[0], c2[0] = _differ(b2[0], b1[0], pool, vocab_size), _differ(c2[0], c1[0], pool, vocab_size)
    paths = [root + b1, root + b2 + c1, root + b2 + c2, root + b2]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a probe forest's POR is no advice to give
        packed = pack([TrajectoryTree.from_sequences(paths), TrajectoryTree.from_sequences([other])],
                      path_bits=bitmask)
        # The path whose rows are spread most over the packed row (the root's rows first, its own
        # after other branches'): alone, every row of it moves.
        spread = max(range(packed.num_paths), key=lambda p: _gap(packed.path_rows(p).tolist()))
        alone_rows = packed.path_rows(spread).tolist()
        alone = pack([TrajectoryTree.from_sequences([packed.input_ids[alone_rows].tolist()])],
                     path_bits=bitmask)
    if bitmask and batch.path_bits is not None:
        # The graph unrolls the path-bit chunks: the probe batches have the batch's count.
        packed, alone = (_with_chunks(b, batch.path_bits.shape[1]) for b in (packed, alone))
    edit = _edited_subtree(packed)
    new_ids = packed.input_ids.clone()
    for r in edit:
        new_ids[r] = _differ(int(new_ids[r]), int(new_ids[r]), pool, vocab_size)
    same = torch.equal(new_ids, packed.input_ids)
    edited = None if same else dataclasses.replace(packed, input_ids=new_ids)
    return _Forest(packed, edited, edit, alone, alone_rows)


def _with_chunks(batch: TreeBatch, chunks: int) -> TreeBatch:
    """``batch`` with its path bits widened to ``chunks`` columns (the new ones empty)."""
    bits = batch.path_bits
    extra = chunks - bits.shape[1]
    if extra <= 0:
        return batch
    return dataclasses.replace(batch, path_bits=torch.cat([bits, bits.new_zeros(bits.shape[0], extra)], 1))


def _gap(rows: list[int]) -> int:
    return rows[-1] - rows[0] + 1 - len(rows)


def _differ(token: int, other: int, pool: list[int], vocab_size: int | None) -> int:
    """``token`` if it differs from ``other``, else another token of the pool (or vocabulary)."""
    if token != other:
        return token
    for t in pool:
        if t != other:
            return t
    if vocab_size and vocab_size > 1:
        return (other + 1) % vocab_size
    return token


def _edited_subtree(batch: TreeBatch) -> range:
    """The rows of a subtree that has a later sibling (whose rows follow it in the packed row)
    and an ancestor before it: edits there reach both if the model mixes rows."""
    parents = batch.node_parent.tolist()
    starts = batch.node_start.tolist()
    for n, p in enumerate(parents):
        later = [m for m in range(n + 1, len(parents)) if parents[m] == p]
        if p >= 0 and later:
            r = starts[n]
            return range(r, int(batch.subtree_end[r]))
    r = starts[-1]
    return range(r, int(batch.subtree_end[r]))


def probe_new_graphs(wrapper: Any, records: list[CompileRecord], batch: TreeBatch) -> None:
    """Probes each graph compiled by the wrapper's latest call that is not probed yet (see
    `probe_record`)."""
    for record in records:
        probe_record(wrapper, record, batch)


def probe_hook(wrapper: Any) -> Callable[[CompileRecord], None]:
    """``hook(record)``: the first-call probe of a new graph of ``wrapper``, run inside the
    graph's first call before the state it writes reaches the model
    (`treecompile.passes.state`), on the batch of the call running (``wrapper._call_batch``).
    It holds the wrapper weakly: the compiled graph, which holds the hook, lives in Dynamo's
    caches as long as the process (see `treecompile.capture.call.compile_named`)."""
    ref = weakref.ref(wrapper)

    def hook(record: CompileRecord) -> None:
        w = ref()
        if w is not None and w._call_batch is not None:
            probe_record(w, record, w._call_batch)

    return hook


def probe_record(wrapper: Any, record: CompileRecord, batch: TreeBatch) -> None:
    """Probes the graph of ``record`` into ``wrapper.probed``, once; the compiled call runs it
    at the graph's first call, before the state the graph writes is written back into the
    model. A refusal is a `ProbeRefused` (the wrapper keeps it); a failure of the probe itself
    is a warning (the rules alone proved the graph)."""
    from treecompile.core.advice import TreeWarning

    if record.probe_graph is None or record.last_args is None:
        return
    try:
        wrapper.probed.append(probe_graph(wrapper, record, batch))
    except BatchRefused as e:  # the forest hit what the model leaves to chance; the call's batch may not
        wrapper.probed.append(ProbeReport(rows=0, edited_rows_compared=0, alone_rows_compared=0,
                                          skipped=[f"the probe forest: {str(e).splitlines()[0]}"]))
    except UnsupportedModelError:
        raise
    except Exception as e:
        warnings.warn(f"treecompile: the first-call probe could not run ({type(e).__name__}: {e}); the graph was "
                      "proven row-local by the rules alone", TreeWarning, stacklevel=3)
    finally:
        record.last_args, record.probe_graph = None, None  # probed once: keep neither


def probe_graph(wrapper: Any, record: CompileRecord, batch: TreeBatch) -> ProbeReport:
    """Runs the probe on the graph of ``record``; raises `UnsupportedModelError` naming the
    first op whose rows differ where per-path training says they cannot."""
    start = time.perf_counter()
    gm = record.probe_graph
    forest = probe_forest(batch, wrapper._vocab_size, bitmask=wrapper.mask == "bitmask")
    with wrapper._state.kept():  # the probe's own calls set the state for their batches
        run = _Runner(wrapper, record, gm)
        base = run(forest.batch)
        report = ProbeReport(rows=forest.batch.num_tokens, edited_rows_compared=0, alone_rows_compared=0)
        # Two runs under different seeds differ if the model draws random numbers (then a third
        # under the first seed is equal) or a kernel varies from run to run (it is not).
        varies = not torch.equal(base, run(forest.batch, seed=1))
        random = varies and torch.equal(base, run(forest.batch))
        outside = [r for r in range(forest.batch.num_tokens) if r not in forest.edit]
        # Rounding may differ between runs where the shapes depend on the data (rows chosen by a
        # router) or where a kernel varies from run to run.
        data_dependent = _has_unbacked_sizes(gm) or _routes_experts(record) or varies and not random
        # Products over another number of rows round differently: their least precise dtype is the
        # model's (a float64 model whose router casts to float32 rounds like a float32 one there), and
        # so does a value cast down to a less precise dtype (a float64 model's float32 softmax).
        computes = rounding_dtype(gm, wrapper_dtype(wrapper))
        if forest.edited is None:
            report.skipped.append("branch edit: the batch has a single token value")
        elif random:
            report.skipped.append("branch edit and path alone: the model draws random numbers (dropout in training "
                                  "mode), so two runs differ anyway")
        else:
            edited = run(forest.edited)
            tol = _rounding(computes) if data_dependent else 0.0
            bad = _first_bad(base, edited, outside, outside, tol)
            report.edited_rows_compared, report.edit_tolerance = len(outside), tol
            if bad is not None:
                raise _refusal(run, forest.batch, forest.edited, outside, outside, tol, bad, "edit")
        if not random:
            alone = run(forest.alone)
            rows_alone = list(range(len(forest.alone_rows)))
            tol = PROBE_TOLERANCE.get(computes, 1e-3)
            bad = _first_bad(base, alone, forest.alone_rows, rows_alone, tol)
            report.alone_rows_compared, report.alone_tolerance = len(rows_alone), tol
            report.alone_max_diff = _relative_diff(base[forest.alone_rows], alone[rows_alone])
            if bad is not None:
                raise _refusal(run, forest.batch, forest.alone, forest.alone_rows, rows_alone, tol, bad, "alone")
    report.seconds = time.perf_counter() - start
    return report


def wrapper_dtype(wrapper: Any) -> torch.dtype:
    p = next(iter(wrapper.parameters()), None)
    return p.dtype if p is not None and p.dtype.is_floating_point else torch.float32


#: The ops whose rounding depends on how many rows they take (a blocked matrix product).
_PRODUCTS = {*MATMUL, F.linear, torch._C._nn.linear, torch.mm, torch.addmm, torch.baddbmm, torch.einsum, F.conv1d,
             F.conv2d, *([F.grouped_mm] if hasattr(F, "grouped_mm") else []),
             *([torch._grouped_mm] if hasattr(torch, "_grouped_mm") else [])}
_PRODUCT_METHODS = {"matmul", "mm", "bmm", "addmm", "baddbmm", "__matmul__"}


def products_dtype(gm: fx.GraphModule, default: torch.dtype) -> torch.dtype:
    """The least precise floating dtype a matrix product of ``gm`` computes in (``default`` if
    every product is at least as precise)."""
    worst = default
    for n in gm.graph.nodes:
        if (n.op == "call_function" and n.target in _PRODUCTS) or (n.op == "call_method" and n.target in
                                                                    _PRODUCT_METHODS):
            v = n.meta.get("example_value")
            if isinstance(v, torch.Tensor) and v.dtype.is_floating_point and \
                    torch.finfo(v.dtype).eps > torch.finfo(worst).eps:
                worst = v.dtype
    return worst


def less_precise(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    """The less precise of two floating dtypes."""
    return b if torch.finfo(b).eps > torch.finfo(a).eps else a


def downcast_dtype(gm: Any, default: torch.dtype) -> torch.dtype:
    """The least precise floating dtype ``gm`` casts a more precise value to (a float64 model's
    norm in float32), or ``default`` if that is less precise: the rounding the model's own run
    and the graph's, summing in other orders, may differ by. (A table kept in a low precision
    and read as it is rounds nothing.)"""
    worst = default
    for n in gm.graph.nodes:
        v = n.meta.get("example_value")
        if not isinstance(v, torch.Tensor) or not v.is_floating_point():
            continue
        ins = [a.meta.get("example_value") for a in n.all_input_nodes]
        if any(isinstance(x, torch.Tensor) and x.is_floating_point() and less_precise(x.dtype, v.dtype) is v.dtype
               and x.dtype is not v.dtype for x in ins):
            worst = less_precise(worst, v.dtype)
    return worst


def rounding_dtype(gm: Any, default: torch.dtype) -> torch.dtype:
    """The dtype whose rounding the graph ``gm``'s results and the model's own run on a path may
    differ by: the least precise of ``default`` (the model's), its products' (`products_dtype`)
    and what it casts down to (`downcast_dtype`)."""
    return downcast_dtype(gm, products_dtype(gm, default))


def _rounding(dtype: torch.dtype) -> float:
    return 64 * torch.finfo(dtype if dtype.is_floating_point else torch.float32).eps


def _routes_experts(record: CompileRecord) -> bool:
    """Whether the graph has mixture-of-experts regions: each expert's matmul takes as many rows
    as the router sends it, which an edit elsewhere changes (and with it the rounding)."""
    return bool(record.counters.get("check_moe_regions_pass", {}).get("experts"))


def _has_unbacked_sizes(gm: fx.GraphModule) -> bool:
    for n in gm.graph.nodes:
        v = n.meta.get("example_value")
        if isinstance(v, torch.Tensor):
            for d in v.shape:
                if isinstance(d, torch.SymInt) and any(str(s).startswith("u") for s in d.node.expr.free_symbols):
                    return True
    return False


def _relative_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.double(), y.double()
    return float(((x - y).abs() / x.abs().clamp(min=1.0)).max()) if x.numel() else 0.0


def _first_bad(a: torch.Tensor, b: torch.Tensor, rows_a: list[int], rows_b: list[int], tol: float) -> int | None:
    """The first position ``i`` where ``a[rows_a[i]]`` and ``b[rows_b[i]]`` differ beyond ``tol``."""
    x, y = a[rows_a].double(), b[rows_b].double()
    if tol == 0.0:
        bad = (x != y) & ~(x.isnan() & y.isnan())
    else:
        bad = (x - y).abs() > tol * x.abs().clamp(min=1.0)
    idx = torch.nonzero(bad.reshape(bad.shape[0], -1).any(-1)).flatten()
    return None if idx.numel() == 0 else int(idx[0])


class _Runner:
    """Runs the rewritten graph on a batch: the batch's tensors in place of the recorded
    call's, every other input (parameters, buffers) as recorded."""

    def __init__(self, wrapper: Any, record: CompileRecord, gm: fx.GraphModule) -> None:
        self.wrapper, self.record, self.gm = wrapper, record, gm

    def args(self, batch: TreeBatch) -> list:
        device = next(iter(self.wrapper.parameters())).device
        batch = batch.padded(2).to(device)
        local = dict(zip(GRAPH_ARGS, self.wrapper._inputs(batch)))
        out = []
        for source, real in zip(self.record.sources, self.record.last_args):
            root = source.split("]")[0][3:-1] if source.startswith("L['") else None
            out.append(eval(source, {"L": local}) if root in local else real)  # noqa: S307 (Dynamo's source names)
        return out

    def __call__(self, batch: TreeBatch, seed: int = 0, interpreter: fx.Interpreter | None = None) -> torch.Tensor:
        args = self.args(batch)
        if self.record.state is not None:
            # The state the graph writes, computed for this batch on copies: the model's own
            # tensors are never written by the probe.
            with torch.no_grad():
                args = self.record.state.prepare(args)[0]
        devices = [a.device for a in args if isinstance(a, torch.Tensor) and a.device.type == "cuda"][:1]
        with torch.no_grad(), torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            out = interpreter.run(*args) if interpreter is not None else self.gm(*args)
        return out[1].detach()


class _Recorder(fx.Interpreter):
    """Keeps every node's result."""

    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm, garbage_collect_values=False)
        self.values: dict[fx.Node, Any] = {}

    def run_node(self, n: fx.Node) -> Any:
        out = super().run_node(n)
        self.values[n] = out
        return out


def _refusal(run: _Runner, batch_a: TreeBatch, batch_b: TreeBatch, rows_a: list[int], rows_b: list[int], tol: float,
             bad: int, kind: str) -> UnsupportedModelError:
    """The model's refusal, naming the first node whose rows differ."""
    rec_a, rec_b = _Recorder(run.gm), _Recorder(run.gm)
    run(batch_a, interpreter=rec_a)
    run(batch_b, interpreter=rec_b)
    # The probe's graph is a copy of the judged one: its nodes have the same names.
    states = {n.name: st for n, st in (run.record.row_states or {}).items()}
    culprit = _first_differing_node(run.gm, rec_a.values, rec_b.values, states, rows_a, rows_b, tol)
    from treecompile.passes._graph import describe, location_of, source_of

    path_row = rows_a[bad]
    if kind == "edit":
        how = ("changes when only the tokens of another branch change: the model mixes tokens of different paths "
               "(an op over the whole packed row, such as attention without a causal mask, a difference or a shift "
               "along the sequence, or a statistic over all tokens)")
    else:
        how = ("differs from the same token's row when its path runs alone: the model depends on where a token sits in "
               "the packed row or on the other paths (a position computed from the row index, a value computed from "
               "the row count)")
    tail = ("No row rule flagged this op, so please report it. tree_compile(verify=False) skips the probe; the model "
            "would then train silently wrong.")
    if culprit is None:
        where, src, module = f"the log-prob of row {path_row}", "", ""
    else:
        if culprit[0].name in run.record.created:
            tail = ("The op is one treecompile inserted in place of the model's (e.g. its tree attention): an internal "
                    "error, please report it.")
        node, row = culprit
        where = f"{describe(node)} at {location_of(node)}"
        module = _module_of(node)
        module = f" (in {module})" if module else ""
        src = f"\n  at {source_of(node)}"
        path_row = row
    return ProbeRefused(
        f"treecompile cannot make this model exact on a tree: the first-call probe found that {where}{module} "
        f"{how} (row {path_row} of the probe forest).{src}\n{tail}"
    )


def _module_of(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path, _ = list(stack.values())[-1]
    path = str(path)
    for prefix in ("L['inner']", "L['self']"):
        path = path.replace(prefix, "model")
    return path.replace("._modules['", ".").replace("']", "")


def _first_differing_node(gm: fx.GraphModule, a: dict, b: dict, states: dict, rows_a: list[int], rows_b: list[int],
                          tol: float) -> tuple[fx.Node, int] | None:
    """The first node (graph order) whose compared rows differ, and the row."""
    from treecompile.passes.rows import Rows

    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output") or node not in a or node not in b:
            continue
        va, vb = a[node], b[node]
        if not (isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor)) or not va.dtype.is_floating_point:
            continue
        st = states.get(node.name)
        if isinstance(st, Rows) and st.key is None and st.ids is None:
            ra, rb = _rows_view(va, st), _rows_view(vb, st)
            if ra is None or rb is None:
                continue
            if max(rows_a) >= ra.shape[0] or max(rows_b) >= rb.shape[0]:
                continue
            bad = _first_bad(ra, rb, rows_a, rows_b, tol)
            if bad is not None:
                return node, rows_a[bad]
        elif st is None and va.shape == vb.shape and tol == 0.0 and not torch.equal(va, vb):
            return node, rows_a[0]
    return None


def _rows_view(v: torch.Tensor, st: Any) -> torch.Tensor | None:
    """``v`` with its rows first: ``[S, ...]`` (merged dims split out), or None."""
    try:
        inner = int(st.inner)
    except TypeError:
        return None
    x = v.movedim(st.dim, 0)
    size = x.shape[0]
    if inner == 1 and size % 1 == 0:
        # rows are the dim or its inner part ([B * S]): with a batch of 1 both are the rows
        return x.reshape(size, -1) if x.dim() > 1 else x.reshape(size, 1)
    rows = size // inner
    return x.reshape(rows, inner, -1).reshape(rows, -1)
