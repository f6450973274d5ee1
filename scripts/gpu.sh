#!/usr/bin/env bash
# treecompile on a CUDA machine: install without touching torch, then check or benchmark, with a report.
#
#   scripts/gpu.sh check [--out DIR] [--dry-run] [--no-install]   # tests/gpu/, in sections (< 8 min on an H100)
#   scripts/gpu.sh bench [--out DIR] [--dry-run] [--no-install]   # treecompile bench --device cuda (< 8 min)
#   scripts/gpu.sh tune  [--out DIR] [--no-install]               # treecompile tune: a new FlexAttention options table
#   scripts/gpu.sh profile [--out DIR] [--no-install]             # one Qwen3-1.7B-shaped step under torch.profiler
#   scripts/gpu.sh perf  [--out DIR] [--dry-run]                  # tune + benchmark at every POR + profile (< 9 min)
#   scripts/gpu.sh run   [--out DIR] [--dry-run]                  # 40 training steps, a new tree each, vs HF (< 9 min)
#   scripts/gpu.sh install                                        # only the install step
#   --sections a,b: run only those sections (e.g. one that ran out of time)
#   --limit S: no section runs longer than S seconds (a short GPU lease)
#
# Needs a CUDA build of torch >= 2.11 already installed (it is never installed, upgraded or
# downgraded here: every pip call is --no-deps). Offline machines: put the wheels that
# requirements-gpu.txt names in .whl/ (or WHEELS=DIR) and they are installed from there.
# Writes DIR/gpu-COMMAND.md, DIR/gpu-COMMAND.json and DIR/gpu-COMMAND-raw.tar.gz (default DIR:
# gpu-report). A failing section never stops the others. See docs/gpu.md.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
usage() { sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; }

cmd=${1:-}
[ $# -gt 0 ] && shift
out=gpu-report dry=0 install=1 sections= limit=
while [ $# -gt 0 ]; do
  case "$1" in
    --out) out=${2:?--out needs a directory}; shift 2 ;;
    --out=*) out=${1#--out=}; shift ;;
    --dry-run) dry=1; shift ;;
    --no-install) install=0; shift ;;
    --sections) sections=${2:?--sections needs names}; shift 2 ;;
    --limit) limit=${2:?--limit needs seconds}; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "gpu.sh: unknown option $1" >&2; usage >&2; exit 2 ;;
  esac
done
case "$cmd" in
  check|bench|tune|profile|perf|run|install) ;;
  *) usage >&2; exit 2 ;;
esac
mkdir -p "$out"

install_project() {
  # torch must be there already, and new enough; nothing below may replace it.
  "$PY" -c 'import sys, torch; v = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]); sys.exit(0 if v >= (2, 11) else 1)' \
    || { echo "torch >= 2.11 is not installed for $PY"; return 1; }
  local args=(--no-deps --no-build-isolation --no-input --disable-pip-version-check -q)
  local wheels=${WHEELS:-.whl}
  [ -d "$wheels" ] && args+=(--no-index --find-links "$wheels")
  if "$PY" -m pip install "${args[@]}" -e .; then
    project="pip install -e ."
  else  # e.g. a setuptools too old for this pyproject, and no network to fetch a newer one
    echo "pip install -e . failed: using the checkout through PYTHONPATH"
    link_checkout
    project="the checkout through PYTHONPATH (pip install -e . failed)"
  fi
  "$PY" -m pip install "${args[@]}" -r requirements-gpu.txt || return 1
}

link_checkout() {
  # The package as setuptools would map it (treecompile/, passes/ and kernels/ as subpackages),
  # made of links into the checkout: nothing to build.
  local site="${TMPDIR:-/tmp}/treecompile-checkout"
  rm -rf "$site" && mkdir -p "$site/treecompile"
  for f in "$PWD"/treecompile/*; do ln -s "$f" "$site/treecompile/"; done
  ln -s "$PWD/passes" "$site/treecompile/passes"
  ln -s "$PWD/kernels" "$site/treecompile/kernels"
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" TREECOMPILE_LINKED_SITE="$site"
}

note="not run" project="not installed"
if [ "$cmd" = perf ] || [ "$cmd" = run ]; then  # no pip: Qwen3 needs nothing beyond the image, and the checkout is linked in
  link_checkout
  note="none needed: the checkout through PYTHONPATH"
elif [ "$cmd" = install ] || { [ "$dry" = 0 ] && [ "$install" = 1 ]; }; then
  if install_project >"$out/gpu-install.log" 2>&1; then
    note="ok (--no-deps; project: $project; requirements-gpu.txt installed)"
  else
    note="FAILED (project: $project), see gpu-install.log: $(tail -n 1 "$out/gpu-install.log")"
  fi
  echo "[gpu.sh] install: $note" >&2
  [ "$cmd" = install ] && { [ "${note%% *}" = ok ]; exit $?; }
elif [ "$dry" = 1 ]; then
  note="skipped: dry run"
else
  note="skipped: --no-install"
fi

args=("$cmd" --out "$out" --install "$note" --invocation "scripts/gpu.sh $cmd")
[ "$dry" = 1 ] && args+=(--dry-run)
[ -n "$sections" ] && args+=(--sections "$sections")
[ -n "$limit" ] && args+=(--limit "$limit")
exec "$PY" scripts/gpu_check.py "${args[@]}"
