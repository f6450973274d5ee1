"""rewrite_positions_pass: positions derived from the sequence index become tree positions.

Per-path training gives the token at path offset ``p`` the position ``p``. In the packed
row, row ``j`` holds a token at path offset ``positions[j]`` (siblings repeat offsets),
so every place where a model derives a position from the row index must read
``positions`` instead:

* ``torch.arange(c, S + c)`` (step 1): RoPE angles, learned absolute embeddings
  ``wpe(arange(T))``, 1-based counts. Replaced by ``positions + c`` (in the arange's
  dtype). Exact: entry ``j`` of the arange was used as row ``j``'s position plus ``c``.
* ``table[:S]`` (``cache[:, :, :S, ...]``, ``cache[..., :S, :]``) on one dim of a constant
  table (cached cos/sin, position embedding weights, a table the call builds from constants:
  TinyLlama's rope cache over the block size): row ``j`` of the slice was used for row ``j``, so it becomes
  ``table.index_select(dim, positions)``. Where the slice is only gathered by position
  (``cos[:S][position_ids]``, transformers 4.x Llama) it is still a table indexed by
  position: the gather reads the table itself (positions are below ``S``).
* ``position_ids`` given to a model (Hugging Face) already are the tree positions; they
  are only counted.
* ``cumsum`` along the rows of an integer or boolean tensor (RoBERTa's and fairseq's
  positions, ``cumsum(ids != pad) + pad``): on a path it counts the tokens before each one
  on that path, so it becomes the sum over the row's ancestors-or-self
  (:func:`treecompile.kernels.scans.path_scan.path_cumsum`, from ``subtree_end``; interval mask).

Aranges that feed mask building (a comparison with another index or the length, ``tril``,
``masked_fill``) are left alone: a mask built from the sequence index is not a position, and
if it survived the attention pass the verify pass refuses it. A comparison with a constant
(``segment_pos == 0``: the first token) is a predicate on the position, and reads it.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import fx

from treecompile.kernels.scans.path_scan import path_cumsum
from treecompile.passes._graph import (ARANGE, PassContext, bind, is_call, mutated_args, new_dims_only, recompute_value,
                                       row_indices, same_size, table_length, value)
from treecompile.passes._mask_eval import depends_on_inputs, token_readers
from treecompile.passes.moe import region_nodes
from treecompile.passes.row_tables import changes_with_length, rewrite_row_tables

__all__ = ["rewrite_positions_pass"]

_COMPARISONS = {operator.lt, operator.le, operator.gt, operator.ge, operator.eq, operator.ne,
                torch.lt, torch.le, torch.gt, torch.ge, torch.eq, torch.ne, torch.tril, torch.triu}
_COMPARISON_METHODS = {"lt", "le", "gt", "ge", "eq", "ne", "tril", "triu", "masked_fill"}
# Ops through which an index keeps being an index (views, broadcasting, offsets).
_PASS_THROUGH = {operator.getitem, operator.add, operator.sub, torch.add, torch.sub}
_PASS_THROUGH_METHODS = {"view", "reshape", "unsqueeze", "expand", "to", "long", "int", "__getitem__", "add", "sub"}


def rewrite_positions_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Replaces sequence-index positions with tree positions.

    Counters (``ctx.counters["rewrite_positions_pass"]``): ``arange``, ``table_slice``,
    ``table_gather``, ``identity_gather``, ``position_ids_input``, ``path_cumsum``, ``row_table``
    (`treecompile.passes.row_tables`).
    """
    external = [u for u in ctx.positions.users if u not in ctx.created]
    if external:
        ctx.count("position_ids_input", len(external))
    _drop_identity_gathers(gm, ctx)
    experts = region_nodes(gm, ctx.seq_len)  # their aranges permute tokens: not positions
    for node in list(gm.graph.nodes):
        if node in ctx.created or node in experts:
            continue
        offset = _row_index_offset(node, ctx) if is_call(node, ARANGE) else None
        # An arange used as an index along the rows is a row index, not a position (the
        # verify pass accepts it only as the identity).
        as_row_index = any(any(i is node for i, _ in row_indices(u, ctx.seq_len)) for u in node.users)
        table = _table_read_by_position(node, ctx) if offset == 0 and not _feeds_comparison(node) and \
            not as_row_index else None
        if table:
            ctx.off_rows.update(table)  # a table over positions: no rows
            ctx.count("table_gather")
        elif offset is not None and not _feeds_comparison(node) and not as_row_index:
            dtype = value(node).dtype
            with gm.graph.inserting_before(node):
                new = gm.graph.call_method("to", (ctx.positions,), {"dtype": dtype})
                if offset:
                    new = ctx.mark(gm.graph.call_function(operator.add, (new, offset)), like=node)
            new.meta["example_value"] = value(node)
            ctx.mark(new, like=node)
            node.replace_all_uses_with(new)
            ctx.count("arange")
        elif is_call(node, (torch.cumsum,), ("cumsum",)) and _integer_row_scan(node, ctx) is not None:
            dim = _integer_row_scan(node, ctx)
            with gm.graph.inserting_before(node):
                new = ctx.mark(gm.graph.call_function(path_cumsum, (node.args[0], dim, ctx.mask_buffers[0])), like=node)
                if value(node).dtype != torch.int64:
                    new = gm.graph.call_method("to", (new, value(node).dtype))
            new.meta["example_value"] = value(node)
            ctx.mark(new, like=node)
            node.replace_all_uses_with(new)
            ctx.count("path_cumsum")
        elif node.op == "call_function" and node.target is operator.getitem:
            found = _table_slice(node, ctx)
            dim, new_dims, offset = found if found is not None else (None, [], 0)
            if dim == 0 and not new_dims and not offset and _only_gathered_by_position(node, ctx):
                # ``table[:S][position_ids]``: the slice is still a table indexed by position,
                # and the positions are below S: the gather reads the table itself.
                for u in list(node.users):
                    u.replace_input_with(node, node.args[0])
                    # A cast of the slice is now a cast of the whole table.
                    stack = [u]
                    while stack:
                        n = stack.pop()
                        if n.op == "call_method" and n.target in _TABLE_CASTS:
                            recompute_value(n)
                            stack.extend(n.users)
                ctx.count("table_gather")
            elif dim is not None:
                with gm.graph.inserting_before(node):
                    at = ctx.positions if not offset else \
                        ctx.mark(gm.graph.call_function(operator.add, (ctx.positions, offset)), like=node)
                    new = gm.graph.call_function(torch.index_select, (node.args[0], dim, at))
                    for at in new_dims:  # ``None`` entries of the index: new dims of size 1
                        new = ctx.mark(gm.graph.call_method("unsqueeze", (new, at)), like=node)
                new.meta["example_value"] = value(node)
                ctx.mark(new, like=node)
                node.replace_all_uses_with(new)
                ctx.count("table_slice")
    rewrite_row_tables(gm, ctx)
    return gm


