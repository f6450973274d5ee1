"""The keys and values a context-parallel rank reads from the others, gathered in its graph.

Under context parallelism (CP) each rank of a group holds a contiguous run of the packed
row (`treecompile.planning.cp`). A rank's queries see, besides its own rows, the rows of
the root path of its first row, which earlier ranks hold. ``treecompile::cp_gather_rows``
fetches those rows of one layer's keys (or values) inside the compiled graph: every rank
all-gathers the group's rows, each rank's padded to the longest rank's (collectives move
equal chunks), and keeps the rows its ``index`` names. Its backward adds the gradient of
the kept rows into a gathered-shape tensor and reduce-scatters it (a sum over the ranks):
each rank receives, for its own rows, what every rank's queries contributed. These are the
collectives torch's own FlexAttention CP uses (an all-gather of K/V, a reduce-scatter of
dK/dV), from ``torch.distributed`` on any backend that has them (gloo on CPU, NCCL on CUDA).

A custom op, so a captured graph holds one opaque node per gather and every rank runs the
same collectives in the same order: the graph's. The group is named by a string
(`register_group`) because a custom op takes no process-group objects.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["register_group", "group_of", "cp_gather_rows"]

Tensor = torch.Tensor

_GROUPS: dict[str, dist.ProcessGroup] = {}

# The flat-tensor collectives under their current names (torch 2.13 deprecates the old ones).
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def register_group(group: dist.ProcessGroup) -> str:
    """The name `cp_gather_rows` knows ``group`` by (its ``group_name``)."""
    name = group.group_name
    _GROUPS[name] = group
    return name


def group_of(name: str) -> dist.ProcessGroup:
    """The group registered under ``name``.

    Raises:
        RuntimeError: none is (a graph compiled in another process, a group destroyed since).
    """
    group = _GROUPS.get(name)
    if group is None:
        raise RuntimeError(f"treecompile: no context-parallel process group {name!r} is registered in this process")
    return group


def _gathered(x: Tensor, rows: int, group: dist.ProcessGroup) -> Tensor:
    """``[K * rows, H, D]``: every rank's ``x`` ``[1, H, S_r, D]`` rows, each padded to ``rows``."""
    local = x[0].transpose(0, 1)  # [S, H, D]
    if local.shape[0] < rows:
        local = torch.cat([local, local.new_zeros(rows - local.shape[0], *local.shape[1:])])
    local = local.contiguous()
    out = local.new_empty(dist.get_world_size(group) * rows, *local.shape[1:])
    _all_gather(out, local, group=group)
    return out


@torch.library.custom_op("treecompile::cp_gather_rows", mutates_args=())
def cp_gather_rows(x: Tensor, index: Tensor, sizes: Tensor, group: str) -> Tensor:
    """Rows of the group's ``x``, gathered.

    Args:
        x: ``[1, H, S_r, D]``: this rank's rows (keys or values of one layer).
        index: ``[n]`` int64 rows to keep, in gathered coordinates: row ``i`` of rank ``r``
            is ``r * max(sizes) + i``.
        sizes: ``[K]`` int64 on the CPU: each rank's ``S_r``, the same on every rank.
        group: a name from `register_group`.

    Returns:
        ``[1, H, n, D]``.
    """
    g = group_of(group)
    rows = int(sizes.max())
    full = _gathered(x, rows, g)
    return full.index_select(0, index).transpose(0, 1).unsqueeze(0).contiguous()


@cp_gather_rows.register_fake
def _(x, index, sizes, group):
    return x.new_empty(1, x.shape[1], index.shape[0], x.shape[3])


@torch.library.custom_op("treecompile::cp_scatter_rows", mutates_args=())
def cp_scatter_rows(grad: Tensor, index: Tensor, sizes: Tensor, group: str, local_rows: int) -> Tensor:
    """The backward of `cp_gather_rows`: ``[1, H, S_r, D]``, this rank's rows' share of every
    rank's ``grad`` ``[1, H, n, D]`` (an index-add, then a reduce-scatter summing the ranks)."""
    g = group_of(group)
    rows = int(sizes.max())
    world = dist.get_world_size(g)
    full = grad.new_zeros(world * rows, grad.shape[1], grad.shape[3])
    full.index_add_(0, index, grad[0].transpose(0, 1))
    mine = full.new_empty(rows, *full.shape[1:])
    _reduce_scatter(mine, full, group=g)
    return mine[:local_rows].transpose(0, 1).unsqueeze(0).contiguous()


@cp_scatter_rows.register_fake
def _(grad, index, sizes, group, local_rows):
    return grad.new_empty(1, grad.shape[1], local_rows, grad.shape[3])


def _setup_context(ctx, inputs, output):
    x, index, sizes, group = inputs
    ctx.save_for_backward(index, sizes)
    ctx.group = group
    ctx.local_rows = x.shape[2]


def _backward(ctx, grad):
    index, sizes = ctx.saved_tensors
    dx = torch.ops.treecompile.cp_scatter_rows(grad.contiguous(), index, sizes, ctx.group, ctx.local_rows)
    return dx, None, None, None


cp_gather_rows.register_autograd(_backward, setup_context=_setup_context)
