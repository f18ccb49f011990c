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


def use_device(index):
    """Make GPU ``index`` current for this process (no-op for ``None``)."""
    if index is not None and _cupy is not None:
        _cupy.cuda.Device(index).use()
