"""What compiling cost a benchmark row: Dynamo's recompile reasons and the seconds of each
timed compile phase, read from torch's own logs and counters."""

from __future__ import annotations

import contextlib
import logging

__all__ = ["PHASES_KEPT", "compile_phases", "recompile_reasons"]

#: Compile phases a row keeps: the longest, of Dynamo's and Inductor's timed phases (nested:
#: ``_compile.compile_inner`` holds the whole of a frame's compile, the backend included).
PHASES_KEPT = 10


def compile_phases() -> dict[str, float]:
    """Seconds spent so far in this process in each of Dynamo's and Inductor's timed compile
    phases (``torch._dynamo.utils.compile_times``); ``{}`` where torch does not offer them."""
    try:
        from torch._dynamo.utils import compile_times

        names, values = compile_times(repr="csv", aggregate=True)
        return {n: float(v) for n, v in zip(names, values)}
    except Exception:  # a private API: its absence costs the report a column, not the run
        return {}


#: The logger Dynamo's ``recompiles`` artifact writes to (``TORCH_LOGS=recompiles``).
_RECOMPILES_LOG = "torch._dynamo.guards.__recompiles"


@contextlib.contextmanager
def recompile_reasons():
    """Collects Dynamo's recompile messages (each names the guard that failed) logged inside
    the block; the list is empty unless the ``recompiles`` log is on
    (``torch._logging.set_logs(recompiles=True)``; `treecompile.bench.cuda.main` turns it on)."""
    reasons: list[str] = []

    class _Keep(logging.Handler):
        def emit(self, record):
            reasons.append(record.getMessage())

    logger, handler = logging.getLogger(_RECOMPILES_LOG), _Keep()
    logger.addHandler(handler)
    try:
        yield reasons
    finally:
        logger.removeHandler(handler)
