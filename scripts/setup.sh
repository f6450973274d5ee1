#!/usr/bin/env bash
# Installs treecompile and what its demo and tests need, on a machine with or without a GPU.
# Usage: scripts/setup.sh EXTRAS   (e.g. "hf" or "test,docs")
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-hf}"
if ! python3 -c 'import torch, sys; v = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]); sys.exit(v < (2, 11))' 2>/dev/null; then
    # No usable torch yet: take the CPU build (an unpinned torch pulls several GB of CUDA packages).
    python3 -m pip install -q "torch==2.13.0"
fi
python3 -m pip install -q -e ".[${extras}]"