_INDEX_VIEWS = {"unsqueeze", "view", "reshape", "expand", "to", "long", "int", "contiguous"}


def _index_source(index: Any) -> Any:
    """``index`` without the views and casts around it (``x[None]`` among them)."""
    while isinstance(index, fx.Node) and (index.op == "call_method" and index.target in _INDEX_VIEWS
                                          or _only_new_dims(index)):
        index = index.args[0]
    return index


def _only_new_dims(node: fx.Node) -> bool:
    """Whether ``node`` is ``x[None]`` / ``x[None, :]`` / ``x[..., None]``: new dims of size 1 only."""
    if not (node.op == "call_function" and node.target is operator.getitem and len(node.args) == 2):
        return False
    index = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
    return any(i is None for i in index) and new_dims_only(index)


def _only_gathered_by_position(table: fx.Node, ctx: PassContext) -> bool:
    """Whether every use of ``table`` is, through casts (``.to(dtype)``), a gather
    ``table[positions]`` on dim 0 by the tree positions (the ``position_ids`` the model is given)."""
    uses, stack = [], [table]
    while stack:
        n = stack.pop()
        if not n.users:
            return False
        for u in n.users:
            if u.op == "call_method" and u.target in _TABLE_CASTS and u.args[0] is n and \
                    not any(isinstance(a, fx.Node) and isinstance(value(a), torch.Tensor) for a in u.args[1:]):
                stack.append(u)
            else:
                uses.append((u, n))
    return all(_gathers_at_positions(u, n, ctx) for u, n in uses)


def _gathers_at_positions(u: fx.Node, table: fx.Node, ctx: PassContext) -> bool:
    """Whether ``u`` is ``table[positions]``: a gather on dim 0 by the tree positions the model is
    given (through views, casts and ``[None]``)."""
    return u.op == "call_function" and u.target is operator.getitem and u.args[0] is table and \
        _index_source(u.args[1]) is ctx.positions


