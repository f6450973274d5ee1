"""Python branches on the row count: a graph decides them at its rows, per-path training at each
path's length.

A model's ``if T > 8: x = x * 0.5`` (or ``if T > self.filled: fill the table``) is a Python
``if`` on the sequence length. Dynamo takes the branch the captured call's row count takes and
guards on it (``s0 > 8``); the graph holds that branch alone. Per-path training runs each path
at its own length and may take the other one: a packed row of 11 rows whose paths have 6
tokens each scales every embedding, per-path training none. A streamed part or a CP rank
decides at its own row count, shorter than its rows' positions.

Most such branches choose between two spellings of the same function (nanochat's
``if window >= T: causal SDPA else a windowed mask``, H3's ``if k.size(-1) < L: pad k``), and
the graph's side is then exact for every path; some do not. No rule tells them apart yet, so a
batch whose paths go the other way is **warned about**, naming the line, once per graph and
line (`LengthBranchWarning`); ``verify=True`` checks the first call against per-path
training.

`length_branches` finds, at capture, the guards Dynamo added for a Python branch of the model
(a guard made where Dynamo turns a symbolic value into a Python one, ``evaluate_expr``, at a
line outside treecompile), over the graph's row count alone; `checked_lengths` wraps the
compiled graph so that each call, before it runs, evaluates them at the length of every path
of the batch (``CallState.path_lengths``). Guards an op adds for itself (a slice clamped to a
table's size, a contiguity test) are not branches of the model and are not judged. Not judged:
a graph that writes state (a cache rebuilt for a new length, computed for the batch's length:
`treecompile.passes.held_writes`), and a branch whose guard also reads another symbol (a
Python number the model keeps, made a symbol once it changed).
"""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import sympy
import torch

from treecompile.core.advice import TreeWarning

__all__ = ["LengthBranch", "LengthBranchWarning", "checked_lengths", "length_branches"]


@functools.cache
def _own_code_dirs() -> tuple[str, ...]:
    """treecompile's own folders (the package, its passes and kernels): a branch there is the
    call's, not the model's."""
    import treecompile.core.advice as advice
    import treecompile.kernels as kernels

    package = os.path.dirname(os.path.dirname(os.path.abspath(advice.__file__)))
    dirs = [os.path.dirname(os.path.abspath(__file__)), package, *map(os.path.abspath, kernels.__path__)]
    return tuple(d + os.sep for d in dirs)


class LengthBranchWarning(TreeWarning):
    """A batch with a path whose length takes another branch of the model's code than the
    graph's row count took (`treecompile.passes.length_branches`): exact only if both sides of
    the branch compute the same for that path."""


@dataclass(frozen=True)
class LengthBranch:
    """One Python branch of the model on the row count: ``expr`` (over ``symbol``) holds for
    the captured graph's rows; ``where``: the model's line."""

    expr: sympy.Basic
    symbol: sympy.Symbol
    where: str

    def holds_at(self, length: int) -> bool:
        """Whether the guard holds at ``length``; one that does not evaluate to a truth value
        (a function sympy keeps unevaluated) counts as holding: no warning, as before."""
        try:
            return bool(self.expr.xreplace({self.symbol: sympy.Integer(length)}))
        except TypeError:
            return True


def _is_model_branch(guard) -> str | None:
    """The model's line of a guard Dynamo added for a Python branch, or None (an op's own guard,
    or a branch of treecompile's code around the model)."""
    sloc = getattr(guard, "sloc", None)
    frame = getattr(sloc, "framework_loc", None)
    if getattr(frame, "name", None) != "evaluate_expr" or "_dynamo" not in str(getattr(frame, "filename", "")):
        return None
    user = getattr(sloc, "maybe_user_loc", None)
    if not user:
        return None
    code, _, loc = str(user).rpartition("  # ")  # "<code>  # <file>:<line> in <function>"
    path = loc.rsplit(":", 1)[0]
    if not path or os.path.abspath(path).startswith(_own_code_dirs()):
        return None
    return f"{os.path.basename(path)}:{loc.rsplit(':', 1)[1]} (`{code.strip()}`)" if code else loc


def length_branches(example_inputs, seq_len) -> list[LengthBranch]:
    """The Python branches of the model over the row count ``seq_len`` (a SymInt), from the
    shape environment of the capture (``example_inputs``' fake mode)."""
    if not isinstance(seq_len, torch.SymInt):
        return []
    from torch._guards import detect_fake_mode

    fake = detect_fake_mode(example_inputs)
    env = getattr(fake, "shape_env", None)
    if env is None:
        return []
    symbol = env.replace(seq_len.node.expr)
    if not isinstance(symbol, sympy.Symbol):
        return []
    out = []
    for guard in env.guards:
        where = _is_model_branch(guard)
        if where is None:
            continue
        expr = env.replace(guard.expr)
        if expr.free_symbols != {symbol}:
            continue
        branch = LengthBranch(expr, symbol, where)
        if branch not in out:
            out.append(branch)
    return out


def checked_lengths(fn: Callable, branches: list[LengthBranch], lengths: Callable[[], tuple[int, ...]]) -> Callable:
    """``fn``, warning before it runs, once per line of ``branches``, where a path length of
    ``lengths()`` takes another branch than the graph."""
    if not branches:
        return fn
    lines = {b.where for b in branches}
    warned: set[str] = set()  # once per line (a line of several layers may give several guards)
    judged: list = [None]  # the lengths judged last: a streamed call's parts share its batch's

    def run(*args):
        if len(warned) < len(lines):
            paths = lengths()
            if paths is judged[0]:
                return fn(*args)
            judged[0] = paths
            for branch in branches:
                other = [n for n in paths if not branch.holds_at(n)] if branch.where not in warned else []
                if other:
                    warned.add(branch.where)
                    warnings.warn(
                        f"treecompile: a Python branch of the model on the sequence length at {branch.where} goes "
                        f"the other way for a path of {other[0]} tokens than for the packed row; the result equals "
                        "per-path training for such paths only if both sides of the branch compute the same.\n"
                        f"  The graph holds the branch its row count {branch.symbol} takes ({branch.expr}); "
                        f"{len(other)} of the batch's path lengths decide otherwise. tree_compile(verify=True) "
                        "checks the first call against per-path training.",
                        LengthBranchWarning, stacklevel=2)
        return fn(*args)

    return run
