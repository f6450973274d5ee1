"""Argument types and helpers shared by the ``treecompile`` subcommands.

Checked while parsing, before any command imports torch: a bad value costs no start-up
time. Kept apart from `treecompile.cli.main` so that the modules of the subcommands it
registers (`treecompile.cli.plan`, `treecompile.cli.inspect_cmd`) can use them without importing
the CLI back.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["load_config", "int_at_least", "por_value", "device_name", "require_plot", "check_output_file", "check_cuda",
           "output_console", "progress_bar"]

# Above this many trees, building them shows a progress bar (on stderr).
_PROGRESS_MIN_TREES = 20


def int_at_least(lo: int) -> Callable[[str], int]:
    """An argparse ``type``: an integer of at least ``lo``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < lo:
            raise argparse.ArgumentTypeError(f"must be at least {lo}, got {value}")
        return value

    parse.__name__ = f"integer >= {lo}"
    return parse


def por_value(text: str) -> float:
    """An argparse ``type``: a prefix overlap ratio, a number in [0, 1)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0.0 <= value < 1.0:  # also refuses nan
        raise argparse.ArgumentTypeError(
            f"a prefix overlap ratio must be in [0, 1) (POR = 1 - tree tokens / path tokens), got {text}"
        )
    return value


_DEVICE = re.compile(r"cpu|cuda(:\d+)?")


def device_name(text: str) -> str:
    """An argparse ``type``: ``cpu``, ``cuda`` or ``cuda:N`` (whether CUDA is present is checked later)."""
    if not _DEVICE.fullmatch(text):
        raise argparse.ArgumentTypeError(f"must be cpu, cuda or cuda:N, got {text!r}")
    return text


def _installed(module: str) -> bool:
    """Whether ``module`` can be imported, without importing it."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a blocked or half-removed module
        return False


def require_plot(option: str) -> None:
    """Raises ImportError naming the extra if matplotlib, which ``option`` needs, is missing."""
    if not _installed("matplotlib"):
        raise ImportError(f"{option} draws with matplotlib: pip install 'treecompile[plot]'")


def check_output_file(option: str, path: str, suffix: str, inputs: Sequence[str | None] = ()) -> Path:
    """``path`` checked as a file ``option`` will write, before any work: it ends in ``suffix``,
    its folder exists and is writable, and it is none of ``inputs`` (the command's input files,
    which writing would destroy). Returns it, with ``~`` expanded.

    Raises:
        ValueError: naming the option and what is wrong.
    """
    out = Path(path).expanduser()
    for given in inputs:
        if given is not None and Path(given).expanduser().exists() and out.exists() \
                and os.path.samefile(Path(given).expanduser(), out):
            raise ValueError(f"{option} {path} is the input file {given}: writing it would destroy it; "
                             "name another file")
    if out.is_dir():
        raise ValueError(f"{option} {path} is a folder; name a file *{suffix}")
    if out.suffix.lower() != suffix:
        raise ValueError(f"{option} {path}: the file written is a {suffix[1:].upper()}; name it *{suffix}")
    folder = out.parent if str(out.parent) else Path(".")
    if not folder.is_dir():
        raise ValueError(f"{option} {path}: the folder {folder} does not exist")
    if not os.access(folder, os.W_OK) or (out.exists() and not os.access(out, os.W_OK)):
        raise ValueError(f"{option} {path}: not writable")
    return out


def output_console() -> Any:
    """The console tables are printed on: a terminal's width on a terminal; elsewhere (a pipe, a
    log file) wide enough that no column is cut or wrapped (rich would assume 80 columns and
    cut numbers to ``97132…``)."""
    import sys

    from rich.console import Console

    return Console(highlight=False, width=None if sys.stdout.isatty() else 100_000)


def check_cuda(device: str | None) -> None:
    """Raises ValueError if ``device`` names CUDA and this torch cannot reach that device."""
    if device is None or not device.startswith("cuda"):
        return
    import torch

    if not torch.cuda.is_available():
        raise ValueError(
            f"--device {device}: no CUDA device is available (torch {torch.__version__}, "
            "torch.cuda.is_available() is False); use --device cpu"
        )
    index = int(device.partition(":")[2] or 0)
    if index >= torch.cuda.device_count():
        raise ValueError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)")


def progress_bar(label: str, total: int, *, min_total: int = _PROGRESS_MIN_TREES) -> Any:
    """A transient rich progress bar on stderr (``with bar: ... bar.advance(bar.task_ids[0])``).

    Shown only on a terminal and for at least ``min_total`` steps, so that piped output and
    error messages stay clean.
    """
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
        disable=total < min_total or not console.is_terminal,
    )
    progress.add_task(label, total=total)
    return progress


def load_config(value: str) -> tuple[Any, Any]:
    """``(path, config)`` of ``--config``: a Hugging Face config directory or its config.json,
    as a ``PretrainedConfig`` where transformers reads it (the cost model then finds q/k norms
    on a meta-device model), else its JSON dict.

    Raises:
        ValueError: no such file, or not JSON.
    """
    path = Path(value).expanduser()
    path = path / "config.json" if path.is_dir() else path
    if not path.is_file():
        raise ValueError(f"--config {value}: no such file (a Hugging Face config directory or config.json)")
    try:
        config: Any = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"--config {path} is not valid JSON: {exc}") from None
    try:
        import transformers

        config = transformers.AutoConfig.from_pretrained(str(path))
    except (ImportError, ValueError, KeyError):
        pass
    return path, config
