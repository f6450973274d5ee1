#!/usr/bin/env bash
# The whole suite on the newest torch pip offers here, in a venv of its own: what a CI job on the
# newest torch runs. The wheel is a CUDA build: its CUDA libraries are installed with it (torch imports
# them at start-up, 2.14.1 included), and the tests run on the CPU.
# Usage: scripts/test_newest.sh [pytest args]   (VENV=DIR picks the venv; TORCH=SPEC the pin, default: newest)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv-newest}"
start=$SECONDS
# shellcheck source=scripts/venv_job.sh
source scripts/venv_job.sh
venv_job "$VENV" "test,docs,trl" "${TORCH:-torch}" --upgrade
python3 -c 'import torch; print(f"testing with torch {torch.__version__}")'
python3 -m pytest -n auto --dist loadgroup -m "" -q "$@"
echo "total: $((SECONDS - start)) s"
