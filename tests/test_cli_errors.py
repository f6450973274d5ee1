"""Bad input to the CLI: one line on stderr, exit status 2, no traceback, before anything heavy loads."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from treecompile.cli.main import main
from treecompile.core.advice import TreeWarning

ROOT = Path(__file__).resolve().parents[1]


def run(argv: list[str], capsys) -> tuple[int, str]:
    """``main(argv)``'s exit status and stderr; argument errors exit through argparse."""
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    captured = capsys.readouterr()
    return code, captured.err


def assert_one_line(code: int, err: str, expected: str) -> None:
    assert "Traceback" not in err, err
    assert err.count("\n") == 1 and err.endswith("\n"), f"expected one line on stderr, got:\n{err}"
    assert err.rstrip("\n") == expected
    assert code == 2


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["bench", "--paths", "0"],
         "treecompile bench: error: argument --paths: must be at least 2, got 0 (see treecompile bench --help)"),
        (["bench", "--paths", "two"],
         "treecompile bench: error: argument --paths: expected an integer, got 'two' (see treecompile bench --help)"),
        (["bench", "--device", "tpu"],
         "treecompile bench: error: argument --device: must be cpu, cuda or cuda:N, got 'tpu' "
         "(see treecompile bench --help)"),
        (["bench", "--por", "1.5"],
         "treecompile bench: error: argument --por: a prefix overlap ratio must be in [0, 1) "
         "(POR = 1 - tree tokens / path tokens), got 1.5 (see treecompile bench --help)"),
        (["bench", "--por", "nan"],
         "treecompile bench: error: argument --por: a prefix overlap ratio must be in [0, 1) "
         "(POR = 1 - tree tokens / path tokens), got nan (see treecompile bench --help)"),
        (["bench", "--repeats", "0"],
         "treecompile bench: error: argument --repeats: must be at least 1, got 0 (see treecompile bench --help)"),
        (["stats", "sample:gsm8k", "--limit", "0"],
         "treecompile stats: error: argument --limit: must be at least 1, got 0 (see treecompile stats --help)"),
        (["plan", "sample:gsm8k", "--ranks", "0"],
         "treecompile plan: error: argument --ranks: must be at least 1, got 0 (see treecompile plan --help)"),
        (["plan", "sample:gsm8k", "--capacity", "-5"],
         "treecompile plan: error: argument --capacity: must be at least 1, got -5 (see treecompile plan --help)"),
        (["inspect", "x.json", "--png-cell", "0"],
         "treecompile inspect: error: argument --png-cell: must be at least 1, got 0 (see treecompile inspect --help)"),
    ],
    ids=["paths-0", "paths-word", "device-tpu", "por-1.5", "por-nan", "repeats-0", "limit-0", "ranks-0",
         "capacity-negative", "png-cell-0"],
)
def test_bad_arguments(argv, expected, capsys):
    assert_one_line(*run(argv, capsys), expected)


def test_a_bad_choice_is_one_line(capsys):
    # argparse's own wording of the choices differs between Python versions; the line's shape does not.
    code, err = run(["stats", "sample:gsm8k", "--samples", "turns"], capsys)
    assert_one_line(code, err, err.rstrip("\n"))
    assert err.startswith("treecompile stats: error: argument --samples: invalid choice: 'turns'")
    assert err.endswith("(see treecompile stats --help)\n")


