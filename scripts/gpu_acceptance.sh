#!/usr/bin/env bash
# The GPU path's acceptance, in one command, on a machine with an NVIDIA GPU.
#
#   python3 -m venv .venv && .venv/bin/pip install -e '.[mpich,test,mnist,cuda12]'   # cuda13 for a CUDA 13 driver
#   bash scripts/gpu_acceptance.sh [all|tests|bench|train]      # from the project's root; default all
#
# The cuda12/cuda13 extras install CuPy with the CUDA toolkit libraries it compiles and multiplies with
# (NVRTC, cuBLAS: cupy-cuda12x[ctk]), so a bare machine needs only the NVIDIA driver. With a Python
# that already has CuPy and no network, bring MPI, mpi4py, pytest-mpi and mlxtend some other way, and
# point PYTHON and MPIRUN at them.
#
# What it does, printing each command before it runs it:
#   0. on a machine without a GPU: one line saying so, exit status 2, nothing else;
#   1. checks its own dependencies (mpirun, mpi4py, pytest, pytest-mpi, CuPy with a kernel compile and
#      a matrix product, mlxtend; torch with CUDA is optional) and stops with the install line if any
#      is missing;
#   2. tests: the GPU tests under mpirun at 2, 3 and 4 ranks sharing the GPU (tests/mpi/test_cuda_ipc.py,
#      tests/mpi/test_gpu.py, the CuPy cases of tests/mpi/test_collectives.py), the GPU unit tests, and
#      exiting right after an allreduce and `ringtrain info` on CUDA IPC (tests/cli/test_gpu_cli.py);
#   3. bench: `ringtrain bench allreduce --device gpu` at 2 ranks, 16 MiB to 256 MiB, and the CUDA IPC
#      probe beside it (.gpu/ipc_probe.py, or the file RINGTRAIN_IPC_PROBE names; not part of ringtrain);
#   4. train: mnist5k (784-512-512-10, batch 64, 2 ranks) on the GPU with an empty kernel cache, then
#      again with the warm one; the CPU's sharded step on the same machine; a run stopped at step 150
#      and resumed, compared bitwise with a straight run;
#   5. one table of every figure against its target (scripts/gpu_report.py), from what ran.
#
# Every step has a time bound (STEP_TIMEOUT seconds, default 420). Files go to RINGTRAIN_ACCEPTANCE_DIR
# (default: a fresh temporary directory). The exit status is the number of failed steps and missed targets.
# Where one command may run only so long, run `tests`, `bench` and `train` as three commands with the same
# RINGTRAIN_ACCEPTANCE_DIR: each ends with the table of everything that directory holds so far.
set -u
cd "$(dirname "$0")/.."
what=${1:-all}
case $what in all|tests|bench|train) ;; *) echo "usage: bash scripts/gpu_acceptance.sh [all|tests|bench|train]" >&2; exit 2;; esac

if [ -x .venv/bin/python ]; then py=${PYTHON:-.venv/bin/python}; else py=${PYTHON:-python3}; fi
if [ -x .venv/bin/mpirun ]; then mpirun=${MPIRUN:-.venv/bin/mpirun}; else mpirun=${MPIRUN:-mpirun}; fi

# 0. A GPU at all? The driver's device files, the driver's own tool, or CuPy: any one will do.
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
if ! ls /dev/nvidia[0-9]* >/dev/null 2>&1 && [ "${gpus:-0}" = 0 ] \
   && ! "$py" -c 'import cupy, sys; sys.exit(0 if cupy.is_available() else 1)' >/dev/null 2>&1; then
  echo "gpu_acceptance: no NVIDIA GPU on this machine (no /dev/nvidia*, nvidia-smi lists none, CuPy sees none); nothing to accept"
  exit 2
fi

# 1. Dependencies: every missing one is named, then it stops.
missing=()
command -v "$mpirun" >/dev/null 2>&1 || missing+=("mpirun (an MPI runtime: the mpich extra)")
for module in mpi4py pytest pytest_mpi mlxtend ringtrain; do
  "$py" -c "import $module" >/dev/null 2>&1 || missing+=("the Python module $module")
done
# Without NVRTC or cuBLAS CuPy still imports and sees the GPU; the first kernel or matrix product fails.
check='import cupy as cp; assert cp.is_available(), "CuPy sees no GPU"; a = cp.ones((2, 2), cp.float32)
assert float((a @ a + 1).sum()) == 12.0'
if ! out=$("$py" -c "$check" 2>&1); then
  missing+=("CuPy that sees the GPU, compiles a kernel and multiplies matrices (NVRTC and cuBLAS: the [ctk] in the cuda12/cuda13 extras): ${out##*$'\n'}")
