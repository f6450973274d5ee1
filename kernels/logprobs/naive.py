"""The plain reference implementation of the fused LM head: the same computation written plainly,
used by the tests (and the Triton interpreter's cases) as the ground truth that
:mod:`treecompile.kernels.logprobs.fused` and :mod:`treecompile.kernels.logprobs.fused_triton`
are compared with.

* `reference_target_logprobs`: forms all ``[R, V]`` logits at once (O(R x V) memory, where the
  fused kernels hold one ``[chunk, V]`` chunk), with the projection and soft-cap of
  :mod:`treecompile.kernels.logprobs.fused`.
"""

from __future__ import annotations

import torch

from treecompile.kernels.logprobs.fused import _chunk_logits

__all__ = ["reference_target_logprobs"]

Tensor = torch.Tensor


def reference_target_logprobs(
    hidden: Tensor, weight: Tensor, bias: Tensor | None, slot: Tensor, target: Tensor, *, softcap: float | None = None
) -> Tensor:
    """The plain computation :func:`fused_target_logprobs` fuses: forms all ``[R, V]`` logits."""
    _, z = _chunk_logits(hidden, weight, bias, softcap)
    return torch.log_softmax(z, dim=-1)[slot, target]
