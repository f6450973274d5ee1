"""The options `tree_compile` takes, checked once where it is called.

``verify`` becomes a `Verify`; every other option is checked against the table of what it
accepts, and an unknown value raises ``ValueError`` naming the valid ones.
"""

from __future__ import annotations

import enum
from typing import Any

from treecompile.core.errors import unknown_choice
from treecompile.kernels.attention.masks import MASK_KINDS
from treecompile.kernels.scans.recurrence import SCAN_KERNELS
from treecompile.passes.pipeline import LOWERINGS

__all__ = ["Verify", "MASKS", "OUTPUTS", "DROPOUT", "BACKENDS", "checked_options"]

#: Mask encodings ``tree_compile(mask=...)`` accepts.
MASKS = tuple(MASK_KINDS)
#: Extra outputs ``tree_compile(outputs=...)`` can add to `TreeOutput`.
OUTPUTS = ("entropy",)
#: What ``tree_compile(dropout=...)`` accepts (see there).
DROPOUT = ("refuse", "shared")
#: Backends ``tree_compile(backend=...)`` accepts (None picks inductor on CUDA, aot_eager on CPU).
BACKENDS = tuple(LOWERINGS)


class Verify(enum.Enum):
    """What a compiled model checks (``tree_compile(verify=...)``): the value it is given
    (``False``, ``"probe"``, ``True``) or the member itself.

    - ``OFF``: nothing;
    - ``PROBE`` (default): the first-call probe of every graph compiled (`treecompile.compile.probe`);
    - ``FULL``: the probe, and on the first call the full check against per-path training
      (`treecompile.compile.selfcheck`).
    """

    PROBE = "probe"
    FULL = True
    OFF = False

    @classmethod
    def of(cls, value: Any) -> Verify:
        """The member for ``value``; ``ValueError`` naming the accepted values otherwise."""
        if isinstance(value, cls):
            return value
        if isinstance(value, (bool, str)):
            for member in cls:
                if type(member.value) is type(value) and member.value == value:
                    return member
        raise ValueError(unknown_choice("verify", value, [repr(m.value) for m in cls]))

    @property
    def probes(self) -> bool:
        """Whether the first-call probe runs."""
        return self is not Verify.OFF


def checked_options(*, mask: str, backend: str | None, outputs: Any, temperature: Any, scan_kernel: str,
                    dropout: str, verify: Any) -> Verify:
    """Raises ``ValueError`` for an option value `tree_compile` does not take; returns ``verify``
    as a `Verify`."""
    if mask not in MASKS:
        raise ValueError(unknown_choice("mask", mask, MASKS, "masks"))
    if backend is not None and backend not in BACKENDS:
        raise ValueError(unknown_choice("backend", backend, BACKENDS, "backends"))
    unknown = [o for o in outputs if o not in OUTPUTS]
    if unknown or isinstance(outputs, str):
        raise ValueError(unknown_choice("outputs", outputs, OUTPUTS, "outputs") + " (a tuple)")
    if isinstance(temperature, bool) or not (isinstance(temperature, (int, float)) and 0 < temperature < float("inf")):
        raise ValueError(f"temperature must be a positive finite number, got {temperature!r}")
    if scan_kernel not in SCAN_KERNELS:
        raise ValueError(unknown_choice("scan_kernel", scan_kernel, SCAN_KERNELS, "scan kernels"))
    if dropout not in DROPOUT:
        raise ValueError(unknown_choice("dropout", dropout, map(repr, DROPOUT)))
    return Verify.of(verify)
