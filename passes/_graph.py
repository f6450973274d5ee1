"""Small FX helpers shared by the passes: the pass context, op matching, shapes, sources.

Dynamo's graphs hold torch-level calls (``call_function`` on ``torch.*`` / ``operator.*``
and ``call_method`` on tensors), so matchers here accept every spelling of an op.
"""

from __future__ import annotations

import contextlib
import functools
import operator
import os
import sys
import weakref
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx

from treecompile.kernels.attention.flex import BlockLayout
from treecompile.passes._functorch_ops import STATE_SWITCHES, functorch_state_nodes, uses_functorch_levels

__all__ = ["PassContext", "Emitter", "emit", "is_call", "is_op", "value", "row_dims", "is_row_size", "source_of", "location_of", "describe", "bind", "ancestors", "table_length",
           "new_dims_only", "version_of", "writers_of", "inputs_by_memory"]


@dataclass
class PassContext:
    """What every pass may read: the tree tensors as graph nodes, and the rewrite counters.

    Attributes:
        mask: ``"interval"`` or ``"bitmask"``.
        input_ids: the ``[1, S]`` ids placeholder.
        positions: the ``[S]`` tree positions placeholder.
        mask_buffers: the placeholders the tree ``mask_mod`` reads, in
            :data:`treecompile.kernels.attention.masks.MASK_KINDS` order.
        block_tensors: the BlockMask tensor placeholders.
        layout: the BlockMask tuple layout.
        chunks: ``path_bits.shape[1]`` (bitmask rule), else 0.
        seq_len: S, an int or the SymInt of the traced graph.
        example_inputs: the backend's example inputs, aligned with the placeholders.
        counters: per pass function name, a Counter of rewrites by kind.
        pass_name: the name of the pass now running; :meth:`count` records under it.
        created: nodes the passes inserted (the verify pass trusts them).
        off_rows: nodes whose dims of the row count's size are not rows (a pass's tables over
            distances; a model's table over ``arange(S)`` read only at positions): no row state,
            so the first-call probe does not compare them as rows.
        notes: per node, why a pass left it alone (quoted by the verify pass).
        pred_index: the ``[S]`` placeholder of each row's predecessor on its path (-1 at a
            root), when the call passes the path structure (else None); with it the ``[N, 3]``
            CPU ``node_table`` (start row, end row, parent node per tree node).
        path_count: the ``[S]`` placeholder of the paths through each row (`passes.counters`).
        max_rows: the longest path for which what the passes judged from example values
            holds (a structural mask evaluated at the example length S shows its pattern for
            sequences up to S only); None if nothing was judged that way. The wrapper
            recompiles for a batch with a longer path.
        probe_rows: the length at which to judge such things when it exceeds the example
            length (the wrapper asks for twice the longest path it has seen), or 0.
        judge_cap: the size of a buffer the wrapper extended for the call (the model slices it
            by the row count past its size): masks are judged at most this long, or 0.
        dropout: ``"refuse"``: a random op in the graph (dropout in training mode) is refused;
            ``"shared"``: accepted, one draw per tree row (see ``tree_compile(dropout=...)``).
        scan_kernel: the scan kernel the tree forms of recurrent layers run with, a name
            of :data:`treecompile.kernels.scans.recurrence.SCAN_KERNELS`.
        row_states: per node, where its rows are (:class:`treecompile.passes.rows.Rows`), as
            the verify pass proved them; the first-call probe compares those rows.
        state: the tensors the model writes in place and how the call computes them
            (:class:`treecompile.passes.state.StateWrites`), or None: a value judged by
            evaluation reads what the call writes (`treecompile.passes._mask_eval.evaluate`).
        judged: the indices of the graph inputs an evaluation read (what is judged holds
            for their values at the compile; the backend guards the model's tensors among
            them, see `treecompile.passes.pipeline.JudgedInputChanged`).
    """

    mask: str
    input_ids: fx.Node
    positions: fx.Node
    mask_buffers: list[fx.Node]
    block_tensors: list[fx.Node]
    layout: BlockLayout
    chunks: int
    seq_len: Any
    example_inputs: list[Any]
    counters: dict[str, Counter] = field(default_factory=dict)
    created: set[fx.Node] = field(default_factory=set)
    off_rows: set[fx.Node] = field(default_factory=set)
    notes: dict[fx.Node, str] = field(default_factory=dict)
    pred_index: fx.Node | None = None
    node_table: fx.Node | None = None
    path_count: fx.Node | None = None
    max_rows: int | None = None
    probe_rows: int = 0
    judge_cap: int = 0
    scan_kernel: str = "auto"
    dropout: str = "refuse"
    pass_name: str = ""
    row_states: dict[fx.Node, Any] = field(default_factory=dict)
    state: Any = None
    judged: set[int] = field(default_factory=set)

    def count(self, kind: str, n: int = 1) -> None:
        """Adds ``n`` rewrites of ``kind`` to the running pass's counter."""
        if not self.pass_name:
            raise RuntimeError("treecompile internal error: a pass counted outside run_passes")
        self.counters.setdefault(self.pass_name, Counter())[kind] += n

    def mark(self, node: fx.Node, like: fx.Node | None = None, rows: bool = True) -> fx.Node:
        """Records ``node`` as created by a pass (source info from ``like``; `off_rows` if not ``rows``)."""
        self.created.add(node)
        if not rows:
            self.off_rows.add(node)
        if like is not None:
            for key in ("stack_trace", "nn_module_stack", "source_fn_stack"):
                if key in like.meta:
                    node.meta[key] = like.meta[key]
        return node


