"""Functions of torch swapped for each captured call: each gives the same values as torch's own,
in a form a capture follows (a length kept symbolic, a symbolic bool taken, a check that
branches on data or refuses a backward the tree kernel has left out).

`TORCH_SWAPS` swaps them in torch's namespaces; `imported_torch_swaps` also where a model's
module imported one by name. `treecompile.capture.dynamo.swapped_kernels` applies both.
"""

from __future__ import annotations

import inspect
import sys
from typing import Any

import torch
from torch import nn

__all__ = ["TORCH_SWAPS", "imported_torch_swaps"]


_LINSPACE = torch.linspace


def _linspace(start, end, steps, *, out=None, dtype=None, layout=torch.strided, device=None, requires_grad=False):
    """``torch.linspace`` for a call under capture: ``linspace(0, n - 1, n)`` (positions written as a
    linspace) is ``arange(n)`` in the same values, which the capture keeps symbolic in ``n`` (the
    positions pass reads it as the row index); torch's own would make the length a constant."""
    if out is None and layout == torch.strided and isinstance(start, int) and start == 0 and end == steps - 1:
        return torch.arange(steps, dtype=dtype or torch.get_default_dtype(), device=device,
                            requires_grad=requires_grad)
    return _LINSPACE(start, end, steps, out=out, dtype=dtype, layout=layout, device=device,
                     requires_grad=requires_grad)


def _detect_is_causal_mask(mask, is_causal=None, size=None) -> bool:
    """``nn.Transformer*``'s check whether a mask is causal compares its values (a branch on data,
    which a capture cannot follow). It only picks a kernel: the mask is applied either way, so
    under capture the caller's own flag is kept (False when not given)."""
    return bool(is_causal)


def _validate_device(query, key, value) -> None:
    """FlexAttention's device check for a call under capture, without its refusal of a backward
    on CPU: the attention pass replaces a causal ``flex_attention`` with the tree kernel (which
    has one) and the verify pass refuses any other, so the CPU backward it guards never runs."""


_SDPA = torch.nn.functional.scaled_dot_product_attention


def _sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kwargs):
    """``F.scaled_dot_product_attention`` for a call under capture, taking ``is_causal`` as a
    comparison of the length (``is_causal=q_len > 1``, as transformers 4.x Llama and the code
    copied from it write it): with the length symbolic that is a symbolic bool, which the op
    does not take; a branch on it makes the capture guard on its value and pass a bool."""
    is_causal = True if is_causal else False  # noqa: SIM210 (a branch, not bool(): see above)
    return _SDPA(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                 **kwargs)


def _torch_swaps() -> list[tuple[Any, str, Any]]:
    import torch.nn.attention.flex_attention as flex
    import torch.nn.modules.transformer as transformer

    import torch.nn.modules.rnn as rnn

    from treecompile.kernels.scans.rnn import VF_FOR_CAPTURE

    swaps = [(torch, "linspace", _linspace), (torch.nn.functional, "scaled_dot_product_attention", _sdpa),
             (rnn, "_VF", VF_FOR_CAPTURE)]
    if hasattr(transformer, "_detect_is_causal_mask"):
        swaps.append((transformer, "_detect_is_causal_mask", _detect_is_causal_mask))
    if hasattr(flex, "_validate_device"):
        swaps.append((flex, "_validate_device", _validate_device))
    return swaps


#: Functions of torch swapped for every captured call (each gives the same values).
TORCH_SWAPS: list[tuple[Any, str, Any]] = _torch_swaps()


def imported_torch_swaps(model: nn.Module) -> list[tuple[Any, str, Any]]:
    """`TORCH_SWAPS` for the names the modules defining the model's classes imported from
    torch (openai/whisper's ``from torch.nn.functional import scaled_dot_product_attention``):
    ``(module, name, drop-in)`` for each global bound to a function `TORCH_SWAPS` swaps, which
    swapping it in torch's own namespace does not reach. Modules (``_VF``) are left alone."""
    originals = {id(getattr(owner, name)): drop_in for owner, name, drop_in in TORCH_SWAPS
                 if callable(getattr(owner, name)) and not inspect.ismodule(getattr(owner, name))}
    modules = {type(m).__module__ for m in model.modules()}
    found = []
    for module in (sys.modules.get(name) for name in sorted(modules) if not name.startswith("torch.")):
        if module is not None:
            found += [(module, name, originals[id(fn)]) for name, fn in list(vars(module).items()) if id(fn) in originals]
    return found
