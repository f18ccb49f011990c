"""Where a torch job's commits go: :mod:`ringtrain.cluster.commits`'s store, with tensors kept as arrays.

A commit is one checkpoint file of :mod:`ringtrain.io.checkpoint` in
``$RINGTRAIN_ELASTIC_DIR/commits``: each tensor of the state is a member
array of its own, and the rest (an ``ObjectState``'s values, an optimizer's
options, where each tensor goes) is one pickled member that refers to them.

The pickled member is what Horovod's ``broadcast_object`` sends between
ranks; loading it runs whatever code its classes name, so it is unpickled
only after its HMAC under the directory's key verified (the trust model is
:mod:`ringtrain.cluster.commits`'s). Only rank 0 calls these; nothing here
talks to MPI.
"""

import io
import pickle

import numpy as np
import torch

from ...cluster import commits as _neutral

__all__ = ["CommitStore", "encode", "decode", "FORMAT"]

FORMAT = _neutral.FORMAT
_STATE = "state"


class CommitStore(_neutral.CommitStore):
    """:class:`ringtrain.cluster.commits.CommitStore` whose snapshots hold torch tensors."""

    def encode(self, snapshot):
        """Every tensor an array, the rest one pickle (see :func:`encode`)."""
        return encode(snapshot)

    def decode(self, arrays):
        """The snapshot, its tensors rebuilt (called only on a commit whose HMAC verified)."""
        return decode(arrays)


def encode(snapshot):
    """``(arrays, metadata)`` for a checkpoint file: every tensor an array, the rest pickled once."""
    arrays = {}
    buffer = io.BytesIO()
    _TensorPickler(buffer, arrays).dump(snapshot)
    arrays[_STATE] = np.frombuffer(buffer.getbuffer(), np.uint8)
    return arrays, {"tensors": len(arrays) - 1}


def decode(arrays):
    """The snapshot :func:`encode` wrote, its tensors made from the arrays (on their devices where there are)."""
    return _TensorUnpickler(io.BytesIO(arrays[_STATE].tobytes()), arrays).load()
# NumPy has these dtypes; any other (bfloat16, float8...) travels as its bytes.
_NUMPY_DTYPES = {torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
                 torch.float32, torch.float64, torch.complex64, torch.complex128}


class _TensorPickler(pickle.Pickler):
    """Pickles everything but dense tensors, which become arrays of the checkpoint (no copy on the CPU)."""

    def __init__(self, file, arrays):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.arrays = arrays

    def persistent_id(self, obj):
        if not isinstance(obj, torch.Tensor) or obj.layout != torch.strided or obj.is_quantized:
            return None
        name = f"tensors/{len(self.arrays):05d}"
        data = obj.detach().cpu()
        if data.dtype in _NUMPY_DTYPES:
            array = data.numpy()
        else:
            array = data.contiguous().reshape(-1).view(torch.uint8).numpy()
        self.arrays[name] = array
        dtype = str(data.dtype).split(".")[-1]
        return ("tensor", name, dtype, tuple(obj.shape), str(obj.device), obj.requires_grad,
                isinstance(obj, torch.nn.Parameter))


class _TensorUnpickler(pickle.Unpickler):
    def __init__(self, file, arrays):
        super().__init__(file)
        self.arrays = arrays

    def persistent_load(self, pid):
        kind, name, dtype, shape, device, requires_grad, parameter = pid
        if kind != "tensor":
            raise pickle.UnpicklingError(f"unknown reference {kind!r} in a commit")
        tensor = torch.from_numpy(np.array(self.arrays[name]))  # a copy: the arrays are read-only
        wanted = getattr(torch, dtype)
        if tensor.dtype != wanted:
            tensor = tensor.view(wanted)
        tensor = tensor.reshape(shape)
        if device != "cpu" and _device_available(device):
            tensor = tensor.to(device)
        if parameter:
            return torch.nn.Parameter(tensor, requires_grad=requires_grad)
        return tensor.requires_grad_(requires_grad) if requires_grad else tensor


def _device_available(device):
    try:
        torch.empty(0, device=device)
        return True
    except (RuntimeError, AssertionError):
        return False
