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
the graph's side is then exact for every path; some do not. After a call whose batch has a path
on the other side of a line, the wrapper runs a copy of the unmodified model on such a path and
compares (`treecompile.compile.length_check`): the line is settled where they agree, the batch
(and every later one with a path on that side) refused where they do not, and warned about
(`LengthBranchWarning`) where no copy can run; once per graph and line (`BranchVerdicts`).

`length_branches` finds, at capture, the guards Dynamo added for a Python branch of the model
(a guard made where Dynamo turns a symbolic value into a Python one, ``evaluate_expr``, at a
line outside treecompile), over the graph's row count alone; `checked_lengths` wraps the
compiled graph so that each call, before it runs, evaluates them at the length of every path
of the batch (``CallState.path_lengths``), noting the lines to judge after the call and
raising a line's refusal. Guards an op adds for itself (a slice clamped to a
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
from dataclasses import dataclass, field

import sympy
import torch

from treecompile.core.advice import TreeWarning

__all__ = ["BranchVerdicts", "LengthBranch", "LengthBranchWarning", "checked_lengths", "length_branches"]


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


@dataclass
class BranchVerdicts:
    """What is known, per line, of the branches of one graph (`CompileRecord.branch_verdicts`).

    Attributes:
        same: lines whose other side was checked against the unmodified model on a path that
            takes it, and computes the same there.
        warned: lines warned about (a call that could not check them).
        refused: per line, the refusal of a batch with a path on the other side (it computes
            otherwise there), raised before the graph runs.
        pending: ``(branch, lengths)`` the running call's paths took the other way for, judged
            after the call (`treecompile.compile.length_check`) and cleared.
    """

    same: set[str] = field(default_factory=set)
    warned: set[str] = field(default_factory=set)
    refused: dict[str, Exception] = field(default_factory=dict)
    pending: list[tuple[LengthBranch, tuple[int, ...]]] = field(default_factory=list)

    def settled(self, where: str) -> bool:
        return where in self.same or where in self.warned

    def warn(self, branch: LengthBranch, other: tuple[int, ...], why: str, stacklevel: int = 2) -> None:
        """The warning for a line that could not be checked (``why``), once."""
        self.warned.add(branch.where)
        warnings.warn(
            f"treecompile: a Python branch of the model on the sequence length at {branch.where} goes the other way "
            f"for a path of {other[0]} tokens than for the packed row; the result equals per-path training for such "
            f"paths only if both sides of the branch compute the same, which was not checked: {why}.\n"
            f"  The graph holds the branch its row count {branch.symbol} takes ({branch.expr}); {len(other)} of the "
            "batch's path lengths decide otherwise. tree_compile(verify=True) checks the first call against per-path "
            "training.",
            LengthBranchWarning, stacklevel=stacklevel + 1)


def checked_lengths(fn: Callable, branches: list[LengthBranch], lengths: Callable[[], tuple[int, ...]],
                    verdicts: BranchVerdicts) -> Callable:
    """``fn``, noting in ``verdicts.pending`` before it runs each line of ``branches`` that a path
    length of ``lengths()`` takes the other way for (once per batch: a streamed call's parts
    share their batch's lengths), and raising the line's refusal there if it has one."""
    if not branches:
        return fn
    judged: list = [None]  # the lengths judged last

    def run(*args):
        if not all(verdicts.settled(b.where) for b in branches):
            paths = lengths()
            if paths is not judged[0]:
                judged[0] = paths
                for branch in branches:
                    other = () if verdicts.settled(branch.where) else tuple(n for n in paths if not branch.holds_at(n))
                    if not other:
                        continue
                    refusal = verdicts.refused.get(branch.where)
                    if refusal is not None:
                        raise type(refusal)(*refusal.args)
                    verdicts.pending.append((branch, other))
        return fn(*args)

    return run
