"""Runs the GPU check or benchmark in sections and writes one report (Markdown + JSON).

Called by ``scripts/gpu.sh`` (which installs the project first); see docs/gpu.md.

    python scripts/gpu_check.py check --out DIR [--dry-run]
    python scripts/gpu_check.py bench --out DIR [--dry-run]
    python scripts/gpu_check.py perf --out DIR [--dry-run]

Each section runs in its own process under a time limit, so a failing, crashing or hanging
section never stops the others. Writes ``DIR/gpu-COMMAND.md``, ``DIR/gpu-COMMAND.json`` and
``DIR/gpu-COMMAND-raw.tar.gz`` (every section's log and JUnit XML). Exit status: 0 when every
section passed or was skipped, 1 otherwise.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata as md
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: (section, what it runs, time limit in seconds). The check's sections run at the same time,
#: each in its own process (compiling is most of their time, and it uses the host's cores), so
#: the check takes about as long as its longest section: under 8 minutes on an H100 host with 16
#: cores. A section that runs out of time keeps the results of the tests it finished, failures
#: with their tracebacks, and can be run again alone (``--sections NAME``).
#: The exactness tests are split in three sections per dtype of about equal work (on an H100
#: with five sections at once, 2026-11-24, the float32 tests took 420 s together): the interval
#: mask with the gathered head on the dense models, on the MoE / hybrid / GPT-2 models, and the
#: bitmask or fused-head cases. A ``-k`` expression is one argument: it may hold spaces.
_EXACT = "tests/gpu/test_gpu_exactness.py"
_SPARSE = "(moe or next or bamba or gpt2)"
CHECK_SECTIONS = [
    ("fused-head", "tests/gpu/test_gpu_fused_head.py", 120),
    ("blockmask", "tests/gpu/test_gpu_blockmask.py", 120),
    ("custom-attention", "tests/gpu/test_gpu_custom_attention.py", 380),
    ("compile-behaviour", "tests/gpu/test_gpu_compile_behaviour.py", 420),
    ("stream-cp", "tests/gpu/test_gpu_stream_cp.py", 420),
    *((f"exactness-{short}-{part}", f"{_EXACT} -k {expr}", 420)
      for short, dtype in (("fp32", "float32"), ("bf16", "bfloat16"))
      for part, expr in (("dense", f"interval-gather-{dtype} and not {_SPARSE}"),
                         ("moe-hybrid", f"interval-gather-{dtype} and {_SPARSE}"),
                         ("masks-heads", f"{dtype} and not interval-gather-{dtype}"))),
]
BENCH_SECTIONS = [("bench", "treecompile.bench.cuda", 450)]
TUNE_SECTIONS = [("tune", "treecompile tune", 450)]
PROFILE_SECTIONS = [("profile", "treecompile.bench.profile_cuda", 420)]
#: ``perf``: one command of at most 9 minutes. FlexAttention options for the Qwen3 head dim are
#: tuned first (its table, when it found one, is what the benchmark's tree methods then use),
#: then the benchmark on the Qwen3-1.7B shape with 8 layers at every POR and one real tree,
#: with the profiles of the first workload's steps (the tree's and each baseline's; POR 0
#: first, where the tree runs the baseline's rows). `tree-fused` is left out: on an H200 its
#: first step cost 40 s of compile for a row no target reads (2026-11-28); the benchmark
#: measures it with ``--methods tree-fused``. Files go straight to ``--out`` as they are made
#: (eight of them, no archive), so a run stopped from outside keeps what it measured.
PERF_SECTIONS = [("tune", "treecompile tune --head-dims 128", 130), ("bench", "treecompile.bench.cuda", 390)]
#: perf's sections together: the benchmark gets what the tune left of it (on an H100 the tune
#: took 60 s, 2026-11-27).
PERF_TOTAL_S = 520
PERF_BENCH = ["--models", "qwen3-1.7b-8l", "--path-tokens", "32768", "--por", "0", "0.8", "0.5", "0.92",
              "--real-trees", "tau", "--baselines", "faster",
              "--methods", "hf-packed-flex", "hf-padded-sdpa", "tree"]
#: ``run``: a training run of 40 steps, a new tree at each, the tree's and the baseline's
#: (`treecompile.bench.run`); each method stops taking steps at 40% of the section's limit.
RUN_SECTIONS = [("run", "treecompile.bench.run", 540)]
SECTIONS = {"check": CHECK_SECTIONS, "bench": BENCH_SECTIONS, "tune": TUNE_SECTIONS, "profile": PROFILE_SECTIONS,
            "perf": PERF_SECTIONS, "run": RUN_SECTIONS}


def _version(pkg: str) -> str:
    try:
        return md.version(pkg)
    except md.PackageNotFoundError:
        return "not installed"


def environment() -> dict:
    env = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "host": platform.node(), "python": platform.python_version()}
    try:
        import torch

        env["torch"] = torch.__version__
        env["cuda_runtime"] = str(torch.version.cuda)
        env["cuda_available"] = torch.cuda.is_available()
        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            env["device"] = f"{p.name}, {p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs, " \
                            f"compute capability {p.major}.{p.minor}"
        else:
            env["device"] = "no CUDA device"
    except Exception as e:  # the report is written whatever is broken
        env["torch"] = f"import failed: {e}"
        env["cuda_available"] = False
        env["device"] = "unknown (torch failed to import)"
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            env["driver"] = subprocess.run(
                [smi, "--query-gpu=driver_version,name", "--format=csv,noheader"], capture_output=True, text=True,
                timeout=30).stdout.strip()
        except Exception as e:
            env["driver"] = f"nvidia-smi failed: {e}"
    else:
        env["driver"] = "nvidia-smi not found"
    for pkg in ("triton", "transformers", "flash-linear-attention", "fla-core", "treecompile", "pytest"):
        env[pkg] = _version(pkg)
    try:
        git = ["git", "-C", str(ROOT)]
        head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              timeout=10).stdout.strip() or "unknown"
        changed = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                 text=True, timeout=30).stdout.strip()
        # A copied working tree may carry an older .git: then the files are not that commit.
        env["commit"] = head + (" with uncommitted changes" if changed else "")
    except Exception:
        env["commit"] = "unknown"
    return env


def parse_junit(path: Path) -> list[dict]:
    """Every test case of a JUnit XML file: name, outcome, seconds, message, traceback, properties."""
    tests = []
    for case in ET.parse(path).getroot().iter("testcase"):
        t = {"name": f"{case.get('classname', '')}::{case.get('name', '')}", "seconds": float(case.get("time", 0)),
             "outcome": "passed", "message": "", "traceback": "", "properties": {}}
        for prop in case.iter("property"):
            t["properties"][prop.get("name")] = prop.get("value")
        for kind in ("failure", "error", "skipped"):
            el = case.find(kind)
            if el is not None:
                t["outcome"] = {"failure": "failed", "error": "error", "skipped": "skipped"}[kind]
                t["message"] = el.get("message", "")
                t["traceback"] = (el.text or "").strip()
        tests.append(t)
    return tests


_VERBOSE = re.compile(r"^(\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED)")


def parse_verbose_log(text: str) -> list[dict]:
    """Results of a pytest -v log cut short (a timed-out section has no JUnit file)."""
    out = []
    for line in text.splitlines():
        m = _VERBOSE.match(line.strip())
        if m:
            out.append({"name": m.group(1), "outcome": m.group(2).lower(), "seconds": None, "message": "",
                        "traceback": "", "properties": {}})
    return out


class _Proc:
    """One section's process, started at once; :meth:`wait` stops it at its limit."""

    def __init__(self, cmd: list[str], log: Path, limit: int, env: dict | None = None):
        self.limit, self.t0 = limit, time.perf_counter()
        with open(log, "w") as f:
            # Where gpu.sh linked the checkout in as a package, the sections run outside the
            # checkout: its root's own treecompile/ folder would shadow the linked package.
            self.proc = subprocess.Popen(cmd, cwd=os.environ.get("TREECOMPILE_LINKED_SITE", ROOT), stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                                         env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})

    def wait(self) -> tuple[int | None, float]:
        """``(return code or None if it ran past the limit, seconds)``."""
        try:
            rc = self.proc.wait(timeout=max(0.0, self.t0 + self.limit - time.perf_counter()))
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, 9)
            self.proc.wait()
            rc = None
        return rc, time.perf_counter() - self.t0


