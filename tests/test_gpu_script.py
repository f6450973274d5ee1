"""scripts/gpu.sh and scripts/gpu_check.py on the CPU: dry runs write the report; sections are isolated."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
gpu_check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_check)

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the report of a machine without CUDA")


def _gpu_sh(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(ROOT / "scripts" / "gpu.sh"), *args], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "PYTHON": sys.executable})


@pytest.mark.full
@no_cuda
def test_check_dry_run_reports_every_gpu_test_skipped(tmp_path):
    proc = _gpu_sh("check", "--dry-run", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    report = json.loads((tmp_path / "gpu-check.json").read_text())
    assert [s["name"] for s in report["sections"]] == [name for name, _, _ in gpu_check.CHECK_SECTIONS]
    assert {s["status"] for s in report["sections"]} == {"skipped: no CUDA"}
    tests = [t for s in report["sections"] for t in s["tests"]]
    files = {t["name"].split("::")[0] for t in tests}
    assert files == {str(p.relative_to(ROOT)) for p in (ROOT / "tests" / "gpu").glob("test_*.py")}
    assert len(tests) >= 40 and {t["outcome"] for t in tests} == {"skipped"}
    by = {s["name"]: {t["name"] for t in s["tests"]} for s in report["sections"]}
    # The exactness sections split tests/gpu/test_gpu_exactness.py: each gets some, none shares one.
    exact = [n for n in by if n.startswith("exactness-")]
    assert len(exact) == 6 and all(by[n] for n in exact)
    assert sum(len(by[n]) for n in exact) == len(set().union(*(by[n] for n in exact))) == len(
        [t for t in tests if t["name"].startswith("tests/gpu/test_gpu_exactness.py::")])
    assert all("float32" in t for t in by["exactness-fp32-dense"]) and not any(
        "gpt2" in t or "moe" in t for t in by["exactness-fp32-dense"])
    assert report["env"]["device"] == "no CUDA device" and report["env"]["torch"] == torch.__version__
    md = (tmp_path / "gpu-check.md").read_text()
    assert "| exactness-fp32-dense | skipped: no CUDA |" in md and (tmp_path / "gpu-check-raw.tar.gz").exists()


@no_cuda
@pytest.mark.parametrize("command", ["bench", "profile"])
def test_bench_and_profile_dry_runs_write_the_report(tmp_path, command):
    proc = _gpu_sh(command, "--dry-run", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    report = json.loads((tmp_path / f"gpu-{command}.json").read_text())
    assert [(s["name"], s["status"]) for s in report["sections"]] == [(command, "skipped: no CUDA")]
    assert f"## {command}: skipped: no CUDA" in (tmp_path / f"gpu-{command}.md").read_text()


@no_cuda
def test_perf_dry_run_names_its_sections_and_writes_no_archive(tmp_path):
    # perf writes its files straight to --out (eight at most come back from a lent GPU machine).
    proc = _gpu_sh("perf", "--dry-run", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    report = json.loads((tmp_path / "gpu-perf.json").read_text())
    assert [(s["name"], s["status"]) for s in report["sections"]] == [("tune", "skipped: no CUDA"),
                                                                      ("bench", "skipped: no CUDA")]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpu-perf.json", "gpu-perf.md"]
    assert "checkout through PYTHONPATH" in report["install"]


def test_unknown_command_exits_2(tmp_path):
    assert _gpu_sh("prove", "--out", str(tmp_path)).returncode == 2


@pytest.mark.full
@no_cuda
def test_sections_option_selects_and_checks_names(tmp_path):
    proc = _gpu_sh("check", "--dry-run", "--sections", "blockmask", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    report = json.loads((tmp_path / "gpu-check.json").read_text())
    assert [s["name"] for s in report["sections"]] == ["blockmask"] and len(report["sections"][0]["tests"]) == 3
    assert report["sections"][0]["limit"] == next(lim for n, _, lim in gpu_check.CHECK_SECTIONS if n == "blockmask")
    bad = _gpu_sh("check", "--dry-run", "--sections", "nonsense", "--out", str(tmp_path))
    assert bad.returncode == 2 and "unknown sections" in bad.stderr


@pytest.mark.full
def test_limit_option_caps_every_section_time(tmp_path):
    proc = _gpu_sh("check", "--dry-run", "--sections", "blockmask,stream-cp", "--limit", "90", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    report = json.loads((tmp_path / "gpu-check.json").read_text())
    assert {s["name"]: s["limit"] for s in report["sections"]} == {"blockmask": 90, "stream-cp": 90}
    # Without --limit each section has its own (test_sections_option_selects_and_checks_names).
    assert min(lim for n, _, lim in gpu_check.CHECK_SECTIONS if n in ("blockmask", "stream-cp")) > 90


def _write_tests(tmp_path: Path, body: str) -> str:
    path = tmp_path / "test_section.py"
    path.write_text("import pytest\npytestmark = pytest.mark.gpu\n" + textwrap.dedent(body))
    return str(path)


def test_section_results_tracebacks_and_properties(tmp_path):
    path = _write_tests(tmp_path, """
        def test_ok(record_property):
            record_property("build_ms", "1.25")
        def test_bad():
            assert 1 + 1 == 3, "arithmetic"
        def test_skipped():
            pytest.skip("needs something")
    """)
    work = tmp_path / "work"
    work.mkdir()
    section = gpu_check.run_test_section("demo", path, 120, work)
    assert section["status"] == "failed"
    by = {t["name"].split("::")[-1]: t for t in section["tests"]}
    assert by["test_ok"]["outcome"] == "passed" and by["test_ok"]["properties"] == {"build_ms": "1.25"}
    assert by["test_bad"]["outcome"] == "failed" and "arithmetic" in by["test_bad"]["traceback"]
    assert by["test_skipped"]["outcome"] == "skipped"
    text = gpu_check.render_markdown({"command": "check", "invocation": "test", "env": {"date": "now"},
                                      "install": None, "sections": [section]})
    assert "### " in text and "arithmetic" in text and "build_ms=1.25" in text


@pytest.mark.full
def test_a_hanging_section_is_stopped_and_keeps_its_results_with_tracebacks(tmp_path):
    """pytest prints tracebacks only at the end: the plugin writes each result as it ends."""
    path = _write_tests(tmp_path, """
        import time
        def test_first():
            pass
        def test_bad(record_property):
            record_property("worst", "3e-4")
            assert 2 + 2 == 5, "the measured difference"
        def test_hangs():
            time.sleep(600)
    """)
    work = tmp_path / "work"
    work.mkdir()
    section = gpu_check.run_test_section("hang", path, 6, work)
    assert section["status"].startswith("timed out after 6 s")
    first, bad = section["tests"]
    assert first["name"].endswith("::test_first") and first["outcome"] == "passed"
    assert bad["outcome"] == "failed" and "the measured difference" in bad["traceback"]
    assert bad["properties"] == {"worst": "3e-4"}


@pytest.mark.full
def test_check_sections_run_at_the_same_time(tmp_path):
    """Each section's test waits until every section has started: run one after another, the
    first would wait for the others until its own limit and fail."""
    barrier = tmp_path / "started"
    barrier.mkdir()
    body = f"""
        import os, time
        from pathlib import Path
        def test_wait():
            Path({str(barrier)!r}, str(os.getpid())).touch()
            deadline = time.monotonic() + 30
            while len(os.listdir({str(barrier)!r})) < 3:
                assert time.monotonic() < deadline, "the other sections never started"
                time.sleep(0.05)
    """
    paths = [_write_tests(tmp_path / str(i), body) for i in range(3) if (tmp_path / str(i)).mkdir() is None]
    work = tmp_path / "work"
    work.mkdir()
    procs = {i: gpu_check.start_test_section(f"s{i}", p, 60, work) for i, p in enumerate(paths)}
    sections = [gpu_check.run_test_section(f"s{i}", paths[i], 60, work, proc) for i, proc in procs.items()]
    assert [s["status"] for s in sections] == ["passed"] * 3, [s["log_tail"] for s in sections]
