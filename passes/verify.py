"""verify_graph_pass: every node is proven row-local, rewritten by a pass, or refused.

On a packed tree row, an op that mixes tokens along the sequence is exact only if it
mixes each token with its own root path and nothing else. After the rewrite passes the
only such ops allowed are the ones they inserted. Every other node must be proven not to
combine values of different rows, by the row rules of :mod:`treecompile.passes.rows`
(a table of op families, ``passes/README.md``): an op no rule proves row-local is refused,
never assumed safe. The refusal, :class:`~treecompile.UnsupportedModelError`, names the
node, the model's source line and why; an attention a pass looked at and left is reported
with the pass's note (why it was not rewritten).

Sequence dims are recognised by size: the wrapper makes S dynamic, so it is a symbol and
the check is exact. A model that makes Dynamo specialise S to a number (a Python loop over
the tokens, ``for t in range(S)``, or a branch on the length) leaves per-token ops that no
size check can see, so such a graph is refused outright.
"""

from __future__ import annotations

import functools
import linecache
import operator
import os
import warnings
from typing import Any

import torch
from torch import fx

from treecompile.core.advice import TreeWarning
from treecompile.core.errors import ConstantLength, UnsupportedModelError
from treecompile.passes._graph import (
    PassContext,
    _add_upstream,
    describe,
    is_call,
    location_of,
    same_size,
    source_of,
    value,
)
from treecompile.passes._mask_eval import depends_on_inputs
from treecompile.passes.counters import counter_refusal, weight_counters
from treecompile.passes.rows import ONE_ROW, row_states
from treecompile.passes.rows.random import draws, random_refusal

__all__ = ["verify_graph_pass", "RowsMixed", "HeldAtRowCount"]


class RowsMixed(UnsupportedModelError):
    """The verify pass's refusal of an op that mixes rows; ``node`` is that op (the backend names
    the state the model keeps instead, where the op writes it: `treecompile.passes.state.touches_state`)."""

    def __init__(self, message: str, node: fx.Node) -> None:
        super().__init__(message)
        self.node = node


class HeldAtRowCount(RowsMixed, ConstantLength):
    """A tensor the model keeps, as long as the packed row, read whole (`held_tables`): a cache
    an earlier call built for a sequence as long as this packed row. The whole-tree wrapper runs
    the batch again with a zero-weight row more (the model then takes its cache-miss branch and
    builds the table in the call) before it refuses with this message."""