def _importable() -> None:
    """Makes ``treecompile`` importable: installed, linked in by gpu.sh, or else the checkout."""
    try:
        import treecompile  # noqa: F401
    except ImportError:
        sys.path.insert(0, str(ROOT))


def _run(cmd: list[str], log: Path, limit: int, env: dict | None = None) -> tuple[int | None, float]:
    """``(return code or None if it ran past the limit, seconds)``; output to ``log``."""
    return _Proc(cmd, log, limit, env).wait()


def parse_report_lines(path: Path) -> list[dict]:
    """The results ``scripts/gpu_report_plugin.py`` wrote, one per test, in the order they ended."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _section_args(what: str) -> tuple[str, str | None]:
    """``"FILE"`` or ``"FILE -k EXPRESSION"`` (the expression may hold spaces): ``(file, expression)``."""
    file, _, rest = what.partition(" ")
    return file, (rest.removeprefix("-k ").strip() or None) if rest else None


def _selector(expression: str | None):
    """Whether pytest's ``-k expression`` keeps a test id (a name matches a substring of the id)."""
    if expression is None:
        return lambda test_id: True
    from _pytest.mark.expression import Expression

    compiled = Expression.compile(expression)
    return lambda test_id: compiled.evaluate(lambda word, **_: word.lower() in test_id.lower())


