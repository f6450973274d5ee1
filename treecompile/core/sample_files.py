"""Where the bundled sample files are (``treecompile/samples/``; read by `treecompile.data.samples`).

The sample tokenizer is one of them (``load_tokenizer("sample")``), which is why the
lookup lives in the core layer.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["SAMPLE_FILES", "sample_path"]

#: Short names of the sample files, as the CLI accepts them (``sample:tau_bench``).
SAMPLE_FILES = {
    "tau_bench": "tau_bench_airline_sample.json",
    "gsm8k": "gsm8k_sample.jsonl",
    "think": "tau2_airline_think_sample.jsonl",
    "tokenizer": "sample-tokenizer.json",
}


def sample_path(name: str) -> Path:
    """The path of a bundled file, by file name or short name (see :data:`SAMPLE_FILES`).

    Raises:
        ValueError: for a name that is not bundled.
    """
    filename = SAMPLE_FILES.get(name, name)
    if filename not in SAMPLE_FILES.values():
        raise ValueError(f"no sample file {name!r}; expected one of {', '.join(SAMPLE_FILES)}")
    # Installed as plain files (setuptools package data): treecompile/samples/ beside core/.
    return Path(__file__).resolve().parent.parent / "samples" / filename
