#!/usr/bin/env bash
# The test suite: installs what it needs, runs every test (slow ones included) on parallel
# workers (tests/test_docs.py builds the docs strictly). Extra arguments go to pytest (e.g. -n 0, -k NAME).
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
bash scripts/setup.sh "test,docs,trl"
echo "setup: $((SECONDS - start)) s"

# One torch thread per worker: the workers already use every core.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
tests_start=$SECONDS
# -m "": every marker, overriding the project's default `not slow`; --dist loadgroup keeps tests
# that share a compiled model on one worker (tests/conftest.py) and spreads the rest;
# --durations lists the slowest cases.
python3 -m pytest -n auto --dist loadgroup -m "" --durations=25 -q "$@"
echo "tests: $((SECONDS - tests_start)) s on $(python3 -c 'import os; print(os.cpu_count())') cores"
# The docs are built strictly (diagrams and CLI page included) and their HTML checked by
# tests/test_docs.py, once, inside the run above.
echo "total $((SECONDS - start)) s"