# Every spelling Dynamo records for the ops the passes look for.
SDPA = {F.scaled_dot_product_attention, torch.ops.aten.scaled_dot_product_attention.default}
#: Its arguments in order, and their defaults (for `bind`).
SDPA_ARGS = ["query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa"]
SDPA_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}
SOFTMAX = {torch.softmax, F.softmax, torch.ops.aten._softmax.default, torch.ops.aten.softmax.int}
MATMUL = {operator.matmul, torch.matmul, torch.bmm, torch.ops.aten.matmul.default, torch.ops.aten.bmm.default}
PADS = {F.pad, torch._C._nn.pad, torch.constant_pad_nd}  # F.pad inlines to torch._C._nn.pad
CATS = {torch.cat, torch.concat, torch.concatenate}
ARANGE = {torch.arange, torch.ops.aten.arange.default, torch.ops.aten.arange.start, torch.ops.aten.arange.start_step}


def is_call(node: fx.Node, functions: Iterable[Callable] = (), methods: Iterable[str] = ()) -> bool:
    """True if ``node`` calls one of ``functions`` or a tensor method named in ``methods``."""
    if node.op == "call_function":
        return node.target in set(functions)
    if node.op == "call_method":
        return node.target in set(methods)
    return False


def bind(node: fx.Node, names: list[str], defaults: dict[str, Any]) -> dict[str, Any]:
    """The node's arguments by name (positional then keyword), with defaults filled in."""
    out = dict(defaults)
    out.update(dict(zip(names, node.args)))
    out.update(node.kwargs)
    return out


def is_op(node: fx.Node, packet: Any) -> bool:
    """Whether ``node`` calls the custom op ``packet`` (Dynamo records the packet or ``.default``)."""
    return node.op == "call_function" and (node.target is packet or node.target is getattr(packet, "default", None))


def value(node: Any) -> Any:
    """The example value Dynamo recorded for ``node`` (a FakeTensor, SymInt, ...), or the constant."""
    if isinstance(node, fx.Node):
        return node.meta.get("example_value", node.meta.get("val"))
    return node


