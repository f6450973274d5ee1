"""The row domain: where a value's rows are (`Rows`), the rule table (`RULES`) and what rules share.

A rule (`Rule`) maps the rows of an op's inputs to the rows of its result, or raises
`NotRowLocal` saying how the op mixes rows; the families live one per module of this
package and register themselves in `RULES` with `_register`.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import sympy
import torch
from torch import fx
from treecompile.passes._graph import PassContext, same_size, value

#: ``Rows.ids`` when every value of the tensor is the index, among the packed rows, of the
#: row its element belongs to (``arange(S)``, the row ids ``nonzero`` returns).
IDS = "ids"
#: ``Rows.key`` of a table built in the graph whose length follows the sequence length
#: (``f(arange(2 * T))``): its entries are indexed by value (a position), not rows of the
#: packed row. It may be computed element-wise and read at positions (``table[positions]``);
#: reduced, sliced by the row count or combined with rows, it is refused.
TABLE = "table"


@dataclass(frozen=True)
class Rows:
    """Where a tensor's rows are.

    Attributes:
        dim: the dim that holds the rows (alone, or merged with other dims by a reshape).
        inner: the stride of the row index inside ``dim`` (1 when ``dim`` is the rows or
            the rows are its inner part, ``H`` for ``[S * H]``); a sympy expression.
        count: the number of rows along the axis (S, or a data-dependent count for a selection).
        key: None for the packed rows in order; else the node whose non-zero entries chose
            a subset of them (``x[idx]`` with ``idx = nonzero(mask)``): two tensors line up
            row by row only if their keys are the same.
        ids: None for data; `IDS` if each value is the packed-row index of its own row;
            ``(d, i)`` if entry ``i`` along dim ``d`` holds those indices (``nonzero``'s columns).
        uniform: every row holds the same values (``zeros(S, D)``, ``expand``): it lines up
            with rows in any layout.
    """

    dim: int
    inner: Any = sympy.Integer(1)
    count: Any = None
    key: Any = None
    ids: Any = None
    uniform: bool = False

    def at(self, dim: int, inner: Any = None) -> Rows:
        """The same rows at another dim (and inner stride)."""
        return dataclasses.replace(self, dim=dim, inner=self.inner if inner is None else inner)

    def data(self) -> Rows:
        """The same rows holding data, not row indices."""
        return dataclasses.replace(self, ids=None)


class NotRowLocal(Exception):
    """Raised by a rule: the op mixes rows (or cannot be shown not to); the text says how."""


# --------------------------------------------------------------------------- sizes


def expr(size: Any) -> Any:
    """A size as a sympy expression."""
    if isinstance(size, torch.SymInt):
        return size.node.expr
    return sympy.Integer(int(size))


def divides(a: Any, b: Any) -> bool:
    """Whether ``b / a`` is provably a positive integer."""
    return _divides(expr(a) if not isinstance(a, sympy.Basic) else a, expr(b) if not isinstance(b, sympy.Basic) else b)


@functools.lru_cache(maxsize=8192)
def _divides(a: Any, b: Any) -> bool:
    try:
        ratio = sympy.cancel(b / a)
    except Exception:  # sizes with FloorDiv / Mod the rational simplifier does not take
        return False
    return ratio.is_integer is True and ratio.is_positive is True


def same_expr(a: Any, b: Any) -> bool:
    return divides(a, b) and divides(b, a)


def numel(shape: Iterable[Any]) -> Any:
    out = sympy.Integer(1)
    for d in shape:
        out = out * expr(d)
    return out


# --------------------------------------------------------------------------- op names

_OPERATORS: dict[Any, str] = {
    operator.add: "add", operator.sub: "sub", operator.mul: "mul", operator.truediv: "div",
    operator.floordiv: "floor_divide", operator.mod: "remainder", operator.pow: "pow", operator.neg: "neg",
    operator.pos: "positive", operator.abs: "abs", operator.invert: "bitwise_not", operator.and_: "bitwise_and",
    operator.or_: "bitwise_or", operator.xor: "bitwise_xor", operator.lshift: "bitwise_left_shift",
    operator.rshift: "bitwise_right_shift", operator.matmul: "matmul", operator.eq: "eq", operator.ne: "ne",
    operator.lt: "lt", operator.le: "le", operator.gt: "gt", operator.ge: "ge", operator.getitem: "getitem",
    operator.setitem: "setitem", operator.not_: "logical_not", operator.truth: "__bool__",
    operator.iadd: "add_", operator.isub: "sub_", operator.imul: "mul_", operator.itruediv: "div_",
    operator.ifloordiv: "floor_divide_", operator.imod: "remainder_", operator.ipow: "pow_",
    operator.iand: "bitwise_and_", operator.ior: "bitwise_or_", operator.ixor: "bitwise_xor_",
    operator.ilshift: "bitwise_left_shift_", operator.irshift: "bitwise_right_shift_", operator.imatmul: "matmul_",
    getattr: "getattr", len: "__len__",
}


def _namespaces() -> tuple:
    import torch._functorch.predispatch as predispatch
    import torch.nn.functional as F

    spaces = [torch, torch.Tensor, F, torch._C._nn, torch._C._VariableFunctions, torch.special, torch.fft,
              torch.linalg, torch._C._special, torch._C._fft, torch._C._linalg, torch.functional, predispatch,
              torch._C._functorch]
    return tuple(spaces)


_NAMESPACES = _namespaces()

#: Dunder method names and their op names (``x.__rsub__(y)`` is ``sub`` with the operands swapped,
#: which is the same row behaviour).
_DUNDERS = {
    "__add__": "add", "__radd__": "add", "__sub__": "sub", "__rsub__": "sub", "__mul__": "mul", "__rmul__": "mul",
    "__truediv__": "div", "__rtruediv__": "div", "__floordiv__": "floor_divide", "__rfloordiv__": "floor_divide",
    "__mod__": "remainder", "__rmod__": "remainder", "__pow__": "pow", "__rpow__": "pow", "__matmul__": "matmul",
    "__rmatmul__": "matmul", "__neg__": "neg", "__pos__": "positive", "__abs__": "abs", "__invert__": "bitwise_not",
    "__and__": "bitwise_and", "__rand__": "bitwise_and", "__or__": "bitwise_or", "__ror__": "bitwise_or",
    "__xor__": "bitwise_xor", "__rxor__": "bitwise_xor", "__eq__": "eq", "__ne__": "ne", "__lt__": "lt",
    "__le__": "le", "__gt__": "gt", "__ge__": "ge", "__getitem__": "getitem", "__setitem__": "setitem",
    "__iadd__": "add_", "__isub__": "sub_", "__imul__": "mul_", "__itruediv__": "div_", "__ior__": "bitwise_or_",
    "__iand__": "bitwise_and_", "__len__": "__len__", "__bool__": "__bool__", "__int__": "__int__",
    "__float__": "__float__", "__index__": "__index__", "__lshift__": "bitwise_left_shift",
    "__rshift__": "bitwise_right_shift",
}


def op_key(node: fx.Node) -> str | None:
    """The op's name for the rule table (``add`` for ``torch.add``, ``x.add``, ``x + y``,
    ``aten.add.Tensor``; ``add_`` for the in-place forms), or None for a function that is not
    torch's own."""
    t = node.target
    if node.op == "call_method":
        return _DUNDERS.get(t, t)
    if node.op != "call_function":
        return None
    if t in _OPERATORS:
        return _OPERATORS[t]
    if isinstance(t, torch._ops.OpOverload):
        ns = t.namespace
        return t.overloadpacket.__name__ if ns == "aten" else f"{ns}::{t.overloadpacket.__name__}"
    if isinstance(t, torch._ops.OpOverloadPacket):
        ns = getattr(t, "_qualified_op_name", "").split("::")[0]
        return t.__name__ if ns == "aten" else f"{ns}::{t.__name__}"
    return _torch_name(t)


