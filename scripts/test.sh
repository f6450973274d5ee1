#!/usr/bin/env bash
# The test suite: installs what it needs, runs pytest, then builds the docs strictly.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh "test,docs"
python3 -m pytest -q "$@"
NO_MKDOCS_2_WARNING=1 python3 -m mkdocs build --strict --quiet --site-dir "${TMPDIR:-/tmp}/treecompile-site"
