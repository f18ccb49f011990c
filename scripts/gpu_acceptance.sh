#!/usr/bin/env bash
# The GPU path's acceptance run, in one go, on a machine with an NVIDIA GPU, CuPy and MPI:
#
#   bash scripts/gpu_acceptance.sh            # from the project's root
#   bash .gpu/on-device.sh bash scripts/gpu_acceptance.sh   # on the lent H200 (see the README's GPU section)
#
# 1. the GPU tests at 2 and 3 ranks (CUDA IPC against MPI's Allreduce, its phases, the sharded step on CuPy);
# 2. `bench allreduce --device gpu` at 2 and 3 ranks, 16 MiB to 256 MiB (auto = CUDA IPC, against MPI staged
#    through the host and torch gloo, with the device copy rate), and the IPC probe beside it when present;
# 3. mnist5k training on the GPU at 2 ranks, twice: the first run (cold kernel cache) and a warm one.
# Each step prints a header; a failing step does not stop the rest, and the exit status is the number of failures.
set -u
failed=0
step() { echo; echo "=== $*"; "$@" || failed=$((failed + 1)); }
py=${PYTHON:-python3}
step mpirun -np 2 "$py" -m pytest --with-mpi -q -rs tests/mpi/test_cuda_ipc.py tests/mpi/test_collectives.py
step mpirun -np 3 "$py" -m pytest --with-mpi -q -rs tests/mpi/test_cuda_ipc.py
step "$py" -m pytest -q -rs -m gpu tests/unit
for n in 2 3; do
  step mpirun -np "$n" "$py" -m ringtrain bench allreduce --device gpu --min-bytes 16M --max-bytes 256M
  if [ -f .gpu/ipc_probe.py ]; then step mpirun -np "$n" "$py" .gpu/ipc_probe.py 16777216,67108864,268435456; fi
done
export CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-$(mktemp -d)}  # a fresh cache: the first run compiles every kernel
for run in cold warm; do
  start=$(date +%s.%N)
  step mpirun -np 2 "$py" -m ringtrain train --device gpu --dataset mnist5k --hidden 512,512 --batch-size 64 \
    --epochs 5 --resume none --run-dir "$(mktemp -d)" --no-progress
  echo "$run cache: $(echo "$(date +%s.%N) - $start" | bc) s wall"
done
exit "$failed"