def same_size(a: Any, b: Any) -> bool:
    """Whether two sizes are provably equal, without adding guards."""
    if isinstance(a, fx.Node):
        a = value(a)
    if isinstance(b, fx.Node):
        b = value(b)
    if isinstance(a, torch.SymInt) or isinstance(b, torch.SymInt):
        env = (a if isinstance(a, torch.SymInt) else b).node.shape_env
        # The passes ask about the same few pairs of sizes for every node (each dim against
        # S): the answer per pair of expressions is kept with the shape environment, for as
        # long as it has the same facts (guards, replacements and runtime asserts).
        known = _SAME_SIZE.setdefault(env, {}) if env is not None else {}
        key = (len(env.guards), len(env.replacements), getattr(env, "num_deferred_runtime_asserts", 0),
               _size_key(a), _size_key(b)) if env is not None else None
        if key not in known:
            from torch.fx.experimental.symbolic_shapes import statically_known_true

            try:
                known[key] = bool(statically_known_true(a == b))
            except Exception:
                known[key] = False
        return known[key]
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    return False


#: Per shape environment, `same_size`'s answers by the pair of sizes' expressions.
_SAME_SIZE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _size_key(size: Any) -> Any:
    return size.node.expr if isinstance(size, torch.SymInt) else (type(size), size)


def ancestors(node: fx.Node) -> set[fx.Node]:
    """All nodes ``node`` depends on, itself excluded."""
    return _add_upstream(node.all_input_nodes, set())


def _add_upstream(nodes: Iterable[fx.Node], seen: set[fx.Node]) -> set[fx.Node]:
    """Adds ``nodes`` and everything they depend on to ``seen`` (skipping what it holds); returns it."""
    stack = list(nodes)
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return seen


_TORCH_DIR = os.path.dirname(torch.__file__)


@functools.cache
def _own_dirs() -> tuple[str, ...]:
    """treecompile's own source folders (its drop-ins and kernels run inside the model's calls)."""
    # The package and its two sub-packages are imported before this module can run.
    names = ("treecompile", "treecompile.passes", "treecompile.kernels")
    return tuple(os.path.dirname(sys.modules[n].__file__) + os.sep for n in names)


def source_of(node: fx.Node) -> str:
    """The user source line that produced ``node``: the last frame of its stack trace outside
    torch and treecompile (``self.shift(x)``, not the ``F.pad`` an ``nn.ZeroPad2d`` calls, nor
    the drop-in treecompile swapped in for the model's scan kernel)."""
    trace = node.meta.get("stack_trace")
    if not trace:
        return "<no source recorded>"
    lines = [ln.strip() for ln in trace.strip().splitlines() if ln.strip()]
    frames = [i for i, ln in enumerate(lines) if ln.startswith("File ")]
    if not frames:
        return lines[-1]
    outside = [i for i in frames if _TORCH_DIR not in lines[i] and not any(d in lines[i] for d in _own_dirs())]
    i = (outside or frames)[-1]
    code = lines[i + 1] if i + 1 < len(lines) else ""
    return f"{lines[i]}: {code}"


def location_of(node: fx.Node) -> str:
    """``file.py:line`` of the user source line that produced ``node`` (see `source_of`)."""
    src = source_of(node)
    if not src.startswith("File "):
        return src
    path = src.split('"')[1] if '"' in src else ""
    line = src.split("line ")[1].split(",")[0] if "line " in src else "?"
    return f"{os.path.basename(path)}:{line}"


def describe(node: fx.Node) -> str:
    """``name = target(...)`` for error messages."""
    target = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))
    return f"node {node.name!r} ({node.op} {target})"


# ----------------------------------------------------------------------------- mutations

# ``x += y`` on a tensor is recorded as ``operator.iadd`` (an in-place op on ``x``).
_INPLACE_OPERATORS = {operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv, operator.imod,
                      operator.ipow, operator.iand, operator.ior, operator.ixor, operator.ilshift, operator.irshift,
                      operator.imatmul}
# ``operator.and_`` / ``or_`` / ``not_`` / ``is_`` are pure: their underscore only avoids a keyword.
_PURE_OPERATORS = (operator.and_, operator.or_, operator.not_, operator.is_)