def verify_graph_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Raises on the first node not proven row-local (graph order; a node a pass left with a
    note first).

    Counters (``ctx.counters["verify_graph_pass"]``): ``nodes_checked``.
    """
    checked = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module")
               and n not in ctx.created]
    ctx.count("nodes_checked", len(checked))
    if ctx.dropout != "shared":
        _refuse_random(checked)
    held = held_tables(gm, ctx)
    _refuse_held_tables(held, ctx)
    env, violations = row_states(gm, ctx, trusted=ctx.created, placeholders=held)
    ctx.row_states = env.states
    violations = _on_the_loss_path(gm, ctx, violations)
    if not _symbolic(ctx.seq_len):
        # No symbol tells the rows apart (they were found by their number), so no proof holds;
        # a loop over the tokens (one row taken at a time) is the usual cause, said as such.
        _refuse_static_length(gm, ctx, [(n, w) for n, w in violations if w != ONE_ROW])
    if violations:
        # Report an attention a pass looked at and left (it says why) before the first
        # violation in graph order, which is often just mask-building feeding it.
        noted = [(n, w) for n, w in violations if n in ctx.notes]
        node, why = (noted or violations)[0]
        counted = counter_refusal(gm, ctx, node, why)
        if counted is not None:
            raise counted
        note = ctx.notes.get(node)
        extra = f" ({note})" if note else ""
        raise RowsMixed(
            f"treecompile cannot make this model exact on a tree: {describe(node)} at {location_of(node)} "
            f"{why}{extra}.\n"
            f"  at {source_of(node)}\n"
            "Every op that mixes tokens along the sequence must be rewritten to follow the tree; "
            "see passes/README.md for what is supported.", node)
    weight_counters(gm, ctx, env)
    return gm


def held_tables(gm: fx.GraphModule, ctx: PassContext) -> dict[fx.Node, Any]:
    """The graph inputs the model holds (an attribute of a module, a global: not a local of
    the frame) with a dim as long as the row count: no rows. Only the call's own inputs hold
    rows of the batch; a tensor the model keeps that is as long as the packed row is a table an
    earlier call built for its length (a rotary cache rebuilt when the length changes, kept as
    a plain attribute), whose entry ``i`` is for row index ``i``, not for a position."""
    from treecompile.passes.state import input_source, is_held_source

    if not isinstance(ctx.seq_len, torch.SymInt):
        return {}
    return {n: None for n in gm.graph.nodes if n.op == "placeholder" and isinstance(value(n), torch.Tensor)
            and any(same_size(d, ctx.seq_len) for d in value(n).shape) and is_held_source(input_source(n))}


def _refuse_held_tables(held: dict[fx.Node, Any], ctx: PassContext) -> None:
    """Refuses a held tensor as long as the packed row (`held_tables`) that the model reads
    other than through a pass's gather at the positions."""
    from treecompile.passes.state import input_source, state_name

    for node in held:
        users = [u for u in node.users if u not in ctx.created]
        if users:
            raise HeldAtRowCount(
                f"treecompile cannot make this model exact on a tree: {describe(users[0])} at {location_of(users[0])} "
                f"reads {state_name(input_source(node))}, a tensor the model keeps that is as long as the packed row "
                "(an earlier call built it for its own length): its entry i is for row index i of the packed row, "
                "not for the position on the path.\n"
                f"  at {source_of(users[0])}\n"
                "Read such a table at the positions (table[position_ids], or sliced table[:T] from a table at least "
                "as long as every path), or build it in the call.", users[0])


def _refuse_random(nodes: list[fx.Node]) -> None:
    """Refuses the first op that draws random numbers (`treecompile.passes.rows.random`)."""
    for node in nodes:
        what = draws(node)
        if what is not None:
            raise random_refusal(node, what)


def _on_the_loss_path(gm: fx.GraphModule, ctx: PassContext, violations: list) -> list:
    """The violations that matter: all but a value computed from no token nor parameter (sizes,
    constants, buffers) that nothing on the way to the loss reads, kept only because the model
    stores it (``self.src_mask = mask``, a mask cached on the module). A later call that reads
    the stored value gets it as an input, judged then; a stored value computed from the tokens
    (running statistics) is refused."""
    if not violations:
        return violations
    loss_path = _add_upstream([n for n in ctx.created if n.op != "output"], set())
    kept = [(n, w) for n, w in violations if n in loss_path or depends_on_inputs(ctx, n)]
    stored = [(n, w) for n, w in violations if (n, w) not in kept]
    if stored and not kept:
        node, why = stored[0]
        warnings.warn(
            f"treecompile: {describe(node)} at {location_of(node)} {why}; it does not reach the loss and is only "
            "kept because the model stores it. On a packed row it is built for the whole row: an [S, S] tensor costs "
            "S^2 memory.", TreeWarning, stacklevel=2)
    return kept


def _symbolic(s) -> bool:
    """Whether the sequence length is a symbol (not a number, nor a SymInt specialised to one)."""
    return isinstance(s, torch.SymInt) and bool(s.node.expr.free_symbols)


