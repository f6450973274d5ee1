"""Graph rewrites that make a captured causal LM exact on a packed tree batch.

See ``passes/README.md`` for the invariants, and :mod:`treecompile.passes.pipeline` for
the order the passes run in. Importing a pass module registers the ``treecompile::``
marker ops it needs; nothing heavy is imported here.
"""
