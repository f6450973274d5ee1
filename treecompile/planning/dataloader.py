"""From a stream of trees to per-rank, per-micro-step `TreeBatch` lists under a token budget.

Example:
    >>> from treecompile import TrajectoryTree
    >>> from treecompile.planning.dataloader import plan_step
    >>> trees = [TrajectoryTree.from_sequences([[1, 2, 3, 4], [1, 2, 5, 6], [1, 7]]),
    ...          TrajectoryTree.from_sequences([[8, 9], [8, 10, 11]])]
    >>> plan = plan_step(trees, capacity=6, ranks=2)
    >>> plan.micro_tokens()
    [[6], [6]]
    >>> len(plan.batches(0)), len(plan.batches(1))
    (1, 1)

One global step, `plan_step`:

1. the loss normalizer of the whole step (`treecompile.planning.partition.loss_denominator`) goes
   into every batch as ``denominator``, so the losses of all ranks and micro-steps add
   up to the loss of the whole step (and their gradients, summed, to its gradient);
2. the paths are sharded across ranks (`treecompile.distributed.shard.shard_paths`, AReaL-DTA
   Algorithm 4 by default);
3. each rank's trees are partitioned into parts of at most ``capacity`` tokens
   (`treecompile.planning.partition.partition_tree`);
4. each rank's parts are packed side by side into micro-batches of at most ``capacity``
   tokens (first-fit decreasing);
5. ranks with fewer micro-steps are padded with a one-token, zero-weight batch, so every
   rank runs the same number of forwards (FSDP's collectives need it); its loss and
   gradients are exactly 0.

For ``torch.utils.data``: `StepSampler` yields the dataset indices of each global step
(the same on every rank), `TreeCollator` turns them into this rank's micro-batches::

    loader = DataLoader(dataset, batch_sampler=StepSampler(len(dataset), trees_per_step=8),
                        collate_fn=TreeCollator(capacity=8192, rank=rank, world_size=world))
    for micro_batches in loader:   # list[TreeBatch], one per micro-step
        ...
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from treecompile.core.batch import TreeBatch, pack
from treecompile.core.errors import TreeInputError
from treecompile.planning.partition import ReuseStats, loss_denominator, partition_tree, path_lengths
from treecompile.distributed.shard import Sharding, shard_paths
from treecompile.core.tree import TrajectoryTree

__all__ = ["StepPlan", "StepSampler", "TreeCollator", "as_tree", "padding_tree", "plan_step"]


def padding_tree() -> TrajectoryTree:
    """A one-token tree of weight 0: a micro-step that computes nothing (loss and grads 0)."""
    return TrajectoryTree.from_sequences([[0]], weights=[0.0], metadata={"padding": True})


def as_tree(item: Any) -> TrajectoryTree:
    """A dataset item as a tree: a `TrajectoryTree`, a list of token sequences (one group),
    or a dict with ``sequences`` and optional ``weights`` / ``loss_masks``."""
    if isinstance(item, TrajectoryTree):
        return item
    if isinstance(item, dict):
        if "sequences" not in item:
            raise TreeInputError(f"a dict item needs 'sequences'; got keys {sorted(item)}")
        return TrajectoryTree.from_sequences(
            item["sequences"], weights=item.get("weights"), loss_masks=item.get("loss_masks")
        )
    if isinstance(item, (list, tuple)):
        return TrajectoryTree.from_sequences(item)
    raise TreeInputError(f"cannot make a tree from a {type(item).__name__}; give a TrajectoryTree or sequences")


def _first_fit_decreasing(sizes: Sequence[int], capacity: int) -> list[list[int]]:
    order = sorted(range(len(sizes)), key=lambda i: -sizes[i])
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in order:
        for b, load in enumerate(loads):
            if load + sizes[i] <= capacity:
                bins[b].append(i)
                loads[b] += sizes[i]
                break
        else:
            bins.append([i])
            loads.append(sizes[i])
    return [sorted(b) for b in bins]


@dataclass
class StepPlan(ReuseStats):
    """One global step: for each rank, its micro-steps, each a list of trees packed in one row.

    Attributes:
        micro: ``micro[rank][step]``: the trees of that micro-batch (parts of the input trees);
            an empty list is a padding micro-step.
        capacity: token budget of one micro-batch.
        loss_mode: the loss mode.
        denominator: the step's global loss normalizer (None for ``sum``).
        sharding: how the paths were split across ranks.
        tree_tokens: tokens of the input trees (each once).
        path_tokens: tokens of all paths counted separately.
    """

    micro: list[list[list[TrajectoryTree]]]
    capacity: int
    loss_mode: str
    denominator: float | None
    sharding: Sharding
    tree_tokens: int
    path_tokens: int

    @property
    def ranks(self) -> int:
        return len(self.micro)

    @property
    def micro_steps(self) -> int:
        return max(len(m) for m in self.micro)

    def micro_tokens(self) -> list[list[int]]:
        """Tokens of each rank's micro-batches (0 for padding)."""
        return [[sum(t.num_tokens for t in mb) for mb in m] for m in self.micro]

    @property
    def rank_tokens(self) -> list[int]:
        """Tokens each rank computes over the step."""
        return [sum(r) for r in self.micro_tokens()]

    @property
    def partition_tokens(self) -> int:
        """Tokens computed over all ranks and micro-steps (padding excluded)."""
        return int(sum(self.rank_tokens))

    def batches(self, rank: int, *, device: torch.device | str | None = None) -> list[TreeBatch]:
        """This rank's micro-batches, packed with the step's global ``denominator``."""
        if not 0 <= rank < self.ranks:
            raise ValueError(f"rank {rank} out of range for {self.ranks} ranks")
        out = []
        for trees in self.micro[rank]:
            trees = trees or [padding_tree()]
            out.append(
                pack(trees, loss_mode=self.loss_mode, denominator=self.denominator, max_tokens=self.capacity,
                     device=device)
            )
        return out


