"""How a call enters a tree-compiled model: one at a time (`CALLS`, a re-entrant lock: a
model's first call compiles it, and two threads must not both), and never traced by an outer
``torch.compile`` (`warn_outer_compile`)."""

from __future__ import annotations

import functools
import sys
import threading

__all__ = ["CALLS", "one_at_a_time", "warn_outer_compile"]

CALLS = threading.RLock()  # see TreeCompiledModel.__call__


def one_at_a_time(method):
    """``method`` under `CALLS` (re-entrant: a call through ``__call__`` holds it already)."""

    @functools.wraps(method)
    def locked(*args, **kwargs):
        with CALLS:
            return method(*args, **kwargs)

    return locked


def warn_outer_compile() -> None:
    """Says (once per call site, as warnings do), when a call comes through
    ``torch.compile(compiled)``, that the outer compile does nothing (the call is not traced by
    it; ``tree_compile`` compiles the model itself)."""
    # The frames of torch's eval_frame.py above this call: each tree-compiled call on the
    # stack (this one, and an outer one whose self-check calls a twin) has its own disable
    # wrapper; one more is an outer torch.compile's.
    frame = sys._getframe(1)
    own, calls, seen = frame.f_code, 0, 0
    for _ in range(32):
        if frame is None:
            break
        calls += frame.f_code is own
        seen += frame.f_code.co_filename.replace("\\", "/").endswith("_dynamo/eval_frame.py")
        frame = frame.f_back
    if seen > calls:
        import warnings

        from treecompile.core.advice import TreeWarning

        warnings.warn("torch.compile(...) of a tree-compiled model does nothing: tree_compile compiles the model "
                      "itself, at its first call; call the tree-compiled model directly", TreeWarning, stacklevel=4)
