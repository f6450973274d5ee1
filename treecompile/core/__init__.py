"""The tree, the batch and the loss: what every other layer builds on.

Trees and how they are made (`tree`, `tree_build`, `preorder`, `path_sets`, and from padded
rows `padded_rows`; chat conversations are `treecompile.chat`, on this floor), the packed
`batch` with its validation, per-path `weights`, the `loss` and its modes, the per-path
`reference` every result is tested against, and the `errors` and `advice` the user sees.

Layer 1 of the package (docs/architecture.md), with `treecompile.chat`: imports `treecompile.kernels`
and `treecompile.chat` only.
"""
