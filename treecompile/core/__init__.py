"""The tree, the batch and the loss: what every other layer builds on.

Trees and how they are made (`tree`, `tree_build`, `preorder`, `path_sets`; chat
conversations rendered to token paths: `messages`, `conversation`, `tokenizer`), the packed
`batch` with its validation, per-path `weights`, the `loss` and its modes, the per-path
`reference` every result is tested against, and the `errors` and `advice` the user sees.

Layer 1 of the package (docs/architecture.md): imports `treecompile.kernels` only.
"""
