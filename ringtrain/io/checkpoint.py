"""Checkpoints: atomic, checksummed save; verified load; keep the newest K.

Only rank 0 calls these; the trainer broadcasts what it loads. Nothing here
talks to MPI.

The format is one ``.npz`` file per checkpoint (an uncompressed zip of
``.npy`` members), so NumPy and anything else that reads zip and ``.npy``
can open it; nothing is pickled, and loading refuses pickled members. Each
array is a member under the name the trainer gave it (``params/fc1.weight``,
``optim/momentum/fc1.weight``, ...), in the order given. The member
``__meta__`` is a uint8 array holding UTF-8 JSON: the trainer's metadata plus
``format`` (``"ringtrain-checkpoint"``), ``format_version``, ``step`` and
``sha256``. Any reader can get at it with::

    meta = json.loads(np.load(path)["__meta__"].tobytes())

The checksum is SHA-256 over a canonical serialisation of every array (name,
dtype, shape, C-order bytes, sorted by name) and of the metadata without the
``sha256`` key. Zip's own CRC-32 covers only the member data, not the names,
the ``.npy`` headers or the central directory, and a truncated or mangled
zip can still parse; the checksum is what makes a damaged file fail loudly
instead of loading wrong numbers.

A save writes ``.ckpt-00000120.npz.tmp-<pid>`` in the same directory, fsyncs
it, renames it onto ``ckpt-00000120.npz`` (atomic on POSIX) and fsyncs the
directory, so a crash at any moment leaves either the old set of checkpoints
or the old set plus the new one, never a half-written ``ckpt-*.npz``.
"""

import contextlib
import errno
import hashlib
import json
import os
import re
import stat
import warnings
import zipfile

import numpy as np

from ..errors import UsageError
from .rundir import create_new
from .safeio import open_regular, physical_memory

__all__ = [
    "CheckpointError",
    "CheckpointTooNew",
    "CheckpointWarning",
    "MAX_INFLATION",
    "check_formats",
    "FORMAT",
    "FORMAT_VERSION",
    "checkpoint_name",
    "latest_valid_checkpoint",
    "hash_arrays",
    "list_checkpoints",
    "load_checkpoint",
    "read_checkpoint",
    "save_checkpoint",
]

FORMAT = "ringtrain-checkpoint"
FORMAT_VERSION = 1

META_KEY = "__meta__"
# Keys save_checkpoint writes into the metadata itself.
_RESERVED = ("format", "format_version", "step", "sha256")
# bool, integers, floats, complex, bytes and str: what .npy stores without
# pickling and every reader understands.
_PLAIN_KINDS = "biufcSU"
_NAME_RE = re.compile(r"^ckpt-(\d+)\.npz$")
_TEMP_RE = re.compile(r"^\.ckpt-\d+\.npz\.tmp-(\d+)$")
_CHECKPOINT_DIR = "checkpoints"
# A compressed checkpoint may inflate to this many times its size on disk
# (model weights compress a little, never a hundredfold), or to this many
# bytes, whichever is more (a small file of zeros is no bomb).
MAX_INFLATION = 64
_INFLATION_FLOOR = 64 << 20


class CheckpointError(UsageError):
    """A checkpoint could not be written, or a file is not a whole checkpoint.

    The message is one line naming the file (or directory) and the problem.
    """


class CheckpointTooNew(CheckpointError):
    """A checkpoint written by a newer ringtrain, in a format this one cannot read.

    Never skipped: a resume that fell back past it would later prune or
    overwrite it, losing the newest work. Refused, naming both versions.
    """


class CheckpointWarning(UserWarning):
    """A damaged checkpoint or a stale temporary file was skipped."""


def checkpoint_name(step):
    """Return the file name for ``step``: ``ckpt-00000120.npz``."""
    return f"ckpt-{step:08d}.npz"


# ----------------------------------------------------------------------------
# canonical serialisation and checksum


def _canonical_json(obj):
    return json.dumps(
        obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    )


def _json_default(obj):
    # NumPy scalars and small arrays turn up in configurations and RNG state.
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, (tuple, set, frozenset)):
        return list(obj)
    raise TypeError(f"{type(obj).__name__} is not JSON serialisable")


def hash_arrays(h, arrays):
    """Feed ``arrays`` to ``h`` (a hashlib or hmac object) in the checksum's canonical form, sorted by name."""
    for name in sorted(arrays):
        _hash_array(h, name, arrays[name])


