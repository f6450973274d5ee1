"""Benchmarks: tree training against what a user runs today.

`trees` (``treecompile bench``, CPU and GPU, against per-path training with packing),
`cuda` (``treecompile bench --device cuda``: Qwen3 shapes against the unmodified Hugging
Face model), `baselines` (those models, and the baselines written out as a user runs them),
`profile_cuda` (one step under the profiler).

Layer 11: imports the layers below it.
"""