fi
if [ ${#missing[@]} -gt 0 ]; then
  echo "gpu_acceptance: missing:"
  printf '  - %s\n' "${missing[@]}"
  echo "install: python3 -m venv .venv && .venv/bin/pip install -e '.[mpich,test,mnist,cuda12]'   (or cuda13)"
  exit 2
fi
mpiflags=()
if "$mpirun" --version 2>&1 | grep -q "Open MPI"; then
  mpiflags+=(--oversubscribe)
  [ "$(id -u)" = 0 ] && mpiflags+=(--allow-run-as-root)
fi

out=${RINGTRAIN_ACCEPTANCE_DIR:-$(mktemp -d -t ringtrain-gpu-XXXXXX)}
mkdir -p "$out"
limit=${STEP_TIMEOUT:-420}
versions='import sys, cupy; from mpi4py import MPI
print(f"python {sys.version.split()[0]}, CuPy {cupy.__version__}, {MPI.Get_library_version().splitlines()[0].strip()}")'
echo "gpu_acceptance: $what; $("$py" -c "$versions" 2>&1 | tail -1); files in $out"
nvidia-smi --query-gpu=name,memory.total,driver_version,compute_mode --format=csv,noheader 2>/dev/null

# step NAME COMMAND...: print it, run it under the time bound, record status and seconds in steps.tsv.
step() {
  local name=$1; shift
  echo >&2; echo "=== [$name] $*" >&2
  local start=$(date +%s.%N)
  timeout --kill-after=10 "$limit" "$@"
  local status=$?
  echo -e "$name\t$status\t$(echo "$(date +%s.%N) $start" | awk '{printf "%.2f", $1 - $2}')" >> "$out/steps.tsv"
  return $status
}
# run_mpi NAME N COMMAND...: the same, on N ranks.
run_mpi() { local name=$1 n=$2; shift 2; step "$name" "$mpirun" -np "$n" ${mpiflags[@]+"${mpiflags[@]}"} "$@"; }

if [ "$what" = all ] || [ "$what" = tests ]; then
  for n in 2 3 4; do
    run_mpi "tests at $n ranks" "$n" "$py" -m pytest --with-mpi -q -rs -p no:cacheprovider \
      tests/mpi/test_cuda_ipc.py tests/mpi/test_gpu.py
    run_mpi "collectives on CuPy at $n ranks" "$n" "$py" -m pytest --with-mpi -q -rs -p no:cacheprovider -m gpu \
      tests/mpi/test_collectives.py
  done
  step "GPU unit tests" "$py" -m pytest -q -rs -p no:cacheprovider -m gpu tests/unit/test_models.py \
    tests/unit/test_cnn.py tests/unit/test_torch_model.py
  step "GPU commands (exit after an allreduce, info)" "$py" -m pytest -q -rs -p no:cacheprovider tests/cli/test_gpu_cli.py
fi

if [ "$what" = all ] || [ "$what" = bench ]; then
  run_mpi "bench at 2 ranks" 2 "$py" -m ringtrain bench allreduce --device gpu --min-bytes 16M --max-bytes 256M \
    --json > "$out/bench-2.json"
  probe=${RINGTRAIN_IPC_PROBE:-.gpu/ipc_probe.py}
  if [ -f "$probe" ]; then
    run_mpi "IPC probe at 2 ranks" 2 "$py" "$probe" 16777216,67108864,268435456 | tee "$out/probe-2.txt"
  else
    echo; echo "=== [IPC probe] not run: $probe is absent (the probe is not part of ringtrain; set RINGTRAIN_IPC_PROBE to it)"
  fi
fi

if [ "$what" = all ] || [ "$what" = train ]; then
  mnist=(--dataset mnist5k --hidden 512,512 --batch-size 64 --no-progress)
  export CUPY_CACHE_DIR
  CUPY_CACHE_DIR=$(mktemp -d -t ringtrain-cupy-cache-XXXXXX)  # empty: the first run compiles every kernel
  for run in cold warm; do
    run_mpi "train, $run kernel cache" 2 "$py" -m ringtrain train --device gpu "${mnist[@]}" --epochs 5 \
      --resume none --run-dir "$out/train-$run"
  done
  run_mpi "train on the CPU (sharded step)" 2 "$py" -m ringtrain train --device cpu "${mnist[@]}" --epochs 5 \
    --resume none --run-dir "$out/train-cpu"
  # About 35 steps an epoch: step 50 stops mid-epoch 2, with a checkpoint; the rerun resumes from it.
  run_mpi "straight run" 2 "$py" -m ringtrain train --device gpu "${mnist[@]}" --epochs 3 --resume none \
    --run-dir "$out/straight"
  run_mpi "run stopped at step 50" 2 "$py" -m ringtrain train --device gpu "${mnist[@]}" --epochs 3 --resume none \
    --max-steps 50 --run-dir "$out/resumed"
  run_mpi "the same run resumed" 2 "$py" -m ringtrain train --device gpu "${mnist[@]}" --epochs 3 --resume auto \
    --run-dir "$out/resumed"
fi

echo
"$py" scripts/gpu_report.py "$out"
