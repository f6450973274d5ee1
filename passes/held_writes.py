"""State writes in a call that runs its graphs several times: one state per call.

A whole-tree call runs one compiled graph, and `treecompile.passes.state.run_with_state`
writes the state it computed into the model once that graph has run. A streamed call runs a
part graph per part, some parts twice (the auxiliary loss's statistics pass, a part run
again for its backward in recompute mode). Written after every run, a step counter would
advance once per run, and a later part would read what an earlier one wrote (a warm-up
schedule at another step, a flag set by the first part). Inside `held_state_writes`:

* every run computes its state from the model's state as it was before the call: the
  tensors the model writes in place are written only at the end, and what Dynamo sets on
  the model's modules after a run (attributes, Python numbers, buffers bound anew) is set
  back to its value before the run as soon as the run returns (`HeldWrites.run`);
* every run computes the state for a sequence of the whole batch's length (`at_length`), not
  its part's: a table over ``arange(T)`` read at the part's positions, which go past the
  part's own row count, holds them all, as in a whole-tree call;
* once every part has run, the model gets the state of the call's **first run**;
* a **counter** (`treecompile.passes.counters`: ``buffer.add_(increment)``, weighted by the paths
  through each row) gets the increments of the first run of each part (`HeldWrites.part`):
  every row of the tree is in one part, and the sum is what per-path training adds;
* a tensor the model fills in place for the sequence's length and reads back (a table filled
  up to the longest length seen, ``if T > self.filled: self.table[:T] = ...``) is refused: a part decides whether to
  fill it at its own row count, which is shorter than its rows' positions, and reads rows
  past what was filled (`HeldWrites.check`, and `HeldWrites.check_reads` for a tensor an
  earlier call filled, `note_filled`);
* what Dynamo sets elsewhere (a dict entry, a global) cannot be set back: where its new value
  reads the value it replaces (`self_updates`: ``cache = cat([cache, new])``) the streamed
  call is refused naming it, before any part runs (`HeldWrites.check`); a value that does not
  read it (a table cached for the part's length) is set by each run, as calls of several
  lengths set it.

A call that fails or is refused leaves the model's modules and tensors as they were.
"""

from __future__ import annotations

import contextlib
import contextvars
import re
import sys
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import fx, nn

from treecompile.core.errors import UnsupportedModelError
from treecompile.passes._graph import _add_upstream, op_name, value

__all__ = ["HeldWrites", "held_state_writes", "holding", "self_updates", "repeated_idempotent", "UNNAMED",
           "length_inputs", "at_length", "note_filled", "is_filled", "held_run"]

#: What a value Dynamo writes back is called where this torch does not say.
UNNAMED = "a value the model keeps"

_HOLDING: contextvars.ContextVar[HeldWrites | None] = contextvars.ContextVar("treecompile_held_writes", default=None)
_MISSING = object()
#: The model tensors a call has filled in place (`note_filled`), by id, held weakly.
_FILLED: dict[int, weakref.ref] = {}
_ATTRIBUTE = re.compile(r"^model((?:\.[A-Za-z_][A-Za-z0-9_]*)*)\.([A-Za-z_][A-Za-z0-9_]*)$")


