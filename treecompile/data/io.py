"""JSONL files of token sequences, conversations and trees, and detection of a file's kind.

Three JSONL layouts, one JSON object per line (``.gz`` files are read and written
compressed):

* **sequences**: ``{"input_ids": [...], "weight": 1.0, "loss_mask": [...], "group": "..."}``;
  only ``input_ids`` is required. Sequences with the same ``group`` form one tree.
* **conversations**: ``{"messages": [...], "group": "...", "weight": 1.0}``; OpenAI-format
  messages, rendered by :mod:`treecompile.chat.to_tree`.
* **trees**: one :meth:`TrajectoryTree.to_dict` per line (``"format": "treecompile.core.tree/1"``).

Example:
    >>> import tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "seqs.jsonl")
    >>> save_sequences(path, [SequenceRecord([1, 2, 3], group="a"), SequenceRecord([1, 2, 4], group="a")])
    2
    >>> trees = trees_from_sequences(load_sequences(path))
    >>> trees["a"].num_tokens
    4

:func:`detect_kind` tells these apart, and also the tau-bench / tau2 / GSM8K files that
:mod:`treecompile.chat.to_tree` reads, for the CLI.
"""

from __future__ import annotations

import gzip
import json
import math
import os
import secrets
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from treecompile.core.errors import TreeInputError
from treecompile.core.tree import TrajectoryTree

__all__ = [
    "FILE_KINDS",
    "UNGROUPED",
    "ConversationRecord",
    "SequenceRecord",
    "detect_kind",
    "group_records",
    "iter_jsonl",
    "load_conversations",
    "load_sequences",
    "load_trees",
    "save_conversations",
    "save_sequences",
    "save_trees",
    "trees_from_sequences",
    "write_jsonl",
]

#: What :func:`detect_kind` can answer.
FILE_KINDS = ("sequences", "conversations", "trees", "tau_bench", "tau2", "gsm8k")

#: The group of records that name none.
UNGROUPED = "ungrouped"


@dataclass
class SequenceRecord:
    """One token sequence of a sequences JSONL file.

    Attributes:
        input_ids: ``[T]`` token ids.
        weight: the path's loss weight.
        loss_mask: ``[T]`` 0/1, or None for all ones.
        group: sequences with the same group form one tree; None joins :data:`UNGROUPED`.
    """

    input_ids: list[int]
    weight: float = 1.0
    loss_mask: list[int] | None = None
    group: str | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"input_ids": [int(t) for t in self.input_ids]}
        if self.weight != 1.0:
            out["weight"] = float(self.weight)
        if self.loss_mask is not None:
            out["loss_mask"] = [int(m) for m in self.loss_mask]
        if self.group is not None:
            out["group"] = self.group
        return out


@dataclass
class ConversationRecord:
    """One conversation of a conversations JSONL file."""

    messages: list[dict[str, Any]]
    group: str | None = None
    weight: float = 1.0
    extra: dict[str, Any] = field(default_factory=dict)  # other keys, kept on a round trip

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"messages": self.messages}
        if self.group is not None:
            out["group"] = self.group
        if self.weight != 1.0:
            out["weight"] = float(self.weight)
        out.update(self.extra)
        return out


# ---------------------------------------------------------------------------- raw JSONL


def _open(path: str | Path, mode: str) -> IO[str]:
    # Read: UTF-8 with or without a byte-order mark (editors on Windows write one); written: without.
    encoding = "utf-8-sig" if mode == "r" else "utf-8"
    if str(path).endswith(".gz"):
        return gzip.open(path, mode + "t", encoding=encoding)  # type: ignore[return-value]
    return open(path, mode, encoding=encoding)


def _lines(f: IO[str], path: str | Path) -> Iterator[str]:
    """The lines of ``f``; a file that is not UTF-8 text is a `TreeInputError` naming it and the line."""
    while True:
        try:
            line = f.readline()
        except UnicodeDecodeError:
            raise TreeInputError(_not_text(path)) from None
        except OSError as exc:  # e.g. a .gz name on a file that is not gzip
            raise TreeInputError(f"{path}: cannot be read: {exc}") from None
        except EOFError:  # gzip data cut short (an interrupted download or copy)
            raise TreeInputError(f"{path}: the compressed file is truncated (it ends before its end-of-stream "
                                 "marker); copy or download it again") from None
        if not line:
            return
        yield line