def mutated_args(node: fx.Node) -> list[fx.Node]:
    """The graph values whose memory ``node`` writes in place ([] for a pure op).

    Covers tensor methods with a trailing underscore (``add_``, ``copy_``, ``index_add_``,
    ``masked_fill_``, ``scatter_``, ``index_put_`` ...), their function spellings
    (``torch.relu_``), in-place operators (``x += y``), ``x[i] = v``, ``out=`` and
    ``inplace=True`` forms, and ops whose schema declares a mutation.
    """
    out: list[fx.Node] = []
    first = node.args[0] if node.args else None
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    inplace_name = isinstance(name, str) and name.endswith("_") and not name.startswith("__") and name != "_" \
        and node.target not in _PURE_OPERATORS
    if node.op == "call_method":
        if inplace_name or name in ("__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__"):
            out.append(first)
    elif node.op == "call_function":
        if node.target is operator.setitem or node.target in _INPLACE_OPERATORS or inplace_name \
                or node.kwargs.get("inplace") is True:
            out.append(first)
        schema = getattr(node.target, "_schema", None)
        if schema is not None and getattr(schema, "is_mutable", False):
            for i, arg in enumerate(schema.arguments):
                if arg.alias_info is not None and arg.alias_info.is_write:
                    out.append(node.args[i] if i < len(node.args) else node.kwargs.get(arg.name))
    out.append(node.kwargs.get("out"))
    flat: list[fx.Node] = []
    for a in out:
        if isinstance(a, fx.Node):
            flat.append(a)
        elif isinstance(a, (list, tuple)):
            flat.extend(x for x in a if isinstance(x, fx.Node))
    return flat


def version_of(t: torch.Tensor) -> int | None:
    """``t``'s version counter (bumped by in-place writes); None under ``torch.inference_mode``."""
    try:
        return t._version
    except RuntimeError:
        return None


def storage_of(node: Any) -> int | None:
    """An id of the memory the node's tensor lives in (views share it), or None if unknown."""
    v = value(node)
    if not isinstance(v, torch.Tensor):
        return None
    try:
        return v.untyped_storage()._cdata
    except Exception:  # a tensor without storage (sparse, nested): unknown
        return None


def inputs_by_memory(graph: fx.Graph) -> dict[int | None, list[fx.Node]]:
    """The graph's inputs (placeholders and attributes) by the memory they hold (`storage_of`)."""
    out: dict[int | None, list[fx.Node]] = {}
    for x in (*graph.find_nodes(op="placeholder"), *graph.find_nodes(op="get_attr")):
        out.setdefault(storage_of(x), []).append(x)
    return out


def writers_of(node: fx.Node, inputs: dict[int | None, list[fx.Node]] | None = None) -> list[fx.Node] | None:
    """The nodes that write ``node``'s memory in place (None: memory of unknown origin). Memory is
    shared only along an op's edge (a view) or by aliasing graph inputs (``inputs``: `inputs_by_memory`):
    the search follows edges between nodes in that memory from those, not the whole graph."""
    store = storage_of(node)
    if store is None:
        return None
    inputs = inputs_by_memory(node.graph) if inputs is None else inputs
    alias = {node, *inputs.get(store, ())}  # the nodes in this memory, grown along edges
    todo = list(alias)
    while todo:
        m = todo.pop()
        for a in (*m.all_input_nodes, *m.users):
            if a not in alias and storage_of(a) == store:
                alias.add(a)
                todo.append(a)
    return [u for u in {u: None for m in alias for u in m.users} if any(storage_of(t) == store for t in mutated_args(u))]


#: Ops whose result is new memory (nothing else aliases it when it is made).
_FRESH = {"new_zeros", "new_ones", "new_empty", "new_full", "zeros", "ones", "empty", "full", "zeros_like",
          "ones_like", "empty_like", "full_like", "clone", "rand", "randn"}
#: Ops whose result views their first argument's memory.
_VIEWS = {"view", "reshape", "transpose", "permute", "unsqueeze", "squeeze", "expand", "getitem", "__getitem__",
          "select", "narrow", "flatten", "unflatten", "movedim", "view_as", "expand_as", "t", "contiguous"}