def test_bad_arguments_are_refused_before_torch_is_imported():
    # Each case in a fresh interpreter would cost a second of start-up; one interpreter checks all.
    cases = [["bench", "--paths", "0"], ["bench", "--device", "tpu"], ["bench", "--por", "1.5"],
             ["bench", "--repeats", "0"], ["stats", "sample:gsm8k", "--limit", "0"], ["plan", "x", "--ranks", "0"],
             ["stats", str(ROOT)]]
    code = (
        "import contextlib, io, sys\n"
        "from treecompile.cli.main import main\n"
        f"for argv in {cases!r}:\n"
        "    with contextlib.redirect_stderr(io.StringIO()):\n"
        "        try:\n"
        "            code = main(argv)\n"
        "        except SystemExit as exc:\n"
        "            code = exc.code\n"
        "    assert code == 2, (argv, code)\n"
        "    heavy = [m for m in ('torch', 'transformers') if m in sys.modules]\n"
        "    assert not heavy, (argv, heavy)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=120)


def test_cuda_requested_without_cuda(monkeypatch, capsys):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, err = run(["bench", "--tiny", "--device", "cuda"], capsys)
    assert_one_line(
        code, err,
        f"treecompile bench: error: --device cuda: no CUDA device is available (torch {torch.__version__}, "
        "torch.cuda.is_available() is False); use --device cpu",
    )


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--paths", "300"], "treecompile bench: error: --path-tokens 512 over --paths 300 leaves 1 token(s) a "
                             "path; every path needs at least 2"),
        (["--por", "0.9"], "treecompile bench: error: POR (--por) 0.9 cannot be reached by 4 paths of 128 tokens "
                           "(at most 0.744: every path keeps one token of its own)"),
    ],
    ids=["paths-too-many-for-tokens", "por-unreachable"],
)
def test_bench_options_that_do_not_fit_together(argv, expected, capsys):
    assert_one_line(*run(["bench", "--tiny", *argv], capsys), expected)


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["bench", "--quick", "--tiny"],
         "treecompile bench: error: argument --tiny: not allowed with argument --quick (see treecompile bench --help)"),
        (["bench", "--markdown", "--json"],
         "treecompile bench: error: argument --json: not allowed with argument --markdown "
         "(see treecompile bench --help)"),
        (["plan", "sample:gsm8k", "--dtype", "float32"],
         "treecompile plan: error: --dtype describes the step that --budget-bytes is measured on, and no "
         "--budget-bytes was given: add it, or leave it out"),
        (["plan", "sample:gsm8k", "--config", "x", "--optimizer", "sgd"],
         "treecompile plan: error: --config, --optimizer describe the step that --budget-bytes is measured on, and "
         "no --budget-bytes was given: add it, or leave it out"),
        (["plan", "sample:gsm8k", "--cp-align", "64"],
         "treecompile plan: error: --cp-align sets where a context-parallel split cuts the row: give it with --cp"),
    ],
    ids=["quick-and-tiny", "markdown-and-json", "dtype-without-budget", "config-without-budget",
         "cp-align-without-cp"],
)
def test_options_that_would_be_ignored_or_conflict_are_refused(argv, expected, capsys):
    assert_one_line(*run(argv, capsys), expected)


def test_more_ranks_than_paths_is_said(capsys):
    code, err = run(["plan", "sample:gsm8k", "--tokenizer", "bytes", "--ranks", "1000", "--capacity", "4000"], capsys)
    assert code == 0
    assert "treecompile plan: warning: --ranks 1000 is more than the 120 paths: 880 ranks get no work" in err, err


def test_a_directory_as_data_file(tmp_path, capsys):
    for command in ("stats", "plan"):
        code, err = run([command, str(tmp_path)], capsys)
        assert_one_line(code, err, f"treecompile {command}: error: {tmp_path} is a directory; "
                                   "expected a data file (JSON or JSONL)")


def test_a_missing_file(tmp_path, capsys):
    missing = tmp_path / "nope.jsonl"
    assert_one_line(*run(["stats", str(missing)], capsys), f"treecompile stats: error: no such file: {missing}")


def test_a_binary_file_is_named(tmp_path, capsys):
    png = tmp_path / "picture.png"
    png.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")
    assert_one_line(
        *run(["stats", str(png)], capsys),
        f"treecompile stats: error: {png}:1: not a UTF-8 text file (byte 0x89 at offset 0); expected JSON or JSONL",
    )
    # The bad byte on a later line: the line is found although text is decoded in chunks.
    half = tmp_path / "half.jsonl"
    half.write_bytes(b'{"input_ids": [1, 2, 3]}\n{"input_ids": [1, 2, 4]}\n\xff\xfe\n')
    assert_one_line(
        *run(["stats", str(half)], capsys),
        f"treecompile stats: error: {half}:3: not a UTF-8 text file (byte 0xff at offset 50); expected JSON or JSONL",
    )


def test_a_gz_name_on_a_file_that_is_not_gzip(tmp_path, capsys):
    fake = tmp_path / "seqs.jsonl.gz"
    fake.write_text('{"input_ids": [1]}\n')
    assert_one_line(
        *run(["stats", str(fake)], capsys),
        f"treecompile stats: error: {fake}: cannot be read: Not a gzipped file (b'{{\"')",
    )