def collect_only(sections: list[tuple[str, str, int]], work: Path) -> dict[str, list[str]]:
    """The test ids each test section would run (one ``pytest --collect-only`` for all), for
    sections that do not run, selected by each section's ``-k`` expression."""
    files = sorted({_section_args(what)[0] for _, what, _ in sections if what.startswith("tests/")})
    if not files:
        return {}
    log = work / "collect.log"
    _run([sys.executable, "-m", "pytest", "-q", "--collect-only", *files, "-m", "gpu", "-o", "addopts=", "-p",
          "no:cacheprovider"], log, 300)
    ids = [line.strip() for line in log.read_text().splitlines() if line.startswith("tests/") and "::" in line]
    out = {}
    for name, what, _ in sections:
        file, expression = _section_args(what)
        keeps = _selector(expression)
        out[name] = [i for i in ids if i.startswith(file + "::") and keeps(i.split("::", 1)[1])]
    return out


def start_test_section(name: str, what: str, limit: int, work: Path) -> _Proc:
    junit, log, lines = work / f"junit-{name}.xml", work / f"{name}.log", work / f"results-{name}.jsonl"
    file, expression = _section_args(what)
    cmd = [sys.executable, "-m", "pytest", file, *(["-k", expression] if expression else []), "-m", "gpu", "-v",
           "-rA", "-o", "addopts=", "-p", "no:cacheprovider", "-p", "gpu_report_plugin", f"--junitxml={junit}",
           "-o", "junit_family=xunit1"]
    path = os.pathsep.join(p for p in (str(ROOT / "scripts"), os.environ.get("PYTHONPATH", "")) if p)
    return _Proc(cmd, log, limit, env={"PYTHONPATH": path, "TREECOMPILE_TEST_REPORT": str(lines)})


def run_test_section(name: str, what: str, limit: int, work: Path, proc: _Proc | None = None) -> dict:
    """Runs one test section (or waits for the one ``proc`` started) and reads its results."""
    proc = proc or start_test_section(name, what, limit, work)
    rc, secs = proc.wait()
    junit, log = work / f"junit-{name}.xml", work / f"{name}.log"
    text = log.read_text(errors="replace")
    tests = parse_junit(junit) if junit.exists() else (parse_report_lines(work / f"results-{name}.jsonl")
                                                       or parse_verbose_log(text))
    if rc is None:
        status = f"timed out after {limit} s ({len(tests)} tests finished)"
    elif rc == 0:
        status = "passed"
    elif rc == 5:
        status = "no tests ran"
    else:
        status = "failed" if tests else f"crashed (exit {rc})"
    return {"name": name, "status": status, "seconds": round(secs, 1), "tests": tests, "log_tail": text[-3000:]}


