"""Overlapping the gradient allreduce with backward: a bucketed, asynchronous reducer.

Backward produces gradients last layer first. Instead of averaging them all
after backward (one :func:`~ringtrain.comm.buckets.allreduce_many_`), the
:class:`Reducer` starts a bucket's reduction as soon as its last gradient has
been pushed, on a communication thread, while the main thread goes on with the
rest of backward (NumPy's matmuls release the GIL, and so do mpi4py's MPI
calls)::

    reducer = Reducer(comm, {n: model.grads[n] for n in reversed(model.params)})
    loss, grads, correct = model.loss_and_grad(x, y, on_grad=reducer.push)
    reducer.wait()      # every gradient now holds the mean over ranks
    ...
    reducer.close()     # or use it as a context manager

Contract (every rank): the constructor, :meth:`Reducer.wait` and
:meth:`Reducer.close` are collective, and every rank must push the same
names in any order between two ``wait()`` calls. Buckets are planned once, at
construction, from the arrays in the order given (give them in the order
``push`` will deliver them, so buckets fill and start early), with
:func:`~ringtrain.comm.buckets.plan_buckets`, and they are started strictly in
that order, so every rank makes the same collective calls in the same order.
Each bucket goes through the same header-checked path as ``allreduce_many_``
(:func:`ringtrain.comm.buckets.reduce_bucket`), so mismatched calls still raise
on every rank, and the results are bitwise those of ``allreduce_many_`` over
the same list, ``bucket_bytes``, ``op``, ``algorithm`` and ``compression``.

The reductions run on a duplicate of ``comm`` (``Comm.Dup``), so they never
match messages of collectives the main thread makes meanwhile. That needs
``MPI_THREAD_MULTIPLE``, which mpi4py asks for by default; with a lower
thread level (or one rank) the reducer reduces each bucket synchronously in
``push``, with the same results.
"""

import contextlib
import queue
import threading

import numpy as np

from .. import backend
from ..errors import UsageError
from ..failure import agree
from ..backend import contiguous_span
from .buckets import check_list, pack, plan_buckets, reduce_bucket, travels_as_fp16, unpack
from .collectives import NO_PROBLEM
from .state import CommState, release

__all__ = ["Reducer"]


class _Bucket:
    """One bucket: its members' indices, and where its data is reduced."""

    def __init__(self, indices, arrays, wire):
        self.indices = indices
        members = [arrays[i] for i in indices]
        self.span = contiguous_span(members)
        self.total = sum(a.size for a in members)
        first = members[0]
        xp = backend.get_array_module(first)
        # Its own buffers: the main thread packs bucket k + 1 while the thread reduces bucket k.
        self.fused = self.span if self.span is not None else xp.empty(self.total, first.dtype)
        self.wire = xp.empty(self.total, np.float16) if wire else None