@functools.lru_cache(maxsize=4096)
def _torch_name(t: Any) -> str | None:
    name = getattr(t, "__name__", None)
    if not isinstance(name, str):
        return None
    if any(getattr(ns, name, None) is t for ns in _NAMESPACES):
        return _DUNDERS.get(name, name)
    return None


def split_inplace(name: str | None) -> tuple[str | None, bool]:
    """``("add", True)`` for ``add_``; ``(name, False)`` otherwise."""
    if name and name.endswith("_") and not name.endswith("__") and len(name) > 1:
        return name[:-1], True
    return name, False


# --------------------------------------------------------------------------- the table


@dataclass(frozen=True)
class Rule:
    """One op family's row behaviour.

    Attributes:
        infer: ``infer(node, args, env) -> state`` (a `Rows`, None, or a tuple of them for an
            op with several results); raises `NotRowLocal` with the reason.
        family: the family's name (``pointwise``, ``reduction`` ...), for the rule table.
        sizes: which arguments take sizes, where the sequence length may appear: ``"*"``
            (every argument but the first tensor), a tuple of positions and keyword names,
            or ``"rule"`` (the rule checks them itself).
    """

    infer: Callable[[fx.Node, Args, RowEnv], Any]
    family: str
    sizes: Any = ()


#: op name -> Rule; filled by the family modules of :mod:`treecompile.passes.rows`.
RULES: dict[str, Rule] = {}