def run_bench_section(name: str, limit: int, work: Path, perf: bool = False) -> dict:
    out, mdfile, log = work / "bench.json", work / "bench.md", work / "bench.log"
    cmd = [sys.executable, "-m", "treecompile.bench.cuda", "--out", str(out), "--time-budget", str(int(limit * 0.75))]
    env = None
    if perf:
        cmd += [*PERF_BENCH, "--profile", str(work / "profile.json")]
        if (work / "flex-options.json").exists():  # what the tune section measured
            env = {"TREECOMPILE_FLEX_OPTIONS": str(work / "flex-options.json")}
    else:
        cmd += ["--markdown", str(mdfile)]
    rc, secs = _run(cmd, log, limit, env)
    text = log.read_text(errors="replace")
    result = json.loads(out.read_text()) if out.exists() else None
    table = None
    if result is not None:
        _importable()
        from treecompile.bench.cuda import markdown_table

        table = markdown_table(result)
    status = {None: f"timed out after {limit} s (rows so far kept)", 0: "passed", 1: "loss mismatch"}.get(
        rc, f"failed (exit {rc})")
    section = {"name": name, "status": status, "seconds": round(secs, 1), "tests": [], "bench": result,
               "table": table, "log_tail": text[-3000:], "flex_options": (env or {}).get("TREECOMPILE_FLEX_OPTIONS")}
    if perf and (work / "profile.json").exists():
        _importable()
        from treecompile.bench.profile_cuda import markdown_report

        profile = json.loads((work / "profile.json").read_text())
        section["profile"] = profile
        steps = (profile, *profile.get("baselines", {}).values())  # the tree's, then each baseline's
        reports = [markdown_report(r) for r in steps if "categories_ms" in r]
        if reports:
            section["table"] = (table or "") + "\n\nProfiles of the first workload's steps:\n\n" + "\n\n".join(reports)
    return section


def run_tune_section(name: str, limit: int, work: Path, perf: bool = False) -> dict:
    log, out = work / "tune.log", work / "tune.json"
    cmd = [sys.executable, "-m", "treecompile.cli.main", "tune", "--json", str(out)]
    if perf:  # the Qwen3 head dim, bfloat16; a budget that leaves time to finish the candidate in hand
        cmd += ["--head-dims", "128", "--write", str(work / "flex-options.json"), "--time-budget", str(int(limit * 0.6))]
    rc, secs = _run(cmd, log, limit)
    text = log.read_text(errors="replace")
    status = {None: f"timed out after {limit} s", 0: "passed"}.get(rc, f"failed (exit {rc})")
    table = text[text.rfind("# measured by"):] if "# measured by" in text else None
    return {"name": name, "status": status, "seconds": round(secs, 1), "tests": [], "table": table,
            "log_tail": text[-3000:]}


def _module_section(name: str, module: str, key: str, limit: int, work: Path, *extra: str) -> dict:
    """A section that runs ``python -m module --out work/KEY.json --markdown work/KEY.md`` (and
    ``extra``): its status, its Markdown as the table, its JSON under ``key``."""
    out, mdfile, log = work / f"{key}.json", work / f"{key}.md", work / f"{key}.log"
    rc, secs = _run([sys.executable, "-m", module, "--out", str(out), "--markdown", str(mdfile), *extra], log, limit)
    text = log.read_text(errors="replace")
    status = {None: f"timed out after {limit} s", 0: "passed"}.get(rc, f"failed (exit {rc})")
    return {"name": name, "status": status, "seconds": round(secs, 1), "tests": [],
            "table": mdfile.read_text() if mdfile.exists() else None,
            key: json.loads(out.read_text()) if out.exists() else None, "log_tail": text[-3000:]}


def run_profile_section(name: str, limit: int, work: Path) -> dict:
    return _module_section(name, "treecompile.bench.profile_cuda", "profile", limit, work)


def run_run_section(name: str, limit: int, work: Path) -> dict:
    # Each method stops taking steps at 40% of the limit: both fit, with the baseline's profile.
    return _module_section(name, "treecompile.bench.run", "run", limit, work, "--time-budget", str(int(limit * 0.4)))


