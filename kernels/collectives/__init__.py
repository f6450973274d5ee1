"""Collectives in the graph: `cp_gather` (a context-parallel rank's prefix keys and values
gathered from the other ranks)."""
