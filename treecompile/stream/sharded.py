"""A model sharded by FSDP2, run as one unsharded model for the length of a call whose
backward runs inside it (context parallelism, `treecompile.stream.context_parallel`).

FSDP2 (``fully_shard``) gathers a unit's parameters in a forward hook and frees them in
another, and reduce-scatters their gradients in backward hooks: outside any graph, where
``tree_compile``'s one captured graph cannot hold them. A call that runs its backward itself
does not need them: `Unsharded` gathers every unit's parameters first (``unshard()``, FSDP2's
own all-gather), sets the units' hooks aside, so the graph sees an ordinary module holding
full parameters, and afterwards gives each unit its hooks back and frees the full
parameters again (``reshard()``). `Unsharded.shard_grads` then turns the full gradients into
FSDP2's sharded ones: summed over the data-parallel mesh (a reduce-scatter) and cut as
FSDP2 cuts the parameters (dim 0, ``torch.chunk``'s sizes).

The sum, not FSDP2's default mean: as with `treecompile.compile.distributed.wrap_fsdp`, each
rank's batch weights are already the global loss's share (``plan_step``), so the global
gradient is the sum over ranks.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
import torch.distributed as dist

__all__ = ["Unsharded"]

#: The hook tables of an ``nn.Module`` a forward call reads.
_HOOK_TABLES = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks", "_forward_hooks_with_kwargs",
                "_forward_hooks_always_called")


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
        if not self.units:
            return self
        self.sharded = dict(self.model.named_parameters())
        for unit in self.units:
            unit.unshard()
        for unit in self.units:
            self._hooks.append(tuple(getattr(unit, t) for t in _HOOK_TABLES))
            for t in _HOOK_TABLES:
                setattr(unit, t, OrderedDict())
        return self

    def __exit__(self, *exc) -> None:
        for unit, tables in zip(self.units, self._hooks):
            for t, table in zip(_HOOK_TABLES, tables):
                setattr(unit, t, table)
        self._hooks = []
        for unit in self.units:
            unit.reshard()

    def shard_grads(self, names: list[str], grads: list[torch.Tensor]) -> tuple[list, list]:
        """``(parameters, gradients)``: the sharded parameter of each name and its gradient,
        ``grads`` (full, of the unsharded parameters) summed over the parameter's mesh and
        cut as FSDP2 cuts it; a parameter FSDP2 does not shard keeps its own, summed over the
        units' mesh.

        Raises:
            NotImplementedError: a parameter placed otherwise than sharded along dim 0 on a
                one-dimensional mesh (HSDP, tensor parallelism).
        """
        from torch.distributed.tensor import DTensor, Shard

        params, out, mesh = [], [], None
        for name, g in zip(names, grads):
            p = self.sharded[name]
            if isinstance(p, DTensor):
                if p.device_mesh.ndim != 1 or tuple(p.placements) != (Shard(0),):
                    raise NotImplementedError(
                        f"{name} is placed {p.placements} on a {p.device_mesh.ndim}-D mesh: tree_compile(cp=...) takes "
                        "FSDP2 parameters sharded along dim 0 on one mesh dimension")
                mesh = p.device_mesh
                local = _reduce_scatter_dim0(g, mesh.get_group(), p.to_local().shape[0])
                out.append(DTensor.from_local(local, mesh, p.placements, shape=p.shape, stride=p.stride()))
            else:
                out.append(g)
            params.append(p)
        if mesh is not None:
            for p, g in zip(params, out):
                if not isinstance(p, DTensor):
                    dist.all_reduce(g, group=mesh.get_group())
        return params, out


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
