"""Data-parallel training on tree batches: DDP and FSDP2 with globally normalized losses.

Example (on each rank, after ``torch.distributed.init_process_group``)::

    from treecompile.planning.dataloader import TreeCollator
    from treecompile.distributed.data_parallel import wrap_ddp, train_step

    model = wrap_ddp(model)                       # gradients are summed, not averaged
    collate = TreeCollator(capacity=8192, rank=rank, world_size=world)
    micro_batches = collate(step_trees)           # this rank's list[TreeBatch]
    loss = train_step(model, micro_batches, optimizer)

Why sum: every batch is packed with the *global* ``denominator`` of the step
(`treecompile.planning.dataloader.plan_step`), so each rank's loss is already its share of the
global loss, and the global gradient is the **sum** of the ranks' gradients. DDP and
FSDP average by default (they divide the sum by the world size), which would shrink
the gradient K-fold. `wrap_ddp` registers a communication hook that all-reduces with a
plain sum; `wrap_fsdp` sets FSDP2's gradient divide factor to 1. (Multiplying each loss
by K would do the same up to rounding; the hook keeps the arithmetic exact.)

Micro-steps: all but the last run without gradient sync (DDP ``no_sync``, FSDP2
``set_requires_gradient_sync(False)``); the last one syncs the accumulated gradients.
`treecompile.planning.dataloader.plan_step` pads ranks to the same number of micro-steps with
zero-weight batches, as FSDP2's per-forward all-gathers require.

The forward is pluggable: ``forward(model, batch) -> loss``. `reference_forward` uses the
dense-mask reference (O(S^2), for tests and tiny models); `compiled_forward` uses
`treecompile.tree_compile` when it is available.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from treecompile.core.batch import TreeBatch
from treecompile.core.loss import gather_logprobs, tree_loss
from treecompile.core.reference import dense_mask_inputs

__all__ = [
    "Forward",
    "accumulate_gradients",
    "compiled_forward",
    "reference_forward",
    "sum_allreduce_hook",
    "train_step",
    "wrap_ddp",
    "wrap_fsdp",
]

Forward = Callable[[torch.nn.Module, TreeBatch], torch.Tensor]


def reference_forward(model: torch.nn.Module, batch: TreeBatch) -> torch.Tensor:
    """The tree loss through `treecompile.core.reference.dense_mask_logits` (HF models; O(S^2))."""
    from treecompile.core.reference import dense_mask_logits

    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        logits = _ddp_logits(model, batch)
    else:  # a plain or FSDP2-sharded model (fully_shard keeps the model's own class API)
        logits = dense_mask_logits(model, batch)
    return tree_loss(gather_logprobs(logits, batch), batch)


def _ddp_logits(ddp: torch.nn.Module, batch: TreeBatch) -> torch.Tensor:
    # Call the DDP wrapper itself (its forward hooks prepare the gradient reduction), with
    # the same inputs dense_mask_logits gives the model.
    out = ddp(**dense_mask_inputs(batch, next(ddp.parameters()).dtype))
    return out.logits[0]


def compiled_forward(model: torch.nn.Module, **kwargs: Any) -> Forward:
    """A forward through `treecompile.tree_compile(model, **kwargs)`; ``out.loss`` is the tree loss.

    Raises:
        ImportError: if this treecompile has no ``tree_compile``.
    """
    from treecompile.compile.wrapper import tree_compile

    compiled = tree_compile(model, **kwargs)

    def forward(_model: torch.nn.Module, batch: TreeBatch) -> torch.Tensor:
        return compiled(batch).loss

    forward.__name__ = "compiled_forward"
    return forward


def sum_allreduce_hook(process_group, bucket):  # noqa: ANN001, ANN201 - DDP checks these annotations
    """DDP communication hook: all-reduce gradient buckets with SUM (no division by world size).

    Left unannotated: DDP refuses a hook whose annotations are not the real
    ``dist.GradBucket`` / ``Future`` classes, and this module's annotations are strings.
    """
    group = process_group if process_group is not None else dist.group.WORLD
    work = dist.all_reduce(bucket.buffer(), op=dist.ReduceOp.SUM, group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def wrap_ddp(model: torch.nn.Module, **kwargs: Any) -> torch.nn.parallel.DistributedDataParallel:
    """``DistributedDataParallel(model, **kwargs)`` whose gradient all-reduce sums."""
    ddp = torch.nn.parallel.DistributedDataParallel(model, **kwargs)
    ddp.register_comm_hook(state=None, hook=sum_allreduce_hook)
    return ddp


def wrap_fsdp(
    model: torch.nn.Module, *, mesh: Any = None, layers: Sequence[torch.nn.Module] | None = None
) -> torch.nn.Module:
    """FSDP2 (`torch.distributed.fsdp.fully_shard`) with summed gradients.

    Args:
        model: the model; sharded in place (its class becomes an FSDP subclass).
        mesh: a 1-D device mesh (default: every rank, on the model's device type).
        layers: submodules to shard as their own units first (e.g. the decoder layers);
            default: none, the whole model is one unit.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    if mesh is None:
        device_type = next(model.parameters()).device.type
        mesh = init_device_mesh(device_type, (dist.get_world_size(),))
    for layer in layers or ():
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
    return model


@contextlib.contextmanager
def _sync(model: torch.nn.Module, enabled: bool) -> Iterator[None]:
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        if enabled:
            yield
        else:
            with model.no_sync():
                yield
    elif isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:
        yield


def accumulate_gradients(
    model: torch.nn.Module, micro_batches: Sequence[TreeBatch], *, forward: Forward = reference_forward
) -> torch.Tensor:
    """Forward and backward over this rank's micro-batches; gradients sync on the last one.

    Returns:
        This rank's summed loss (detached); all-reduce it with SUM for the step's loss.
    """
    if not micro_batches:
        raise ValueError("a rank needs at least one micro-batch (plan_step pads ranks with zero-weight batches)")
    total = None
    for i, batch in enumerate(micro_batches):
        with _sync(model, enabled=i == len(micro_batches) - 1):
            loss = forward(model, batch)
            loss.backward()
        total = loss.detach() if total is None else total + loss.detach()
    return total


def train_step(
    model: torch.nn.Module,
    micro_batches: Sequence[TreeBatch],
    optimizer: torch.optim.Optimizer,
    *,
    forward: Forward = reference_forward,
) -> torch.Tensor:
    """One optimizer step on this rank's micro-batches; returns the global loss (summed over ranks)."""
    optimizer.zero_grad(set_to_none=True)
    loss = accumulate_gradients(model, micro_batches, forward=forward)
    optimizer.step()
    if dist.is_available() and dist.is_initialized():
        loss = loss.clone()
        dist.all_reduce(loss, op=dist.ReduceOp.SUM)
    return loss
