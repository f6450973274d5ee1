"""The walk: every node of a graph judged by its rule, in graph order (`row_states`).

Besides the rules, two checks hold for every node the passes did not create: a size
computed from the sequence length may appear only as the dim of the rows, and the length
(or a count of data-chosen rows) may enter an op only where the op takes a size.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
from torch import fx
from treecompile.passes._graph import (
    PassContext,
    describe,
    mutated_args,
    same_size,
    storage_of,
    value,
)
from treecompile.passes.rows.domain import (
    RULES,
    Args,
    NotRowLocal,
    RowEnv,
    Rows,
    Rule,
    iter_nodes,
    op_key,
    same_expr,
    split_inplace,
)
from treecompile.passes.rows.grouped import GroupCount, group_count_item


def row_states(
    gm: fx.GraphModule, ctx: PassContext, *, trusted: set[fx.Node], placeholders: dict[fx.Node, Any] | None = None,
) -> tuple[RowEnv, list[tuple[fx.Node, str]]]:
    """Interprets ``gm`` over the row domain.

    Args:
        trusted: nodes the passes created: never refused (their state comes from the rules
            where they apply, else from their sizes).
        placeholders: states of some placeholders (the rest are found from their sizes).

    Returns:
        ``(env, refusals)``: the states of every node, and ``(node, reason)`` for each node
        not proven row-local, in graph order.
    """
    env = RowEnv(ctx)
    refusals: list[tuple[fx.Node, str]] = []
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "get_attr"):
            given = (placeholders or {}).get(node, ...)
            env.states[node] = env.by_size(node) if given is ... else given
            continue
        if node.op == "output":
            continue
        if node in ctx.off_rows:  # a pass's table over distances (or keys): no rows
            env.states[node] = None
            continue
        try:
            state = infer(node, env)
            if node in trusted and not _has_rows(state):
                state = env.by_size(node)  # a pass's node (its inputs may lack recorded shapes)
            check_sizes(node, state, env)
        except Exception as e:
            # A node a pass inserted needs no proof: a rule that cannot read it (its example
            # value left out where the pass changed the shapes) leaves its state by size.
            if not isinstance(e, NotRowLocal) and node not in trusted:
                raise
            state = env.by_size(node)
            if node not in trusted:
                refusals.append((node, str(e)))
        env.states[node] = state
        _written(node, env)
    return env, refusals


def _written(node: fx.Node, env: RowEnv) -> None:
    """After an in-place write, the tensors sharing the written memory no longer hold one
    value in every row."""
    targets = mutated_args(node)
    if not targets:
        return
    stores = {storage_of(t) for t in targets} - {None}
    for n, st in env.states.items():
        if isinstance(st, Rows) and st.uniform and storage_of(n) in stores:
            env.states[n] = dataclasses.replace(st, uniform=False)


def row_family(node: fx.Node) -> str | None:
    """The family of the rule that judges ``node`` (None if no rule names its op)."""
    name = op_key(node)
    rule = RULES.get(name) or RULES.get(split_inplace(name)[0])
    return None if rule is None else rule.family


def infer(node: fx.Node, env: RowEnv) -> Any:
    """The state of ``node``'s result by its rule; raises `NotRowLocal`."""
    if node.op == "call_function" and isinstance(node.target, torch._ops.HigherOrderOperator):
        return _higher_order(node, env)
    name = op_key(node)
    base, inplace = split_inplace(name)
    args = Args(tuple(node.args), dict(node.kwargs))
    if node.op == "call_function" and node.kwargs.get("inplace") is True:
        inplace = True
    rule = RULES.get(name) or RULES.get(base)
    inputs = list(iter_nodes((node.args, node.kwargs)))
    counted = [a for a in inputs if isinstance(env.states.get(a), GroupCount)]
    if counted:  # a group's count (a histogram of the rows' keys) is a size, never a value
        if name == "item" and len(counted) == 1:
            group_count_item(node, env, env.states[counted[0]])
            return None
        raise NotRowLocal("uses a group's count of rows (a histogram of top-k indices over the rows) as a value: it "
                          "counts the tokens of every path at once")
    carried = [a for a in inputs if _has_rows(env.states.get(a))]
    if rule is None or rule.sizes != "rule":
        _check_values(node, args, rule, env)
    if rule is None:
        if not carried and not any(env.is_row_size(d) for d in _out_sizes(node)):
            return None  # reads nothing that depends on a row, makes no dim of rows
        raise NotRowLocal(_unknown(node, name))
    out = rule.infer(node, args, env)
    if inplace and rule.family not in ("mutation", "cast", "meta"):
        target = env.rows(args.first)
        if not _same_rows(out, target):
            raise NotRowLocal("writes in place values whose rows do not line up with its target's")
        return target
    return env.rows(args.first) if inplace and rule.family == "cast" else out


