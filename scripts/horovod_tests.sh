#!/usr/bin/env bash
# Run Horovod's own tests, unmodified, against ringtrain (test_torch.py by default).
#
#   scripts/horovod_tests.sh HOROVOD_CHECKOUT [NP ...]     (default NP: 2 3)
#   TEST_FILE=test_tensorflow.py scripts/horovod_tests.sh HOROVOD_CHECKOUT 2 3
#
# HOROVOD_CHECKOUT holds test/parallel/$TEST_FILE and test/utils/ (for
# example `git clone -b v0.28.1 https://github.com/horovod/horovod`). pytest
# runs under ringtrain's runner (`python -m ringtrain.horovod -m pytest`), so
# the file's `import horovod.torch as hvd` gets ringtrain.torch in those
# processes only; scripts/horovod_compat on PYTHONPATH adds the muon_off
# plugin, which hides torch.optim.Muon (see its docstring), and `mock`. Each
# rank writes a JUnit report; a test counts as passed only if it passed on every rank.
#
# The tests run CHUNK at a time, one mpirun per chunk (CHUNK=1 is one mpirun
# per test, as Horovod's own CI runs them), each rank's pytest with -x and its
# -v log written unbuffered: a test that fails, on one rank or on all, ends
# its mpirun at once (mpirun ends the job when a rank exits with an error)
# rather than leaving the ranks out of step until the bound, and the chunk's
# remaining tests run again in a new mpirun. A rank that mpirun killed still
# tells, in its log, which tests it finished.
#
# Environment: PYTHON (default: .venv/bin/python, else python3), MPIRUN
# (default: next to PYTHON, else mpirun), CHUNK (default 20), TIMEOUT per
# mpirun in seconds (default 300), TEST_FILE (default test_torch.py; the muon_off
# plugin is loaded for it only), PYTEST_K (a pytest -k expression, e.g.
# "allreduce and not grad"), KEEP_LOGS (a directory the logs and reports are
# written to as the run goes, and kept: what ran before a run was cut off is there).
set -u
here="$(cd "$(dirname "$0")" && pwd)"
root="$(dirname "$here")"
test_file="${TEST_FILE:-test_torch.py}"
case "$test_file" in */*|'') echo "$0: TEST_FILE must be a file name in test/parallel, got '$test_file'" >&2; exit 2;; esac
if [ $# -lt 1 ] || [ ! -f "$1/test/parallel/$test_file" ]; then
    echo "usage: $0 HOROVOD_CHECKOUT [NP ...]: expected HOROVOD_CHECKOUT/test/parallel/$test_file" >&2
    exit 2
fi
plugins=""; [ "$test_file" = test_torch.py ] && plugins="-p muon_off"
checkout="$(cd "$1" && pwd)"; shift
nps=("$@"); [ ${#nps[@]} -eq 0 ] && nps=(2 3)
for np in "${nps[@]}"; do
    case "$np" in ''|*[!0-9]*|0) echo "$0: NP must be a positive integer, got '$np'" >&2; exit 2;; esac
done
chunk="${CHUNK:-20}"
case "$chunk" in ''|*[!0-9]*|0) echo "$0: CHUNK must be a positive integer, got '$chunk'" >&2; exit 2;; esac
python="${PYTHON:-$root/.venv/bin/python}"; [ -x "$python" ] || python="$(command -v python3)"
mpirun="${MPIRUN:-$(dirname "$python")/mpirun}"; [ -x "$mpirun" ] || mpirun="$(command -v mpirun)"
timeout_s="${TIMEOUT:-300}"
if [ -n "${KEEP_LOGS:-}" ]; then
    if [ -e "$KEEP_LOGS" ] && { [ ! -d "$KEEP_LOGS" ] || [ -n "$(ls -A "$KEEP_LOGS")" ]; }; then
        echo "$0: KEEP_LOGS must name an empty or new directory, got '$KEEP_LOGS' (not an empty directory)" >&2
        exit 2
    fi
    mkdir -p "$KEEP_LOGS" && reports="$(cd "$KEEP_LOGS" && pwd)" || exit 2
else
    reports="$(mktemp -d)"
    trap 'rm -rf "$reports"' EXIT
fi
export PYTHONPATH="$root/scripts/horovod_compat:$root${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=1 \
    PYTHONUNBUFFERED=1
# The test ids, collected once in a single process (pytest 9 prints them from the
# checkout's root, where setup.cfg is; they are passed from test/parallel). Only
# lines that are ids: TensorFlow's log lines also hold '::' (absl::InitializeLog).
(cd "$checkout/test/parallel" && "$python" -m ringtrain.horovod -m pytest $plugins -q --collect-only -p no:cacheprovider \
    ${PYTEST_K:+-k "$PYTEST_K"} "$test_file") | sed 's#^test/parallel/##' | grep -F "$test_file::" | grep -v ' ' > "$reports/ids"
if [ ! -s "$reports/ids" ]; then
    echo "$0: collected no tests from $checkout/test/parallel/$test_file" >&2
    exit 2
fi
split -l "$chunk" -d -a 3 "$reports/ids" "$reports/chunk-"
status=0
for np in "${nps[@]}"; do
    for list in "$reports"/chunk-*; do
        todo="$list"; attempt=0
        while [ -s "$todo" ]; do
            out="$reports/np$np/$(basename "$list").$(printf %03d "$attempt")"
            mkdir -p "$out"
            # PMI_RANK (MPICH) or OMPI_COMM_WORLD_RANK (Open MPI) names each rank's report and log.
            timeout -k 10 "$timeout_s" "$mpirun" -np "$np" bash -c \
                'r=${PMI_RANK:-${OMPI_COMM_WORLD_RANK:-0}}; cd "$1" && exec "$2" -m ringtrain.horovod -m pytest $5 -v -x \
                    -p no:cacheprovider -o faulthandler_timeout=120 $(cat "$4") \
                    --junitxml="$3/rank-$r.xml" > "$3/rank-$r.log" 2>&1' \
                _ "$checkout/test/parallel" "$python" "$out" "$todo" "$plugins" > "$out/mpirun.log" 2>&1
            case $? in 124|137) echo "np=$np $(basename "$out"): timed out after ${timeout_s}s" >&2;; esac
            # The tests after the first one that did not pass on every rank run again, in a new mpirun
            # (none when nothing ran at all: see horovod_tests_summary.rest).
            if ! "$python" "$here/horovod_tests_summary.py" --rest "$np" "$todo" "$out" > "$out/rest"; then
                echo "np=$np $(basename "$out"): could not read the attempt's outcomes; the chunk ends here" >&2
                : > "$out/rest"
            fi
            todo="$out/rest"; attempt=$((attempt + 1))
        done
    done
    "$python" "$here/horovod_tests_summary.py" "$np" "$reports/ids" "$reports/np$np" || status=1
done
exit $status
