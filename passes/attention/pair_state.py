"""What the dense pair rule (`treecompile.passes.attention.dense_pairs`) knows of a region tensor:
its value off the query's path (`Hidden`), its query dim, and the constant fills it needs not read
at path positions."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx

from treecompile.passes._graph import PassContext, same_size, storage_of, value
from treecompile.passes.rows.domain import op_key

__all__ = ["Hidden", "UNKNOWN", "query_dim", "is_pair", "FILLS", "FILL_ARGS", "fill_value", "written", "INDEX_CASTS"]


@dataclass(frozen=True)
class Hidden:
    """What a region tensor holds at hidden entries: one constant (a 0-dim tensor), or unknown."""

    const: torch.Tensor | None = None

    def is_(self, x: float) -> bool:
        return self.const is not None and bool(self.const.double() == x)


UNKNOWN = Hidden()


def query_dim(x, ctx: PassContext) -> int | None:
    """The query dim of an ``[S, S]`` tensor (-2: ``[.., S, S]``; -3: ``[.., S, h, S]``, scores per
    head of a sparse-attention indexer before it sums them), the key dim being -1; else None."""
    v = value(x) if isinstance(x, fx.Node) else None
    if not (isinstance(v, torch.Tensor) and v.dim() >= 2 and same_size(v.shape[-1], ctx.seq_len)):
        return None
    dims = [d - v.dim() for d in range(v.dim() - 1) if same_size(v.shape[d], ctx.seq_len)]
    return dims[0] if len(dims) == 1 and dims[0] in (-2, -3) else None


def is_pair(x, ctx: PassContext) -> bool:
    return query_dim(x, ctx) is not None


#: Ops filling a new tensor with one value (``torch.zeros(size)``; ``x.new_ones(size)`` reads only
#: the shape and dtype of ``x``), and the value; `FILL_ARGS`: those taking it as an argument, and its position.
FILLS = {"new_ones": 1, "new_zeros": 0, "ones_like": 1, "zeros_like": 0, "ones": 1, "zeros": 0}
FILL_ARGS = {"new_full": 2, "full_like": 1, "full": 1}


def fill_value(n: fx.Node) -> torch.Tensor | None:
    """The one value a constant fill holds (a 0-dim tensor of its dtype), else None."""
    name = op_key(n) if n.op in ("call_function", "call_method") else None
    if name in FILL_ARGS:
        at = FILL_ARGS[name]
        c = n.args[at] if len(n.args) > at else n.kwargs.get("fill_value")
    else:
        c = FILLS.get(name)
    v = value(n)
    if not isinstance(c, (bool, int, float)) or not isinstance(v, torch.Tensor):
        return None
    return torch.tensor(c, dtype=v.dtype)


def written(n: fx.Node, state: dict, members: set) -> None:
    """After ``n`` wrote its first argument in place, every tensor of the region sharing that
    memory (the earlier names of these scores, views keeping the last two dims) holds ``n``'s
    values from here on."""
    target = storage_of(n.args[0])
    for m in members:
        if m is not n and target is not None and storage_of(m) == target and m in state:
            state[m] = state[n]


#: Casts of key indices (``topk(..).indices.to(torch.int32)``, ``.long()``).
INDEX_CASTS = {"to", "long", "int", "type"}