def _higher_order(node: fx.Node, env: RowEnv) -> Any:
    """A ``torch.autograd.Function`` is accepted if neither its forward nor its backward body
    mixes rows (checked node by node like the graph, its inputs' rows found from their sizes);
    any other op with a subgraph is refused when it sees rows."""
    carried = any(_has_rows(env.states.get(a)) for a in iter_nodes((node.args, node.kwargs)))
    t = node.target
    if t is getattr(torch.ops.higher_order, "autograd_function_apply", None):
        gm = node.graph.owning_module
        bodies = [getattr(gm, a.target) for a in node.args if isinstance(a, fx.Node) and a.op == "get_attr"]
        if not bodies and carried:
            raise NotRowLocal("is a torch.autograd.Function whose body treecompile cannot see")
        for body in bodies:
            _, refusals = row_states(body, env.ctx, trusted=set())
            if refusals:
                inner, why = refusals[0]
                raise NotRowLocal(f"is a torch.autograd.Function whose body has {describe(inner)} that {why}")
        return env.by_size(node)
    if not carried:
        return env.by_size(node)
    if t is getattr(torch.ops.higher_order, "flex_attention", None):
        raise NotRowLocal("is a FlexAttention call with the model's own mask, which is not the tree mask")
    raise NotRowLocal(f"is a higher-order op ({getattr(t, '__name__', t)}: torch.cond, a torch.autograd.Function, a "
                      "loop or region with its own subgraph) whose body the passes do not rewrite or check")


def _has_rows(st: Any) -> bool:
    if isinstance(st, Rows):
        return True
    if isinstance(st, tuple):
        return any(_has_rows(x) for x in st)
    return False


def _same_rows(a: Any, b: Any) -> bool:
    """Whether an in-place op's result has its target's rows."""
    if a is None or b is None:
        return a is None and b is None
    if isinstance(a, Rows) and isinstance(b, Rows):
        return a.dim == b.dim and (a.uniform or b.uniform or (a.key == b.key and same_expr(a.inner, b.inner)))
    return False


def _out_sizes(node: fx.Node) -> list[Any]:
    v = value(node)
    vals = v if isinstance(v, (tuple, list)) else [v]
    return [d for t in vals if isinstance(t, torch.Tensor) for d in t.shape]


def _unknown(node: fx.Node, name: str | None) -> str:
    t = node.target
    ns = getattr(t, "namespace", None) if isinstance(t, torch._ops.OpOverload) else None
    if ns is None and isinstance(name, str) and "::" in name:
        ns = name.split("::")[0]
    if ns is not None and ns not in ("aten", "prims"):
        return "is a custom op treecompile does not know, applied to the sequence (it may mix tokens)"
    if node.op == "call_module":
        return "is a recurrent layer (or an opaque module) over the sequence"
    label = name or getattr(t, "__name__", str(t))
    return (f"is an op ({label}) that no row rule of treecompile covers, applied to the packed rows: it is not "
            "proven to keep each token's row to itself, so it is refused (passes/README.md lists the rules)")


def _check_values(node: fx.Node, args: Args, rule: Rule | None, env: RowEnv) -> None:
    """Refuses the sequence length (or a selection's count) used as a tensor value."""
    if not _makes_tensor(node):
        return
    allowed = _size_positions(rule, args)
    for pos, a in _positions(args):
        if pos in allowed:
            continue
        for n in iter_nodes(a):
            v = value(n)
            if isinstance(v, torch.Tensor):
                continue
            syms = env.row_symbols(v)
            if not syms:
                continue
            if all(str(x).startswith("u") for x in syms):
                raise NotRowLocal(
                    f"uses a count of rows chosen by the data ({v}) as a value: it counts rows of the whole packed "
                    "row (every path's tokens at once), not of one path")
            what = "the length S itself" if same_size(v, env.s) else f"{v}, computed from the length S"
            raise NotRowLocal(
                f"uses the sequence length as a value ({what}), e.g. arange(T) / T or a log(T) temperature: each "
                "path has its own length, which one packed row does not have")


def _makes_tensor(node: fx.Node) -> bool:
    v = value(node)
    if isinstance(v, torch.Tensor):
        return True
    return isinstance(v, (tuple, list)) and any(isinstance(x, torch.Tensor) for x in v)


def _positions(args: Args) -> Iterator[tuple[Any, Any]]:
    for i, a in enumerate(args.args):
        yield i, a
    yield from args.kwargs.items()


def _size_positions(rule: Rule | None, args: Args) -> set:
    if rule is None:
        return set()
    values = {"fill_value", "value"}
    if rule.sizes == "*":
        return set(range(1, len(args.args))) | set(args.kwargs) - values
    if "all" in rule.sizes:
        return set(range(len(args.args))) | set(args.kwargs) - values
    return set(rule.sizes)


def check_sizes(node: fx.Node, state: Any, env: RowEnv) -> None:
    """Refuses a result with a dim computed from the sequence length that is not its rows."""
    v = value(node)
    if isinstance(v, (tuple, list)):
        states = state if isinstance(state, tuple) else (None,) * len(v)
        for x, st in zip(v, states):
            _check_tensor_sizes(x, st, env)
    else:
        _check_tensor_sizes(v, state, env)


def _check_tensor_sizes(v: Any, st: Any, env: RowEnv) -> None:
    if not isinstance(v, torch.Tensor):
        return
    for d, size in enumerate(v.shape):
        if not env.is_row_size(size) or isinstance(st, Rows) and st.dim == d:
            continue
        if isinstance(st, Rows) and env.s is not None and same_size(size, env.s):
            raise NotRowLocal("produces a [.., S, S] tensor (attention scores or a mask built from the sequence length)")
        raise NotRowLocal("changes the sequence length (a shift, pad or cat along the sequence)")
