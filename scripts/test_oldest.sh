#!/usr/bin/env bash
# The Hugging Face tests on the oldest transformers treecompile supports (the floor of the
# `hf` extra in pyproject.toml), in a venv of their own: what a CI job on the oldest version runs.
# Usage: scripts/test_oldest.sh [pytest args]   (VENV=DIR picks the venv; default .venv-oldest)
set -euo pipefail
cd "$(dirname "$0")/.."
OLDEST="transformers==5.10.*"
VENV="${VENV:-.venv-oldest}"
start=$SECONDS
# The venv sees the packages already installed (torch above all), so only transformers and
# what pins to it are installed again, in the venv, over them.
[ -x "$VENV/bin/python3" ] || python3 -m venv --system-site-packages "$VENV"
# shellcheck disable=SC1091
source "$VENV/bin/activate"
bash scripts/setup.sh "test,trl"
echo "setup: pip install $OLDEST"
python3 -m pip install -q "$OLDEST"
python3 -c 'import transformers; print(f"testing with transformers {transformers.__version__}")'
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
python3 -m pytest -n auto --dist loadgroup -q \
    tests/test_compile_hf.py tests/test_compile_hf_masks.py tests/test_compile_models.py \
    tests/test_compiled_model_hf.py tests/test_integrations_hf.py tests/test_integrations_verl.py \
    tests/test_compile_subgraphs.py tests/test_compile_mixed_precision.py tests/test_compile_moe.py \
    tests/test_zoo.py tests/test_compile_hybrid.py tests/test_integration_trl.py "$@"
echo "total: $((SECONDS - start)) s"
