"""Checks that every replica holds what it should: the same settings, the same model, the same bits.

Each check is collective (an allgather) and raises on every rank alike, so a
disagreement never leaves a rank waiting.
"""

import hashlib

import numpy as np

from .. import backend
from ..errors import MismatchError
from .config import MUST_MATCH, flag_name

__all__ = ["params_digest", "check_same_settings", "check_same_params", "check_params_everywhere"]


def params_digest(params):
    """SHA-256 of every parameter's bytes, in name order: equal iff bitwise equal (pure)."""
    h = hashlib.sha256()
    for name in sorted(params):
        a = np.ascontiguousarray(backend.to_numpy(params[name]))
        h.update(name.encode())
        h.update(str(a.dtype).encode())
        h.update(repr(a.shape).encode())
        h.update(a.tobytes())
    return h.hexdigest()


def check_same_settings(comm, cfg):
    """Raise MismatchError on every rank if the ranks were given different settings (collective)."""
    mine = {name: getattr(cfg, name) for name in MUST_MATCH}
    everyone = comm.allgather(mine)
    for name in MUST_MATCH:
        values = [e[name] for e in everyone]
        if any(v != values[0] for v in values):
            odd = next(r for r, v in enumerate(values) if v != values[0])
            raise MismatchError(f"ranks disagree on {flag_name(name)}: rank 0 has {values[0]!r}, rank {odd} has "
                                f"{values[odd]!r}; give every rank the same settings")


def check_same_params(comm, params):
    """Raise MismatchError on every rank unless all ranks hold the same parameter list (collective)."""
    mine = [(name, tuple(p.shape), str(p.dtype)) for name, p in params.items()]
    everyone = comm.allgather(mine)
    for rank, theirs in enumerate(everyone):
        if theirs != everyone[0]:
            diff = next((a, b) for a, b in zip(everyone[0] + [None] * len(theirs), theirs + [None] * len(everyone[0]))
                        if a != b)
            raise MismatchError(f"ranks disagree on the model's parameters: rank 0 has {diff[0]}, rank {rank} has "
                                f"{diff[1]}; every rank must build the same model")


def check_params_everywhere(comm, params, step):
    """Allgather a digest of the parameters; a difference means the replicas diverged (collective).

    Returns:
        The digest, the same on every rank.

    Raises:
        RuntimeError: on every rank, naming the first rank that differs from rank 0.
    """
    mine = params_digest(params)
    everyone = comm.allgather(mine)
    for rank, digest in enumerate(everyone):
        if digest != everyone[0]:
            raise RuntimeError(f"parameters differ across ranks at step {step}: rank 0 {everyone[0][:12]}, "
                               f"rank {rank} {digest[:12]}; the replicas have diverged")
    return mine