def _fresh_root(node: Any) -> Any:
    """For a tensor whose memory Dynamo's example value does not show (inside ``torch.vmap``),
    the node that created that memory fresh (``new_zeros`` ...), through views; else None (the
    write goes to memory of unknown origin)."""
    while isinstance(node, fx.Node) and node.op in ("call_function", "call_method"):
        name = op_name(node)
        if name in _FRESH:
            return ("fresh", node)
        if name not in _VIEWS or not node.args:
            return None
        node = node.args[0]
    return None


def eliminate_dead_code(gm: fx.GraphModule) -> int:
    """Dead-code elimination that keeps every observable mutation; returns nodes removed.

    ``fx.Graph.eliminate_dead_code`` treats tensor methods as pure, so an ``add_`` /
    ``copy_`` / ``index_add_`` whose return value is unused would be deleted even though a
    later node reads the tensor it wrote (experts accumulating into a buffer, a tensor filled
    by ``copy_``): silently wrong values and gradients. Here an in-place op is live if it
    writes a graph input, a parameter or buffer, memory of unknown origin, or memory that a
    live node reads (found through the storage of Dynamo's example values, so writes through
    views count). Only a write into a fresh tensor that nothing live reads is removed (e.g.
    the in-place building of a causal mask the attention pass made unnecessary).
    """
    graph = gm.graph
    nodes = list(graph.nodes)
    external = {storage_of(n) for n in nodes if n.op in ("placeholder", "get_attr")} - {None}
    writes: dict[fx.Node, set] = {}
    for n in nodes:
        targets = mutated_args(n)
        if targets:
            writes[n] = {storage_of(t) if storage_of(t) is not None else _fresh_root(t) for t in targets}
    live: set[fx.Node] = set()

    def mark(n: fx.Node) -> None:
        _add_upstream([n], live)

    for n in nodes:
        # x[i] = v is impure to torch.fx; here it is a write like the others, live as they are.
        impure = n.op in ("placeholder", "output", "call_module") or (
            n.op == "call_function" and (n.is_impure() and n.target is not operator.setitem
                                         or n.target in STATE_SWITCHES))
        storages = writes.get(n)
        if impure or (storages is not None and (None in storages or storages & external)):
            mark(n)
    # A write into fresh memory is live once a live node reads that memory, and the torch.func
    # state calls once an op taking a level is (see FUNCTORCH_STATE); marking either can make
    # more of both live (``_set_tensor_requires_grad`` writes its input): to a fixed point.
    state = functorch_state_nodes(nodes)
    changed = True
    while changed:
        changed = False
        read = {storage_of(i) for m in live for i in m.all_input_nodes} | {storage_of(m) for m in live}
        read |= {_fresh_root(i) for m in live for i in m.all_input_nodes} | {_fresh_root(m) for m in live}
        for n, storages in writes.items():
            if n not in live and storages & read:
                mark(n)
                changed = True
        if state and not set(state) <= live and uses_functorch_levels(live):
            for n in state:
                mark(n)
            changed = True
    removed = 0
    for n in reversed(nodes):
        if n not in live and not n.users:
            graph.erase_node(n)
            removed += 1
    return removed


# ----------------------------------------------------------------------------- rows


def is_row_size(size: Any, s: Any, how: str = "rows") -> bool:
    """Whether a dim of size ``size`` runs over the packed rows, S of them.

    Args:
        size: the dim's size (an int or a SymInt).
        s: S, the graph's sequence length (None: nothing is a row dim).
        how: ``"seq"``: exactly S, a dim that holds one entry per row. ``"rows"``: S, or
            provably ``c * S`` (the rows merged with other dims by a reshape,
            ``[B, S, H, D] -> [B * S * H, D]``). ``"derived"``: S, or any symbolic size whose
            expression involves S (``S - 1``, ``S * k`` pairs): anything computed from the rows.
    """
    if s is None:
        return False
    if same_size(size, s):
        return True
    if how == "seq" or not (isinstance(size, torch.SymInt) and isinstance(s, torch.SymInt)):
        return False
    if how == "rows":
        return multiple_of(size, s)
    return bool(size.node.expr.free_symbols & s.node.expr.free_symbols)