def plan_step(
    trees: Sequence[TrajectoryTree],
    *,
    capacity: int,
    ranks: int = 1,
    loss_mode: str = "token-mean",
    method: str = "greedy",
    shard_method: str = "dfs",
    equalize: bool = True,
) -> StepPlan:
    """Plans one global step over ``ranks`` ranks with micro-batches of ``capacity`` tokens.

    Args:
        trees: the step's trees (one per task or prompt group).
        capacity: the token budget of one micro-batch (`treecompile.planning.budget.CostModel.capacity`).
        ranks: data-parallel ranks.
        loss_mode: a key of `treecompile.LOSS_MODES`.
        method: partitioning method (`treecompile.planning.partition.METHODS`).
        shard_method: sharding method (`treecompile.distributed.shard.SHARD_METHODS`).
        equalize: pad ranks to the same number of micro-steps (needed by FSDP).

    Raises:
        CapacityError: a path is longer than ``capacity``.
    """
    trees = [as_tree(t) for t in trees]
    if not trees:
        raise TreeInputError("plan_step needs at least one tree")
    den = loss_denominator(trees, loss_mode)
    sharding = shard_paths(trees, ranks, method=shard_method)
    micro: list[list[list[TrajectoryTree]]] = []
    for shard in sharding.shards:
        parts = [p for t in shard.trees(trees) for p in partition_tree(t, capacity, method=method).parts]
        bins = _first_fit_decreasing([p.num_tokens for p in parts], capacity)
        micro.append([[parts[i] for i in b] for b in bins])
    steps = max(max(len(m) for m in micro), 1)
    if equalize:
        for m in micro:
            m.extend([] for _ in range(steps - len(m)))
    return StepPlan(
        micro=micro,
        capacity=int(capacity),
        loss_mode=loss_mode,
        denominator=den,
        sharding=sharding,
        tree_tokens=int(sum(t.num_tokens for t in trees)),
        path_tokens=int(sum(int(path_lengths(t).sum()) for t in trees)),
    )


class StepSampler(torch.utils.data.Sampler):
    """Yields the dataset indices of each global step; identical on every rank.

    Every rank iterates the same sampler (same seed and epoch) and its `TreeCollator`
    keeps its own share, so no rank needs another's data.

    Args:
        num_items: dataset length (trees, or prompt groups).
        trees_per_step: items per global step.
        shuffle: shuffle each epoch with ``seed + epoch``.
        drop_last: drop a final step with fewer items.
    """

    def __init__(
        self, num_items: int, trees_per_step: int, *, shuffle: bool = True, seed: int = 0, drop_last: bool = False
    ) -> None:
        if trees_per_step < 1:
            raise ValueError(f"trees_per_step must be at least 1, got {trees_per_step}")
        self.num_items = num_items
        self.trees_per_step = trees_per_step
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[list[int]]:
        order = np.arange(self.num_items)
        if self.shuffle:
            order = np.random.default_rng(self.seed + self.epoch).permutation(self.num_items)
        for a in range(0, self.num_items, self.trees_per_step):
            chunk = order[a : a + self.trees_per_step]
            if len(chunk) < self.trees_per_step and self.drop_last:
                return
            yield chunk.tolist()

    def __len__(self) -> int:
        if self.drop_last:
            return self.num_items // self.trees_per_step
        return -(-self.num_items // self.trees_per_step)


class TreeCollator:
    """``collate_fn``: a global step's items -> this rank's micro-batches (``list[TreeBatch]``).

    Args:
        capacity: token budget of one micro-batch.
        rank: this rank.
        world_size: number of ranks.
        loss_mode: as in `plan_step`.
        method: as in `plan_step`.
        shard_method: as in `plan_step`.
    """

    def __init__(
        self,
        *,
        capacity: int,
        rank: int = 0,
        world_size: int = 1,
        loss_mode: str = "token-mean",
        method: str = "greedy",
        shard_method: str = "dfs",
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} out of range for world_size {world_size}")
        self.capacity = capacity
        self.rank = rank
        self.world_size = world_size
        self.loss_mode = loss_mode
        self.method = method
        self.shard_method = shard_method

    def plan(self, items: Sequence[Any]) -> StepPlan:
        return plan_step(
            [as_tree(x) for x in items],
            capacity=self.capacity,
            ranks=self.world_size,
            loss_mode=self.loss_mode,
            method=self.method,
            shard_method=self.shard_method,
        )

    def __call__(self, items: Sequence[Any]) -> list[TreeBatch]:
        return self.plan(items).batches(self.rank)
