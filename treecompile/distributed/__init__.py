"""Training over several processes: every kind of parallelism treecompile runs a tree under.

- `shard`: a batch's paths spread over data-parallel ranks (by tokens, by shared prefix, or
  AReaL-DTA's balanced method), each rank's share a tree of its own.
- `data_parallel`: DDP and FSDP2 around a tree-compiled model (`wrap_ddp`, `wrap_fsdp`,
  `train_step`), whose gradients equal per-path training over the whole batch.
- `unsharded`: an FSDP2 model's units gathered for one tree call and resharded after its
  backward, which every whole-tree and streamed call of an FSDP2 model goes through.
- `cp_split`: one packed row split over a context-parallel group by work (attention pairs).
- `context_parallel`: that row run over the group, each rank's queries seeing the prefix keys
  and values gathered from the other ranks in the graph (`treecompile.kernels.collectives.cp_gather`).
- `stream_cp`: a tree over the row budget streamed in parts, each part split over the group.

The modules stand on the floors of the layers they serve (docs/architecture.md): `unsharded`
on core's (it imports nothing of treecompile), `shard` and `cp_split` on planning's,
`context_parallel` and `stream_cp` on stream's, `data_parallel` on compile's.
"""
