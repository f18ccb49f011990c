"""A dataset's content fingerprint: what a resumed run compares, so the same name with new contents is refused.

Pure file reading, no MPI: rank 0 computes it at start-up and records it in
every checkpoint's metadata. The built-in datasets (``digits``, ``mnist5k``,
``synthetic``) are fixed by their name and settings and have none.
"""

import hashlib
import os

from .sources import DATASETS

__all__ = ["dataset_fingerprint", "DATA_FILES"]

# The files a data directory may hold, in the order they are hashed.
DATA_FILES = ("x.npy", "y.npy", "x_test.npy", "y_test.npy")
_CHUNK = 1 << 20


def _hash_file(h, path):
    with open(path, "rb") as fh:
        while True:
            chunk = fh.read(_CHUNK)
            if not chunk:
                return
            h.update(chunk)


def dataset_fingerprint(dataset):
    """``{"path": resolved path, "sha256": hex}`` for a dataset file or directory, or None.

    None for a built-in dataset, or for one that cannot be read here (the
    data loading that came before has said why, or will).
    """
    if dataset in DATASETS:
        return None
    path = os.path.realpath(dataset)
    h = hashlib.sha256()
    try:
        if os.path.isdir(path):
            for name in DATA_FILES:
                file = os.path.join(path, name)
                if os.path.exists(file):
                    h.update(f"\0{name}\0".encode())
                    _hash_file(h, file)
        else:
            _hash_file(h, path)
    except OSError:
        return None
    return {"path": path, "sha256": h.hexdigest()}