@dataclass(frozen=True)
class Args:
    """A node's arguments by position or keyword name."""

    args: tuple
    kwargs: dict

    def get(self, pos: int | None, name: str | None = None, default: Any = None) -> Any:
        if pos is not None and pos < len(self.args):
            return self.args[pos]
        if name is not None and name in self.kwargs:
            return self.kwargs[name]
        return default

    @property
    def first(self) -> Any:
        return self.get(0, "input", self.kwargs.get("self"))


# --------------------------------------------------------------------------- the walk


class RowEnv:
    """The states of the nodes seen so far, and the facts the rules need."""

    def __init__(self, ctx: PassContext) -> None:
        self.ctx = ctx
        self.s = ctx.seq_len
        self.s_expr = expr(self.s) if isinstance(self.s, (int, torch.SymInt)) else None
        self.s_syms = self.s.node.expr.free_symbols if isinstance(self.s, torch.SymInt) else set()
        self.states: dict[fx.Node, Any] = {}
        #: The counts of data-chosen rows (their unbacked symbols), by the selection's key.
        self.selections: dict[Any, Any] = {}
        #: Rows a ``torch.vmap`` maps over, by its level: hidden inside, back at its end.
        self.hidden: dict[Any, Rows] = {}
        #: Unbacked counts that are not rows: entries a mask chose along dims before the rows
        #: (``x[lang_mask]`` over the batch), each a count of the mask's entries.
        self.other_counts: set = set()
        #: Sort-based grouping (`treecompile.passes.rows.grouped`): what is known of each key
        #: tensor's groups, the group of each count's symbol, and the key tensor of each sort.
        self.groups: dict = {}
        self.group_syms: dict = {}
        self.sorted: dict = {}

    def state(self, a: Any) -> Any:
        """The state of an argument: a node's, a tuple of states for a list, else None."""
        if isinstance(a, fx.Node):
            return self.states.get(a)
        if isinstance(a, (list, tuple)):
            return tuple(self.state(x) for x in a)
        return None

    def rows(self, a: Any) -> Rows | None:
        """The `Rows` of a tensor argument (None if it has none)."""
        st = self.state(a)
        if isinstance(st, Rows):
            return st
        if isinstance(st, tuple) and any(x is not None for x in st):
            raise NotRowLocal("takes a list of tensors with rows where one tensor is expected")
        return None

    def is_row_size(self, size: Any) -> bool:
        return bool(self.row_symbols(size))

    def row_symbols(self, size: Any) -> set:
        """The symbols of the sequence length or of a selection's count that ``size`` mentions."""
        if not isinstance(size, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            return set()
        try:
            syms = size.node.expr.free_symbols
        except AttributeError:
            return set()
        return {x for x in syms if x in self.s_syms or str(x).startswith("u") and x not in self.other_counts}

    def by_size(self, node: fx.Node) -> Any:
        """A state from sizes alone: the first dim of size S (or a selection's count)."""
        return _by_size(value(node), self)


def _by_size(v: Any, env: RowEnv) -> Any:
    if isinstance(v, (tuple, list)):
        return tuple(_by_size(x, env) for x in v)
    if not isinstance(v, torch.Tensor):
        return None
    for d, size in enumerate(v.shape):
        if env.s is not None and same_size(size, env.s):
            return Rows(d, count=env.s_expr)
        for key, count in env.selections.items():
            if isinstance(size, torch.SymInt) and same_expr(expr(size), count):
                return Rows(d, count=count, key=key)
    return None


def iter_nodes(a: Any) -> Iterator[fx.Node]:
    """The nodes inside an argument (lists, tuples, slices, dicts)."""
    if isinstance(a, fx.Node):
        yield a
    elif isinstance(a, (list, tuple)):
        for x in a:
            yield from iter_nodes(x)
    elif isinstance(a, slice):
        for x in (a.start, a.stop, a.step):
            yield from iter_nodes(x)
    elif isinstance(a, dict):
        for x in a.values():
            yield from iter_nodes(x)


SQUARE = "produces a [.., S, S] tensor (attention scores or a mask built from the sequence length)"
LENGTH = "changes the sequence length (a shift, pad or cat along the sequence)"
ROW_INDEX_MATH = ("computes with row indices as values (an arange over the packed row, or row ids from nonzero): a "
                  "token's index in the packed row is neither its position on its path nor its neighbours' (e.g. a "
                  "mask or a shift built from arange(T))")
ONE_ROW = "takes one row of the sequence by its index (a token's row in the packed row is not its place on its path)"
SPLIT_ROWS = "splits the rows of the sequence into pieces (each piece holds the tokens of other paths)"


def _register(family: str, names: str | list[str], sizes: Any = ()):
    def deco(fn):
        for name in names.split() if isinstance(names, str) else names:
            RULES[name] = Rule(fn, family, sizes)
        return fn

    return deco


def _nd(x: Any) -> int:
    v = value(x)
    return v.dim() if isinstance(v, torch.Tensor) else 0


def _shape(x: Any) -> tuple:
    v = value(x)
    return tuple(v.shape) if isinstance(v, torch.Tensor) else ()


def _is_tensor(x: Any) -> bool:
    return isinstance(x, fx.Node) and isinstance(value(x), torch.Tensor)


def _dim(d: Any, nd: int) -> int:
    if not isinstance(d, int):
        raise NotRowLocal(f"takes a dim that is not a constant ({d})")
    return d % nd if nd else 0


def combine(states: list[Rows | None]) -> Rows | None:
    """One result's rows from inputs' rows already placed in the result's dims: they must be
    the same rows at the same dim (uniform rows line up with any layout)."""
    out: Rows | None = None
    for r in states:
        if r is None:
            continue
        if out is None:
            out = r
            continue
        if r.dim != out.dim:
            raise NotRowLocal(SQUARE)
        if r.uniform:
            continue
        if out.uniform:
            out = r
            continue
        if r.key != out.key or not same_expr(r.inner, out.inner):
            raise NotRowLocal("combines rows that do not line up (two layouts of the packed rows, or rows chosen by "
                              "different selections)")
    return out


def _data_rows(env: RowEnv, x: Any) -> Rows | None:
    r = env.rows(x)
    if r is not None and r.ids is not None:
        if r.key == TABLE:
            return r.data()  # a table's entry index is a value like any other (f(arange(N)))
        raise NotRowLocal(ROW_INDEX_MATH)
    return r


def _right_aligned(env: RowEnv, x: Any, nd: int) -> Rows | None:
    """``x``'s rows placed in a result of ``nd`` dims by broadcasting (right-aligned)."""
    r = _data_rows(env, x)
    return None if r is None else r.at(r.dim + nd - _nd(x))


# --------------------------------------------------------------------------- element-wise

def op_is(node: fx.Node, *names: str) -> bool:
    return split_inplace(op_key(node))[0] in names


def _name(node: fx.Node) -> str:
    return split_inplace(op_key(node))[0] or ""


def _is_row_sym(env: RowEnv, x: Any) -> bool:
    return any(env.row_symbols(value(n)) for n in iter_nodes(x))


_TABLE_SLICE = ("slices a tensor by the sequence length (table[:T]): row i of the packed row would read entry i, its "
                "index in the packed row, not its position on its path")
_LOOKUP = ("reads a table at row indices (e.g. a position embedding looked up with arange(T)): a token's index in the "
           "packed row is not its position on its path")


def _created_rows(node: fx.Node, env: RowEnv) -> Rows | None:
    """A tensor that holds one value everywhere: a dim of S (or a selection's count) is rows
    (uniform); two such dims are an [S, S] mask."""
    found = []
    for d, size in enumerate(_shape(node)):
        if not env.is_row_size(size):
            continue
        if env.s is not None and same_size(size, env.s):
            found.append(Rows(d, count=env.s_expr, uniform=True))
            continue
        key = next((k for k, c in env.selections.items() if c is not None and same_expr(expr(size), c)), None)
        if key is None:
            raise NotRowLocal(LENGTH)
        found.append(Rows(d, count=env.selections[key], key=key, uniform=True))
    if len(found) > 1:
        raise NotRowLocal(SQUARE)
    return found[0] if found else None


