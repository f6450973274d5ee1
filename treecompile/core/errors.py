"""Exceptions raised by treecompile."""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

__all__ = ["TreeInputError", "TreeWarning", "UnsupportedModelError", "about_sizes", "capture_error", "row_count_error",
           "CaptureFailed", "unexpected_error", "unknown_choice"]


def unknown_choice(what: str, value: Any, valid: Any, plural: str = "") -> str:
    """The one message for a value outside its choices: ``unknown {what} {value!r}; valid
    {plural}: a, b, c`` (``valid: ...`` without ``plural``), the choices as ``valid`` lists them."""
    listed = ", ".join(str(v) for v in valid)
    return f"unknown {what} {value!r}; valid{' ' + plural if plural else ''}: {listed}"


class TreeWarning(UserWarning):
    """A batch that trains exactly but probably not as the caller intends."""


class TreeInputError(ValueError):
    """Input data (sequences, masks, weights, trees, batches) that cannot be trained on exactly."""


class UnsupportedModelError(RuntimeError):
    """A model contains an operation that treecompile cannot make exact on a tree."""


def capture_error(exc: BaseException) -> UnsupportedModelError:
    """Turns an error raised while Dynamo captures the model into a refusal whose first line
    says what failed, where in the model's source, and why.

    Dynamo's own message (a graph-break type such as "Observed exception", an explanation,
    hints and developer context) is condensed: its user-code frame gives the source line, its
    explanation or the exception the model raised gives the reason. Dynamo's full message is
    not repeated (it would bury the reason); ``TORCHDYNAMO_VERBOSE=1`` shows its trace.
    """
    text = str(exc)
    lines = text.splitlines()
    kind = lines[0].strip() if lines else type(exc).__name__
    where, code = _user_frame(lines)
    # A guard on a data-dependent value (torch.fx's GuardOnDataDependentSymNode) names the
    # model's line as "Caused by: <code>  # <file>:<line> in <function>".
    caused = re.search(r"^Caused by: (.*?)\s+#\s*(\S+:\d+) in \w+", text, re.MULTILINE)
    if caused and not where:
        code, where = caused.group(1).strip(), caused.group(2)
    raised = _after(text, "Developer debug context: raised exception ")
    explanation = _after(text, "Explanation: ")
    fake = re.search(r"got (\w+(?:Error|Exception)\(.*?\))\s*$", text, re.MULTILINE)
    if fake and not raised:
        raised = fake.group(1)
    refusal = next((c for c in _refusal_types() if raised.startswith(f"{c.__name__}(")), None)
    if refusal is not None:
        # One of treecompile's own refusals, raised inside the model's call (an attention or
        # mask marker): its text is the reason, the model's call site the place; its type is kept
        # (the wrapper acts on some).
        try:
            reason = ast.literal_eval(raised[len(refusal.__name__):].strip()[1:-1].rstrip(","))
        except (ValueError, SyntaxError):
            reason = raised
        short = where.rsplit("/", 1)[-1]
        return refusal(
            f"treecompile cannot make this model exact on a tree: {reason} (called at {short}).\n  at {where}: {code}"
        )
    # Newer Dynamo reports an argument mismatch at treecompile's own call of the model as the
    # TypeError Python would raise there.
    binding = raised.startswith("TypeError(") and where.startswith(_CALL_SITE) and bool(_BINDING.search(raised))
    if raised and not binding:
        why = f"it raises {raised} when traced"
        hint = "run the model eagerly on one path to see the same error; models that read an attention_mask " \
               "tensor need it built, which tree batches do not do"
    elif binding or "failed to bind arguments" in text or "argument mismatch" in text.lower():
        return UnsupportedModelError(
            "treecompile cannot capture this model: its forward cannot be called as model(input_ids) (a plain PyTorch "
            "model must take the token ids [1, S] as its one required argument).\n  What to do: wrap it in a module "
            "whose forward(input_ids) calls it with what else it needs."
        )
    elif kind.lower().startswith("data-dependent branching"):
        why = "it branches on a tensor's value, which cannot be captured as one graph"
        hint = "make the code branchless (torch.where) or move the decision out of the model"
    elif "data-dependent expression" in text or type(exc).__name__ == "GuardOnDataDependentSymNode":
        why = ("a tensor's values decide a size or a Python number (split sizes or a loop count from .tolist(), "
               ".item() or nonzero()), which one captured graph cannot follow")
        kind = type(exc).__name__
        hint = ("compute with the tensor itself (a mask, torch.where, index_add_ over all rows) instead of sizes read "
                "from its values, or route Hugging Face experts through their experts interface")
    elif explanation:
        why = explanation.rstrip(".")
        hint = "the model must run on one packed row of any length; see docs/supported-models.md"
    else:
        why = kind
        hint = "see docs/supported-models.md"
    site = f"`{code}` at {where}" if where else "the model"
    return UnsupportedModelError(
        f"treecompile cannot capture this model: {site}: {why} ({kind}).\n  What to do: {hint}.\n"
        f"  (Dynamo: {kind}; set TORCHDYNAMO_VERBOSE=1 for its full trace.)"
    )


def _refusal_types() -> list[type[UnsupportedModelError]]:
    """`UnsupportedModelError` and its subclasses (Dynamo reports an exception the traced code
    raised by its type's name and arguments)."""
    found, stack = [], [UnsupportedModelError]
    while stack:
        c = stack.pop()
        found.append(c)
        stack.extend(c.__subclasses__())
    return found


