"""The array backend: NumPy on the CPU, CuPy on a GPU.

This is the only module that imports CuPy. Everything else is written once
against an array module ``xp`` (CuPy's own idiom) and asks this module which
one an array belongs to. ``import cupy`` succeeds on machines without a GPU
and only array creation fails there, so :func:`gpu_available` asks
``cupy.is_available()`` rather than trusting the import.

CuPy is imported on first use, not with ringtrain: importing it loads the
CUDA libraries (0.5-1 s), which a CPU run never needs. A NumPy array is
recognised without importing it.
"""

import contextlib
import functools

import numpy as np

__all__ = [
    "cupy_installed",
    "gpu_available",
    "device_count",
    "get_array_module",
    "is_gpu_array",
    "to_numpy",
    "xp_for",
    "synchronize",
    "use_device",
    "device_of",
    "device_buffer",
    "ipc_handle",
    "open_ipc",
    "close_ipc",
    "rank_order_kernel",
    "from_dlpack",
    "kernel_cache_cold",
    "address",
    "contiguous_span",
    "side_stream",
    "record_event",
    "wait_event",
    "rank_order_source",
    "host_scalars",
]


@functools.lru_cache(maxsize=None)
def _cp():
    """The cupy module, imported on first use; None where it is not installed or cannot load."""
    try:  # CuPy is optional: the cuda12/cuda13 extras install it.
        import cupy
    except Exception:  # noqa: BLE001 - a broken CUDA install raises more than ImportError
        return None
    return cupy


def cupy_installed():
    """True when CuPy can be imported (it may still see no GPU)."""
    return _cp() is not None


def gpu_available():
    """True when CuPy is installed and sees at least one usable GPU."""
    if _cp() is None:
        return False
    try:
        return bool(_cp().is_available())
    except Exception:  # noqa: BLE001 - driver errors mean "no GPU" here
        return False


def device_count():
    """Number of GPUs CuPy can use on this host (0 without CuPy or a GPU)."""
    if not gpu_available():
        return 0
    return int(_cp().cuda.runtime.getDeviceCount())


def get_array_module(x):
    """``cupy`` for a CuPy array, ``numpy`` for anything else."""
    return _cp() if is_gpu_array(x) else np


def is_gpu_array(x):
    """True when ``x`` lives on a GPU."""
    # The module name first: a NumPy array must not trigger CuPy's import.
    return type(x).__module__.startswith("cupy") and _cp() is not None and isinstance(x, _cp().ndarray)


def to_numpy(x):
    """A NumPy array with ``x``'s values (a copy from the GPU, ``x`` itself on the CPU)."""
    if is_gpu_array(x):
        return _cp().asnumpy(x)
    return np.asarray(x)


def xp_for(device):
    """The array module for a device name: ``"cpu"`` gives NumPy, ``"gpu"`` CuPy.

    Raises:
        ValueError: for ``"gpu"`` when CuPy sees no GPU, or an unknown name.
    """
    if device == "cpu":
        return np
    if device == "gpu":
        if not gpu_available():
            why = "CuPy is not installed" if _cp() is None else "CuPy sees no GPU"
            raise ValueError(
                f"--device gpu needs a CUDA GPU, but {why}; "
                "install ringtrain[cuda12] or ringtrain[cuda13] on a GPU host, or use --device cpu"
            )
        return _cp()
    raise ValueError(f"unknown device {device!r}; choose one of cpu, gpu")


def synchronize(x):
    """Wait for queued GPU work on ``x`` to finish; a no-op for NumPy arrays.

    MPI reads and writes buffers directly, knowing nothing of CUDA streams, so
    a kernel still writing a gradient would race the send. Call this before
    handing a CuPy array (or its staging copy) to MPI.
    """
    if is_gpu_array(x):
        _cp().cuda.get_current_stream().synchronize()


