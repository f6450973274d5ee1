"""The arguments of a whole-tree compiled call, from a batch.

One definition of what the compiled function ``tree_forward`` (`treecompile.compile.wrapper`)
takes, by name and in its order (`GraphInputs`; `GRAPH_ARGS` names them): the ids, the
positions, the mask rule's tensors, the BlockMask's tables, the path structure, the head's
indices, the target weights and the path counts. The BlockMask is built here, once per batch,
outside the model.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from treecompile.core.batch import TreeBatch
from treecompile.core.errors import TreeInputError
from treecompile.kernels.attention.flex import BLOCK_SIZE, BlockLayout, interval_block_mask, split_block_mask

__all__ = ["GRAPH_ARGS", "GraphInputs", "tree_call_inputs"]


@dataclasses.dataclass(frozen=True)
class GraphInputs:
    """The compiled whole-tree function's arguments, by name, in the order it takes them.

    Attributes:
        ids: the token ids ``[1, S]``.
        positions: each row's position on its path ``[S]``.
        mask_buffers: the mask rule's tensors (``subtree_end``; or the tree ids and path bits).
        block_tensors: the BlockMask's tables (`split_block_mask`).
        structure: the path structure (``pred_index`` and the CPU node table), or empty.
        rows, slot, target, dest: the head's indices (`TreeBatch.head_index`).
        weight: each target's loss weight.
        path_count: how many paths pass through each row (the weights of a counter the model keeps,
            `treecompile.passes.counters`).
    """

    ids: torch.Tensor
    positions: torch.Tensor
    mask_buffers: list
    block_tensors: list
    structure: list
    rows: torch.Tensor
    slot: torch.Tensor
    target: torch.Tensor
    dest: torch.Tensor
    weight: torch.Tensor
    path_count: torch.Tensor

    def args(self) -> tuple[Any, ...]:
        """The positional arguments of the compiled call."""
        return tuple(getattr(self, name) for name in GRAPH_ARGS)


#: The compiled function's argument names, in its order.
GRAPH_ARGS = tuple(f.name for f in dataclasses.fields(GraphInputs))


def tree_call_inputs(batch: TreeBatch, mask: str, structure: bool) -> tuple[GraphInputs, BlockLayout, int]:
    """``(arguments, block layout, path-bit chunks)`` of one whole-tree call.

    Args:
        batch: the (padded, on-device) batch.
        mask: ``"interval"`` or ``"bitmask"``.
        structure: pass the path structure (``pred_index`` and the CPU node table),
            which the conv context and SSM state passes read.

    Every size that follows the batch (rows, targets, predicting rows, nodes, blocks) is
    marked dynamic, so that one graph serves every batch.
    """
    if mask == "interval":
        buffers = [batch.subtree_end]
        chunks = 0
    else:
        if batch.path_bits is None:
            raise TreeInputError("mask='bitmask' needs path bits: pack the batch with pack(..., path_bits=True)")
        buffers = [batch.tree_ids, batch.path_bits]
        chunks = int(batch.path_bits.shape[1])
        # The chunk loop is unrolled in the mask_mod: a new chunk count must recompile.
        torch._dynamo.mark_static(batch.path_bits, 1)
    # The bitmask rule is the same relation as the interval rule, so the block classes from
    # subtree_end are its exact classes (what create_block_mask would find); the bitmask
    # mask_mod decides the pairs inside partial blocks.
    block_tensors, layout = split_block_mask(interval_block_mask(batch.subtree_end, BLOCK_SIZE, min_blocks=2))
    # The target rows and their predicting rows, from the batch's check (built on the host at
    # pack time: no device sync here).
    dest, rows, slot = batch.head_index()
    target = batch.input_ids[dest]
    ids = batch.input_ids[None]
    # The node table lives on the CPU: the scan ops read it on the host, without a device sync.
    paths = [batch.pred_index, batch.node_table()] if structure else []
    # S, the number of targets M and of predicting rows R vary per batch: one graph for all.
    for t, d in [(ids, 1), (batch.position_ids, 0), (rows, 0), (slot, 0), (target, 0), (dest, 0),
                 (batch.target_weight, 0), (batch.path_count, 0), *[(b, 0) for b in buffers],
                 *[(b, 0) for b in paths],
                 # The block tables' sizes follow S too ([1, 1, nb] and [1, 1, nb, nb]): dynamic
                 # from the first call, so a second batch size does not recompile.
                 *[(b, d) for b in block_tensors for d in range(2, b.dim())]]:
        torch._dynamo.maybe_mark_dynamic(t, d)
    inputs = GraphInputs(ids, batch.position_ids, buffers, block_tensors, paths, rows, slot, target, dest,
                         batch.target_weight, batch.path_count)
    return inputs, layout, chunks
