#!/usr/bin/env bash
# The Hugging Face tests on the oldest transformers treecompile supports (the floor of the
# `hf` extra in pyproject.toml), in a venv of their own: what a CI job on the oldest version runs.
# Usage: scripts/test_oldest.sh [pytest args]   (VENV=DIR picks the venv; default .venv-oldest)
set -euo pipefail
cd "$(dirname "$0")/.."
OLDEST="transformers==5.10.*"
VENV="${VENV:-.venv-oldest}"
start=$SECONDS
# shellcheck source=scripts/venv_job.sh
source scripts/venv_job.sh
venv_job "$VENV" "test,trl" "$OLDEST"
python3 -c 'import transformers; print(f"testing with transformers {transformers.__version__}")'
python3 -m pytest -n auto --dist loadgroup -q \
    tests/test_compile_hf.py tests/test_compile_hf_masks.py tests/test_compile_models.py \
    tests/test_compiled_model_hf.py tests/test_integrations_hf.py tests/test_integrations_verl.py \
    tests/test_compile_subgraphs.py tests/test_compile_mixed_precision.py tests/test_compile_moe.py \
    tests/test_zoo.py tests/test_compile_hybrid.py tests/test_integration_trl.py "$@"
echo "total: $((SECONDS - start)) s"