def host_scalars(*values):
    """Python floats of scalars on the host or a GPU, in one transfer from a GPU.

    Each ``float()`` of a CuPy scalar waits for the device; a step's loss and
    count together cost one wait this way, not two. Host values convert as
    ``float()`` does (counts stay exact: below 2**53).
    """
    if any(is_gpu_array(v) for v in values):
        cp = _cp()
        return [float(v) for v in cp.stack([cp.asarray(v, dtype=np.float64) for v in values]).get()]
    return [float(v) for v in values]


def device_of(x):
    """The GPU index ``x`` lives on, or None for a NumPy array."""
    return int(x.device.id) if is_gpu_array(x) else None


def use_device(index):
    """Make GPU ``index`` current for this process (no-op for ``None``)."""
    if index is not None and _cp() is not None:
        _cp().cuda.Device(index).use()


# -- device memory other processes can map (CUDA IPC) -----------------------------

def device_buffer(nbytes):
    """A 1-D uint8 CuPy array in a device allocation of its own (``cudaMalloc``, not CuPy's pool).

    An IPC handle names a whole allocation; arrays carved from CuPy's pool
    share theirs with unrelated arrays, so memory to be mapped by other
    processes gets its own.
    """
    cp = _cp()
    memory = cp.cuda.Memory(max(int(nbytes), 1))
    return cp.ndarray((int(nbytes),), cp.uint8, cp.cuda.MemoryPointer(memory, 0))


def ipc_handle(array):
    """``(handle, offset)``: the CUDA IPC handle of ``array``'s allocation and its offset in it.

    Only for arrays made by :func:`device_buffer`: a pool chunk's ``mem.ptr``
    is the start of the chunk, not of the ``cudaMalloc`` the handle maps, so
    the offset a peer applied would be wrong.

    Raises:
        ValueError: for an array of CuPy's memory pool.
    """
    cp = _cp()
    if type(array.data.mem) is not cp.cuda.Memory:
        raise ValueError(f"ipc_handle needs an array from device_buffer(), not one in {type(array.data.mem).__name__}")
    base = array.data.mem.ptr
    return bytes(cp.cuda.runtime.ipcGetMemHandle(base)), array.data.ptr - base


def open_ipc(handle, offset, nbytes):
    """Map a peer's allocation: ``(uint8 array of nbytes at offset, pointer to close with close_ipc)``.

    Opened with lazy peer access, so it works with ranks sharing one GPU and
    with one GPU per rank (the kernels then read over NVLink or PCIe).
    """
    cp = _cp()
    runtime = cp.cuda.runtime
    pointer = runtime.ipcOpenMemHandle(handle, runtime.cudaIpcMemLazyEnablePeerAccess)
    device = cp.cuda.Device().id
    # The mapping is valid in this process's context: declared on the current
    # device, so CuPy's kernels accept it beside local arrays.
    memory = cp.cuda.UnownedMemory(pointer, offset + nbytes, None, device)
    return cp.ndarray((int(nbytes),), cp.uint8, cp.cuda.MemoryPointer(memory, offset)), pointer


def close_ipc(pointer):
    """Unmap a peer's allocation opened with :func:`open_ipc`."""
    _cp().cuda.runtime.ipcCloseMemHandle(pointer)


_PICK = {"minimum": "<", "maximum": ">"}


def rank_order_source(n, combine="add"):
    """``(inputs, body)`` of the rank-order kernel over ``n`` operands (pure: no CuPy needed).

    One statement per operand, so the source grows linearly with the rank
    count: nesting the running expression instead pastes it several times
    per rank (4^(n-1) characters, 202 KB at 8 ranks, 52 MB at 12).

    Raises:
        ValueError: for a combine other than add, minimum and maximum.
    """
    if combine != "add" and combine not in _PICK:
        raise ValueError(f"unknown combine {combine!r}; choose one of add, maximum, minimum")
    inputs = ", ".join(f"T x{i}" for i in range(n))
    if combine == "add":
        return inputs, "y = " + " + ".join(f"x{i}" for i in range(n)) + ";"
    # NaN propagates, as in np.minimum/np.maximum (CUDA's min/max would drop
    # it): keep the running value while it wins or is NaN (a != a).
    pick = _PICK[combine]
    steps = [f"a = (a {pick} x{i} || a != a) ? a : x{i};" for i in range(1, n)]
    return inputs, " ".join(["T a = x0;", *steps, "y = a;"])


