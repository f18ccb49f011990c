"""The arrays the engine takes (NumPy on the host, CuPy on a GPU): their element types, bytes and staging.

A face hands the engine arrays that share its tensors' memory (zero-copy
views: ``tensor.numpy()``, DLPack) and reads the results from the same
memory. Everything the engine needs to know about an array is here, so the
kernels (:mod:`ringtrain.engine.kernels`) are written once for NumPy and
CuPy (the ``xp`` idiom; CuPy is reached through :mod:`ringtrain.backend`,
the one module that imports it).

bfloat16 has no NumPy dtype: a face passes its bits as a 16-bit integer
array and says ``dtype="bfloat16"``; reductions then run in float32 and
round back to nearest even, as frameworks do (:func:`bf16_to_f32`,
:func:`f32_to_bf16`). An array whose own dtype is named ``bfloat16``
(``ml_dtypes``, TensorFlow's NumPy) is taken the same way.
"""

import math

import numpy as np

from .. import backend

__all__ = ["SUPPORTED", "RING_DTYPES", "element_name", "check_array", "is_cuda", "xp_of", "flat", "host",
           "bits", "byte_view", "empty", "zeros", "like", "synchronize", "itemsize", "work_name", "bf16_to_f32",
           "f32_to_bf16", "to_work", "from_work"]

# The element types every op takes (Horovod's list); a face refuses others before they reach the engine.
SUPPORTED = ("uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32", "float64", "bool")
_SUPPORTED = frozenset(SUPPORTED)
# The element types ringtrain's own allreduce (ringtrain.comm) reduces; the rest go to MPI's Allreduce.
RING_DTYPES = frozenset(("float16", "float32", "float64", "int32", "int64"))
_ITEMSIZE = {name: (2 if name == "bfloat16" else np.dtype(name).itemsize) for name in SUPPORTED}


def element_name(array, dtype=None):
    """The element type the ranks agree on: ``dtype`` when given (``"bfloat16"`` bits), else the array's (pure)."""
    return dtype if dtype is not None else array.dtype.name


def check_array(array, who, dtype=None):
    """The problem with an array no collective takes, as one line, or None (pure)."""
    if not (isinstance(array, np.ndarray) or backend.is_gpu_array(array)):
        return f"{who}: expected a NumPy or CuPy array, got {type(array).__name__}"
    if not array.dtype.isnative:  # (its bytes would be read as this host's order, here and on every peer)
        return (f"{who}: the array's elements are in non-native byte order ({array.dtype.str}); pass "
                "array.astype(array.dtype.newbyteorder('='))")
    name = element_name(array, dtype)
    if name not in _SUPPORTED:
        what = " (strings or Python objects)" if array.dtype.kind in "OSU" else ""  # (a string tensor's array)
        return f"{who}: element type {name}{what} is not supported; use one of {', '.join(SUPPORTED)}"
    if name == "bfloat16" and array.dtype.itemsize != 2:
        return f"{who}: dtype='bfloat16' needs an array of 16-bit elements (its bits), got {array.dtype.name}"
    return None


def is_cuda(array):
    """True for an array in GPU memory."""
    return backend.is_gpu_array(array)


def xp_of(array):
    """``numpy`` or ``cupy``: the module whose functions take ``array``."""
    return backend.get_array_module(array)


def itemsize(name):
    """Bytes per element of an element type name (pure)."""
    return _ITEMSIZE[name]


def work_name(name):
    """The element type a reduction of ``name`` runs in: float32 for bfloat16, else itself (pure)."""
    return "float32" if name == "bfloat16" else name


def flat(array):
    """A 1-D view of a contiguous array (a copy, to read only, of a strided one)."""
    return array.reshape(-1)


def bits(array, name):
    """``array`` as NumPy or CuPy sees its elements: bfloat16 as its uint16 bits, others as they are."""
    if name == "bfloat16" and array.dtype != np.uint16:
        return array.view(np.uint16)
    return array


def host(array):
    """A contiguous NumPy array with ``array``'s values (the array itself when it already is one)."""
    if is_cuda(array):
        synchronize(array)
        return backend.to_numpy(array)
    return np.ascontiguousarray(array)


def byte_view(array):
    """The raw bytes of a contiguous host array, as a 1-D uint8 view (0-dim included)."""
    return array.reshape(-1).view(np.uint8)


def empty(shape, name, like_array):
    """A new array of ``shape`` holding ``name`` elements, on ``like_array``'s device."""
    dtype = np.uint16 if name == "bfloat16" else np.dtype(name)
    if is_cuda(like_array):
        cp = xp_of(like_array)
        with cp.cuda.Device(like_array.device.id):
            return cp.empty(shape, dtype)
    return np.empty(shape, dtype)


def zeros(shape, name, cuda=False):
    """Zeros of ``shape`` and element type ``name`` (on the current GPU when ``cuda``): a joined rank's input."""
    dtype = np.uint16 if name == "bfloat16" else np.dtype(name)
    xp = backend.xp_for("gpu") if cuda else np
    return xp.zeros(shape, dtype)


def like(values, array):
    """``values`` (a host array) on ``array``'s device: itself for a host array, a copy to the GPU for a CuPy one."""
    if not is_cuda(array):
        return values
    cp = xp_of(array)
    with cp.cuda.Device(array.device.id):
        return cp.asarray(values)


def synchronize(array):
    """Wait for the work queued on the stream of ``array``'s own device; a no-op for host arrays.

    MPI and the host read GPU memory knowing nothing of CUDA streams; the
    engine's thread may have another device current than the array's, so
    the device is the array's, not the thread's.
    """
    if is_cuda(array):
        cp = xp_of(array)
        with cp.cuda.Device(array.device.id):
            cp.cuda.get_current_stream().synchronize()


def bf16_to_f32(raw):
    """float32 values of bfloat16 bits (a uint16 array; NumPy or CuPy) (pure)."""
    xp = xp_of(raw)
    return (raw.astype(xp.uint32) << 16).view(xp.float32)


def f32_to_bf16(values):
    """bfloat16 bits (uint16) of float32 values, rounded to nearest even; NaN stays a quiet NaN (pure)."""
    xp = xp_of(values)
    u = xp.ascontiguousarray(values, dtype=xp.float32).view(xp.uint32)
    rounded = ((u + xp.uint32(0x7FFF) + ((u >> 16) & xp.uint32(1))) >> 16).astype(xp.uint16)
    nan = xp.isnan(values)
    if nan.any():
        rounded[nan] = ((u[nan] >> 16) | xp.uint32(0x40)).astype(xp.uint16)
    return rounded


def to_work(array, name, copy=True):
    """A flat array of the values of ``array`` (``name`` elements) in the type a reduction runs in."""
    a = array.reshape(-1)
    if name == "bfloat16":
        return bf16_to_f32(bits(a, name))
    xp = xp_of(a)
    return a.astype(a.dtype, copy=True) if copy else xp.ascontiguousarray(a)


def from_work(values, name, out):
    """Write reduced ``values`` (in the work type) into ``out`` (``name`` elements), in place; return ``out``."""
    if name == "bfloat16":
        values = f32_to_bf16(values)
        target = bits(out, name)
    else:
        target = out
    if values.dtype != target.dtype:
        values = values.astype(target.dtype)
    target[...] = values.reshape(out.shape)
    return out


def nbytes_of(shape, name):
    """The size in bytes of an array of ``shape`` and element type ``name`` (pure)."""
    return math.prod(shape) * _ITEMSIZE[name]