def render_markdown(report: dict) -> str:
    env = report["env"]
    lines = [f"# treecompile GPU {report['command']}", "",
             f"Written by `{report['invocation']}` on {env['date']}.", "", "## Environment", "",
             "| | |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in env.items()]
    if report.get("install"):
        lines += ["", f"Install: {report['install']}"]
    lines += ["", "## Sections", "", "| section | status | tests | seconds |", "|---|---|---|---|"]
    for s in report["sections"]:
        counts = {}
        for t in s["tests"]:
            counts[t["outcome"]] = counts.get(t["outcome"], 0) + 1
        summary = ", ".join(f"{n} {k}" for k, n in sorted(counts.items())) or "–"
        lines.append(f"| {s['name']} | {s['status']} | {summary} | {s['seconds'] if s['seconds'] is not None else '–'} |")
    for s in report["sections"]:
        lines += ["", f"## {s['name']}: {s['status']}", ""]
        if s["tests"]:
            lines += ["| test | result | seconds | measured |", "|---|---|---|---|"]
            for t in s["tests"]:
                props = "; ".join(f"{k}={v}" for k, v in t["properties"].items()).replace("|", "/")
                secs = "–" if t["seconds"] is None else f"{t['seconds']:.1f}"
                outcome = t["outcome"] + (f": {t['message']}" if t["outcome"] == "skipped" and t["message"] else "")
                lines.append(f"| `{t['name']}` | {outcome} | {secs} | {props} |")
            for t in s["tests"]:
                if t["outcome"] in ("failed", "error"):
                    lines += ["", f"### {t['name']}", "", "```", (t["traceback"] or t["message"])[-6000:], "```"]
        if s.get("table"):
            lines += ["", s["table"]]
        if s["status"] not in ("passed",) and not s["status"].startswith("skipped") and s.get("log_tail"):
            lines += ["", "Log tail:", "", "```", s["log_tail"], "```"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="treecompile GPU check / benchmark report")
    p.add_argument("command", choices=sorted(SECTIONS))
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--dry-run", action="store_true", help="run nothing; every section reports why it was skipped")
    p.add_argument("--install", default=None, help="one line on how the install went (from gpu.sh)")
    p.add_argument("--invocation", default=None)
    p.add_argument("--sections", default=None, help="comma-separated section names to run (default: all)")
    p.add_argument("--limit", type=int, default=None, metavar="S",
                   help="cap every section's time limit at S seconds (a short GPU lease)")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    sections = SECTIONS[args.command]
    if args.sections:
        wanted = args.sections.split(",")
        unknown = [w for w in wanted if w not in {n for n, _, _ in sections}]
        if unknown:
            p.error(f"unknown sections {unknown}; {args.command} has: {', '.join(n for n, _, _ in sections)}")
        sections = [s for s in sections if s[0] in wanted]
    if args.limit is not None:
        sections = [(name, what, min(limit, args.limit)) for name, what, limit in sections]
    env = environment()  # after the arguments are checked: it imports torch
    skip = "skipped: no CUDA" if not env.get("cuda_available") else ("skipped: dry run" if args.dry_run else None)
    report = {"command": args.command, "invocation": args.invocation or " ".join(["scripts/gpu.sh", *sys.argv[1:]]),
              "env": env, "install": args.install, "sections": []}
    with tempfile.TemporaryDirectory() as tmp:
        perf = args.command == "perf"
        # perf and run write straight to --out: a run stopped from outside keeps what it measured.
        work = args.out if args.command in ("perf", "run") else Path(tmp)
        listed = collect_only(sections, work) if skip else {}
        started = {}
        if args.command == "check" and not skip:  # every test section at once
            for name, what, limit in sections:
                print(f"[gpu.sh] {name}: started, up to {limit} s", file=sys.stderr, flush=True)
                started[name] = start_test_section(name, what, limit, work)
        for name, what, limit in sections:
            if skip:
                tests = [{"name": t, "outcome": "skipped", "seconds": None, "message": skip.removeprefix("skipped: "),
                          "traceback": "", "properties": {}} for t in listed.get(name, [])]
                report["sections"].append({"name": name, "status": skip, "seconds": None, "limit": limit, "tests": tests})
                continue
            if args.command == "check":
                section = run_test_section(name, what, limit, work, started[name])
            else:
                if perf and name == "bench":
                    limit = max(limit, PERF_TOTAL_S - int(sum(x["seconds"] or 0 for x in report["sections"])))
                print(f"[gpu.sh] {name}: up to {limit} s", file=sys.stderr, flush=True)
                if perf:
                    section = {"bench": run_bench_section, "tune": run_tune_section}[name](name, limit, work, perf=True)
                else:
                    run = {"bench": run_bench_section, "tune": run_tune_section, "profile": run_profile_section,
                           "run": run_run_section}[args.command]
                    section = run(name, limit, work)
            print(f"[gpu.sh] {name}: {section['status']} ({section['seconds']} s)", file=sys.stderr, flush=True)
            report["sections"].append({**section, "limit": limit})
        if work != args.out:
            with tarfile.open(args.out / f"gpu-{args.command}-raw.tar.gz", "w:gz") as tar:
                for f in sorted(work.iterdir()):
                    tar.add(f, arcname=f.name)
    (args.out / f"gpu-{args.command}.json").write_text(json.dumps(report, indent=2))
    text = render_markdown(report)
    (args.out / f"gpu-{args.command}.md").write_text(text)
    print(text)
    ok = all(s["status"] == "passed" or s["status"].startswith("skipped") for s in report["sections"])
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
