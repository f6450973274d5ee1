"""Kernels the rewritten graphs call, one family per module (``flex``: tree FlexAttention)."""