def _refuse_static_length(gm: fx.GraphModule, ctx: PassContext, violations: list) -> None:
    """Raises: the captured graph has a constant sequence length; names a per-token op if it
    finds one, and the first op the rules found mixing rows (by their number)."""
    s = ctx.seq_len
    culprit = next((n for n in gm.graph.nodes if n not in ctx.created and _indexes_one_token(n, s)), None)
    where = (f" {describe(culprit)} takes one token of the row at a time.\n  at {source_of(culprit)}\n"
             if culprit is not None else "\n")
    if violations:
        node, why = violations[0]
        where += (f"  The first op that mixes rows: {describe(node)} at {location_of(node)} {why}.\n"
                  f"  at {source_of(node)}\n")
    line = _where_length_became_constant(ctx, s)
    code, _, place = (line or "").partition("  # ")
    at = f" at {_whole_path(place.strip())} (`{code.strip()}`)" if line else " in the captured graph"
    if line and "range(" in code and not code.lstrip().startswith(("for ", "while ")):
        advice = ("A Python range (or list) of the length becomes numbers at capture: build positions with "
                  "torch.arange(T, device=x.device), which the tree rewrite reads.")
    else:
        advice = ("Write the recurrence as a scan kernel treecompile knows (see docs/hybrid.md), or as ops over "
                  "the whole sequence.")
    raise ConstantLength(
        f"treecompile cannot make this model exact on a tree: the model makes the sequence length a constant "
        f"({s}){at}, typically a Python loop over the tokens (for t in range(seq_len)), a Python range of the "
        f"length or a branch on it, so its per-token ops cannot be checked.{where}{advice}"
    )


def _where_length_became_constant(ctx: PassContext, s) -> str | None:
    """The model's source line at which Dynamo replaced the row length's symbol by ``s`` (its
    shape environment records where each symbol was specialised; lines of treecompile's own
    call around the model are skipped), or None."""
    from torch._guards import detect_fake_mode

    try:
        env = getattr(detect_fake_mode(ctx.example_inputs), "shape_env", None)
        slocs = getattr(env, "replacements_slocs", None) or {}
        for sym, val in getattr(env, "replacements", {}).items():
            user = getattr(slocs.get(sym), "maybe_user_loc", None)
            if user and val == int(s) and not _own_source(str(user)):
                return str(user).strip()
    except Exception:  # an older shape environment without these records: the message stays general
        return None
    return None


def _whole_path(place: str) -> str:
    """``path:line in function`` with the path Dynamo cut on the left made whole again: the one
    loaded module file (or linecache entry) it ends with, else the file it names in the working
    directory; as it is when none or several do."""
    import re
    import sys

    m = re.match(r"(\S+)(:\d+ in \S+)$", place)
    if m is None or os.path.isabs(m.group(1)):
        return place
    files = {getattr(mod, "__file__", None) for mod in list(sys.modules.values())} | set(linecache.cache)
    found = [f for f in files if isinstance(f, str) and f.endswith(m.group(1))]
    if len(found) == 1:
        return found[0] + m.group(2)
    # Relative to the working directory (torch 2.14 cuts the path so).
    return os.path.abspath(m.group(1)) + m.group(2) if os.path.exists(m.group(1)) else place


def _own_source(loc: str) -> bool:
    """Whether ``loc`` (``code  # path:line in function``, the path maybe cut on the left) is a
    line of treecompile's own packages."""
    import re

    m = re.search(r"#\s*(\S+):\d+ in \S+\s*$", loc)
    return m is not None and any(f.endswith(m.group(1)) for f in _own_files())


@functools.lru_cache(maxsize=1)
def _own_files() -> tuple[str, ...]:
    """The source files of treecompile's packages (the api and core folder, passes, kernels)."""
    import importlib
    from pathlib import Path

    core, kernels = (importlib.import_module(f"treecompile.{name}") for name in ("core", "kernels"))
    roots = {Path(core.__file__).parents[1], Path(__file__).parent, Path(kernels.__file__).parent}
    return tuple(str(f) for root in roots for f in root.rglob("*.py"))


def _indexes_one_token(node: fx.Node, s) -> bool:
    """``x[:, t]`` / ``x.select(1, t)`` / ``x.unbind(1)`` on a dim of the row length."""
    x = node.args[0] if node.args else None
    xv = value(x)
    if not isinstance(xv, torch.Tensor):
        return False
    if node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[1], tuple):
        index = node.args[1]
        if Ellipsis in index:
            return False
        return any(isinstance(i, int) and d < xv.dim() and same_size(xv.shape[d], s) for d, i in enumerate(index))
    if is_call(node, (torch.select, torch.unbind), ("select", "unbind")):
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
        return isinstance(dim, int) and same_size(xv.shape[dim], s)
    return False