_CALL_SITE = str(Path(__file__).resolve().parents[1] / "capture" / "call.py")
_BINDING = re.compile(r"missing \d* ?required|positional argument|unexpected keyword argument")


def _after(text: str, marker: str) -> str:
    i = text.find(marker)
    if i < 0:
        return ""
    rest = text[i + len(marker):].strip().splitlines()
    return rest[0].strip() if rest else ""


def _user_frame(lines: list[str]) -> tuple[str, str]:
    """``("file:line", code)`` of the innermost frame under "from user code:" outside treecompile."""
    try:
        start = next(i for i, ln in enumerate(lines) if ln.strip() == "from user code:")
    except StopIteration:
        return "", ""
    frames = []
    for i in range(start + 1, len(lines)):
        ln = lines[i].strip()
        if ln.startswith('File "'):
            path = ln.split('"')[1]
            lineno = ln.split("line ")[1].split(",")[0] if "line " in ln else "?"
            code = lines[i + 1].strip() if i + 1 < len(lines) else ""
            frames.append((f"{path}:{lineno}", code, path))
    ours = _package_dirs()
    outside = [f for f in frames if not any(f[2].startswith(d) for d in ours)]
    chosen = (outside or frames or [("", "", "")])[-1]
    return chosen[0], chosen[1]


def _package_dirs() -> list[str]:
    """Directories of treecompile's own code (its passes and kernels may live apart from it)."""
    import os
    import sys

    dirs = []
    for name in ("treecompile", "treecompile.passes", "treecompile.kernels"):
        mod = sys.modules.get(name)
        path = getattr(mod, "__file__", None)
        if path:
            dirs.append(os.path.dirname(path) + os.sep)
    return dirs


def unexpected_error(exc: BaseException, stage: str) -> UnsupportedModelError:
    """A refusal for an exception of no kind treecompile knows, raised while it compiled the
    rewritten graph (``stage``, e.g. "lowering with inductor"): the model is refused, not
    run unchecked; the original exception is chained to it."""
    first = (str(exc).strip().splitlines() or [""])[0]
    return UnsupportedModelError(
        f"treecompile cannot compile this model: {stage} failed ({type(exc).__name__}: {first}).\n"
        "  The graph was rewritten and checked; this step failed after that. If it names a kernel or a backend, "
        "tree_compile(backend='aot_eager') may run it; otherwise please report it (the exception it chains to has "
        "the full trace)."
    )


class BatchRefused(UnsupportedModelError):
    """A supported model refused on one batch, whose result the model itself leaves to chance
    (top-k scores that tie: which tied key ``torch.topk`` keeps changes with the row's length).
    Other batches run; the first-call probe skips a forest that hits it."""


class ConstantLength(UnsupportedModelError):
    """The captured graph holds the row count as a constant. The wrapper captures once more
    with the buffers exactly as long as the row extended (a lazily grown cache that an earlier
    call made that long: Dynamo takes the row count for the buffer's fixed size) before it
    refuses with this message."""


class CaptureFailed(Exception):
    """A failed capture, carrying its refusal (``error``)."""

    def __init__(self, error: UnsupportedModelError) -> None:
        super().__init__(str(error))
        self.error = error


def about_sizes(error: BaseException, rows: int) -> bool:
    """Whether a capture's ``error`` may come from a size (a slice, shape or index that the
    packed row's length breaks), not from a tensor's values deciding the control flow
    (``.tolist()``, ``.item()``, a branch on a tensor)."""
    text = str(error).lower()
    if any(w in text for w in ("values decide a size", "branches on a tensor's value", "data-dependent")):
        return False
    return re.search(rf"\b{rows}\b", text) is not None or re.search(
        r"\b(sizes?|shapes?|length|out of range|out of bounds|index)\b", text) is not None  # (not resize_)


def row_count_error(model: Any, rows: int, longest: int, error: UnsupportedModelError,
                     short: list) -> UnsupportedModelError:
    """``error``, or, if the batch has more rows than its longest path, a refusal that says how
    to run it: a model that checks or slices by the sequence length sees the packed row's length.
    A buffer shorter than the rows but as long as every path (``tril[:T, :T]``, ``cos[:T]``) is
    extended for the call (`short`); a capture that fails anyway names it. A refusal of a kind of
    its own (a subclass, which the wrapper acts on) is returned as it is."""
    if type(error) is not UnsupportedModelError:
        return error
    first, _, rest = str(error).partition("\n")
    about_length = about_sizes(error, rows)
    if short and about_length:
        module, attr, size = short[0]
        name = next((f"{n}.{attr}" if n else attr for n, m in model.named_modules() if m is module), attr)
        return UnsupportedModelError(
            f"treecompile cannot capture this model on a batch of {rows} rows: it slices buffer {name!r} "
            f"({size} entries) by the sequence length, and the packed row is longer than the buffer although "
            f"every path fits ({longest} tokens).\n"
            f"  What to do: pack at most {size} rows per batch (treecompile.planning.partition with that capacity), or "
            f"enlarge the buffer.\n  The capture failed with: {first}"
        )
    if rows > longest and about_length:
        return UnsupportedModelError(
            f"{first}\n  The batch packs {rows} rows and its longest path has {longest} tokens: a check or slice by "
            "the sequence length in the model sees the packed row's length. If the model runs each path alone, pack "
            f"fewer rows per batch (treecompile.planning.partition with a smaller capacity).\n{rest}"
        )
    return error