def row_dims(x: Any, s: Any, how: str = "rows") -> list[int]:
    """Dims of ``x``'s tensor value that run over the packed rows (see :func:`is_row_size`);
    a scan, reduction or contraction along one mixes tokens."""
    v = value(x)
    if not isinstance(v, torch.Tensor):
        return []
    return [d for d, size in enumerate(v.shape) if is_row_size(size, s, how)]


def multiple_of(size: torch.SymInt, s: torch.SymInt) -> bool:
    """Whether ``size`` is provably an integer multiple of ``s`` (``c * S``)."""
    return _multiple_of(size.node.expr, s.node.expr)


@functools.lru_cache(maxsize=4096)
def _multiple_of(size: Any, s: Any) -> bool:
    # A graph asks about the same few sizes at every node: one answer per pair of expressions.
    # A size free of S's symbols is not a multiple of S for every S; a ratio that is already a
    # product of positive integers (``B * H``: sympy cancels S on division) needs no simplify,
    # which is slow on the floor divisions of chunked kernels and is only tried when the
    # cancelled ratio proves nothing.
    import sympy

    if not size.free_symbols & s.free_symbols:
        return False
    ratio = size / s
    if ratio.is_integer and ratio.is_positive:
        return True
    ratio = sympy.simplify(ratio)
    return bool(ratio.is_integer) and bool(ratio.is_positive)


def table_length(length: Any, s: Any) -> bool:
    """Whether ``length`` (a size expression) is a table's length built from the row count ``s``:
    ``c * S``, ``S + c`` (``c`` a positive constant), or a ``max`` with one of them (Qwen-1's rotary
    cache over ``max(2 * S, 16)``): longer than S for every S, so its first S entries are indices 0
    to S - 1, read at positions."""
    if type(length).__name__ == "Max":
        return any(table_length(a, s) for a in length.args)
    extra = length - s
    return _multiple_of(length, s) and extra != 0 or bool(getattr(extra, "is_Integer", False)) and int(extra) > 0


# Ops that index along one dim of their first argument: (dim argument position, name, index argument
# position, name); getitem / setitem are handled separately.
_INDEX_OPS = {
    "index_select": (1, "dim", 2, "index"), "gather": (1, "dim", 2, "index"),
    "take_along_dim": (2, "dim", 1, "indices"), "index_add": (1, "dim", 2, "index"),
    "index_add_": (1, "dim", 2, "index"), "index_copy": (1, "dim", 2, "index"), "index_copy_": (1, "dim", 2, "index"),
    "index_fill": (1, "dim", 2, "index"), "index_fill_": (1, "dim", 2, "index"), "scatter": (1, "dim", 2, "index"),
    "scatter_": (1, "dim", 2, "index"), "scatter_add": (1, "dim", 2, "index"), "scatter_add_": (1, "dim", 2, "index"),
    "scatter_reduce": (1, "dim", 2, "index"), "scatter_reduce_": (1, "dim", 2, "index"),
    "index_reduce": (1, "dim", 2, "index"), "index_reduce_": (1, "dim", 2, "index"),
}
_INDEX_FUNCTIONS = {torch.index_select, torch.gather, torch.take_along_dim, torch.index_add, torch.index_copy,
                    torch.scatter, torch.scatter_add, torch.scatter_reduce}


def op_name(node: fx.Node) -> str:
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    return name if isinstance(name, str) else ""