class HeldWrites:
    """The state of the runs of one call (see the module)."""

    def __init__(self, model: nn.Module, length: int, several: bool = True) -> None:
        self.model, self.length, self.several = model, length, several
        self._first_bindings: list | None = None
        self._first_writes: tuple[Any, Sequence[Any], Sequence[Any]] | None = None
        self._increments: list[tuple[Any, Sequence[Any], Sequence[Any]]] = []
        self._part: Any = None
        self._counted: set = set()

    def part(self, key: Any) -> None:
        """The next runs are of part ``key``: the first of them that runs adds its counters."""
        self._part = key

    def check(self, state: Any) -> None:
        """Raises, before a run of ``state``'s graph (a `treecompile.passes.state.StateWrites`), if
        it computes state from a size of the batch other than its length, fills a tensor for the
        length and reads it back, or sets a value from the one it replaces where `run` cannot
        set it back."""
        if state.other_sizes:
            raise UnsupportedModelError(
                f"treecompile cannot {self._how}: the state it keeps ({', '.join(state.names)}) is computed from "
                f"{', '.join(state.other_sizes)}, a size of the batch other than its length, which {self._runs} does "
                f"not share.\n{self._instead}, or keep it out of the forward in training.")
        if state.read_after and state.lengths:  # filled for the sequence's length (a counter is not)
            self._refuse_filled(", ".join(state.written_name(i) for i in sorted(state.read_after)))
        lost = [name for name in dict.fromkeys(state.self_updates) if self.several and not self._on_a_module(name)]
        if lost:
            raise UnsupportedModelError(
                f"treecompile cannot stream this model: the model sets {', '.join(lost)} in every call from its value "
                "before the call, which a streamed call, running the model's graph once per part, would set once "
                "per part (and a later part would read what an earlier one set).\n"
                "Keep it on a module (an attribute or a buffer), keep it out of the forward in training, or call "
                "without stream= (the whole tree in one call sets it once).")

    def check_reads(self, args: Sequence[Any]) -> None:
        """Raises, before the run, if it reads a tensor an earlier call filled in place."""
        for a in args:
            if isinstance(a, torch.Tensor) and is_filled(a):
                name = next((f"model.{n}" for n, b in self.model.named_buffers() if b is a), "a tensor of the model")
                self._refuse_filled(name)

    def _refuse_filled(self, name: str) -> None:
        raise UnsupportedModelError(
            f"treecompile cannot {self._how}: it fills {name} in place and reads it back (a table filled up to "
            f"the longest sequence seen), and {self._runs} decides whether to fill it at its own row count, which "
            f"is shorter than its rows' positions: it would read rows the model never filled.\n{self._instead}, "
            "or fill the table for every position in __init__.")

    @property
    def _how(self) -> str:
        return "stream this model" if self.several else "run this model over a CP group"

    @property
    def _runs(self) -> str:
        return "each streamed part" if self.several else "each rank, which runs some of the rows,"

    @property
    def _instead(self) -> str:
        return "Call without stream= (the whole tree in one call)" if self.several else "Call without cp="

    def hold(self, state: Any, args: Sequence[Any], new: Sequence[Any], added: Sequence[Any]) -> None:
        """Keeps what one run would write into the model's tensors: the written tensors of the
        call's first run, the counters' increments of its part's first."""
        if self._first_writes is None:
            self._first_writes = (state, args, new)
        if added and self._part not in self._counted:
            self._counted.add(self._part)
            self._increments.append((state, args, added))

    @contextlib.contextmanager
    def run(self) -> Iterator[None]:
        """Around one compiled run: what it sets on the modules (Dynamo's writes after the
        graph) goes back to its value before the run as soon as it returns (the first run's
        is kept for the end), or if it fails."""
        before = _bindings(self.model)
        try:
            yield
        finally:
            undone = _restore(before)
            if self._first_bindings is None and sys.exc_info()[0] is None:
                self._first_bindings = undone

    def commit(self) -> None:
        if self._first_writes is not None:
            state, args, new = self._first_writes
            state.commit(args, new)
        for state, args, added in self._increments:
            state.commit(args, (), added)
        for space, key, v in self._first_bindings or ():
            if v is _MISSING:
                space.pop(key, None)
            else:
                space[key] = v

    def _on_a_module(self, name: str) -> bool:
        m = _ATTRIBUTE.match(name)
        if m is None:
            return False
        try:
            owner = self.model.get_submodule(m.group(1).lstrip("."))
        except AttributeError:
            return False
        return m.group(2) in vars(owner) or m.group(2) in owner._buffers


def _bindings(model: nn.Module) -> list[tuple[dict, dict]]:
    """``[(namespace, a copy of it)]``: every module's attributes and buffers."""
    out = []
    for m in model.modules():
        out.append((m.__dict__, m.__dict__.copy()))
        out.append((m._buffers, m._buffers.copy()))
    return out


def _changed(space: dict, old: dict) -> list[tuple[str, Any]]:
    """``[(key, value now or _MISSING)]`` where ``space`` binds another object than ``old``."""
    out = [(k, v) for k, v in space.items() if old.get(k, _MISSING) is not v]
    if len(space) - len(out) != len(old):  # a key removed
        out += [(k, _MISSING) for k in old if k not in space]
    return out


def _restore(snapshot: list[tuple[dict, dict]]) -> list[tuple[dict, str, Any]]:
    """Sets every namespace back to its copy; returns what it undid, ``[(namespace, key, value)]``."""
    undone = []
    for space, old in snapshot:
        for k, v in _changed(space, old):
            undone.append((space, k, v))
            if k in old:
                space[k] = old[k]
            else:
                del space[k]
    return undone


def note_filled(t: torch.Tensor) -> None:
    """Records that a call wrote ``t``, a tensor of the model, in place."""
    key = id(t)
    _FILLED[key] = weakref.ref(t, lambda _, key=key: _FILLED.pop(key, None))


def is_filled(t: torch.Tensor) -> bool:
    ref = _FILLED.get(id(t))
    return ref is not None and ref() is t


def holding() -> HeldWrites | None:
    """The running call's `HeldWrites`, or None outside `held_state_writes`."""
    return _HOLDING.get()


def held_run() -> contextlib.AbstractContextManager:
    """`HeldWrites.run` of the running call, around one compiled run (nothing outside one)."""
    held = holding()
    return held.run() if held is not None else contextlib.nullcontext()


@contextlib.contextmanager
def held_state_writes(model: nn.Module, length: int, several: bool = True) -> Iterator[HeldWrites]:
    """One state per call for the compiled runs inside (see the module), computed for a sequence
    of ``length`` rows; written on success. ``several=False``: a call that runs one graph once
    on some of the rows (a CP rank's), which needs the length but sets nothing twice. Inside
    another (two calls of one step, `treecompile.stream.runner.stream_logprob_loss`), the
    outer one holds the runs of both."""
    outer = holding()
    if outer is not None:
        yield outer
        return
    held = HeldWrites(model, length, several)
    token = _HOLDING.set(held)
    try:
        yield held
    finally:
        _HOLDING.reset(token)
    held.commit()


