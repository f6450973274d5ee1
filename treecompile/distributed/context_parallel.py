"""Context parallelism (CP): one packed tree row split over the ranks of a process group.

``tree_compile(model, cp=group)`` (a ``torch.distributed`` process group, or a 1-D
``DeviceMesh``): every rank of the group calls the wrapper with the same batch; each runs the
model on its own consecutive rows only (`treecompile.distributed.cp_split.split_for_cp`, balanced by
work), and every attention layer gathers, from the other ranks, the keys and values of the
rows its queries see before its first row: the root path of that row
(`treecompile.passes.cp`). The loss, the log-probabilities and every parameter's gradient
come back on every rank equal to one process training the whole tree, so to per-path
training:

* a rank's targets are those its rows predict (the predicting row's output is local);
* the loss is the sum of the ranks' losses; a router's auxiliary loss is computed from the
  ranks' summed router statistics, and its gradient reaches each rank's share through them;
* the backward runs inside the call, as the streamed path's does
  (`treecompile.stream.runner`): each rank's graph backward sends the gradients of the keys
  and values it read back to their owners (the reverse all-to-all), then the parameter gradients are
  summed over the group, and ``loss.backward()`` hands them to the parameters.

Memory per rank: the parameters and optimizer state (each rank holds them all), the
activations of its own rows, and per layer the keys and values of its prefix rows, which
the attention keeps for its backward (`treecompile.distributed.cp_split.CPSplit.peak_bytes` predicts
it; the exchange's buffers are transient, one layer at a time).

Hybrid models (recurrent or convolution layers) are refused under CP by the op's name.
With ``stream=`` as well, a batch larger than the group holds streams, each part split over
the group (`treecompile.distributed.stream_cp`).
"""

from __future__ import annotations

import functools

import numpy as np
import torch
import torch.distributed as dist

from treecompile.capture.call import (CallSetup, TreeOutput, argument_names, call_under_setup, compile_named,
                                      device_of, run_head)
from treecompile.core.batch import TreeBatch, on_host, to_device
from treecompile.kernels.collectives.cp_gather import padded_send, register_group
from treecompile.kernels.attention.flex import BLOCK_SIZE, interval_block_mask, split_block_mask
from treecompile.passes import markers
from treecompile.passes.held_writes import held_run, held_state_writes
from treecompile.passes.cp import CPGraph
from treecompile.passes.pipeline import CallState, Pipeline, context_parallel
from treecompile.distributed.cp_split import CPSplit, RowWork, split_for_cp
from treecompile.stream.parts import PAD_PREFIX, BatchArrays
from treecompile.stream.runner import _StreamedLoss
from treecompile.distributed.unsharded import Unsharded

__all__ = ["CPRunner", "cp_group_of", "cp_group_checked", "row_work_of", "local_structure", "check_same_batch"]


def row_work_of(model) -> RowWork | None:
    """The per-row costs a CP split balances, from ``model.config`` (a dense decoder's
    dimensions, `RowWork.from_dims`); None (split by rows) for a model without a config the
    cost model reads (no config, mixture-of-experts)."""
    from treecompile.planning.budget import BudgetError
    from treecompile.planning.model_dims import dims_of

    config = getattr(model, "config", None)
    if config is None:
        return None
    try:
        return RowWork.from_dims(dims_of(config, check=False))
    except (BudgetError, TypeError, ValueError):
        return None


