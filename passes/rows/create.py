"""Row rules: new tensors (uniform rows, ``arange``), and ops refused by name."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import fx
from treecompile.passes._graph import same_size, table_length
from treecompile.passes.rows.domain import (
    IDS,
    RULES,
    TABLE,
    Args,
    NotRowLocal,
    RowEnv,
    Rows,
    Rule,
    _created_rows,
    _is_row_sym,
    _nd,
    _register,
    _shape,
    expr,
    iter_nodes,
)
from treecompile.passes.rows.grouped import empty_rows
from treecompile.passes.ssm_state import SCAN_OPS


@_register("like", "zeros_like ones_like empty_like full_like")
def like(node: fx.Node, a: Args, env: RowEnv) -> Any:
    """A new tensor shaped like ``x``: its rows, with the same value (or i.i.d. noise) in each."""
    r = env.rows(a.first)
    return None if r is None else dataclasses.replace(r, ids=None, uniform=True)


@_register("creation", "zeros ones empty empty_strided empty_permuted", sizes=("all",))
def creation(node: fx.Node, a: Args, env: RowEnv) -> Any:
    return empty_rows(node, env) or _created_rows(node, env)


@_register("creation", "full", sizes=(0, "size"))
def full(node: fx.Node, a: Args, env: RowEnv) -> Any:
    return empty_rows(node, env) or _created_rows(node, env)


@_register("creation", "new_zeros new_ones new_empty new_empty_strided", sizes="*")
def new_tensor(node: fx.Node, a: Args, env: RowEnv) -> Any:
    return empty_rows(node, env) or _created_rows(node, env)


@_register("creation", "new_full", sizes=(1, "size"))
def new_full(node: fx.Node, a: Args, env: RowEnv) -> Any:
    return empty_rows(node, env) or _created_rows(node, env)


@_register("creation", "arange", sizes="rule")
def arange(node: fx.Node, a: Args, env: RowEnv) -> Any:
    """``arange(S)`` is the row ids of the packed row (an index that moves nothing); any other
    arange over the rows is a row index used as a value."""
    size = _shape(node)[0] if _nd(node) == 1 else None
    if size is None or not env.is_row_size(size):
        if _is_row_sym(env, (a.args, a.kwargs)):
            raise NotRowLocal("is an index over the packed row that is not a position (e.g. feeds a mask)")
        return None
    args = list(a.args)
    start, end, step = (0, args[0], 1) if len(args) == 1 else (args + [1])[:3]
    start, step = a.kwargs.get("start", start), a.kwargs.get("step", step)
    if start == 0 and step == 1 and same_size(size, env.s):
        return Rows(0, count=env.s_expr, ids=IDS)
    if start == 0 and step == 1 and isinstance(size, torch.SymInt) and table_length(expr(size), env.s_expr) \
            and not _is_row_sym(env, a.kwargs.get("start")):
        # arange(c * S) or arange(S + c): the entries of a table to be read at positions (each
        # below S, at most the table's length); fairseq builds its sinusoids over padding_idx + 1 + S.
        return Rows(0, count=expr(size), key=TABLE, ids=IDS)
    raise NotRowLocal("is an index over the packed row that is not a position (e.g. feeds a mask)")


@_register("creation", "linspace logspace eye tril_indices triu_indices", sizes="rule")
def positional(node: fx.Node, a: Args, env: RowEnv) -> Any:
    if _is_row_sym(env, (a.args, a.kwargs)) or any(env.is_row_size(d) for d in _shape(node)):
        raise NotRowLocal("builds values from the row index (positions as linspace(0, T - 1, T), an eye(T) ...): "
                          "a token's index in the packed row is not its position on its path")
    return None


# --------------------------------------------------------------------------- refused by name

_REFUSED = {
    "gru": "is a recurrent layer (or an opaque module) over the sequence",
    "lstm": "is a recurrent layer (or an opaque module) over the sequence",
    "rnn_tanh": "is a recurrent layer (or an opaque module) over the sequence",
    "rnn_relu": "is a recurrent layer (or an opaque module) over the sequence",
    "treecompile::causal_attention": "is a causal attention that was not rewritten",
    "treecompile::tree_inputs": "is the tree input marker, which must have been removed",
    "treecompile::causal_conv1d": "is a sequence kernel (causal conv or recurrent scan) over the packed row that was "
                                  "not rewritten",
    "treecompile::row_earlier": "is a step of an associative scan along the packed row that was not rewritten",
    "treecompile::row_has_earlier": "is a step of an associative scan along the packed row that was not rewritten",
    "multi_head_attention_forward": "is nn.MultiheadAttention over the packed rows, not rewritten to the tree "
                                    "attention",
    "cross_entropy": "computes a loss over the rows inside the model (a reduction along the sequence)",
    "nll_loss": "computes a loss over the rows inside the model (a reduction along the sequence)",
}


def _refuse_rule(reason: str):
    def rule(node: fx.Node, a: Args, env: RowEnv) -> Any:
        if any(env.rows(x) is not None for x in iter_nodes((a.args, a.kwargs))):
            raise NotRowLocal(reason)
        return env.by_size(node)

    return rule


# The linear-sequence scan kernels the wrapper swaps in (their tree forms are created nodes).
_REFUSED.update({f"treecompile::{kind}": _REFUSED["treecompile::causal_conv1d"] for kind in SCAN_OPS})

for _op, _why in _REFUSED.items():
    RULES[_op] = Rule(_refuse_rule(_why), "refused")
