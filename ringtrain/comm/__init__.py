"""The communication layer: averaging arrays across ranks, by transports behind one interface.

How the pieces fit:

* :mod:`~ringtrain.comm.collectives` and :mod:`~ringtrain.comm.buckets`: the
  public collectives (``allreduce``, ``allreduce_``, ``allreduce_many_``,
  ``broadcast_``). Every call starts with a header exchange
  (:mod:`~ringtrain.comm.header`), so ranks that disagree raise instead of
  hanging; small calls carry their data in it (:mod:`~ringtrain.comm.plans`
  replays them at 2 ranks).
* :mod:`~ringtrain.comm.policy`: which transport serves a buffer, every
  threshold in one place.
* :mod:`~ringtrain.comm.transports.base` and :mod:`~ringtrain.comm.transports`: the
  transport interface (reduce-scatter, allgather, allreduce) and its
  registry; one module per transport: :mod:`~ringtrain.comm.transports.shm` (shared
  memory on one host), :mod:`~ringtrain.comm.transports.ring` (the pipelined ring),
  :mod:`~ringtrain.comm.transports.mpi` (MPI's own collectives),
  :mod:`~ringtrain.comm.transports.hierarchical` (within hosts, then across).
* :mod:`~ringtrain.comm.reducer`: buckets reduced on a thread while backward
  runs, each by a communication hook (:mod:`~ringtrain.comm.hooks`);
  :mod:`~ringtrain.comm.state`: what is cached on each communicator
  (:mod:`~ringtrain.comm.exchange`: the header exchange's mailbox;
  :mod:`~ringtrain.comm.staging`: GPU arrays through pinned host memory);
  :mod:`~ringtrain.comm.schedule`: the pure index maths.
* :mod:`~ringtrain.comm.guard`: the time bound on the public collectives
  (``set_timeout``, ``timeout``, ``RINGTRAIN_TIMEOUT``) and the refusal of a
  second thread on one communicator.
"""

from .buckets import allreduce_many_, plan_buckets
from .collectives import allreduce, allreduce_, broadcast_
from .hooks import allreduce_hook, fp16_compress_hook
from .guard import get_timeout, set_timeout, timeout
from .reducer import Reducer
from .state import release
from .transports import TRANSPORTS, create_transport, open_transport

__all__ = ["allreduce", "allreduce_", "allreduce_many_", "broadcast_", "plan_buckets", "Reducer", "allreduce_hook",
           "fp16_compress_hook", "TRANSPORTS", "create_transport", "open_transport", "release", "set_timeout",
           "get_timeout", "timeout"]