def cp_group_of(cp) -> dist.ProcessGroup:
    """The process group of ``tree_compile(cp=...)``: a group, or a 1-D ``DeviceMesh``'s.

    Raises:
        TypeError: anything else, or a mesh of more than one dimension (pass ``mesh["cp"]``).
        RuntimeError: ``torch.distributed`` is not initialised.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("tree_compile(cp=...) needs torch.distributed initialised (dist.init_process_group)")
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(cp, DeviceMesh):
        if cp.ndim != 1:
            raise TypeError(f"tree_compile(cp=...) takes a 1-D DeviceMesh (mesh['cp']), got one of {cp.ndim} dimensions")
        return cp.get_group()
    if isinstance(cp, dist.ProcessGroup):
        return cp
    raise TypeError(f"tree_compile(cp=...) takes a torch.distributed ProcessGroup or a 1-D DeviceMesh, "
                    f"got {type(cp).__name__}")


def cp_group_checked(cp, *, mask: str, full_check: bool) -> dist.ProcessGroup:
    """`cp_group_of` ``cp``, with the other `tree_compile` options it cannot take refused.

    Raises:
        ValueError: a mask other than ``"interval"``, the full check (``verify=True``).
    """
    group = cp_group_of(cp)
    if mask != "interval":
        raise ValueError("tree_compile(cp=...) runs the interval mask (mask='interval')")
    if full_check:
        raise ValueError("tree_compile(cp=..., verify=True): the full check runs one process on a float64 CPU "
                         "copy and cannot run the group's collectives; check the model without cp= "
                         "(tree_compile(model, verify=True) on one process), whose passes a CP rank's graph shares")
    return group


class CPRunner:
    """Runs a `TreeCompiledModel`'s batches split over a CP group (see the module docstring).

    Attributes:
        group: the process group; rank and world size are read from it.
        work: the per-row costs the split balances (None: by rows).
        align: cuts on multiples of this many rows.
        split: the `CPSplit` of the latest batch.
        group_name: the name the graphs know the group by (`treecompile.kernels.collectives.cp_gather.register_group`).
    """

    def __init__(self, setup: CallSetup, group: dist.ProcessGroup, work: RowWork | None = None,
                 align: int = 1) -> None:
        if setup.router_aux is not None:
            setup.router_aux.check_stats_form()
        self.setup = setup
        self.group = group
        self.work = work
        self.align = align
        self.split: CPSplit | None = None
        self.group_name = register_group(group)
        self._compiled = None
        self._state = CallState()  # this rank's layout, read when its graph compiles
        self._checked = False  # a call has checked the ranks' batches and waited for the answer

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    @property
    def world(self) -> int:
        return dist.get_world_size(self.group)

    def check(self, batch: TreeBatch, device: torch.device) -> None:
        """`check_same_batch` of a call: the first waits for the answer (a ValueError naming
        each rank's batch); later calls on CUDA leave the comparison on the device, so that
        a call does not wait for the work queued before it."""
        check_same_batch(batch, self.group, device, wait=not self._checked or device.type != "cuda")
        self._checked = True

    def _build(self, device: torch.device) -> None:
        w = self.setup
        state = CPGraph(group=self.group_name)
        pipeline = w.passes if isinstance(w.passes, Pipeline) else Pipeline(tuple(w.passes))
        inner, kwargs_of, router, want_entropy, temperature = w.graph_parts()

        def cp_forward(ids, positions, sub_local, block_tensors, structure, rows, slot, target, dest, weight,
                       path_count, cp_meta):
            ids = torch.ops.treecompile.tree_inputs(ids, [positions, sub_local], list(block_tensors), list(structure),
                                                    path_count)
            ids = torch.ops.treecompile.cp_inputs(ids, list(cp_meta))
            out, loss, logprobs, entropy = run_head(inner, kwargs_of(positions), ids, positions, rows, slot, target,
                                                    dest, weight, temperature, want_entropy)
            stats = router.tree_stats(out.router_logits, path_count) if router is not None else None
            return markers.returned((loss, logprobs, stats, entropy))

        backend = w.backend(device, mask="interval", state=self._state, passes=context_parallel(pipeline, state),
                            arguments=argument_names(cp_forward))
        self._compiled = compile_named(cp_forward, "cp_forward", backend)

    def _call(self, args: tuple) -> tuple:
        return call_under_setup(self.setup, self._compiled, args)

    def inputs(self, batch: TreeBatch, split: CPSplit | None = None) -> tuple[tuple, torch.Tensor]:
        """This rank's compiled-call arguments for ``batch`` and the global rows of its targets;
        sets `split`."""
        if split is None:
            split = split_for_cp(batch, self.world, self.work, align=self.align)
        self.split = split
        bounds = split.bounds
        data = BatchArrays(batch)
        a, b = int(bounds[self.rank]), int(bounds[self.rank + 1])
        prefix = split.paths[self.rank]  # the root path of its first row: what it receives
        inputs, dest = data.part_inputs(a, b, prefix)
        # The prefix rows in the exchange's coordinates: 1 + i is the i-th row received (in rank
        # order, which is the path's order); the padding keys (never visible) read the zero row.
        index = np.concatenate([np.zeros(PAD_PREFIX, np.int64), 1 + np.arange(len(prefix), dtype=np.int64)])
        send_rows, send_counts, recv_counts = split.exchange(self.rank)
        send_rows = padded_send(send_rows)
        ids, positions, sub_local, rows, slot, target, dest_local, weight, path_count, kv_end, kv_pos = inputs
        block_tensors, self._state.layout = split_block_mask(interval_block_mask(sub_local, BLOCK_SIZE, min_blocks=2))
        device = device_of(self.setup.model)
        moved = [to_device(x, device) for x in (ids[None], positions, sub_local, rows, slot, target, dest_local,
                                                weight, path_count, kv_end, kv_pos, torch.from_numpy(index),
                                                torch.from_numpy(send_rows))]
        (ids, positions, sub_local, rows, slot, target, dest_local, weight, path_count, kv_end, kv_pos, index,
         send_rows) = moved
        block_tensors = type(block_tensors)(*(to_device(t, device) for t in block_tensors))
        counts = torch.from_numpy(np.stack([send_counts, recv_counts]))  # on the CPU: read on the host
        for t, d in [(ids, 1), (positions, 0), (sub_local, 0), (rows, 0), (slot, 0), (target, 0), (dest_local, 0),
                     (weight, 0), (path_count, 0), (kv_end, 0), (kv_pos, 0), (index, 0), (send_rows, 0),
                     *[(bt, d) for bt in block_tensors for d in range(2, bt.dim())]]:
            torch._dynamo.maybe_mark_dynamic(t, d)
        # A model with recurrent or conv layers gets its rows' own structure, so that the capture
        # reaches the pass that refuses those layers by name (`treecompile.passes.cp`).
        structure = local_structure(batch, a, b, data.run_rows(a, b), device) if self.setup.structure else []
        args = (ids, positions, sub_local, block_tensors, structure, rows, slot, target, dest_local, weight,
                path_count, [kv_end, kv_pos, index, send_rows, counts])
        return args, dest

    def __call__(self, batch: TreeBatch, checked: bool = False, split: CPSplit | None = None) -> TreeOutput:
        """The whole tree's loss and log-probabilities on every rank; with grad enabled,
        ``loss.backward()`` gives every parameter the whole tree's gradient (FSDP2's sharded
        parameters: their shards of it, reduced over the data-parallel mesh as the units are
        configured, see `treecompile.distributed.unsharded`). ``checked``: the caller checked that
        every rank has the same batch (`check_same_batch`); ``split``: the caller's split of
        the batch padded to the group's size (`split_for_cp`), else computed here."""
        w = self.setup
        device = device_of(w.model)
        batch = on_host(batch)
        self._state.path_lengths = functools.cache(batch.path_lengths)  # judged at every path
        if not checked:
            self.check(batch, device)
        rows = batch.num_tokens
        # Fewer rows than ranks (a data-parallel rank's padding micro-step): one-token trees of
        # weight 0 give every rank a row and change nothing else.
        batch = batch.padded(self.world)
        args, dest = self.inputs(batch, split)
        if self._compiled is None:
            self._build(device)
        with Unsharded(w.model) as unsharded:
            out, names, grads = self._step(batch, args, dest, device)
        if rows < batch.num_tokens:
            out = TreeOutput(loss=out.loss, logprobs=out.logprobs[:rows], aux_loss=out.aux_loss,
                             entropy=None if out.entropy is None else out.entropy[:rows])
        if names is None:
            return out
        wanted = set(names)
        params = [p for n, p in w.model.named_parameters() if n in wanted]
        if unsharded.units:
            params, grads = unsharded.shard_grads(names, grads)
        loss = _StreamedLoss.apply(out.loss.detach(), list(grads), *params)
        return TreeOutput(loss=loss, logprobs=out.logprobs, aux_loss=out.aux_loss, entropy=out.entropy)

    def _step(self, batch: TreeBatch, args: tuple, dest: torch.Tensor, device) -> tuple:
        """``(output, names, gradients)`` of this rank's call: the loss and log-probabilities
        summed over the group; with grad enabled, the parameters' names and their gradients,
        summed over the group (else None and None)."""
        w = self.setup
        grad = torch.is_grad_enabled()
        named = [(n, p) for n, p in w.model.named_parameters() if p.requires_grad] if grad else []
        params = [p for _, p in named]
        router = w.router_aux
        # The state the graph keeps, computed for the whole tree's length (the rank's rows are
        # fewer than their positions): passes/held_writes.py.
        with torch.set_grad_enabled(grad), held_state_writes(w.model, batch.num_tokens, several=False), held_run():
            loss, lp, stats, ent = self._call(args)
        m = dest.shape[0]
        dest = to_device(dest, device)
        # What the ranks computed, summed over the group in one collective: the loss, the
        # log-probabilities (and entropies) at their targets' rows, the router statistics.
        pieces = [loss.detach().to(torch.float64).reshape(1)]
        lp_full = torch.zeros(batch.num_tokens, dtype=torch.float64, device=device)
        lp_full[dest] = lp[:m].detach().to(torch.float64)
        pieces.append(lp_full)
        if ent is not None:
            ent_full = torch.zeros_like(lp_full)
            ent_full[dest] = ent[:m].detach().to(torch.float64)
            pieces.append(ent_full)
        if stats is not None:
            pieces.append(stats.detach().to(torch.float64).reshape(-1))
        summed = torch.cat(pieces)
        dist.all_reduce(summed, group=self.group)
        s = batch.num_tokens
        total, logprobs = summed[0], summed[1:1 + s]
        entropy = summed[1 + s:1 + 2 * s] if ent is not None else None
        value, aux = total.to(loss.dtype), None
        if stats is not None:
            all_stats = summed[summed.shape[0] - stats.numel():].reshape(stats.shape)
            aux = router.aux_from_stats(all_stats)
            value = value + router.coef * aux.to(value.dtype)
        out = TreeOutput(loss=value, logprobs=logprobs.to(lp.dtype), aux_loss=aux,
                         entropy=None if entropy is None else entropy.to(lp.dtype))
        if not grad:
            return out, None, None
        objective = loss
        if stats is not None:
            # coef * aux depends on this rank's router sums through the group's sums: its
            # gradient with respect to them, dotted with this rank's sums, is this rank's share.
            probe = all_stats.clone().requires_grad_(True)
            (aux_grad,) = torch.autograd.grad(router.coef * router.aux_from_stats(probe), probe)
            objective = objective + (aux_grad.to(stats.dtype) * stats).sum().to(loss.dtype)
        # Every rank runs its backward (its gathers' reverse all-to-alls meet the other ranks').
        grads = [g.contiguous() for g in
                 torch.autograd.grad(objective, params, allow_unused=True, materialize_grads=True)]
        # Summed over the group in place, one collective per tensor, all in flight at once
        # (no flat copy of every gradient).
        for work in [dist.all_reduce(g, group=self.group, async_op=True) for g in grads]:
            work.wait()
        return out, [n for n, _ in named], grads