def _hash_array(h, name, array):
    header = json.dumps(
        [name, np.lib.format.dtype_to_descr(array.dtype), list(array.shape)],
        separators=(",", ":"),
    ).encode()
    # Length prefixes make the serialisation unambiguous.
    h.update(len(header).to_bytes(8, "little"))
    h.update(header)
    h.update(array.nbytes.to_bytes(8, "little"))
    # ravel() is a view for C-contiguous arrays; hashing the view's bytes
    # avoids a copy of the data.
    h.update(np.ascontiguousarray(array).reshape(-1).view(np.uint8))


def _hash_meta(h, meta_without_sum):
    text = _canonical_json(meta_without_sum).encode()
    h.update(b"\0meta")
    h.update(len(text).to_bytes(8, "little"))
    h.update(text)


def _new_hash():
    h = hashlib.sha256()
    h.update(f"{FORMAT}\0{FORMAT_VERSION}\0".encode())
    return h


def _checksum(arrays, meta_without_sum):
    h = _new_hash()
    for name in sorted(arrays):
        _hash_array(h, name, arrays[name])
    _hash_meta(h, meta_without_sum)
    return h.hexdigest()


# ----------------------------------------------------------------------------
# saving


def _check_arrays(arrays):
    checked = {}
    for name, value in arrays.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"array names must be non-empty strings, got {name!r}")
        if name == META_KEY:
            raise ValueError(f"array name {META_KEY!r} is reserved for the metadata")
        array = np.asarray(value)
        if array.dtype.kind not in _PLAIN_KINDS or array.dtype.fields is not None:
            raise ValueError(
                f"array {name!r} has dtype {array.dtype}; checkpoints hold bool, "
                "integer, float, complex, bytes and str arrays only (never pickles)"
            )
        checked[name] = array
    return checked


def _prepare_meta(step, metadata):
    metadata = dict(metadata or {})
    for key in _RESERVED:
        if key in metadata and not (key == "step" and metadata[key] == step):
            raise ValueError(f"metadata key {key!r} is reserved; save_checkpoint sets it")
    metadata.update(format=FORMAT, format_version=FORMAT_VERSION, step=step)
    try:
        text = json.dumps(metadata, default=_json_default, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"checkpoint metadata is not JSON serialisable: {exc}") from None
    # Hash what a reader will see after parsing, not the Python objects.
    return json.loads(text)


def _fsync_directory(directory):
    # The rename is durable only once the directory entry itself is on disk.
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def _write_npz(fileobj, arrays, meta):
    """Write ``arrays`` and ``meta`` as an uncompressed npz; return the meta written.

    The checksum is computed in the same pass, from the arrays in memory.
    """
    h = _new_hash()
    with zipfile.ZipFile(fileobj, mode="w", compression=zipfile.ZIP_STORED) as zf:
        # Members go in the caller's order (the model's layer order); the hash
        # goes over sorted names so it does not depend on that order.
        for name in arrays:
            with zf.open(name + ".npy", mode="w", force_zip64=True) as member:
                np.lib.format.write_array(member, arrays[name], allow_pickle=False)
        for name in sorted(arrays):
            _hash_array(h, name, arrays[name])
        _hash_meta(h, meta)
        meta = dict(meta, sha256=h.hexdigest())
        blob = np.frombuffer(_canonical_json(meta).encode(), dtype=np.uint8)
        with zf.open(META_KEY + ".npy", mode="w", force_zip64=True) as member:
            np.lib.format.write_array(member, blob, allow_pickle=False)
    return meta


