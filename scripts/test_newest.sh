#!/usr/bin/env bash
# The whole suite on the newest torch pip offers here, in a venv of its own: what a CI job on the
# newest torch runs. The wheel's CUDA libraries are not installed (--no-deps): the tests run on the CPU.
# Usage: scripts/test_newest.sh [pytest args]   (VENV=DIR picks the venv; TORCH=SPEC the pin, default: newest)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv-newest}"
start=$SECONDS
[ -x "$VENV/bin/python3" ] || python3 -m venv --system-site-packages "$VENV"
# shellcheck disable=SC1091
source "$VENV/bin/activate"
bash scripts/setup.sh "test,docs,trl"
python3 -m pip install -q --no-deps --upgrade "${TORCH:-torch}"
python3 -c 'import torch; print(f"testing with torch {torch.__version__}")'
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
python3 -m pytest -n auto --dist loadgroup -m "" -q "$@"
echo "total: $((SECONDS - start)) s"
