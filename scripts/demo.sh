#!/usr/bin/env bash
# The main demo: installs treecompile and trains a small model on bundled real trajectory trees (CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh "hf"
python3 -m treecompile.cli.demo "$@"