def _not_text(path: str | Path) -> str:
    """Where the first byte that is not UTF-8 is (text files are decoded in chunks, so the
    error the decoder raises does not say which line)."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rb") as f:
        raw = f.read()
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        return (
            f"{path}:{line}: not a UTF-8 text file (byte 0x{raw[exc.start]:02x} at offset {exc.start}); "
            "expected JSON or JSONL"
        )
    return f"{path}: not a UTF-8 text file; expected JSON or JSONL"


def iter_jsonl(path: str | Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yields ``(line number, object)`` for each non-blank line.

    Raises:
        TreeInputError: on a line that is not a JSON object, naming the file and line.
    """
    with _open(path, "r") as f:
        for n, line in enumerate(_lines(f, path), start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line.rstrip("\r\n"))  # columns count on this line, not the next
            except json.JSONDecodeError as exc:
                # exc.msg alone can end mid-sentence ("Invalid control character at"): say where.
                raise TreeInputError(f"{path}:{n}: not valid JSON ({exc.msg.removesuffix(' at')} at column "
                                     f"{exc.colno})") from None
            if not isinstance(obj, dict):
                raise TreeInputError(f"{path}:{n}: expected a JSON object, got {type(obj).__name__}")
            yield n, obj


def write_jsonl(path: str | Path, objects: Iterable[dict[str, Any]]) -> int:
    """Writes one compact JSON object per line; returns the number written."""
    n = 0
    with _open(path, "w") as f:
        for obj in objects:
            f.write(json.dumps(obj, ensure_ascii=False, separators=(",", ":")))
            f.write("\n")
            n += 1
    return n


def write_text_atomic(path: str | Path, text: str) -> None:
    """Writes ``text`` to ``path`` whole or not at all: a file beside it, then renamed over it.

    A run stopped mid-write (Ctrl-C, a killed job) leaves the previous version, never half a file.
    """
    path = Path(path)
    tmp = path.parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    # Created as open() creates a file (mode 0o666 less the umask), never over another one.
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json(path: str | Path, obj: Any) -> None:
    """``obj`` as indented JSON, written by :func:`write_text_atomic`."""
    write_text_atomic(path, json.dumps(obj, indent=2) + "\n")


# ---------------------------------------------------------------------------- sequences


def load_sequences(path: str | Path) -> list[SequenceRecord]:
    """Reads a sequences JSONL file.

    Raises:
        TreeInputError: on a line without ``input_ids`` or with fields of the wrong type.
    """
    out = []
    for n, obj in iter_jsonl(path):
        ids = obj.get("input_ids")
        if not isinstance(ids, list):
            raise TreeInputError(f"{path}:{n}: expected an 'input_ids' list")
        mask = obj.get("loss_mask")
        if mask is not None and (not isinstance(mask, list) or len(mask) != len(ids)):
            raise TreeInputError(f"{path}:{n}: 'loss_mask' must be a list as long as 'input_ids' ({len(ids)})")
        ids, mask = _hf_keys(path, n, obj, ids, mask)
        weight = obj.get("weight", 1.0)
        if not isinstance(weight, (int, float)) or isinstance(weight, bool) or not math.isfinite(weight) or weight < 0:
            raise TreeInputError(f"{path}:{n}: 'weight' must be a finite number >= 0, got {weight!r}")
        _check_sequence_line(path, n, ids, mask)
        group = obj.get("group")
        out.append(SequenceRecord(ids, float(weight), mask, None if group is None else str(group)))
    return out


