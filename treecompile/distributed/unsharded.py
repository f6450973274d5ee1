"""A model sharded by FSDP2, run as one unsharded model for the length of a call whose
backward runs inside it (a streamed call, `treecompile.stream.runner`; context parallelism,
`treecompile.distributed.context_parallel`), or until the end of the backward through a
whole-tree call's outputs (`UnshardedUntilBackward`).

FSDP2 (``fully_shard``) gathers a unit's parameters in a forward hook and frees them in
another, and reduce-scatters their gradients in backward hooks: outside any graph, where
``tree_compile``'s one captured graph cannot hold them. A call that runs its backward itself
does not need them: `Unsharded` gathers every unit's parameters first (``unshard()``, FSDP2's
own all-gather), sets the units' hooks aside, so the graph sees an ordinary module holding
full parameters, and afterwards gives each unit its hooks back and frees the full
parameters again (``reshard()``). `Unsharded.shard_grads` then turns the full gradients into
FSDP2's sharded ones as FSDP2 would: reduced over the data-parallel mesh (a reduce-scatter),
divided as the units are configured (``set_gradient_divide_factor``: by that factor; FSDP2's
default, the mesh size: the mean; `treecompile.distributed.data_parallel.wrap_fsdp` sets 1, the
sum), in the shards' dtype, and cut as FSDP2 cuts the parameters (dim 0, ``torch.chunk``'s
sizes).
"""

from __future__ import annotations

import weakref
from collections import OrderedDict

import torch
import torch.distributed as dist

__all__ = ["Unsharded", "UnshardedUntilBackward", "fsdp_call_of"]

#: The hook tables of an ``nn.Module`` a forward call reads.
_HOOK_TABLES = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks", "_forward_hooks_with_kwargs",
                "_forward_hooks_always_called")


#: Per model, the full gradients kept under FSDP2's ``set_requires_gradient_sync(False)``
#: (`Unsharded.defer`), until a call that synchronises puts them in the shards
#: (`Unsharded.flush`): one table for every wrapper and path of the model, so that none is left
#: behind whichever call comes next.
_DEFERRED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _fsdp_units(model: torch.nn.Module) -> list:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a build without torch.distributed
        return []
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


