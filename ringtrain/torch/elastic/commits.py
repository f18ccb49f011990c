"""Where a commit goes: rank 0 writes it whole or not at all, so a restarted job finds the last one.

A commit is one checkpoint file of :mod:`ringtrain.io.checkpoint` (written
to a temporary file, fsynced, renamed over its name, the directory
fsynced; SHA-256 over every byte), in ``$RINGTRAIN_ELASTIC_DIR/commits``:
each tensor of the state is a member array of its own, and the rest (an
``ObjectState``'s values, an optimizer's options, where each tensor goes)
is one pickled member that refers to them. The newest two are kept, so a
commit damaged on disk falls back to the one before it.

The pickled member is what Horovod's ``broadcast_object`` sends between
ranks; loading it runs whatever code its classes name, so the directory
must be as trusted as the script itself (the launcher makes it, private to
its user, or under ``-o``). Only rank 0 calls these; nothing here talks to MPI.
"""

import io
import os
import pickle
import warnings

import numpy as np
import torch

from ...cluster.elastic import COMMITS, ENV_DIR, elastic_start, read_notice, write_listening
from ...io.checkpoint import CheckpointError, latest_valid_checkpoint, save_checkpoint

__all__ = ["CommitStore", "encode", "decode", "FORMAT"]

FORMAT = 1
_STATE = "state"
_KEEP = 2


class CommitStore:
    """A job's commit directory and its host notices, as the launcher set them in the environment.

    Args:
        directory: ``$RINGTRAIN_ELASTIC_DIR``.
        job: which start of the job this is (``$RINGTRAIN_ELASTIC_JOB``).
        generation: the host notices' generation this start began at.
    """

    def __init__(self, directory, job=0, generation=0):
        self.directory = os.path.abspath(directory)
        self.commits = os.path.join(self.directory, COMMITS)
        self.job, self.generation = job, generation

    @classmethod
    def from_env(cls, env=None):
        """The store the environment names, or None outside an elastic launch (commits stay in memory)."""
        env = os.environ if env is None else env
        if not env.get(ENV_DIR):
            return None
        job, generation = elastic_start(env) or (0, 0)
        return cls(env[ENV_DIR], job, generation)

    def write(self, sequence, snapshot, size, finished=False):
        """Write commit number ``sequence`` (whole, or not at all); returns its path.

        Raises:
            CheckpointError: one line naming the file and why it could not be written.
        """
        arrays, meta = encode(snapshot)
        meta.update(elastic_format=FORMAT, size=size, finished=bool(finished))
        return save_checkpoint(self.commits, sequence, arrays, meta, keep=_KEEP)

    def latest(self):
        """``(sequence, snapshot, metadata)`` of the newest commit that verifies, or None when there is none.

        A damaged commit is skipped with a warning (falling back to the one before).
        """
        found = latest_valid_checkpoint(self.commits, warn=_warn)
        if found is None:
            return None
        path, arrays, meta = found
        if meta.get("elastic_format") != FORMAT or _STATE not in arrays:
            raise CheckpointError(f"{path} is not a commit of hvd.elastic (format {meta.get('elastic_format')!r}); "
                                  f"remove it, or give another {ENV_DIR}")
        return meta["step"], decode(arrays), meta

    def notice(self):
        """The generation of the launcher's latest host notice and what changed, or None."""
        return read_notice(self.directory)

    def listen(self):
        """Tell the launcher that this start watches its host notices (so it need not send SIGUSR1)."""
        os.makedirs(self.directory, exist_ok=True)
        write_listening(self.directory, self.job)


def _warn(line):
    warnings.warn(line, stacklevel=2)


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