def save_checkpoint(directory, step, arrays, metadata=None, keep=3):
    """Write one checkpoint atomically, then keep only the newest ``keep``.

    Args:
        directory: where checkpoints live (created if missing).
        step: the global step; names the file ``ckpt-<step, 8 digits>.npz``.
        arrays: flat dict name -> NumPy array, e.g. ``"params/fc1.weight"``,
            ``"optim/momentum/fc1.weight"``. NumPy arrays (copy GPU arrays
            to the host first) of plain dtypes only.
        metadata: JSON-able dict (epoch, configuration, RNG and data
            position, ...). The keys ``format``, ``format_version`` and
            ``sha256`` are reserved; ``step`` is filled in from ``step``.
        keep: how many checkpoints at or below ``step`` to keep, this one
            included; ``None`` keeps all. Checkpoints with a higher step (left
            by a run that was resumed from an earlier point) are not touched.

    Returns:
        The path of the new checkpoint (a str).

    Raises:
        CheckpointError: the file could not be written (disk full, no
            permission, ...). The temporary file is removed and the existing
            checkpoints are untouched.
        ValueError, TypeError: bad arguments (a programming error).
    """
    if isinstance(step, (bool, np.bool_)) or not isinstance(step, (int, np.integer)) or step < 0:
        raise ValueError(f"step must be a non-negative integer, got {step!r}")
    step = int(step)
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
        raise ValueError(f"keep must be at least 1 (or None to keep all), got {keep!r}")
    arrays = _check_arrays(arrays)
    meta = _prepare_meta(step, metadata)

    directory = os.fspath(directory)
    final = os.path.join(directory, checkpoint_name(step))
    try:
        _write_atomically(directory, final, arrays, meta)
    except OSError as exc:
        # A full disk with exactly `keep` checkpoints could never take another
        # if the old ones were pruned only after the new one is written; so
        # free what this save would prune anyway, if that makes room, and retry.
        pruned = _make_room(directory, step, keep, arrays, exc)
        if not pruned:
            raise CheckpointError(f"could not write checkpoint {final}: {exc.strerror or exc} "
                                  "(earlier checkpoints are untouched)") from exc
        try:
            _write_atomically(directory, final, arrays, meta)
        except OSError as again:
            raise CheckpointError(f"could not write checkpoint {final}: {again.strerror or again} (even after "
                                  f"pruning {pruned} older checkpoint(s) to make room; the newest others are "
                                  "untouched)") from again
    _prune(directory, step, keep)
    return final


def _write_atomically(directory, final, arrays, meta):
    """Write through a temporary file, fsync, rename; on any failure remove the temporary and re-raise."""
    temp = os.path.join(directory, f".{os.path.basename(final)}.tmp-{os.getpid()}")
    try:
        os.makedirs(directory, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)  # a leftover of a dead process that had our pid, or a planted link
        # O_EXCL | O_NOFOLLOW: never written through a symbolic link in the run directory.
        with os.fdopen(create_new(temp), "wb") as f:
            _write_npz(f, arrays, meta)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, final)
        _fsync_directory(directory)
    except BaseException:
        try:
            os.unlink(temp)
        except OSError:
            pass
        raise


def _make_room(directory, step, keep, arrays, exc):
    """After ENOSPC: delete the checkpoints this save would prune anyway, if that frees enough.

    Returns how many files were deleted (0: nothing done, because the disk is
    not what failed, there is nothing to prune, or pruning would not free
    enough, in which case every old checkpoint is left in place).
    """
    if exc.errno not in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)):
        return 0
    # What a successful save would leave: this one plus the newest keep - 1 at or below its step.
    doomed = [] if keep is None else [p for s, p in _steps_and_paths(directory) if s < step][keep - 1:]
    doomed += _stale_temporaries(directory)
    if not doomed:
        return 0
    # The file is the arrays plus small per-member headers and the metadata.
    needed = sum(a.nbytes for a in arrays.values()) + 512 * (len(arrays) + 1) + 64 * 1024
    try:
        fs = os.statvfs(directory)
        free = fs.f_bavail * fs.f_frsize
        freed = sum(os.stat(p).st_size for p in doomed)
    except OSError:
        return 0
    if free >= needed or free + freed < needed:
        return 0  # space was not the problem, or pruning cannot solve it: keep every checkpoint
    for path in doomed:
        _remove_quietly(path)
    return len(doomed)


def _prune(directory, step, keep):
    """Delete checkpoints older than the newest ``keep`` and dead temporaries."""
    if keep is not None:
        older = [(s, p) for s, p in _steps_and_paths(directory) if s <= step]
        for _, path in older[keep:]:
            _remove_quietly(path)
    for path in _stale_temporaries(directory):
        _remove_quietly(path)


def _remove_quietly(path):
    # Pruning is housekeeping: failing to delete an old file must not turn a
    # successful save into an error. Only regular files: whatever else has a
    # checkpoint's name (a link, a directory) was not written here.
    try:
        if stat.S_ISREG(os.lstat(path).st_mode):
            os.unlink(path)
    except OSError:
        pass


def _pid_alive(pid):
    if pid == os.getpid():
        return False  # our own saves always clean up, so any leftover is stale
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OSError:
        return False
    return True


