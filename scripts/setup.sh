#!/usr/bin/env bash
# Installs treecompile and what its demo and tests need, on a machine with or without a GPU.
# Usage: scripts/setup.sh EXTRAS   (e.g. "hf" or "test,docs")
#
# torch: an installed torch >= 2.11 is kept as it is (on a GPU machine, install your CUDA build
# first). Otherwise torch==2.13.0 is installed, from the PyTorch CPU wheel index when that index
# can be reached (the CPU build, about 200 MB), else from the configured package index (on PyPI
# for Linux x86-64 that is the CUDA build, several GB; a mirror may hold the CPU wheel instead).
# Either way the script prints which build it installed.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-hf}"
TORCH="torch==2.13.0"
CPU_INDEX="https://download.pytorch.org/whl/cpu"

torch_build() {
    # (stderr dropped: torch warns when numpy, installed with treecompile below, is not there yet)
    python3 -c 'import torch; print(f"torch {torch.__version__} (" + (f"CUDA {torch.version.cuda} build" if torch.version.cuda else "CPU build") + ")")' 2>/dev/null
}

if python3 -c 'import torch, sys; v = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]); sys.exit(v < (2, 11))' 2>/dev/null; then
    echo "setup: keeping the installed $(torch_build)"
elif python3 -c "import urllib.request; urllib.request.urlopen('$CPU_INDEX/torch/', timeout=10)" 2>/dev/null; then
    echo "setup: no torch >= 2.11 installed; installing $TORCH, CPU build, from $CPU_INDEX"
    python3 -m pip install -q "$TORCH" --index-url "$CPU_INDEX"
    echo "setup: installed $(torch_build)"
else
    echo "setup: no torch >= 2.11 installed, and the CPU wheel index $CPU_INDEX cannot be reached;"
    echo "setup: installing $TORCH from the configured package index (on PyPI for Linux x86-64: the CUDA build, several GB)"
    python3 -m pip install -q "$TORCH"
    echo "setup: installed $(torch_build)"
fi
echo "setup: pip install -e .[${extras}]"
python3 -m pip install -q -e ".[${extras}]"
