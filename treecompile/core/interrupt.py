"""Ctrl-C that is never lost.

Python turns SIGINT into a ``KeyboardInterrupt`` wherever the main thread happens to be. When that
is a weak-reference callback or a ``__del__`` (Dynamo's caches run such callbacks while compiling),
Python prints "Exception ignored" and goes on: the run continues as if no key was pressed.
:func:`interrupts_kept` remembers every SIGINT, and :func:`raise_if_interrupted`, called between
units of work (a benchmark's measurements), raises the one that was swallowed, without Python's
"Exception ignored" text in between.

A Ctrl-C that lands inside torch's compiler (Dynamo tracing, fake tensors, AOTAutograd,
inductor) is held rather than raised there: torch logs an exception raised inside its fake
tensor dispatch as an error with a long traceback before passing it on. It is raised at the
next :func:`raise_if_interrupted`, or when the block ends; a second Ctrl-C raises at once.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterator

__all__ = ["interrupts_kept", "raise_if_interrupted"]

_pressed = threading.Event()
_held = threading.Event()  # a press inside torch's compiler, not raised there


@contextlib.contextmanager
def interrupts_kept() -> Iterator[None]:
    """Within the block, SIGINT raises ``KeyboardInterrupt`` as usual and is also remembered.

    A no-op outside the main thread (only it receives signals) or when SIGINT is not handled by
    Python's default handler (an embedding application's own is left alone).
    """
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield
        return

    def pressed(signum, frame):
        held = not _pressed.is_set() and _in_compiler(frame)
        _pressed.set()
        if held:
            _held.set()
        else:
            raise KeyboardInterrupt

    hook = sys.unraisablehook

    def unraisable(info):  # the swallowed Ctrl-C is raised again later: no "Exception ignored" text
        if not (info.exc_type is KeyboardInterrupt and _pressed.is_set()):
            hook(info)

    _pressed.clear()
    _held.clear()
    signal.signal(signal.SIGINT, pressed)
    sys.unraisablehook = unraisable
    try:
        yield
        if _held.is_set():  # held inside the compiler and not raised since
            raise KeyboardInterrupt
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        sys.unraisablehook = hook
        _pressed.clear()
        _held.clear()


#: torch's compiler, where a KeyboardInterrupt raised mid-dispatch is logged as an error.
_COMPILER = tuple(f"/torch/{d}/" for d in ("_dynamo", "_subclasses", "fx", "_functorch", "_inductor",
                                           "_higher_order_ops", "_library", "_prims", "_prims_common",
                                           "utils/_sympy")) + ("/sympy/",)


def _in_compiler(frame) -> bool:
    name = frame.f_code.co_filename.replace("\\", "/") if frame is not None else ""
    return any(d in name for d in _COMPILER)


def raise_if_interrupted() -> None:
    """Raises ``KeyboardInterrupt`` if Ctrl-C was pressed inside :func:`interrupts_kept`."""
    if _pressed.is_set():
        _held.clear()
        raise KeyboardInterrupt
