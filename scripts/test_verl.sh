#!/usr/bin/env bash
# The verl actor tests (tests/needs_verl/): the tree engine against verl's own actor engine,
# with verl installed, in a venv of its own (verl 0.9.1 pins transformers < 5.11, below the
# main environment's). What a CI job with verl runs.
# Usage: scripts/test_verl.sh [pytest args]   (VENV=DIR picks the venv; default .venv-verl)
set -euo pipefail
cd "$(dirname "$0")/.."
VERL="verl==0.9.1"
VENV="${VENV:-.venv-verl}"
start=$SECONDS
# verl brings what it pins (transformers, tensordict, ray, hydra, ...) into the venv.
# shellcheck source=scripts/venv_job.sh
source scripts/venv_job.sh
venv_job "$VENV" "test" "$VERL"
python3 -c 'import transformers, verl; print(f"testing with verl {verl.__version__}, transformers {transformers.__version__}")'
echo "setup: $((SECONDS - start)) s"
tests_start=$SECONDS
python3 -m pytest -q -p no:cacheprovider -W "ignore::UserWarning:verl.workers.engine" tests/needs_verl "$@"
echo "tests: $((SECONDS - tests_start)) s; total: $((SECONDS - start)) s"