@pytest.mark.parametrize(
    "bad_line, message",
    [
        ('{"input_ids": [1, "x", 4], "group": "b"}', "'input_ids': token ids must be integers, got dtype <U21"),
        ('{"input_ids": [1, -5, 4], "group": "b"}', "'input_ids': negative token id -5 at position 1"),
        ('{"input_ids": [1, 2], "loss_mask": [1, 2], "group": "b"}',
         "'loss_mask': values must be 0 or 1; position 1 holds 2"),
        ('{"input_ids": [1, 2], "weight": "heavy", "group": "b"}', "'weight' must be a finite number >= 0, got 'heavy'"),
        ('{"input_ids": [1, 2], "weight": NaN, "group": "b"}', "'weight' must be a finite number >= 0, got nan"),
        ('{"input_ids": [1, 2], "weight": -1, "group": "b"}', "'weight' must be a finite number >= 0, got -1"),
        ('{"input_ids": [1, 2], "group": "b"', "not valid JSON (Expecting ',' delimiter at column 35)"),
        ('{"input_ids": [1, 2], "group": "b\tc"}', "not valid JSON (Invalid control character at column 34)"),
    ],
    ids=["string-token", "negative-token", "mask-value", "weight", "nan-weight", "negative-weight",
         "broken-json", "control-character"],
)
def test_a_bad_line_in_grouped_jsonl_names_file_and_line(bad_line, message, tmp_path, capsys):
    path = tmp_path / "grouped.jsonl"
    path.write_text('{"input_ids": [1, 2, 3], "group": "a"}\n{"input_ids": [1, 2, 4], "group": "a"}\n\n'
                    f"{bad_line}\n")
    for command in ("stats", "plan"):
        assert_one_line(*run([command, str(path)], capsys), f"treecompile {command}: error: {path}:4: {message}")


def test_capacity_advice_covers_every_tree(capsys):
    from treecompile.chat.to_tree import tree_from_messages
    from treecompile.data.samples import sample_gsm8k
    from treecompile.planning.partition import path_lengths

    trees = {k: tree_from_messages(v, "bytes") for k, v in sample_gsm8k().items()}
    longest = {k: int(path_lengths(t).max()) for k, t in trees.items()}
    capacity = sorted(longest.values())[-4]  # three trees have a longer path, not only the first
    over = {k: m for k, m in longest.items() if m > capacity}
    n_paths = sum(int((path_lengths(trees[k]) > capacity).sum()) for k in over)
    shown = ", ".join(
        f"{k} ({int((path_lengths(trees[k]) > capacity).sum())} path(s), longest {m})"
        for k, m in sorted(over.items(), key=lambda kv: -kv[1])
    )
    code, err = run(["plan", "sample:gsm8k", "--tokenizer", "bytes", "--capacity", str(capacity)], capsys)
    assert_one_line(
        code, err,
        f"treecompile plan: error: --capacity {capacity}: 3 of {len(trees)} trees have paths longer than C "
        f"({n_paths} of {sum(t.num_paths for t in trees.values())} paths; a path is never split): {shown}. "
        f"--capacity {max(longest.values())} fits every path of every tree.",
    )


@pytest.mark.parametrize(
    "bad_line, message",
    [
        ('{"messages": [{"role": "user", "content": 5}], "group": "b"}',
         "message 0: content must be a string, a list of text parts or null, got int"),
        ('{"messages": ["just text"], "group": "b"}', "message 0: expected a dict, got str"),
        ('{"messages": [{"role": "user", "content": "hi"}, {"content": "no role"}], "group": "b"}',
         "message 1: unknown role None; expected one of ['assistant', 'developer', 'function', 'system', 'tool', "
         "'user']"),
        ('{"messages": [], "group": "b"}', "expected a non-empty 'messages' list"),
    ],
    ids=["content-int", "message-str", "no-role", "empty"],
)
def test_a_bad_line_in_grouped_conversations_names_file_and_line(bad_line, message, tmp_path, capsys):
    good = '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}], "group": "a"}'
    path = tmp_path / "chats.jsonl"
    path.write_text(f"{good}\n{good}\n{bad_line}\n")
    assert_one_line(*run(["stats", str(path), "--tokenizer", "bytes"], capsys),
                    f"treecompile stats: error: {path}:3: {message}")


@pytest.mark.parametrize("content", [b"\x00\x01binary", b'{"model_type": "qwen3"}', b""],
                         ids=["binary", "a-model-config", "empty"])
def test_a_file_that_is_not_a_tokenizer_is_one_line(tmp_path, capsys, content):
    path = tmp_path / "tok.json"
    path.write_bytes(content)
    code, err = run(["stats", "sample:gsm8k", "--tokenizer", str(path)], capsys)
    assert code == 2 and "Traceback" not in err and err.count("\n") == 1, err
    assert err.startswith(f"treecompile stats: error: {path} is not a tokenizer file (a Hugging Face tokenizer.json)")


def test_a_utf8_file_with_a_byte_order_mark_is_read(tmp_path, capsys):
    path = tmp_path / "bom.jsonl"
    path.write_bytes("\ufeff".encode() + b'{"input_ids": [1, 2, 3], "group": "a"}\n{"input_ids": [1, 2, 4], "group": "a"}\n')
    code, err = run(["stats", str(path), "--json"], capsys)
    assert code == 0 and err == "", err



