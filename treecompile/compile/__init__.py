"""`tree_compile`: the wrapper, its first-call probe and checks, and what shows its work.

`wrapper` (`tree_compile`, `TreeCompiledModel`), `probe` (the metamorphic first-call
check), `selfcheck` (the full check against per-path training), `extract` (log-probs of
a batch), `inspection` and `maskview` (what `treecompile inspect` shows). DDP, FSDP2 and
context parallelism over trees are `treecompile.distributed`.

Layer 7: imports every layer below it (kernels, core, passes, capture, planning, stream).
"""
