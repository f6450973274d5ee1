"""`tree_compile`: the wrapper, its first-call probe and checks, and what shows its work.

`wrapper` (`tree_compile`, `TreeCompiledModel`), `probe` (the metamorphic first-call
check), `selfcheck` (the full check against per-path training), `extract` (log-probs of
a batch), `inspection` and `maskview` (what `treecompile inspect` shows), `distributed`
(DDP and FSDP2 over trees).

Layer 7: imports every layer below it (kernels, core, passes, capture, planning, stream).
"""
