"""Sizes shared by the zoo's repository models."""

VOCAB = 32
DIM = 32
HEADS = 4
HD = DIM // HEADS
LAYERS = 1  # one layer: the spellings, not depth, are what the cases test (modded-nanoGPT needs two)
CTX = 64