def _hf_keys(path: str | Path, n: int, obj: dict[str, Any], ids: list[Any], mask: list[Any] | None
             ) -> tuple[list[Any], list[Any] | None]:
    """A line's Hugging Face-style ``labels`` and ``attention_mask``, honoured where their
    meaning is clear (`treecompile.core.padded_rows.record_span`: ``attention_mask`` 0 at the ends is
    padding, dropped; ``labels`` -100 is a token not trained, the loss mask); anything else is
    refused naming the line, as are labels that disagree with a ``loss_mask``."""
    from treecompile.core.padded_rows import IGNORE_INDEX, record_span

    labels, attn = obj.get("labels"), obj.get("attention_mask")
    if labels is None and attn is None:
        return ids, mask
    for key, value in (("labels", labels), ("attention_mask", attn)):
        if value is not None and (not isinstance(value, list) or not all(
                isinstance(v, int) and not isinstance(v, bool) for v in value)):
            raise TreeInputError(f"{path}:{n}: '{key}' must be a list of integers")
    span = record_span(ids, labels, attn, f"{path}:{n}")
    ids, mask = ids[span], None if mask is None else mask[span]
    if labels is None:
        return ids, mask
    from_labels = [0 if lab == IGNORE_INDEX else 1 for lab in labels[span]]
    if mask is not None and [int(bool(m)) for m in mask][1:] != from_labels[1:]:
        raise TreeInputError(f"{path}:{n}: 'labels' and 'loss_mask' disagree on which tokens are trained")
    return ids, from_labels


def _check_sequence_line(path: str | Path, n: int, ids: list[Any], mask: list[Any] | None) -> None:
    """The checks `TrajectoryTree.from_sequences` makes, here where the file line is known."""
    from treecompile.core.tree_build import as_mask_array, as_token_array

    try:
        arr = as_token_array(ids, 0, None)
        if mask is not None:
            as_mask_array(mask, 0, len(arr))
    except TreeInputError as exc:
        # The tree's messages say "sequence 0" / "loss_masks[0]"; here the line says which.
        text = str(exc).replace("sequence 0: ", "'input_ids': ", 1).replace("loss_masks[0]: ", "'loss_mask': ", 1)
        raise TreeInputError(f"{path}:{n}: {text}") from None


def save_sequences(path: str | Path, records: Iterable[SequenceRecord | dict[str, Any]]) -> int:
    """Writes sequence records (or dicts with the same keys); returns how many."""
    return write_jsonl(path, (r.to_json() if isinstance(r, SequenceRecord) else SequenceRecord(**r).to_json() for r in records))


def group_records(records: Iterable[Any]) -> dict[str, list[Any]]:
    """Groups records by their ``group`` attribute, in order of first appearance."""
    groups: dict[str, list[Any]] = {}
    for r in records:
        groups.setdefault(UNGROUPED if r.group is None else r.group, []).append(r)
    return groups


def trees_from_sequences(
    records: Sequence[SequenceRecord], *, vocab_size: int | None = None
) -> dict[str, TrajectoryTree]:
    """One tree per group of sequence records (ungrouped ones together under :data:`UNGROUPED`)."""
    out = {}
    for name, group in group_records(records).items():
        out[name] = TrajectoryTree.from_sequences(
            [r.input_ids for r in group],
            weights=[r.weight for r in group],
            loss_masks=[r.loss_mask for r in group],
            vocab_size=vocab_size,
            metadata={"group": name},
        )
    return out


# ---------------------------------------------------------------------------- conversations


def load_conversations(path: str | Path) -> list[ConversationRecord]:
    """Reads a conversations JSONL file (``{"messages": [...], "group": ..., "weight": ...}``)."""
    out = []
    for n, obj in iter_jsonl(path):
        messages = obj.get("messages")
        if not isinstance(messages, list) or not messages:
            raise TreeInputError(f"{path}:{n}: expected a non-empty 'messages' list")
        stray = [k for k in ("labels", "attention_mask", "loss_mask", "input_ids") if k in obj]
        if stray:
            raise TreeInputError(
                f"{path}:{n}: a conversation line with {', '.join(map(repr, stray))}: it would not be read (what a "
                "conversation trains comes from its roles: the assistant's turns); give tokenized lines "
                "('input_ids' with 'labels' or 'loss_mask') instead")
        group = obj.get("group")
        weight = obj.get("weight", 1.0)
        if not isinstance(weight, (int, float)) or isinstance(weight, bool) or not math.isfinite(weight) or weight < 0:
            raise TreeInputError(f"{path}:{n}: 'weight' must be a finite number >= 0, got {weight!r}")
        _check_conversation_line(path, n, messages)
        extra = {k: v for k, v in obj.items() if k not in ("messages", "group", "weight")}
        out.append(ConversationRecord(messages, None if group is None else str(group), float(weight), extra))
    return out


