"""The one compute-dtype rule of treecompile.

Log-probabilities, losses and recurrent states are computed in at least float32, as the
per-path reference (`treecompile.core.reference`) computes them: bfloat16 or float16 inputs give
float32, float32 and float64 stay as they are.
"""

from __future__ import annotations

import torch

__all__ = ["compute_dtype"]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """``dtype`` promoted to at least float32."""
    return torch.promote_types(dtype, torch.float32)