def _stale_temporaries(directory):
    """Temporaries left by a save that died (its process is gone)."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    stale = []
    for name in sorted(names):
        match = _TEMP_RE.match(name)
        if match and not _pid_alive(int(match.group(1))):
            stale.append(os.path.join(directory, name))
    return stale


# ----------------------------------------------------------------------------
# listing and loading


def _steps_and_paths(directory):
    try:
        names = os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return []
    found = []
    for name in names:
        match = _NAME_RE.match(name)
        if match:
            found.append((int(match.group(1)), os.path.join(directory, name)))
    found.sort(reverse=True)
    return found


def list_checkpoints(directory):
    """Return the paths of ``ckpt-*.npz`` in ``directory``, newest step first.

    Only names are looked at; use :func:`read_checkpoint` to verify one.
    A missing directory has no checkpoints.
    """
    return [path for _, path in _steps_and_paths(os.fspath(directory))]


def _one_line(exc):
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 200 else text[:197] + "..."


class _Damaged(Exception):
    """A member that save_checkpoint would never write."""


def _read_members(f):
    """Read every member of an npz from the open file ``f`` (closed here); return (arrays in file order, meta bytes)."""
    arrays, meta_bytes = {}, None
    # A file object rather than a path for np.load: when the zip directory is
    # damaged, np.load's NpzFile fails after taking ownership of the file it
    # opened, and that file would leak.
    with f, np.load(f, allow_pickle=False) as npz:
        for key in npz.files:
            value = npz[key]
            if not isinstance(value, np.ndarray):
                raise _Damaged(f"unexpected member {key!r} (not a .npy array)")
            if key == META_KEY:
                meta_bytes = value.tobytes()
            else:
                arrays[key] = value
    return arrays, meta_bytes


def read_checkpoint(path, follow=True):
    """Read one checkpoint file and verify its checksum.

    Args:
        path: a ``.npz`` written by :func:`save_checkpoint`.
        follow: False refuses a symbolic link at ``path`` (``O_NOFOLLOW``).

    Returns:
        ``(arrays, metadata)``: the flat dict name -> NumPy array in the order
        saved, and the metadata dict (the trainer's keys plus ``format``,
        ``format_version``, ``step`` and ``sha256``).

    Raises:
        CheckpointError: one line naming the file and what is wrong with it
            (missing, empty, truncated, not a ringtrain checkpoint, pickled
            members, checksum mismatch, ...).
    """
    path = os.fspath(path)

    def fail(problem):
        return CheckpointError(f"checkpoint {path}: {problem}")

    arrays, meta_bytes = _read_zip(path, fail, follow)
    meta = _parse_meta(meta_bytes, fail)
    stored = meta.pop("sha256", None)
    if not isinstance(stored, str):
        raise fail("damaged metadata (no sha256 checksum)")
    actual = _checksum(arrays, meta)
    if actual != stored:
        raise fail(
            f"checksum mismatch (stored sha256 {stored[:12]}..., "
            f"contents hash to {actual[:12]}...); the file is damaged"
        )
    match = _NAME_RE.match(os.path.basename(path))
    if match and int(match.group(1)) != meta.get("step"):
        raise fail(f"holds step {meta.get('step')!r}, which does not match its file name")
    meta["sha256"] = stored
    return arrays, meta


def _read_zip(path, fail, follow=True):
    """The arrays and the raw metadata member of the checkpoint at ``path``; ``fail(problem)`` makes the error."""
    # A FIFO named like a checkpoint must not block the resume, nor a link
    # to /dev/zero fill memory; and a checkpoint is read whole, so it must fit.
    f = open_regular(path, "checkpoint", physical_memory(), "checkpoints", error=CheckpointError, follow=follow)
    try:
        size = os.fstat(f.fileno()).st_size
        magic = f.read(4)
    except OSError as exc:
        f.close()
        raise fail(f"cannot read it: {exc.strerror or _one_line(exc)}") from None
    if size == 0:
        f.close()
        raise fail("empty file (0 bytes); the save that wrote it did not finish")
    if magic != b"PK\x03\x04":
        f.close()
        raise fail("not a ringtrain checkpoint (not an npz/zip file)")
    try:
        f.seek(0)
        _check_declared_sizes(f, size)
        f.seek(0)
        return _read_members(f)
    except _Damaged as exc:
        raise fail(f"not a ringtrain checkpoint: {exc}") from None
    except ValueError as exc:
        if "allow_pickle" in str(exc):
            raise fail("holds pickled objects, which are never loaded") from None
        raise fail(f"damaged or truncated ({_one_line(exc)})") from None
    except MemoryError:
        raise fail("damaged (a header asks for more memory than there is)") from None
    except Exception as exc:  # zipfile, zlib and .npy parsing raise many kinds
        raise fail(f"damaged or truncated ({type(exc).__name__}: {_one_line(exc)})") from None


def _check_declared_sizes(f, size):
    """Check what each member says it holds before anything is inflated (raises _Damaged).

    A deflated member can inflate a thousandfold (a "deflate bomb": half a
    megabyte that asks for half a gigabyte), and a ``.npy`` header can claim
    any shape. So each member's ``.npy`` header must account for exactly its
    declared size, a stored member must be as big as it says, and a
    compressed one may not inflate past :data:`MAX_INFLATION` times the file.
    ringtrain writes its checkpoints uncompressed; other writers' compressed
    ones within the bound still load.
    """
    inflated = 0
    with zipfile.ZipFile(f) as zf:
        for info in zf.infolist():
            if info.compress_type == zipfile.ZIP_STORED:
                if info.compress_size != info.file_size:
                    raise _Damaged(f"member {info.filename!r} says it holds {info.file_size} bytes in "
                                   f"{info.compress_size}")
            elif info.compress_type == zipfile.ZIP_DEFLATED:
                inflated += info.file_size
            else:
                raise _Damaged(f"member {info.filename!r} is compressed with method {info.compress_type}")
            if inflated > max(_INFLATION_FLOOR, MAX_INFLATION * size):
                raise _Damaged(f"its compressed members would inflate to more than {MAX_INFLATION} times the "
                               "file's size (a deflate bomb?)")
            with zf.open(info) as member:
                _check_npy_header(member, info)


def _check_npy_header(member, info):
    version = np.lib.format.read_magic(member)
    if version == (1, 0):
        shape, _, dtype = np.lib.format.read_array_header_1_0(member)
    elif version in ((2, 0), (3, 0)):
        shape, _, dtype = np.lib.format.read_array_header_2_0(member)
    else:
        raise _Damaged(f"member {info.filename!r} has .npy version {version}")
    if dtype.hasobject:
        raise ValueError("allow_pickle")  # named as pickled objects by the caller
    count = 1
    for n in shape:
        count *= n
    header = member.tell()
    if header + count * dtype.itemsize != info.file_size:
        raise _Damaged(f"member {info.filename!r} declares shape {tuple(shape)} of {dtype} "
                       f"({count * dtype.itemsize} bytes) but holds {info.file_size - header}")


def _parse_meta(meta_bytes, fail):
    """The metadata dict of a checkpoint, checked for ringtrain's format and a version this code reads."""
    if meta_bytes is None:
        raise fail(f"not a ringtrain checkpoint (no {META_KEY} member)")
    try:
        meta = json.loads(meta_bytes.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):  # RecursionError: JSON nested past any real use
        raise fail("damaged metadata (not valid UTF-8 JSON)") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise fail(f"not a ringtrain checkpoint ({META_KEY} has no format {FORMAT!r})")
    version = meta.get("format_version")
    if not isinstance(version, int) or isinstance(version, bool):
        raise fail("damaged metadata (format_version is not an integer)")
    if version > FORMAT_VERSION:
        raise CheckpointTooNew(str(fail(_too_new(version))))
    step = meta.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise fail(f"damaged metadata (step is {_kind_of(step)}, not a non-negative integer)")
    return meta