_DIFFERENT = ("tree_compile(cp=...): the ranks of the CP group called with different batches{}; every rank of a "
              "CP group must pass the same batch (give one data-parallel replica's batch to all the ranks of its cp "
              "group)")


def check_same_batch(batch: TreeBatch, group: dist.ProcessGroup, device, wait: bool = True) -> None:
    """Refuses a call whose ranks hold different batches (each rank of a CP group must pass
    the same one; a data-parallel sampler over the CP ranks hands each its own): one
    all-gather of each rank's row count and a CRC-32 of its tokens, tree, predictors and
    weights (``batch`` on the host). Every rank raises, so none waits in a collective the
    others never join.

    ``wait=False``: the comparison stays on ``device`` (`torch._assert_async`), so that on
    CUDA the host does not wait for the work queued before the all-gather (the previous
    step); a mismatch then stops the process at a later CUDA call with this message (the
    CUDA context is lost), instead of a ValueError here. On the CPU it raises at once.

    Raises:
        ValueError: the ranks' batches differ (``wait``).
        RuntimeError: the same (``wait=False``, on the CPU).
    """
    import zlib

    digest = 0
    for t in (batch.input_ids, batch.subtree_end, batch.pred_index, batch.target_weight):
        digest = zlib.crc32(t.detach().contiguous().numpy().tobytes(), digest)
    mine = to_device(torch.tensor([batch.num_tokens, digest], dtype=torch.int64), device)
    got = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(got, mine, group=group)
    seen = torch.stack(got)
    if not wait:
        torch._assert_async((seen == seen[:1]).all(), _DIFFERENT.format(""))
        return
    seen = seen.cpu().tolist()
    if any(x != seen[0] for x in seen):
        ranks = ", ".join(f"rank {r}: {n} rows, CRC-32 {h:08x}" for r, (n, h) in enumerate(seen))
        raise ValueError(_DIFFERENT.format(f" ({ranks})"))


def local_structure(batch: TreeBatch, a: int, b: int, s_run: int, device) -> list[torch.Tensor]:
    """``[pred_index [S_run], node_table [N, 3]]`` of rows ``[a, b)`` alone (the tree's nodes
    clipped to them, a node reaching before ``a`` a root; padding rows one more root)."""
    pred = batch.pred_index.cpu().numpy()[a:b]
    pred_local = np.concatenate([np.where(pred >= a, pred - a, -1), np.full(s_run - (b - a), -1)])
    start, end, parent = batch.node_table().numpy().T
    v0, v1 = int(np.searchsorted(start, a, side="right")) - 1, int(np.searchsorted(start, b, side="left"))
    table = [[max(int(start[v]), a) - a, min(int(end[v]), b) - a,
              int(parent[v]) - v0 if start[v] >= a and parent[v] >= v0 else -1] for v in range(v0, v1)] if b > a else []
    if s_run > b - a:
        table.append([b - a, s_run, -1])
    return [to_device(torch.from_numpy(pred_local.astype(np.int64)), device), torch.tensor(table, dtype=torch.int64)]