class Unsharded:
    """``with Unsharded(model) as u:`` the model holds full parameters and runs without its
    FSDP2 hooks; nothing changes for a model without FSDP2 units (``u.units`` empty).

    Attributes:
        units: the model's FSDP2 units.
        sharded: the model's parameters by name as they were before (FSDP2's DTensors).
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.units = _fsdp_units(model)
        self.sharded: dict[str, torch.Tensor] = {}
        self._hooks: list[tuple] = []

    def __enter__(self) -> Unsharded:
        self.unshard()
        self.flush()  # a call that puts its gradients in the shards takes the kept ones along
        self.hooks_aside()
        return self

    def __exit__(self, *exc) -> None:
        self.hooks_back()
        self.reshard()

    def unshard(self) -> None:
        """Every unit's full parameters in place of its shards (FSDP2's ``unshard()``)."""
        if self.units:
            self.sharded = dict(self.model.named_parameters())
        for unit in self.units:
            unit.unshard()

    def reshard(self) -> None:
        """The shards back (FSDP2's ``reshard()``)."""
        for unit in self.units:
            unit.reshard()

    def hooks_aside(self) -> None:
        """The units' forward hooks set aside: a forward runs the modules alone."""
        for unit in self.units:
            self._hooks.append(tuple(getattr(unit, t) for t in _HOOK_TABLES))
            for t in _HOOK_TABLES:
                setattr(unit, t, OrderedDict())

    def hooks_back(self) -> None:
        for unit, tables in zip(self.units, self._hooks):
            for t, table in zip(_HOOK_TABLES, tables):
                setattr(unit, t, table)
        self._hooks = []

    def shard_grads(self, names: list[str], grads: list[torch.Tensor]) -> tuple[list, list]:
        """``(parameters, gradients)``: the sharded parameter of each name and its gradient,
        ``grads`` (full, of the unsharded parameters) reduced over the parameter's mesh,
        divided as the units are configured (`_divide_factor`) and cut as FSDP2 cuts it; a
        parameter FSDP2 does not shard keeps its own, reduced over the units' mesh alike.

        Raises:
            NotImplementedError: a parameter placed otherwise than sharded along dim 0 on a
                one-dimensional mesh (HSDP, tensor parallelism).
        """
        from torch.distributed.tensor import DTensor, Shard

        factor = self._divide_factor()
        params, out, mesh = [], [], None
        for name, g in zip(names, grads):
            p = self.sharded[name]
            if isinstance(p, DTensor):
                if p.device_mesh.ndim != 1 or tuple(p.placements) != (Shard(0),):
                    raise NotImplementedError(
                        f"{name} is placed {p.placements} on a {p.device_mesh.ndim}-D mesh: tree_compile takes FSDP2 "
                        "parameters sharded along dim 0 on one mesh dimension")
                mesh = p.device_mesh
                g = g.to(p.dtype) / (factor or mesh.size())
                local = _reduce_scatter_dim0(g, mesh.get_group(), p.to_local().shape[0])
                out.append(DTensor.from_local(local, mesh, p.placements, shape=p.shape, stride=p.stride()))
            else:
                out.append(g)
            params.append(p)
        if mesh is not None:
            for i, (p, g) in enumerate(zip(params, out)):
                if not isinstance(p, DTensor):
                    out[i] = g = g / (factor or mesh.size())
                    dist.all_reduce(g, group=mesh.get_group())
        return params, out

    def defer(self, grads: dict[str, torch.Tensor]) -> None:
        """Keeps full gradients (by parameter name) for a later `flush`, summed with those kept."""
        kept = _DEFERRED.setdefault(self.model, {})
        for n, g in grads.items():
            kept[n] = g + kept[n] if n in kept else g

    def flush(self) -> None:
        """The kept full gradients (`defer`), reduce-scattered into their shards now (needs the
        shards: after `unshard`)."""
        kept = _DEFERRED.pop(self.model, None)
        if not kept:
            return
        params, grads = self.shard_grads(list(kept), list(kept.values()))
        for p, g in zip(params, grads):
            p.grad = g if p.grad is None else p.grad + g

    def reduces_grads(self) -> bool:
        """False after FSDP2's ``set_requires_gradient_sync(False)`` on the units (their
        gradients accumulate unsharded until a backward with it on), else True. Read from
        FSDP2's state, whose layout is not public: where it cannot be read, True.

        Raises:
            NotImplementedError: some units synchronise and others do not.
        """
        flags = {getattr(g, "reduce_grads", True) for g in self._param_groups()}
        if len(flags) > 1:
            raise NotImplementedError("FSDP2 units of one model with and without gradient synchronisation "
                                      "(set_requires_gradient_sync on some units only)")
        return next(iter(flags), True)

    def _param_groups(self) -> list:
        """The FSDP2 parameter group of each unit that holds parameters (FSDP2's private state)."""
        groups = []
        for unit in self.units:
            state = getattr(unit, "_get_fsdp_state", None)
            group = getattr(state(), "_fsdp_param_group", None) if state is not None else None
            if group is not None:
                groups.append(group)
        return groups

    def _divide_factor(self) -> float | None:
        """The units' gradient divide factor (``set_gradient_divide_factor``), None for FSDP2's
        default (the mesh size). Read from FSDP2's state, whose layout is not public: where it
        cannot be read, None."""
        factors = {getattr(g, "gradient_divide_factor", None) for g in self._param_groups()}
        if len(factors) > 1:
            raise NotImplementedError(f"FSDP2 units with different gradient divide factors {sorted(map(str, factors))}")
        return next(iter(factors), None)


def _reduce_scatter_dim0(full: torch.Tensor, group: dist.ProcessGroup, rows: int) -> torch.Tensor:
    """This rank's rows of ``full`` summed over ``group``, the rows cut as ``torch.chunk`` cuts
    them (``ceil(n / W)`` each, the last ones shorter or empty): ``rows`` of them."""
    world = dist.get_world_size(group)
    chunk = -(-full.shape[0] // world)
    padded = full.new_zeros(world * chunk, *full.shape[1:])
    padded[: full.shape[0]] = full
    mine = full.new_empty(chunk, *full.shape[1:])
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    reduce_scatter(mine, padded, group=group)
    return mine[:rows].contiguous()


class UnshardedUntilBackward:
    """A whole-tree call of an FSDP2 model: `begin` before the forward (full parameters,
    hooks aside), `forward_done` after it (hooks back); the full parameters stay until the end
    of the backward through the call's outputs, when each gradient is reduce-scattered into
    its shard (added to the shard's ``.grad``; `Unsharded.shard_grads`) and the shards come
    back. Outputs that need no gradient: the shards come back at once. A call whose backward
    never comes is finished (its gradients dropped) by the next `begin`.

    Under FSDP2's ``set_requires_gradient_sync(False)`` (gradient accumulation without
    communication, as verl runs its non-final micro-batches) the full gradients are kept,
    summed over such backwards, and reduce-scattered with the next call that synchronises (a
    whole-tree backward with it on, or any streamed or CP call of the model, which take them
    along: `Unsharded.defer`, `Unsharded.flush`): one reduce-scatter per parameter for the
    accumulation, as FSDP2 does, holding full gradients in between."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.state = Unsharded(model)
        self._pending = False
        self._queued = False

    @property
    def units(self) -> list:
        return self.state.units

    def begin(self) -> None:
        if self._pending:
            self._finish(keep_grads=False)
        self.state.unshard()
        self.state.hooks_aside()

    def forward_done(self, outputs: list) -> None:
        self.state.hooks_back()
        live = [t for t in outputs if isinstance(t, torch.Tensor) and t.requires_grad]
        if not live:
            self.state.reshard()
            return
        self._pending, self._queued = True, False
        for t in live:
            t.register_hook(self._on_backward)

    def _on_backward(self, grad: torch.Tensor) -> torch.Tensor:
        if not self._queued:  # once per backward: at its end, after every gradient is in
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(lambda: self._finish(keep_grads=True))
        return grad

    def _finish(self, keep_grads: bool) -> None:
        self._pending = False
        full = [(n, p) for n, p in self.state.model.named_parameters() if p.grad is not None]
        if keep_grads:
            self.state.defer({n: p.grad for n, p in full})
            if self.state.reduces_grads():
                self.state.flush()
        for _, p in full:
            p.grad = None
        self.state.reshard()


def fsdp_call_of(model: torch.nn.Module) -> UnshardedUntilBackward | None:
    """An `UnshardedUntilBackward` for a model with FSDP2 units, else None."""
    call = UnshardedUntilBackward(model)
    return call if call.units else None