def _too_new(version):
    return (f"written in checkpoint format version {version}, and this ringtrain reads format version "
            f"{FORMAT_VERSION} at most; upgrade ringtrain to read it (nothing was written)")


def _kind_of(value):
    return f"{type(value).__name__} {value!r}"[:60]


def _warn_default(message):
    warnings.warn(message, CheckpointWarning, stacklevel=3)


def _peek_meta(path):
    """The metadata of a checkpoint, read without verifying anything; None if it cannot be read.

    Cheap (one small zip member): it lets a caller pass over checkpoints it
    does not want before paying for the full checksum.
    """
    try:
        with open_regular(path, "checkpoint", error=CheckpointError) as f, zipfile.ZipFile(f) as zf:
            if zf.getinfo(META_KEY + ".npy").file_size > (16 << 20):  # metadata is a few KiB
                return None
            with zf.open(META_KEY + ".npy") as member:
                meta = json.loads(np.lib.format.read_array(member, allow_pickle=False).tobytes().decode("utf-8"))
        return meta if isinstance(meta, dict) else None
    except Exception:  # noqa: BLE001 - anything unreadable is left to read_checkpoint to name
        return None


def check_formats(directory):
    """Refuse a directory holding a checkpoint of a newer format than this ringtrain reads.

    Raises :class:`CheckpointTooNew` (one line naming the file and both
    versions). Only each file's small metadata member is read; a file that
    cannot be read at all is left to :func:`read_checkpoint` to name.
    """
    for path in list_checkpoints(directory):
        version = (_peek_meta(path) or {}).get("format_version")
        if isinstance(version, int) and not isinstance(version, bool) and version > FORMAT_VERSION:
            raise CheckpointTooNew(f"checkpoint {path}: {_too_new(version)}")


