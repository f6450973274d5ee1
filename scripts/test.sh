#!/usr/bin/env bash
# The test suite: installs what it needs, runs every test (slow ones included) on parallel
# workers (tests/test_docs.py builds the docs strictly). Extra arguments go to pytest (e.g. -n 0, -k NAME).
#
# --quick (first argument): the inner loop, under 2 minutes on 2 idle cores: every test function
# once, on its first case, without the tests marked `full` or `slow` and with fewer generated
# examples (tests/conftest.py, quick_selection). CI runs the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
markers=""
if [[ "${1:-}" == "--quick" ]]; then
    shift
    export TREECOMPILE_QUICK=1
    markers="not slow and not full"
fi
start=$SECONDS
bash scripts/setup.sh "test,docs,trl"
echo "setup: $((SECONDS - start)) s"

# One torch thread per worker: the workers already use every core.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
tests_start=$SECONDS
# -m "": every marker (the full suite), overriding the project's default `not slow`; --dist loadgroup keeps tests
# that share a compiled model on one worker (tests/conftest.py) and spreads the rest;
# --durations lists the slowest cases.
python3 -m pytest -n auto --dist loadgroup -m "$markers" --durations=25 -q "$@"
echo "tests: $((SECONDS - tests_start)) s on $(python3 -c 'import os; print(os.cpu_count())') cores"
# The docs are built strictly (diagrams and CLI page included) and their HTML checked by
# tests/test_docs.py, once, inside the run above.
echo "total $((SECONDS - start)) s"