def _check_conversation_line(path: str | Path, n: int, messages: list[Any]) -> None:
    """The message checks of `treecompile.chat.to_tree`, here where the file line is known."""
    from treecompile.chat.to_tree import normalize_conversation

    try:
        normalize_conversation(messages, index=0)
    except TreeInputError as exc:
        text = str(exc).replace("conversation 0, ", "", 1).replace("conversation 0: ", "", 1)
        raise TreeInputError(f"{path}:{n}: {text}") from None


def save_conversations(path: str | Path, records: Iterable[ConversationRecord | Sequence[dict[str, Any]]]) -> int:
    """Writes conversation records (or bare message lists); returns how many."""

    def as_json(r: Any) -> dict[str, Any]:
        return r.to_json() if isinstance(r, ConversationRecord) else {"messages": list(r)}

    return write_jsonl(path, (as_json(r) for r in records))


# ---------------------------------------------------------------------------- trees


def load_trees(path: str | Path) -> list[TrajectoryTree]:
    """Reads a trees JSONL file (one :meth:`TrajectoryTree.to_dict` per line), or a JSON
    file holding one tree."""
    if not _is_jsonl(path):
        with _open(path, "r") as f:
            objects: Iterable[tuple[int, Any]] = [(1, json.load(f))]
    else:
        objects = iter_jsonl(path)
    out = []
    for n, obj in objects:
        try:
            out.append(TrajectoryTree.from_dict(obj))
        except TreeInputError as exc:
            raise TreeInputError(f"{path}:{n}: {exc}") from None
        except (KeyError, TypeError) as exc:
            raise TreeInputError(f"{path}:{n}: malformed tree ({type(exc).__name__}: {exc})") from None
    return out


def save_trees(path: str | Path, trees: Iterable[TrajectoryTree]) -> int:
    """Writes one tree per line; returns how many."""
    return write_jsonl(path, (t.to_dict() for t in trees))


# ---------------------------------------------------------------------------- detection


def detect_kind(path: str | Path) -> str:
    """Which of :data:`FILE_KINDS` a file holds, judged from its first record.

    Raises:
        TreeInputError: if the file is empty or none of the kinds matches.
    """
    first_line = ""
    with _open(path, "r") as f:
        for line in _lines(f, path):
            if line.strip():
                first_line = line
                break
    if not first_line:
        raise TreeInputError(f"{path}: the file is empty")
    try:
        obj = json.loads(first_line)
    except json.JSONDecodeError:
        obj = None  # not one object per line: a (pretty-printed) JSON document
    if obj is None or isinstance(obj, list):
        try:
            with _open(path, "r") as f:
                data = json.loads("".join(_lines(f, path)))
        except json.JSONDecodeError as exc:
            raise TreeInputError(f"{path}: neither JSON nor JSONL ({exc.msg} at line {exc.lineno})") from None
        if isinstance(data, list) and data and isinstance(data[0], dict) and "traj" in data[0]:
            return "tau_bench"
        if isinstance(data, dict) and "simulations" in data:
            return "tau2"
        if isinstance(data, dict) and str(data.get("format", "")).startswith("treecompile.core.tree/"):
            return "trees"  # a single tree written as a plain JSON file
        raise TreeInputError(
            f"{path}: a JSON document that is neither a tau-bench trajectory list nor a tau2 simulation file"
        )
    if not isinstance(obj, dict):
        raise TreeInputError(f"{path}: the first line is not a JSON object")
    if "simulations" in obj:
        return "tau2"
    if "input_ids" in obj:
        return "sequences"
    if "messages" in obj:
        return "conversations"
    if str(obj.get("format", "")).startswith("treecompile.core.tree/"):
        return "trees"
    if "question" in obj and "175b_verification" in obj:
        return "gsm8k"
    raise TreeInputError(
        f"{path}: cannot tell the kind of this JSONL file from its first line (keys {sorted(obj)[:8]}); "
        "expected 'input_ids' (sequences), 'messages' (conversations) or 'format' (trees)"
    )


def _is_jsonl(path: str | Path) -> bool:
    """True if the first non-blank line is a whole JSON value (one record per line)."""
    with _open(path, "r") as f:
        for line in f:
            if line.strip():
                try:
                    json.loads(line)
                except json.JSONDecodeError:
                    return False
                return True
    return True