def latest_valid_checkpoint(directory, warn=None, accept=None):
    """Find the newest checkpoint in ``directory`` that verifies.

    Walks the checkpoints newest first; each damaged one is reported through
    ``warn`` (one line) and skipped, falling back to an older one. Stale
    temporary files from an interrupted save are reported too (and left for
    the next save to delete).

    Args:
        directory: a checkpoints directory.
        warn: called with one line per problem; default
            :func:`warnings.warn` with :class:`CheckpointWarning`.
        accept: if given, a predicate on a checkpoint's metadata: those it
            rejects are passed over in silence (they are whole, just not
            wanted, e.g. another lineage's).

    Returns:
        ``(path, arrays, metadata)``, or ``None`` when no checkpoint verifies.

    Raises:
        CheckpointTooNew: a checkpoint there is of a newer format (see
            :func:`check_formats`), whatever its lineage.
    """
    warn = warn or _warn_default
    directory = os.fspath(directory)
    check_formats(directory)
    for temp in _stale_temporaries(directory):
        warn(f"ignoring {temp}: a temporary file left by an interrupted save")
    paths = list_checkpoints(directory)
    if accept is not None:
        peeked = {path: _peek_meta(path) for path in paths}
        paths = [path for path in paths if peeked[path] is None or accept(peeked[path])]
    for index, path in enumerate(paths):
        try:
            arrays, meta = read_checkpoint(path)
        except CheckpointTooNew:
            raise  # never skipped, so never later pruned or overwritten
        except CheckpointError as exc:
            rest = "falling back to an older checkpoint" if index + 1 < len(paths) else (
                "no older checkpoint to fall back to"
            )
            warn(f"skipping damaged {exc}; {rest}")
            continue
        if accept is not None and not accept(meta):
            continue
        return path, arrays, meta
    return None


def load_checkpoint(path_or_run_dir, warn=None):
    """Load parameters and metadata from a checkpoint, a run or its checkpoints.

    Args:
        path_or_run_dir: a checkpoint file; a checkpoints directory; or a run
            directory holding ``checkpoints/``. A directory gives its newest
            checkpoint that verifies (damaged ones are skipped with a
            warning).
        warn: as for :func:`latest_valid_checkpoint`.

    Returns:
        ``(params, metadata)``: dict name -> NumPy array (the ``params/``
        entries, prefix removed, in the model's order) and the metadata dict.

    Raises:
        CheckpointError: the file is damaged, or the directory holds no
            checkpoint that verifies.
    """
    path = os.fspath(path_or_run_dir)
    if os.path.isdir(path):
        directory = path
        if os.path.isdir(os.path.join(path, _CHECKPOINT_DIR)):
            directory = os.path.join(path, _CHECKPOINT_DIR)
        found = latest_valid_checkpoint(directory, warn=warn)
        if found is None:
            count = len(list_checkpoints(directory))
            why = f"all {count} are damaged" if count else "there are none"
            raise CheckpointError(f"no valid checkpoint in {directory} ({why})")
        _, arrays, meta = found
    elif os.path.exists(path):
        arrays, meta = read_checkpoint(path)
    else:
        raise CheckpointError(f"no such checkpoint file or run directory: {path}")
    prefix = "params/"
    params = {k[len(prefix):]: v for k, v in arrays.items() if k.startswith(prefix)}
    return params, meta