class Reducer:
    """Reduce gradient buckets asynchronously as they become ready (see the module docstring).

    Args:
        comm: communicator (duplicated; the constructor is collective).
        arrays: dict of name -> array (or a list, named by index), in the order
            :meth:`push` will deliver them. Arrays that are consecutive,
            contiguous views of one NumPy buffer (such as a model's
            ``grad_buffer``) are reduced in place, without copies.
        bucket_bytes: largest bucket (default
            :data:`~ringtrain.comm.buckets.DEFAULT_BUCKET_BYTES`).
        op: ``"sum"``, ``"mean"``, ``"min"`` or ``"max"``.
        compression: ``None`` or ``"fp16"`` (see
            :func:`~ringtrain.comm.buckets.allreduce_many_`).
        algorithm: ``"auto"``, ``"ring"``, ``"mpi"`` or ``"hierarchical"``.
        threaded: reduce on a communication thread (default: when MPI
            provides ``MPI_THREAD_MULTIPLE`` and there is more than one rank).
        trace: optional ``trace(k)`` returning a context manager around the
            reduction of bucket ``k`` (on the thread that reduces it), e.g. a
            :class:`~ringtrain.training.timeline.Timeline` span.

    Raises:
        UsageError: on every rank, for arguments any rank cannot use.
    """

    def __init__(self, comm, arrays, bucket_bytes=None, op="mean", compression=None, algorithm="auto",
                 threaded=None, trace=None):
        from mpi4py import MPI

        if isinstance(arrays, dict):
            names, items = list(arrays), list(arrays.values())
        else:
            items = list(arrays)
            names = list(range(len(items)))
        self.bucket_bytes, self.signature, problem = check_list(items, bucket_bytes, compression)
        agree(comm, f"Reducer: {problem[1]}" if problem[0] else None)
        self.comm = comm.Dup()
        self.state = CommState.of(self.comm)
        self.op, self.algorithm, self.compression = op, algorithm, compression
        self.trace = trace
        self.names, self.arrays = names, items
        self._device = backend.device_of(items[0]) if items else None
        self._index = {name: i for i, name in enumerate(names)}
        size = self.state.size
        self.buckets = [_Bucket(b, items, travels_as_fp16(np.dtype(items[b[0]].dtype), compression, size))
                        for b in plan_buckets(items, self.bucket_bytes)]
        self._bucket_of = [0] * len(items)
        for k, bucket in enumerate(self.buckets):
            for i in bucket.indices:
                self._bucket_of[i] = k
        if threaded is None:
            threaded = size > 1 and MPI.Query_thread() == MPI.THREAD_MULTIPLE
        self._jobs = self._done = self._thread = None
        self._error = None
        if threaded:
            self._jobs, self._done = queue.SimpleQueue(), queue.SimpleQueue()
            self._thread = threading.Thread(target=self._serve, name="ringtrain-reducer", daemon=True)
            self._thread.start()
        self._reset()

    def _reset(self):
        self._current = list(self.arrays)
        self._pushed = [False] * len(self.arrays)
        self._missing = [len(b.indices) for b in self.buckets]
        self._next = 0  # the next bucket to start: strictly in order, the same on every rank
        self._in_flight = 0

    def push(self, name, grad):
        """Hand over gradient ``name``, final for this step; may start its bucket's reduction.

        ``grad`` may be the registered array or any array of its shape and
        dtype; either way it holds the result after :meth:`wait`, and must not
        be written until then. Fits ``Model.loss_and_grad(on_grad=...)``.
        """
        i = self._index.get(name)
        if i is None:
            raise KeyError(f"Reducer.push: unknown gradient {name!r}; the reducer was built for "
                           f"{', '.join(map(str, self.names))}")
        if self._pushed[i]:
            raise ValueError(f"Reducer.push: gradient {name!r} pushed twice in one step; call wait() between steps")
        registered = self.arrays[i]
        if grad is not registered and (grad.shape != registered.shape or grad.dtype != registered.dtype):
            raise ValueError(f"Reducer.push: gradient {name!r} has shape {grad.shape} and dtype {grad.dtype}, "
                             f"expected {registered.shape} and {registered.dtype}")
        self._pushed[i] = True
        self._current[i] = grad
        k = self._bucket_of[i]
        self._missing[k] -= 1
        while self._next < len(self.buckets) and self._missing[self._next] == 0:
            self._start(self._next)
            self._next += 1

    def wait(self):
        """Finish every bucket (collective); the pushed arrays then hold the results.

        Arrays not pushed this step are reduced as they are, so ``wait()``
        alone reduces every registered array, like ``allreduce_many_``.

        Raises:
            the first exception a reduction raised (MismatchError and
            UsageError are raised on every rank alike).
        """
        while self._next < len(self.buckets):
            self._start(self._next)
            self._next += 1
        if self._thread is not None:
            for _ in range(self._in_flight):
                self._done.get()
        error, self._error = self._error, None
        self._reset()
        if error is not None:
            raise error

    def close(self):
        """Stop the communication thread and free the duplicate communicator (collective)."""
        if self.comm is None:
            return
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join()
            self._thread = None
        release(self.comm)  # its plans' persistent requests first, so the free is immediate
        self.comm = None

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()

    def _start(self, k):
        if self.comm is None:
            raise UsageError("Reducer: used after close()")
        bucket = self.buckets[k]
        members = [self._current[i] for i in bucket.indices]
        in_place = bucket.span is not None and all(m is self.arrays[i] for m, i in zip(members, bucket.indices))
        if not in_place:
            flat = bucket.fused if bucket.span is None else self._spare(bucket)
            pack(members, flat)
        else:
            flat = bucket.fused
        # CuPy: the gradient kernels must finish before another thread hands the memory to MPI.
        backend.synchronize(flat)
        job = (k, flat, bucket, members, in_place)
        if self._thread is None:
            self._reduce(job)
            if self._error is not None:
                error, self._error = self._error, None
                self._reset()
                raise error
        else:
            self._in_flight += 1
            self._jobs.put(job)

    def _spare(self, bucket):
        # A bucket planned in place but handed other arrays this step: stage it.
        if not hasattr(bucket, "staging"):
            bucket.staging = backend.get_array_module(bucket.fused).empty_like(bucket.fused)
        return bucket.staging

    def _reduce(self, job):
        k, flat, bucket, members, in_place = job
        if self._error is not None:
            # An earlier bucket failed (on every rank alike, for the checked errors): skip the rest.
            return
        try:
            with self.trace(k) if self.trace is not None else contextlib.nullcontext():
                reduce_bucket(self.state, "Reducer", flat, bucket.wire, self.op, self.algorithm,
                              len(self.arrays), self.signature, NO_PROBLEM)
                if not in_place:
                    unpack(flat, members)
        except BaseException as exc:  # noqa: BLE001 - handed to wait() on the main thread
            self._error = exc

    def _serve(self):
        # CuPy's current device is per thread: reduce on the device the gradients live on.
        backend.use_device(self._device)
        while True:
            job = self._jobs.get()
            if job is None:
                return
            self._reduce(job)
            self._done.put(True)
