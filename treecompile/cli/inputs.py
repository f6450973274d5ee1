"""The input files of ``treecompile stats`` and ``treecompile plan``, read the same way for both.

A file (or a bundled sample, ``sample:NAME``) of any kind `treecompile.data.io.detect_kind` knows
is read into groups of records, one group per tree to build (a tau-bench / tau2 task, the
``group`` field of JSONL records, or everything with ``--group-by all``), and each group is
built into a `TrajectoryTree` with the command's chat options. :func:`load_input_trees` does
all of it from the parsed arguments.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from treecompile.cli.args import progress_bar
from treecompile.core.errors import TreeInputError
from treecompile.data.io import detect_kind, group_records, load_conversations, load_sequences, load_trees

__all__ = ["CHAT_KINDS", "DEFAULT_CHAT_TOKENIZER", "Group", "InputTrees", "load_input_trees"]

#: File kinds that hold chat conversations, built into trees with a tokenizer.
CHAT_KINDS = ("conversations", "tau_bench", "tau2", "gsm8k")
#: The tokenizer of chat input when ``--tokenizer`` names none (a base dependency: tiktoken).
DEFAULT_CHAT_TOKENIZER = "cl100k"


@dataclass
class Group:
    """One tree to build: a name and what it is built from."""

    name: str
    conversations: list[Any] = field(default_factory=list)
    weights: list[float] = field(default_factory=list)
    sequences: list[Any] = field(default_factory=list)  # SequenceRecord
    trees: list[Any] = field(default_factory=list)  # TrajectoryTree, merged if several

    @property
    def size(self) -> int:
        return len(self.conversations) + len(self.sequences) + len(self.trees)


def resolve_file(spec: str) -> Path:
    if spec.startswith("sample:"):
        from treecompile.data.samples import sample_path

        return sample_path(spec[len("sample:") :])
    if spec == "-":
        return _spooled(sys.stdin.buffer, "stdin")
    path = Path(spec).expanduser()
    if path.is_dir():
        raise TreeInputError(f"{spec} is a directory; expected a data file (JSON or JSONL)")
    if not path.exists():
        raise TreeInputError(f"no such file: {spec}")
    if not path.is_file():  # a FIFO, /dev/stdin, a process substitution: read once, here
        try:
            with open(path, "rb") as f:
                return _spooled(f, path.name)
        except OSError as e:
            raise TreeInputError(f"{spec}: cannot be read ({e.strerror})") from None
    return path


def _spooled(stream: Any, name: str) -> Path:
    """The bytes of ``stream`` (standard input, a FIFO) in a file of their own, named ``name``
    (``.gz`` added for gzip data): the readers look at a file more than once. The file is
    removed when the process exits."""
    import atexit
    import shutil
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="treecompile-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    data = stream.read()
    if not data:
        raise TreeInputError(f"{name}: no data (an empty input)")
    path = folder / (name + (".gz" if data[:2] == b"\x1f\x8b" and not name.endswith(".gz") else ""))
    path.write_bytes(data)
    return path


def read_groups(path: Path, kind: str) -> list[Group]:
    from treecompile.data import datasets

    if kind == "tau_bench":
        return [Group(str(k), conversations=v, weights=[1.0] * len(v)) for k, v in datasets.load_tau_bench(path).items()]
    if kind == "tau2":
        return [Group(str(k), conversations=v, weights=[1.0] * len(v)) for k, v in datasets.load_tau2(path).items()]
    if kind == "gsm8k":
        return [
            Group(k, conversations=v, weights=[1.0] * len(v)) for k, v in datasets.load_gsm8k_solutions(path).items()
        ]
    if kind == "conversations":
        return [
            Group(k, conversations=[r.messages for r in rs], weights=[r.weight for r in rs])
            for k, rs in group_records(load_conversations(path)).items()
        ]
    if kind == "sequences":
        return [Group(k, sequences=rs) for k, rs in group_records(load_sequences(path)).items()]
    if kind == "trees":
        trees = load_trees(path)
        return [Group(str(t.metadata.get("group", f"tree-{i}")), trees=[t]) for i, t in enumerate(trees)]
    raise TreeInputError(f"{path}: unsupported file kind {kind!r}")


def build_tree(group: Group, args: argparse.Namespace, tokenizer: Any) -> Any:
    from treecompile.chat.to_tree import tree_from_messages
    from treecompile.core.tree import TrajectoryTree

    if group.conversations:
        return tree_from_messages(
            group.conversations,
            tokenizer,
            samples=args.samples,
            think=args.think,
            normalize_tool_call_ids=not args.keep_tool_call_ids,
            on_drift="ignore",  # summarized once for the whole file below
            weights=group.weights,
        )
    if group.sequences:
        rs = group.sequences
        if not any(len(r.input_ids) for r in rs):
            raise TreeInputError(f"group {group.name!r}: every sequence is empty ({len(rs)} of them): a tree needs "
                                 "at least one token")
        return TrajectoryTree.from_sequences(
            [r.input_ids for r in rs], weights=[r.weight for r in rs], loss_masks=[r.loss_mask for r in rs]
        )
    if len(group.trees) == 1:
        return group.trees[0]
    paths = [p for t in group.trees for p in t.paths()]
    return TrajectoryTree.from_sequences(
        [p.tokens for p in paths], weights=[p.weight for p in paths], loss_masks=[p.loss_mask for p in paths]
    )


def merge_groups(groups: list[Group]) -> Group:
    out = Group("all")
    for g in groups:
        out.conversations += g.conversations
        out.weights += g.weights
        out.sequences += g.sequences
        out.trees += g.trees
    return out


def build_all(groups: list[Group], args: argparse.Namespace, tokenizer: Any) -> list[Any]:
    progress = progress_bar("building trees", len(groups))
    trees = []
    with progress:
        for g in groups:
            trees.append(build_tree(g, args, tokenizer))
            progress.advance(progress.task_ids[0])
    return trees


@dataclass
class InputTrees:
    """What :func:`load_input_trees` read and built.

    Attributes:
        path: the file read.
        kind: its kind, as `treecompile.data.io.detect_kind` names it.
        tokenizer: the tokenizer of chat input (None for token ids and trees).
        names: ``[T]`` the name of each tree's group.
        trees: ``[T]`` the trees.
        records: records read, before grouping and ``--limit``.
        seconds: time spent reading and building (the tokenizer's loading left out).
    """

    path: Path
    kind: str
    tokenizer: Any
    names: list[str]
    trees: list[Any]
    records: int
    seconds: float


def load_input_trees(args: argparse.Namespace) -> InputTrees:
    """Reads ``args.file`` and builds its trees, grouped by ``args.group_by``, at most ``args.limit``."""
    from treecompile.chat.tokenizer import chat_tokenizer

    path = resolve_file(args.file)
    kind = detect_kind(path)
    # A tokenizer folder with a chat template renders chats by it, as training does.
    tokenizer = chat_tokenizer(args.tokenizer or DEFAULT_CHAT_TOKENIZER) if kind in CHAT_KINDS else None
    start = time.perf_counter()
    groups = read_groups(path, kind)
    records = sum(g.size for g in groups)
    if args.group_by == "all":
        groups = [merge_groups(groups)]
    if args.limit is not None:
        if args.limit < 1:
            raise ValueError(f"--limit must be at least 1, got {args.limit}")
        groups = groups[: args.limit]
    trees = build_all(groups, args, tokenizer)
    return InputTrees(path, kind, tokenizer, [g.name for g in groups], trees, records, time.perf_counter() - start)