def rank_order_kernel(n, combine="add"):
    """An elementwise kernel ``y = x0 + x1 + ... + x{n-1}`` (left to right), or min/max in that order.

    One kernel reads every rank's chunk: the sum is made in rank order for
    every element, so every rank gets the same bits whoever owns the chunk.
    """
    inputs, body = rank_order_source(n, combine)
    return _cp().ElementwiseKernel(inputs, "T y", body, f"ringtrain_{combine}_{n}")


def from_dlpack(tensor):
    """A CuPy view of a CUDA tensor (DLPack, zero-copy)."""
    return _cp().from_dlpack(tensor)


def kernel_cache_cold():
    """True when CuPy's kernel cache is empty: the first GPU run on this machine compiles every kernel."""
    import os

    if _cp() is None:
        return False
    directory = os.environ.get("CUPY_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cupy", "kernel_cache"))
    try:
        return not any(os.scandir(directory))
    except OSError:
        return True


@contextlib.contextmanager
def side_stream(device):
    """A non-blocking CUDA stream of the calling thread's own, current inside the block.

    Without it a second thread's kernels go to the legacy default stream and
    queue behind every kernel the main thread has issued. Nothing for the CPU
    (``device`` None).
    """
    if device is None or _cp() is None:
        yield None
        return
    with _cp().cuda.Stream(non_blocking=True) as stream:
        yield stream


def record_event(x):
    """An event after the work queued so far on the current stream, for another stream to wait on.

    None for a NumPy array: there is nothing to wait for.
    """
    if not is_gpu_array(x):
        return None
    event = _cp().cuda.Event(disable_timing=True)
    event.record()
    return event


def wait_event(event):
    """Make the current stream wait for ``event`` on the device, without blocking the host (None: nothing)."""
    if event is not None:
        _cp().cuda.get_current_stream().wait_event(event)


def address(a):
    """The data address of a NumPy or CuPy array (CuPy through ``__cuda_array_interface__``)."""
    interface = getattr(a, "__cuda_array_interface__", None) or a.__array_interface__
    return interface["data"][0]


def contiguous_span(arrays, within=None):
    """A 1-D view over ``arrays`` when they tile one allocation back to back, else None.

    The arrays must be C-contiguous, of one dtype, each starting where the
    previous one ends, all inside one writeable base array: ``within`` if
    given (a 1-D array over the whole allocation, e.g. a torch storage),
    else the base of the first array. Being adjacent is not enough: two
    separate allocations can sit side by side, so the whole span must lie
    inside that one base.
    """
    if not arrays:
        return None
    first = arrays[0]
    # NumPy or CuPy arrays (a CuPy model's grad_buffer views too: the
    # Reducer then reduces them in place), over a torch storage if given.
    kind = type(within) if within is not None else type(first)
    if kind is not np.ndarray and not is_gpu_array(within if within is not None else first):
        return None
    if any(type(a) is not kind for a in arrays):
        return None
    base = within
    if base is None:
        base = first
        while isinstance(base.base, kind):
            base = base.base
    if not (base.flags.c_contiguous and getattr(base.flags, "writeable", True)):
        return None
    start = end = address(first)
    for a in arrays:
        if not a.flags.c_contiguous or a.dtype != first.dtype or address(a) != end:
            return None
        end += a.nbytes
    lo, hi = start - address(base), end - address(base)
    if lo < 0 or hi > base.nbytes:
        return None
    return base.reshape(-1).view(np.uint8)[lo:hi].view(first.dtype)
