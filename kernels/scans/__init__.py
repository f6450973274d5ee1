"""Recurrences along the tree: every node starts from its parent node's final state.

`recurrence` (the level-by-level driver and its scan kernels, `recurrence_ops` its ops), the
families it runs (`gdn`: Gated DeltaNet, `mamba2`: SSD, `selective_scan` and `mamba`: Mamba),
`path_scan` (running sums and any associative scan along the root path) and `table` (the
table of recurrent scans the passes route). Their plain references (the ``*_reference``
functions, the tests' ground truth) are in `naive`."""