def _table_read_by_position(arange: fx.Node, ctx: PassContext) -> set[fx.Node] | None:
    """The nodes computed from ``arange`` where it builds tables over the rows that the model reads only as
    ``table[position_ids]`` on dim 0, each reading no token and writing nothing, with entry ``t``
    the same at every length (`treecompile.passes.row_tables.changes_with_length`):
    transformers 4.x registers its rotary cache again over ``arange(T)`` for a sequence longer
    than the cache, then gathers it at the ``position_ids`` it is given. The tree positions are
    below the row count, so the table over ``arange(S)`` is read as it is. Else None."""
    tables: set[fx.Node] = set()
    seen, stack = {arange}, [arange]
    while stack:
        n = stack.pop()
        if mutated_args(n):
            return None
        for u in n.users:
            if _gathers_at_positions(u, n, ctx):
                tables.add(n)
            elif u.op == "output":
                return None
            elif u not in seen:
                seen.add(u)
                stack.append(u)
    if not tables:
        return None
    tokens = token_readers(ctx, arange.graph)
    ok = all(t not in tokens and isinstance(value(t), torch.Tensor) and value(t).dim() >= 1
             and same_size(value(t).shape[0], ctx.seq_len) and changes_with_length(ctx, t, 0) is None for t in tables)
    return seen if ok else None


def _drop_identity_gathers(gm: fx.GraphModule, ctx: PassContext) -> None:
    """``x[arange(S)]`` on a dim 0 of size S is ``x`` (``x[None]`` for an index ``[1, S]``):
    transformers 4.x Llama gathers its rotary tables by ``position_ids = arange(S)[None]``.
    Removed first, so that what remains is the table (a slice ``[:S]`` or one built over
    ``arange(S)``) aligned with the rows, which the rules below rewrite."""
    for node in list(gm.graph.nodes):
        if not (node.op == "call_function" and node.target is operator.getitem and len(node.args) == 2):
            continue
        x, index = node.args
        source = _index_source(index)
        xv, iv = value(x), value(index)
        if not (isinstance(source, fx.Node) and is_call(source, ARANGE) and _row_index_offset(source, ctx) == 0
                and isinstance(xv, torch.Tensor) and isinstance(iv, torch.Tensor) and xv.dim() >= 1
                and same_size(xv.shape[0], ctx.seq_len) and same_size(iv.shape[-1], ctx.seq_len)
                and all(d == 1 for d in iv.shape[:-1])):
            continue
        with gm.graph.inserting_before(node):
            new = x
            for _ in range(iv.dim() - 1):
                new = gm.graph.call_method("unsqueeze", (new, 0))
                new.meta["example_value"] = value(node)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        ctx.count("identity_gather")


def _integer_row_scan(node: fx.Node, ctx: PassContext) -> int | None:
    """The rows' dim if ``node`` is ``cumsum`` of an integer or boolean tensor along the rows
    (S of them) under the interval mask, else None."""
    if ctx.mask != "interval" or node.kwargs.get("out") is not None:
        return None
    a = bind(node, ["input", "dim"], {"dim": None})
    x, dim = a["input"], a["dim"]
    xv = value(x)
    if not isinstance(xv, torch.Tensor) or not isinstance(dim, int) or xv.dtype.is_floating_point \
            or xv.dtype.is_complex or a.get("dtype") not in (None, torch.int64, torch.int32):
        return None
    dim %= xv.dim()
    return dim if same_size(xv.shape[dim], ctx.seq_len) else None


def _row_index_offset(node: fx.Node, ctx: PassContext) -> int | None:
    """``c`` if ``node`` is ``arange(c, S + c)`` (step 1) with S the sequence length, else None."""
    args = list(node.args)
    if len(args) == 1:
        start, end, step = 0, args[0], 1
    else:
        a = bind(node, ["start", "end", "step"], {"start": 0, "step": 1})
        start, end, step = a["start"], a.get("end"), a["step"]
    if "end" in node.kwargs and len(args) == 0:
        start, end = node.kwargs.get("start", 0), node.kwargs["end"]
    v = value(node)
    if not isinstance(v, torch.Tensor) or v.dim() != 1 or _const(step) != 1 or not isinstance(_const(start), int):
        return None
    offset = _const(start)
    end = value(end) if isinstance(end, fx.Node) else end
    return offset if same_size(end - offset, ctx.seq_len) else None


def _const(x):
    v = value(x) if isinstance(x, fx.Node) else x
    return v if isinstance(v, (int, float)) else None


def _feeds_comparison(node: fx.Node) -> bool:
    """Whether the index reaches, through views and offsets, a comparison that builds a mask:
    one with another index or the length (``i >= j``, ``arange(T) < T - k``), ``tril`` /
    ``triu`` or ``masked_fill``. A comparison with a constant (Griffin's ``segment_pos == 0``,
    the first token) is a predicate on each row's position: the index stays a position."""
    stack, seen = [node], set()
    while stack:
        n = stack.pop()
        for u in n.users:
            if u in seen:
                continue
            seen.add(u)
            if is_call(u, _COMPARISONS, _COMPARISON_METHODS):
                others = [a for a in u.args[:2] if a is not n]
                if u.kwargs or len(u.args) != 2 or not (len(others) == 1 and _is_number(others[0])):
                    return True
            elif is_call(u, _PASS_THROUGH, _PASS_THROUGH_METHODS):
                stack.append(u)
    return False


