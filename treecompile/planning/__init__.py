"""What fits where: memory models, partitions of a tree, shards, micro-batches.

`budget` and `peak_memory` predict and measure a step's peak; `partition` cuts a tree
into parts under a budget, by the methods of `grouping` (which paths go together);
`dataloader` builds tree batches from datasets (its paths spread over ranks by
`treecompile.distributed.shard`); `prefix_sampler`
puts dataset samples that share prefixes into the same micro-batch.

Layer 5: imports kernels and core, and the planning floor of `treecompile.distributed`.
"""
