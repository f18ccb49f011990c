"""The array backend: NumPy on the CPU, CuPy on a GPU.

This is the only module that imports CuPy. Everything else is written once
against an array module ``xp`` (CuPy's own idiom) and asks this module which
one an array belongs to. ``import cupy`` succeeds on machines without a GPU
and only array creation fails there, so :func:`gpu_available` asks
``cupy.is_available()`` rather than trusting the import.
"""

import numpy as np

try:  # CuPy is optional: the cuda12/cuda13 extras install it.
    import cupy as _cupy
except Exception:  # noqa: BLE001 - a broken CUDA install raises more than ImportError
    _cupy = None

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
]


def cupy_installed():
    """True when CuPy can be imported (it may still see no GPU)."""
    return _cupy is not None


def gpu_available():
    """True when CuPy is installed and sees at least one usable GPU."""
    if _cupy is None:
        return False
    try:
        return bool(_cupy.is_available())
    except Exception:  # noqa: BLE001 - driver errors mean "no GPU" here
        return False


def device_count():
    """Number of GPUs CuPy can use on this host (0 without CuPy or a GPU)."""
    if not gpu_available():
        return 0
    return int(_cupy.cuda.runtime.getDeviceCount())


def get_array_module(x):
    """``cupy`` for a CuPy array, ``numpy`` for anything else."""
    if _cupy is not None:
        return _cupy.get_array_module(x)
    return np


def is_gpu_array(x):
    """True when ``x`` lives on a GPU."""
    return _cupy is not None and isinstance(x, _cupy.ndarray)


def to_numpy(x):
    """A NumPy array with ``x``'s values (a copy from the GPU, ``x`` itself on the CPU)."""
    if is_gpu_array(x):
        return _cupy.asnumpy(x)
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
            why = "CuPy is not installed" if _cupy is None else "CuPy sees no GPU"
            raise ValueError(
                f"--device gpu needs a CUDA GPU, but {why}; "
                "install ringtrain[cuda12] or ringtrain[cuda13] on a GPU host, or use --device cpu"
            )
        return _cupy
    raise ValueError(f"unknown device {device!r}; choose one of cpu, gpu")


def synchronize(x):
    """Wait for queued GPU work on ``x`` to finish; a no-op for NumPy arrays.

    MPI reads and writes buffers directly, knowing nothing of CUDA streams, so
    a kernel still writing a gradient would race the send. Call this before
    handing a CuPy array (or its staging copy) to MPI.
    """
    if is_gpu_array(x):
        _cupy.cuda.get_current_stream().synchronize()


def device_of(x):
    """The GPU index ``x`` lives on, or None for a NumPy array."""
    return int(x.device.id) if is_gpu_array(x) else None


def use_device(index):
    """Make GPU ``index`` current for this process (no-op for ``None``)."""
    if index is not None and _cupy is not None:
        _cupy.cuda.Device(index).use()


# -- device memory other processes can map (CUDA IPC) -----------------------------

def device_buffer(nbytes):
    """A 1-D uint8 CuPy array in a device allocation of its own (``cudaMalloc``, not CuPy's pool).

    An IPC handle names a whole allocation; arrays carved from CuPy's pool
    share theirs with unrelated arrays, so memory to be mapped by other
    processes gets its own.
    """
    memory = _cupy.cuda.Memory(max(int(nbytes), 1))
    return _cupy.ndarray((int(nbytes),), _cupy.uint8, _cupy.cuda.MemoryPointer(memory, 0))


def ipc_handle(array):
    """``(handle, offset)``: the CUDA IPC handle of ``array``'s allocation and its offset in it."""
    base = array.data.mem.ptr
    return bytes(_cupy.cuda.runtime.ipcGetMemHandle(base)), array.data.ptr - base


def open_ipc(handle, offset, nbytes):
    """Map a peer's allocation: ``(uint8 array of nbytes at offset, pointer to close with close_ipc)``.

    Opened with lazy peer access, so it works with ranks sharing one GPU and
    with one GPU per rank (the kernels then read over NVLink or PCIe).
    """
    runtime = _cupy.cuda.runtime
    pointer = runtime.ipcOpenMemHandle(handle, runtime.cudaIpcMemLazyEnablePeerAccess)
    device = _cupy.cuda.Device().id
    # The mapping is valid in this process's context: declared on the current
    # device, so CuPy's kernels accept it beside local arrays.
    memory = _cupy.cuda.UnownedMemory(pointer, offset + nbytes, None, device)
    return _cupy.ndarray((int(nbytes),), _cupy.uint8, _cupy.cuda.MemoryPointer(memory, offset)), pointer


def close_ipc(pointer):
    """Unmap a peer's allocation opened with :func:`open_ipc`."""
    _cupy.cuda.runtime.ipcCloseMemHandle(pointer)


def rank_order_kernel(n, combine="add"):
    """An elementwise kernel ``y = x0 + x1 + ... + x{n-1}`` (left to right), or min/max in that order.

    One kernel reads every rank's chunk: the sum is made in rank order for
    every element, so every rank gets the same bits whoever owns the chunk.
    """
    inputs = ", ".join(f"T x{i}" for i in range(n))
    if combine == "add":
        body = " + ".join(f"x{i}" for i in range(n))
    else:
        # NaN propagates, as in np.minimum/np.maximum (CUDA's min/max would drop it).
        body = "x0"
        pick = "<" if combine == "minimum" else ">"
        for i in range(1, n):
            body = f"(({body}) {pick} x{i} || ({body}) != ({body}) ? ({body}) : x{i})"
    return _cupy.ElementwiseKernel(inputs, "T y", f"y = {body}", f"ringtrain_{combine}_{n}")


def from_dlpack(tensor):
    """A CuPy view of a CUDA tensor (DLPack, zero-copy)."""
    return _cupy.from_dlpack(tensor)


def kernel_cache_cold():
    """True when CuPy's kernel cache is empty: the first GPU run on this machine compiles every kernel."""
    import os

    if _cupy is None:
        return False
    directory = os.environ.get("CUPY_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cupy", "kernel_cache"))
    try:
        return not any(os.scandir(directory))
    except OSError:
        return True


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
    kind = np.ndarray if within is None else type(within)  # CuPy arrays, over a torch CUDA storage
    if not arrays or any(type(a) is not kind for a in arrays):
        return None
    first = arrays[0]
    base = within
    if base is None:
        base = first
        while isinstance(base.base, np.ndarray):
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