# ----------------------------------------------------------------------------- the state's length


def length_inputs(placeholders: list[fx.Node], sources: Sequence[str], batch: set, state_nodes: set
                  ) -> tuple[tuple, list[str]]:
    """``(lengths, other sizes)``: the batch inputs the state graph reads that carry the
    sequence's length (the ids' last dim): ``(input, None)`` for the length itself, ``(input,
    dims)`` for a tensor (only its shape: the state graph never reads a batch tensor's values);
    and the sources of the batch sizes it reads besides."""
    ids = next((p for p, s in zip(placeholders, sources) if s == "L['ids']"), None)
    if ids is None or not isinstance(value(ids), torch.Tensor):
        return (), []
    seq = value(ids).shape[-1]
    lengths, others = [], []
    for i, p in enumerate(placeholders):
        if p not in state_nodes or p not in batch:
            continue
        x = value(p)
        if isinstance(x, torch.SymInt):
            if _same(x, seq):
                lengths.append((i, None))
            else:
                others.append(sources[i])
        elif isinstance(x, torch.Tensor):
            dims = [d for d, n in enumerate(x.shape) if isinstance(n, torch.SymInt)]
            if not all(_same(x.shape[d], seq) for d in dims):
                others.append(sources[i])
            elif dims:
                lengths.append((i, tuple(dims)))
    return tuple(lengths), others


def at_length(args: Sequence[Any], lengths: tuple, length: int) -> list:
    """``args`` with the sequence's length (`length_inputs`) set to ``length``."""
    out = list(args)
    for i, dims in lengths:
        if dims is None:
            out[i] = length
        else:
            shape = list(args[i].shape)
            for d in dims:
                shape[d] = length
            out[i] = args[i].new_zeros(shape)
    return out


def _same(a: Any, b: Any) -> bool:
    """Whether sizes ``a`` and ``b`` are the same symbol (tied by the markers' checks)."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return isinstance(a, torch.SymInt) and isinstance(b, torch.SymInt) and statically_known_true(a == b)


# ----------------------------------------------------------------------------- repeatable writes

def self_updates(placeholders: list[fx.Node], names: list[str], outputs: list[Any], labels: list[str]) -> list[str]:
    """The values Dynamo writes back that read the value they replace, by name (see the module).
    A tensor the graph writes in place needs no such check: its value is held back and written
    once (`HeldWrites.hold`).

    Args:
        placeholders: the graph's placeholders; ``names`` what each is in the model.
        outputs: the values Dynamo writes back after the call; ``labels`` what each is in the
            model, or a placeholder text where this torch does not say (then it counts as one:
            what it replaces is not known).
    """
    found = []
    for out, label in zip(outputs, labels):
        if not isinstance(out, fx.Node):
            continue  # a constant
        read = {names[placeholders.index(p)] for p in _add_upstream([out], set()) if p.op == "placeholder"}
        if label in read or label.startswith(UNNAMED):
            found.append(label)
    return found


#: Ops ``f`` with ``f(f(x)) == f(x)`` (for the same arguments).
_IDEMPOTENT = {"clamp", "clamp_min", "clamp_max", "clip", "abs", "relu", "floor", "ceil", "trunc", "round", "sign"}
_SAME_VALUE = {"_get_data_attr", "detach", "clone", "contiguous"}


def repeated_idempotent(writes: list[fx.Node], p: fx.Node) -> bool:
    """Whether ``writes`` (in order, all into ``p``) each set ``p`` to one and the same idempotent op
    of ``p``'s own value (``p.data = p.data.clamp(min=eps)`` in a module that each layer calls):
    after the first of them, ``p`` holds the value the last one leaves. (One op: a chain of two
    idempotent ops is not idempotent in general.)"""
    ops = set()
    for w in writes:
        # ``p.data = v``: ``set_`` (torch 2.13), ``aten.shallow_copy_data_`` (2.14 on).
        if op_name(w) not in ("set_", "copy_", "shallow_copy_data_") or len(w.args) < 2 or w.args[0] is not p \
                or w.kwargs:
            return False
        found, x = [], w.args[1]
        while isinstance(x, fx.Node) and x is not p:
            name = op_name(x)
            # the op reads one tensor, ``x``'s first argument; its other arguments are constants
            if x.op not in ("call_function", "call_method") or name not in _IDEMPOTENT | _SAME_VALUE \
                    or x.all_input_nodes != [x.args[0]]:
                return False
            if name in _IDEMPOTENT:
                found.append((name, tuple(x.args[1:]), tuple(sorted(x.kwargs.items()))))
            x = x.args[0]
        if x is not p or len(found) != 1:
            return False
        ops.add(found[0])
    return len(ops) == 1
