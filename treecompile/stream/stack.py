"""The KV stack between streamed parts: what a part keeps for the parts after it, what a part
reads from the parts before it (prefix keys and values, conv inputs, recurrent states), and
how the gradients with respect to what it read go back to the parts that computed it (see
`treecompile.stream.options`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from treecompile.core.batch import to_device
from treecompile.passes.stream import KVLayout
from treecompile.stream.parts import PAD_PREFIX, PAD_STATES, BatchArrays
from treecompile.stream.plan import StreamPlan

__all__ = ["StackEntry", "gather_prefix", "backward_part"]


@dataclass
class StackEntry:
    """One part on the stack: what it computed for later parts, and what its backward needs."""

    vals: list[torch.Tensor]  # the part's own keys/values per stack slot, detached
    outs: list[torch.Tensor] | None  # the same, attached to the part's graph (None: not kept)
    loss: torch.Tensor | None
    leaves: list[torch.Tensor]  # the prefix tensors the part read, with their grads after its backward
    grads: list[torch.Tensor | None]  # gradients later parts added to ``vals``
    main: torch.Tensor | None = None  # the part's loss without the auxiliary term, detached


def _by_part(plan: StreamPlan, rows: np.ndarray, index_of) -> list[tuple[int, np.ndarray]]:
    """``(part, indices into its entry's values)`` of ``rows`` (sorted), part by part:
    ``index_of(part, its rows)``, by default each row's place in its part."""
    owners = plan.part_of(rows)
    index_of = index_of or (lambda q, held: held - plan.starts[q])
    return [(q, np.asarray(index_of(q, rows[owners == q]), dtype=np.int64)) for q in np.unique(owners).tolist()]


def gather_prefix(plan: StreamPlan, data: BatchArrays, j: int, entries: dict[int, StackEntry], lay: KVLayout,
                  device, rows: np.ndarray | None = None, index_of=None) -> tuple[list, list, list]:
    """What part ``j`` reads from the stack (detached copies), per slot:

    * keys and values ``[1, Hkv, PAD_PREFIX + P_j, D]`` and conv inputs ``[1, C,
      PAD_PREFIX + P_j]``: padding, then the prefix rows' ones, gathered from the parts
      that computed them;
    * recurrent states ``[PAD_STATES + E_j, H, Dk, Dv]``: zeros, then the states after
      the part's entry rows (`BatchArrays._state_rows`), read out by the parts holding them.

    ``rows``, ``index_of``: where a process reads other rows than the part's prefix from
    entries that hold other rows than their parts' (a part split over a CP group,
    `treecompile.distributed.stream_cp`): the rows it reads, and ``index_of(part, rows)``, their
    places in that part's entry.
    """
    rows = plan.prefix[j] if rows is None else rows
    groups = [(p, to_device(torch.from_numpy(idx), device)) for p, idx in _by_part(plan, rows, index_of)]
    kv, conv, states = [], [], []
    for i, (h, d, dtype) in enumerate(lay.shapes):
        pieces = [torch.zeros(1, h, PAD_PREFIX, d, dtype=dtype, device=device)]
        pieces += [entries[p].vals[i].index_select(2, idx) for p, idx in groups]
        kv.append(torch.cat(pieces, dim=2))
    for i, (c, dtype) in enumerate(lay.conv, start=len(lay.shapes)):
        pieces = [torch.zeros(1, c, PAD_PREFIX, dtype=dtype, device=device)]
        pieces += [entries[p].vals[i].index_select(2, idx) for p, idx in groups]
        conv.append(torch.cat(pieces, dim=2))
    state_groups = ([(p, to_device(torch.as_tensor(idx), device)) for p, idx in data.entry_sources(j)]
                    if lay.states else [])
    for i, (h, dk, dv, dtype) in enumerate(lay.states, start=len(lay.shapes) + len(lay.conv)):
        pieces = [torch.zeros(PAD_STATES, h, dk, dv, dtype=dtype, device=device)]
        pieces += [entries[p].vals[i].index_select(0, idx) for p, idx in state_groups]
        states.append(torch.cat(pieces, dim=0))
    return kv, conv, states

def backward_part(plan: StreamPlan, data: BatchArrays, p: int, e: StackEntry, entries: dict[int, StackEntry],
                  lay: KVLayout, rows: np.ndarray | None = None, index_of=None) -> None:
    """Backward of part ``p`` with the gradients its readers added (``e.grads``, each shaped
    as its output); then its prefix gradients go into the entries of the parts that computed
    those rows. ``rows``, ``index_of``: as for `gather_prefix`."""
    tensors, grads = [e.loss], [torch.ones_like(e.loss)]
    for out, g in zip(e.outs, e.grads):
        if g is not None:
            tensors.append(out)
            grads.append(g)
    torch.autograd.backward(tensors, grads)
    rows = plan.prefix[p] if rows is None else rows
    n_seq = len(lay.shapes) + len(lay.conv)
    sources = data.entry_sources(p) if len(e.leaves) > n_seq else []
    along_rows = _by_part(plan, rows, index_of)
    for i, leaf in enumerate(e.leaves):
        if leaf.grad is None:
            continue
        if i < n_seq:  # keys, values, conv inputs: along the rows (dim 2)
            dim, g, pieces = 2, leaf.grad[:, :, PAD_PREFIX:], along_rows
        else:  # recurrent states: one per entry row (dim 0)
            dim, g, pieces = 0, leaf.grad[PAD_STATES:], sources
        offset = 0
        for q, idx in pieces:
            n = len(idx)
            owner = entries[q]
            if owner.grads[i] is None:
                owner.grads[i] = torch.zeros_like(owner.vals[i])
            owner.grads[i].index_add_(dim, to_device(torch.as_tensor(idx), g.device), g.narrow(dim, offset, n))
            offset += n
    e.outs = e.loss = None
    e.leaves = []

