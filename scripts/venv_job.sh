# Sourced by the test jobs that run against other pins than the main environment's
# (scripts/test_oldest.sh, scripts/test_verl.sh): `venv_job DIR EXTRAS PIN` makes the venv DIR
# (it sees the packages already installed, torch above all, so only PIN and what pins to it are
# installed again, in the venv, over them), activates it, installs treecompile with EXTRAS and
# then PIN (with any further arguments given to pip: `venv_job DIR EXTRAS PIN --no-deps`), and
# sets one torch thread per test worker.
venv_job() {
    local venv=$1 extras=$2 pin=$3
    shift 3
    [ -x "$venv/bin/python3" ] || python3 -m venv --system-site-packages "$venv"
    # shellcheck disable=SC1091
    source "$venv/bin/activate"
    bash scripts/setup.sh "$extras"
    echo "setup: pip install $pin"
    python3 -m pip install -q "$@" "$pin"
    export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
}
