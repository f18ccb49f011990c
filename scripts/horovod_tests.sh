#!/usr/bin/env bash
# Run Horovod's own PyTorch tests, unmodified, against ringtrain.torch.
#
#   scripts/horovod_tests.sh HOROVOD_CHECKOUT [NP ...]     (default NP: 2 3)
#
# HOROVOD_CHECKOUT holds test/parallel/test_torch.py and test/utils/ (for
# example `git clone -b v0.28.1 https://github.com/horovod/horovod`). The
# forwarding package scripts/horovod_compat/horovod goes first on PYTHONPATH,
# so the file's `import horovod.torch as hvd` gets ringtrain.torch; the
# muon_off plugin hides torch.optim.Muon (see its docstring). Each rank writes
# a JUnit report; a test counts as passed only if it passed on every rank.
#
# Environment: PYTHON (default: .venv/bin/python, else python3), MPIRUN
# (default: next to PYTHON, else mpirun), TIMEOUT per mpirun in seconds
# (default 900), PYTEST_K (a pytest -k expression, e.g. "allreduce and not grad"),
# KEEP_LOGS (a directory to keep each rank's log and report in).
set -u
here="$(cd "$(dirname "$0")" && pwd)"
root="$(dirname "$here")"
if [ $# -lt 1 ] || [ ! -f "$1/test/parallel/test_torch.py" ]; then
    echo "usage: $0 HOROVOD_CHECKOUT [NP ...]: expected HOROVOD_CHECKOUT/test/parallel/test_torch.py" >&2
    exit 2
fi
checkout="$(cd "$1" && pwd)"; shift
nps=("$@"); [ ${#nps[@]} -eq 0 ] && nps=(2 3)
for np in "${nps[@]}"; do
    case "$np" in ''|*[!0-9]*|0) echo "$0: NP must be a positive integer, got '$np'" >&2; exit 2;; esac
done
python="${PYTHON:-$root/.venv/bin/python}"; [ -x "$python" ] || python="$(command -v python3)"
mpirun="${MPIRUN:-$(dirname "$python")/mpirun}"; [ -x "$mpirun" ] || mpirun="$(command -v mpirun)"
timeout_s="${TIMEOUT:-900}"
reports="$(mktemp -d)"
trap 'rm -rf "$reports"' EXIT
status=0
for np in "${nps[@]}"; do
    mkdir -p "$reports/np$np"
    # PMI_RANK (MPICH) or OMPI_COMM_WORLD_RANK (Open MPI) names each rank's report.
    PYTHONPATH="$root/scripts/horovod_compat:$root${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=1 \
        timeout -k 10 "$timeout_s" "$mpirun" -np "$np" bash -c \
        'r=${PMI_RANK:-${OMPI_COMM_WORLD_RANK:-0}}; cd "$1" && exec "$2" -m pytest -p muon_off -v \
            -p no:cacheprovider -o faulthandler_timeout=120 ${PYTEST_K:+-k "$PYTEST_K"} test_torch.py \
            --junitxml="$3/rank-$r.xml" > "$3/rank-$r.log" 2>&1' \
        _ "$checkout/test/parallel" "$python" "$reports/np$np" > "$reports/np$np/mpirun.log" 2>&1
    rc=$?
    [ $rc -eq 124 ] && echo "np=$np: timed out after ${timeout_s}s" >&2
    "$python" "$here/horovod_tests_summary.py" "$np" "$reports/np$np" || status=1
    # KEEP_LOGS=DIR keeps every rank's pytest output (DIR/npN/rank-R.log).
    [ -n "${KEEP_LOGS:-}" ] && mkdir -p "$KEEP_LOGS" && cp -r "$reports/np$np" "$KEEP_LOGS/"
done
exit $status
