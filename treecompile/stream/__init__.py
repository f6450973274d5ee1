"""Trees larger than one call: parts run in DFS order with a stack of K/V and states.

`options` (`StreamOptions`) is what a user passes; `plan` chooses the parts and the
stack's policy under a budget; `parts` cuts a batch into parts; `stack` holds and
gathers the prefix K/V; `runner` runs the parts through the rewritten graphs. Streamed
parts split over a context-parallel group are `treecompile.distributed.stream_cp`.

Layer 6: imports kernels, core, passes, capture and planning.
"""