def row_indices(node: fx.Node, s: Any) -> list[tuple[fx.Node, int]]:
    """``(index tensor, dim)`` for each tensor index ``node`` applies along a row dim of its
    first argument (``x[:, idx]``, ``index_select``, ``gather``, ``index_add_``, ``scatter_`` ...)."""
    if node.op not in ("call_function", "call_method") or not node.args:
        return []
    x = node.args[0]
    rows = row_dims(x, s)
    if not rows:
        return []
    xv = value(x)
    found: list[tuple[fx.Node, int]] = []
    if node.target in (operator.getitem, operator.setitem) and len(node.args) > 1:
        index = node.args[1]
        items = list(index) if isinstance(index, tuple) else [index]
        dim = 0
        for k, item in enumerate(items):
            if item is Ellipsis:
                dim = xv.dim() - (len(items) - k - 1 - sum(1 for i in items[k + 1:] if i is None))
                continue
            if item is None:
                continue
            if isinstance(item, fx.Node) and isinstance(value(item), torch.Tensor) and dim in rows:
                found.append((item, dim))
            dim += 1
    elif op_name(node) in _INDEX_OPS or node.target in _INDEX_FUNCTIONS:
        dim_pos, dim_name, idx_pos, idx_name = _INDEX_OPS.get(op_name(node), (1, "dim", 2, "index"))
        dim = node.args[dim_pos] if len(node.args) > dim_pos else node.kwargs.get(dim_name)
        index = node.args[idx_pos] if len(node.args) > idx_pos else node.kwargs.get(idx_name)
        if isinstance(dim, int) and isinstance(index, fx.Node) and dim % xv.dim() in rows:
            found.append((index, dim % xv.dim()))
    elif node.target is torch.take and isinstance(node.args[1], fx.Node):
        found.append((node.args[1], 0))
    return found


class Emitter:
    """Inserts marked nodes before ``at``, with example values computed on fake tensors."""

    def __init__(self, gm: fx.GraphModule, ctx: PassContext, at: fx.Node) -> None:
        self.gm, self.ctx, self.at = gm, ctx, at

    def fn(self, target, *args) -> fx.Node:
        return self._emit("call_function", target, args)

    def method(self, name: str, *args) -> fx.Node:
        return self._emit("call_method", name, args)

    def _emit(self, op: str, target, args) -> fx.Node:
        return emit(self.gm, self.ctx, self.at, op, target, args)


def emit(gm: fx.GraphModule, ctx: PassContext, at: fx.Node, op: str, target: Any, args: tuple,
         kwargs: dict | None = None, mark: bool = True, fake: Any = None) -> fx.Node:
    """A node before ``at`` (source info from ``at``) with its example value computed on fake
    tensors (``fake``: the fake mode where no argument is a fake tensor). ``mark=False`` leaves
    it out of ``ctx.created``, so that a later rewrite matches it as if the model wrote it."""
    kwargs = kwargs or {}
    with gm.graph.inserting_before(at):
        n = gm.graph.create_node(op, target, args, kwargs)
    if mark:
        ctx.mark(n, like=at)
    else:
        n.meta.update({k: at.meta[k] for k in ("stack_trace", "nn_module_stack", "source_fn_stack") if k in at.meta})
    return recompute_value(n, fake)


def new_dims_only(index: Any) -> bool:
    """Whether a ``getitem`` index only adds dims of size 1 (``x[:, None]``): whole slices,
    ``None`` and ``...``."""
    index = index if isinstance(index, tuple) else (index,)
    return all(i is None or i is Ellipsis or isinstance(i, slice) and i == slice(None) for i in index)


def recompute_value(n: fx.Node, fake: Any = None) -> fx.Node:
    """``n`` with its example value computed again from its arguments' (on fake tensors where
    they are fake; ``fake``: the fake mode where none is), after an argument was replaced."""
    vals = torch.fx.node.map_arg((n.args, n.kwargs), value)
    fake = next((v.fake_mode for v in torch.utils._pytree.tree_leaves(vals) if hasattr(v, "fake_mode")), fake)
    with fake if fake is not None else contextlib.nullcontext():
        a, k = vals
        n.meta["example_value"] = n.target(*a, **k) if n.op == "call_function" else getattr(a[0], n.target)(*a[1:], **k)
    return n
