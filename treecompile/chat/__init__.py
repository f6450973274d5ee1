"""Chat conversations to token paths and trees.

`messages` (the OpenAI message format, normalised and checked), `template` (a tokenizer's own
chat template, and which of its tokens are trained), `conversation` (rendering conversations to
token paths: ChatML message by message, or the tokenizer's template), `tokenizer` (the tokenizer
adapters: Hugging Face, tiktoken, bytes) and `to_tree` (`tree_from_messages`: conversations to a
`treecompile.core.tree.TrajectoryTree`).

On the floor of `treecompile.core` (layer 1, docs/architecture.md): imports `treecompile.kernels`
and `treecompile.core`, and `TrajectoryTree.from_messages` imports it back.
"""
