"""A pytest plugin that writes each test's result as one JSON line the moment it is known.

``scripts/gpu_check.py`` loads it (``-p gpu_report_plugin``) so that a section stopped at its
time limit still reports why each finished test failed: pytest prints tracebacks and writes
its JUnit XML only at the end of the session. The file is ``$TREECOMPILE_TEST_REPORT``.
"""

from __future__ import annotations

import json
import os


def pytest_runtest_logreport(report):
    path = os.environ.get("TREECOMPILE_TEST_REPORT")
    if not path or (report.when != "call" and report.outcome == "passed"):
        return
    if report.when == "setup" and report.outcome == "passed":
        return
    outcome = report.outcome if report.when == "call" or report.outcome == "skipped" else "error"
    message = ""
    if report.outcome == "skipped" and isinstance(report.longrepr, tuple):
        message = str(report.longrepr[2]).removeprefix("Skipped: ")
    elif report.failed:
        message = getattr(report.longrepr, "reprcrash", None)
        message = message.message if message is not None else str(report.longrepr).splitlines()[-1:]
    line = {"name": report.nodeid, "outcome": outcome, "seconds": round(report.duration, 2), "message": str(message),
            "traceback": report.longreprtext if report.failed else "",
            "properties": {k: str(v) for k, v in report.user_properties}}
    with open(path, "a") as f:
        f.write(json.dumps(line) + "\n")