def _is_number(x: Any) -> bool:
    """A Python number (not a size of the graph)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)


_TABLE_CASTS = {"to", "type", "float", "double", "half", "bfloat16", "contiguous", "detach"}


def _constant_table(node: fx.Node) -> fx.Node | None:
    """The input (a buffer, or a tensor the model holds) that ``node`` is, up to casts and moves
    (``self.freqs_cis.to(h.device)``), else None."""
    while node.op == "call_method" and node.target in _TABLE_CASTS and \
            not any(isinstance(a, fx.Node) and isinstance(value(a), torch.Tensor) for a in node.args[1:]):
        node = node.args[0]
    return node if node.op in ("placeholder", "get_attr") else None


def _zero(start: Any) -> bool:
    """A slice start of 0: none, 0, or a size computed to 0 (``key_len - q_len`` with both S)."""
    v = value(start) if isinstance(start, fx.Node) else start
    if isinstance(v, torch.SymInt):
        return v.node.expr == 0
    return v is None or (isinstance(v, int) and v == 0)


def _table_slice(node: fx.Node, ctx: PassContext) -> tuple[int, list[int], int] | None:
    """``(d, new, c)`` if ``node`` is ``table[..., c:S + c, ...]`` on a constant table, cut to S
    along the table's dim ``d`` from entry ``c`` (`_offset_start`; a table built in the graph only
    from 0), with new dims of size 1 (``None`` entries: ``pos[None, :T, :]``) at the result's
    dims ``new``; else None."""
    table, index = node.args
    if not isinstance(table, fx.Node) or table in (ctx.input_ids, ctx.positions) or \
            _constant_table(table) is None and depends_on_inputs(ctx, table) is not False:
        return None
    tv = value(table)
    if not isinstance(tv, torch.Tensor):
        return None
    index = index if isinstance(index, tuple) else (index,)
    if sum(i is Ellipsis for i in index) == 1:  # cache[..., :T, :], cache[:, :, :T, ...]: whole dims
        at = index.index(Ellipsis)
        whole = tv.dim() - sum(i is not None and i is not Ellipsis for i in index)
        index = index[:at] + (slice(None),) * max(whole, 0) + index[at + 1:]
    new = [at for at, i in enumerate(index) if i is None]
    kept = [at for at, i in enumerate(index) if i is not None]  # the result dim of each table dim indexed
    index = tuple(i for i in index if i is not None)
    if any(i is Ellipsis for i in index) or len(index) > tv.dim():
        return None
    sliced, offset = [], 0
    for d, i in enumerate(index):
        if not isinstance(i, slice):
            return None
        if i == slice(None):
            continue
        start = _offset_start(i, ctx)
        if start is None or i.step not in (None, 1):
            return None
        sliced.append(d)
        offset = start
    # Exactly one dim cut to S: a [:S, :S] cut is a mask, not a position table. A table built in
    # the graph from the inputs' sizes (f(arange(2 * T))) is at least S long there; one built from
    # constants (TinyLlama's rope cache over block_size, made by the first call) is as long as it
    # is, and the slice holds S to it.
    if len(sliced) != 1 or same_size(tv.shape[sliced[0]], ctx.seq_len):
        return None
    # The cut keeps S rows: ``[:S]`` on a dim shorter than S (old GPT-NeoX's ``cos_cached[:T]`` on its
    # leading dim of size 1) keeps the whole dim, and is no position table.
    if not same_size(value(node).shape[kept[sliced[0]]], ctx.seq_len):
        return None
    length = tv.shape[sliced[0]]
    if _constant_table(table) is None and not (isinstance(length, int) or isinstance(
            length, torch.SymInt) and table_length(length.node.expr, ctx.seq_len.node.expr)):
        return None
    if offset and _constant_table(table) is None:  # an offset cut of a table built in the graph: not judged
        return None
    return sliced[0], new, offset


def _offset_start(cut: slice, ctx: PassContext) -> int | None:
    """``c`` where ``cut`` is ``c:S + c`` for a Python int ``c >= 0`` (``[:S]``: 0; fairseq's and
    OPT's learned positions past a padding index, ``wpe[1:T + 1]``), else None."""
    if _zero(cut.start):
        return 0 if same_size(cut.stop, ctx.seq_len) else None
    start = value(cut.start) if isinstance(cut.start, fx.Node) else cut.start
    stop = value(cut.stop) if isinstance(cut.stop, fx.Node) else cut.stop
    if not (isinstance(start, int) and start > 0) or not isinstance(stop, torch.SymInt):
        return None
    return start if stop.node.expr - start == ctx.seq_len.node.expr else None