def test_standard_input_and_a_fifo_are_read(tmp_path):
    """``stats -`` reads standard input and ``stats FIFO`` a named pipe (any readable file, not
    only regular ones), gzip included: the same table as from the file."""
    import gzip
    import os
    import subprocess
    import sys
    import threading

    from treecompile.data.samples import sample_path

    data = sample_path("gsm8k").read_bytes()
    cmd = [sys.executable, "-m", "treecompile", "stats", "--json"]
    want = subprocess.run([*cmd, str(sample_path("gsm8k"))], capture_output=True, check=True).stdout
    got = subprocess.run([*cmd, "-"], input=gzip.compress(data), capture_output=True, check=True).stdout
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    writer = threading.Thread(target=fifo.write_bytes, args=(data,))
    writer.start()
    piped = subprocess.run([*cmd, str(fifo)], capture_output=True, check=True).stdout
    writer.join()
    strip = lambda out: {k: v for k, v in json.loads(out).items() if k not in ("file", "seconds", "built_seconds")}  # noqa: E731
    assert strip(got) == strip(want) == strip(piped)


def test_a_truncated_gzip_file_is_one_line(tmp_path, capsys):
    import gzip

    from treecompile.data.samples import sample_path

    data = gzip.compress(sample_path("gsm8k").read_bytes())
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(data[: len(data) // 2])
    assert_one_line(*run(["stats", str(cut)], capsys), f"treecompile stats: error: {cut}: the compressed file is "
                    "truncated (it ends before its end-of-stream marker); copy or download it again")


def test_a_tau2_simulation_without_messages_is_one_line(tmp_path, capsys):
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    bad = tmp_path / "tau2.json"
    bad.write_text(json.dumps({"simulations": [{"task_id": "1", "trial": 0, "messages": msgs},
                                               {"task_id": "1", "trial": 1}]}))
    assert_one_line(*run(["stats", str(bad)], capsys),
                    f"treecompile stats: error: {bad}: simulation 1 (task '1') has no 'messages' list")
    bad.write_text(json.dumps({"simulations": [{"task_id": "2", "trial": 0, "messages": msgs + ["oops"]}]}))
    code, err = run(["stats", str(bad)], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"{bad}: simulation 0 (task '2'): a message or tool call of the wrong shape (AttributeError" in err, err


@pytest.fixture
def default_sigint():
    """SIGINT handled as Python's default for the test (and so for the processes it starts): a
    suite started in the background, or a library an earlier test loaded, may have left it ignored,
    which a child inherits."""
    import signal

    before = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


def test_ctrl_c_is_one_line_and_status_130(default_sigint):
    """SIGINT to a running command: the shell's status for it, one line, no traceback."""
    import signal
    import time

    code = ("import sys; from treecompile.cli.main import main; print('ready', flush=True); "
            "sys.exit(main(['stats', '-']))")  # blocks reading standard input until interrupted
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "ready\n"
        time.sleep(1.0)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
        proc.stdin.close()
    assert proc.returncode == 130, err
    assert "Traceback" not in err, err
    assert err.strip() == "treecompile stats: interrupted"


@pytest.mark.full
def test_ctrl_c_during_a_running_bench_keeps_the_measured_rows(tmp_path, default_sigint):
    """SIGINT once ``bench --out`` has written its first row: status 130, one line, the file whole."""
    import signal
    import time

    out = tmp_path / "bench.json"
    proc = subprocess.Popen([sys.executable, "-m", "treecompile", "bench", "--tiny", "--repeats", "1", "--json",
                             "--out", str(out)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while not out.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert out.exists(), proc.communicate(timeout=60)[1]
        proc.send_signal(signal.SIGINT)
        stdout, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "Exception ignored" not in err, err
    assert err.strip() == "treecompile bench: interrupted"
    assert stdout == ""  # no table of a run that did not finish
    rows = json.loads(out.read_text())["rows"]
    assert 1 <= len(rows) < 12  # the tiny run measures 12: 3 workloads x 4 methods
    assert rows[0]["method"] == "packed" and rows[0]["exact"]


def test_a_ctrl_c_swallowed_by_a_callback_stops_at_the_next_measurement(default_sigint):
    """Python drops a KeyboardInterrupt raised inside a weakref callback or ``__del__``; the bench
    raises it again before its next measurement."""
    import signal
    import weakref

    from treecompile.core.interrupt import interrupts_kept, raise_if_interrupted

    class Cached:
        pass

    with interrupts_kept():
        obj = Cached()
        weakref.finalize(obj, signal.raise_signal, signal.SIGINT)
        del obj  # the finalizer's KeyboardInterrupt is printed as "Exception ignored" and dropped
        with pytest.raises(KeyboardInterrupt):
            raise_if_interrupted()
    raise_if_interrupted()  # outside the block: forgotten
    # (Whether "Exception ignored" reaches stderr cannot be seen here: pytest installs its own
    # unraisable hook.)


def test_a_ctrl_c_inside_torchs_compiler_is_held_until_the_next_measurement(default_sigint):
    """A KeyboardInterrupt raised inside torch's fake-tensor dispatch is logged by torch as an error
    with a traceback: a Ctrl-C that lands in torch's compiler is held, raised at the next
    measurement (or when the command ends); a second one raises at once."""
    import signal
    from types import SimpleNamespace

    import torch._dynamo.eval_frame

    from treecompile.core.interrupt import interrupts_kept, raise_if_interrupted

    compiling = SimpleNamespace(f_code=SimpleNamespace(co_filename=torch._dynamo.eval_frame.__file__))
    elsewhere = SimpleNamespace(f_code=SimpleNamespace(co_filename=__file__))
    def held(press):
        try:
            press(signal.SIGINT, compiling)
        except KeyboardInterrupt:
            pytest.fail("a Ctrl-C inside torch's compiler was raised there")

    with interrupts_kept():
        held(signal.getsignal(signal.SIGINT))
        with pytest.raises(KeyboardInterrupt):
            raise_if_interrupted()
    with pytest.raises(KeyboardInterrupt):  # held, never raised inside: the block's end raises it
        with interrupts_kept():
            held(signal.getsignal(signal.SIGINT))
    with interrupts_kept():
        press = signal.getsignal(signal.SIGINT)
        held(press)
        with pytest.raises(KeyboardInterrupt):
            press(signal.SIGINT, compiling)  # a second press: at once
        with pytest.raises(KeyboardInterrupt):
            press(signal.SIGINT, elsewhere)  # outside the compiler: at once, as always
        with pytest.raises(KeyboardInterrupt):
            raise_if_interrupted()


def test_an_interrupted_write_keeps_the_previous_file(tmp_path, monkeypatch):
    import os

    from treecompile.data import io

    out = tmp_path / "result.json"
    io.write_json(out, {"rows": ["é"]})
    plain = tmp_path / "plain.txt"
    plain.write_text("x")
    # The mode a plain open() gives (not the temporary file's owner-only one), UTF-8 text.
    assert out.stat().st_mode & 0o777 == plain.stat().st_mode & 0o777
    assert json.loads(out.read_text(encoding="utf-8")) == {"rows": ["é"]}
    plain.unlink()
    io.write_json(out, {"rows": [1]})

    def stopped(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", stopped)
    with pytest.raises(KeyboardInterrupt):
        io.write_json(out, {"rows": [1, 2]})
    assert json.loads(out.read_text()) == {"rows": [1]}
    assert [p.name for p in tmp_path.iterdir()] == ["result.json"]  # no half-written file beside it


def test_an_interrupted_cuda_bench_keeps_the_rows_measured(tmp_path, monkeypatch, capsys):
    from treecompile.bench import cuda

    def a_row_then_ctrl_c(cfg, *, on_row, **kwargs):
        on_row({"rows": [{"method": "tree"}]})
        raise KeyboardInterrupt

    monkeypatch.setattr(cuda, "run_cuda_bench", a_row_then_ctrl_c)
    out = tmp_path / "bench.json"
    assert cuda.main(["--device", "cpu", "--out", str(out)]) == 130
    assert json.loads(out.read_text()) == {"rows": [{"method": "tree"}]}
    assert capsys.readouterr().err.strip() == f"bench_cuda: interrupted; the rows measured so far are in {out}"


def test_an_empty_sequence_line_is_an_empty_path_and_a_group_of_them_is_refused(tmp_path, capsys):
    path = tmp_path / "grouped.jsonl"
    path.write_text('{"input_ids": [1, 2, 3], "group": "a"}\n{"input_ids": [], "group": "a"}\n')
    with pytest.warns(TreeWarning, match=r"1 empty sequence\(s\) \(sequence 1\)"):
        code, err = run(["stats", str(path)], capsys)
    assert code == 0, err
    path.write_text('{"input_ids": [1, 2, 3], "group": "a"}\n{"input_ids": [], "group": "b"}\n')
    assert_one_line(*run(["stats", str(path)], capsys),
                    "treecompile stats: error: group 'b': every sequence is empty (1 of them): a tree needs at "
                    "least one token")
