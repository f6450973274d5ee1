"""The keys and values a context-parallel rank reads from the others, gathered in its graph.

Under context parallelism (CP) each rank of a group holds a contiguous run of the packed
row (`treecompile.distributed.cp_split`). A rank's queries see, besides its own rows, the rows of
the root path of its first row, which earlier ranks hold. ``treecompile::cp_gather_rows``
fetches those rows of one layer's keys (or values) inside the compiled graph with one
all-to-all: each rank sends every later rank the rows of its path that it holds, and
receives the rows of its own path (`treecompile.distributed.cp_split.CPSplit.exchange`), so a rank
receives its path's rows and no others: what moves per layer is the tree's root paths at the
cuts, not the row. Its backward adds the gradient of the received rows and sends it back
the same way (the reverse all-to-all), where each rank adds what every reader sent into its
own rows. ``torch.distributed``'s ``all_to_all_single`` on any backend that has it (gloo on
CPU, NCCL on CUDA). (torch's FlexAttention CP all-gathers every rank's K/V instead, and
reduce-scatters their gradients: on a tree most of those rows are masked out.)

A custom op, so a captured graph holds one opaque node per gather and every rank runs the
same collectives in the same order: the graph's. The group is named by a string
(`register_group`) because a custom op takes no process-group objects.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

__all__ = ["register_group", "group_of", "cp_gather_rows", "PAD_SEND", "padded_send"]

Tensor = torch.Tensor

#: Entries before a rank's send rows, never read: the send rows' count is never 0 or 1,
#: which Dynamo would specialise (a graph more for each, on a rank that sends nothing or one
#: row in some call).
PAD_SEND = 2


def padded_send(send_rows: np.ndarray) -> np.ndarray:
    """``send_rows`` (`treecompile.distributed.cp_split.CPSplit.exchange`) after `PAD_SEND` unread entries."""
    return np.concatenate([np.zeros(PAD_SEND, np.int64), send_rows])

_GROUPS: dict[str, dist.ProcessGroup] = {}

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


def _exchange(rows: Tensor, send_counts: list[int], recv_counts: list[int], group: dist.ProcessGroup) -> Tensor:
    """``[sum(recv_counts), ...]``: one all-to-all of ``rows`` ``[sum(send_counts), ...]``."""
    out = rows.new_empty(sum(recv_counts), *rows.shape[1:])
    dist.all_to_all_single(out, rows.contiguous(), output_split_sizes=recv_counts, input_split_sizes=send_counts,
                           group=group)
    return out


@torch.library.custom_op("treecompile::cp_gather_rows", mutates_args=())
def cp_gather_rows(x: Tensor, index: Tensor, send_rows: Tensor, counts: Tensor, group: str) -> Tensor:
    """Rows of the group's ``x``, gathered.

    Args:
        x: ``[1, H, S_r, D]``: this rank's rows (keys or values of one layer).
        index: ``[n]`` int64 rows to return, in received coordinates: ``1 + i`` is the
            ``i``-th row received (in rank order), ``0`` a zero row (padding keys).
        send_rows: ``[PAD_SEND + m]`` int64: `PAD_SEND` entries never read, then this rank's
            rows (local numbers) to send, grouped by the receiving rank in rank order
            (`padded_send`).
        counts: ``[2, K]`` int64 on the CPU: rows sent to and received from each rank.
        group: a name from `register_group`.

    Returns:
        ``[1, H, n, D]``.
    """
    g = group_of(group)
    send_counts, recv_counts = counts.tolist()
    local = x[0].transpose(0, 1)  # [S_r, H, D]
    got = _exchange(local.index_select(0, send_rows[PAD_SEND:]), send_counts, recv_counts, g)
    full = torch.cat([local.new_zeros(1, *local.shape[1:]), got])
    return full.index_select(0, index).transpose(0, 1).unsqueeze(0).contiguous()


@cp_gather_rows.register_fake
def _(x, index, send_rows, counts, group):
    return x.new_empty(1, x.shape[1], index.shape[0], x.shape[3])


@torch.library.custom_op("treecompile::cp_scatter_rows", mutates_args=())
def cp_scatter_rows(grad: Tensor, index: Tensor, send_rows: Tensor, counts: Tensor, group: str,
                    local_rows: int) -> Tensor:
    """The backward of `cp_gather_rows`: ``[1, H, S_r, D]``, this rank's rows' share of every
    rank's ``grad`` ``[1, H, n, D]`` (an index-add into the received rows, the reverse
    all-to-all, an index-add into this rank's rows)."""
    g = group_of(group)
    send_counts, recv_counts = counts.tolist()
    full = grad.new_zeros(1 + sum(recv_counts), grad.shape[1], grad.shape[3])
    full.index_add_(0, index, grad[0].transpose(0, 1))
    back = _exchange(full[1:], recv_counts, send_counts, g)
    mine = grad.new_zeros(local_rows, grad.shape[1], grad.shape[3])
    mine.index_add_(0, send_rows[PAD_SEND:], back)
    return mine.transpose(0, 1).unsqueeze(0).contiguous()


@cp_scatter_rows.register_fake
def _(grad, index, send_rows, counts, group, local_rows):
    return grad.new_empty(1, grad.shape[1], local_rows, grad.shape[3])


def _setup_context(ctx, inputs, output):
    x, index, send_rows, counts, group = inputs
    ctx.save_for_backward(index, send_rows, counts)
    ctx.group = group
    ctx.local_rows = x.shape[2]


def _backward(ctx, grad):
    index, send_rows, counts = ctx.saved_tensors
    dx = torch.ops.treecompile.cp_scatter_rows(grad.contiguous(), index, send_rows, counts, ctx.group,
                                                ctx.local_rows)
    return dx, None, None, None, None


cp_gather_rows.register_autograd(_backward, setup_context=_setup_context)
