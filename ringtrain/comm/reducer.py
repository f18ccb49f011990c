"""Overlapping the gradient allreduce with backward: a bucketed, asynchronous reducer.

Backward produces gradients last layer first. Instead of averaging them all
after backward (one :func:`~ringtrain.comm.buckets.allreduce_many_`), the
:class:`Reducer` starts a bucket's reduction as soon as its last gradient has
been pushed, on a communication thread, while the main thread goes on with the
rest of backward (NumPy's matmuls release the GIL, and so do mpi4py's MPI
calls)::

    reducer = Reducer(comm, {n: model.grads[n] for n in reversed(model.params)}, hook=allreduce_hook("mean"))
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
the same list, ``bucket_bytes``, ``op``, ``transport`` and ``compression``
(:func:`~ringtrain.comm.hooks.allreduce_hook` takes the three). How a bucket
is reduced is a hook (:mod:`ringtrain.comm.hooks`), as in PyTorch DDP: the
Reducer decides when, the hook how.

The reductions run on a duplicate of ``comm`` (``Comm.Dup``), so they never
match messages of collectives the main thread makes meanwhile. That needs
``MPI_THREAD_MULTIPLE``, which mpi4py asks for by default; with a lower
thread level (or one rank) the reducer reduces each bucket synchronously in
``push``, with the same results.

On a GPU the communication thread issues its kernels on a CUDA stream of its
own, which waits on an event recorded after the bucket's gradients: backward
goes on queueing kernels meanwhile, instead of the thread's work queueing
behind them on the legacy default stream and the main thread blocking on
the device at every bucket. A CuPy model's gradient buffer is reduced in
place, as a NumPy one is.
"""


import contextlib
import functools
import queue
import threading

from .. import backend
from ..backend import contiguous_span
from ..errors import UsageError
from ..failure import agree
from .buckets import check_list, pack, plan_buckets, unpack
from .hooks import GradBucket, allreduce_hook
from .state import CommState, release

__all__ = ["Reducer"]


class _Bucket:
    """One bucket: its members' indices, and where its data is reduced."""

    def __init__(self, index, indices, arrays):
        self.index, self.indices = index, indices
        members = [arrays[i] for i in indices]
        self.span = contiguous_span(members)
        first = members[0]
        xp = backend.get_array_module(first)
        # Its own buffer: the main thread packs bucket k + 1 while the thread reduces bucket k.
        self.fused = self.span if self.span is not None else xp.empty(sum(a.size for a in members), first.dtype)
        self.staging = None  # for a bucket planned in place but handed other arrays

    def buffer_for(self, members, registered):
        """``(flat, in_place)``: where this step's ``members`` are reduced, packed there unless in place."""
        if self.span is not None and all(m is r for m, r in zip(members, registered)):
            return self.fused, True
        if self.span is None:
            flat = self.fused
        else:
            if self.staging is None:
                self.staging = backend.get_array_module(self.fused).empty_like(self.fused)
            flat = self.staging
        pack(members, flat)
        return flat, False


class _Worker:
    """The communication thread: runs jobs in order, on a CUDA stream of its own where there is a GPU."""

    def __init__(self, device):
        self.device = device
        self.jobs, self.done = queue.SimpleQueue(), queue.SimpleQueue()
        self.pending = 0
        self.thread = threading.Thread(target=self._serve, name="ringtrain-reducer", daemon=True)
        self.thread.start()

    def submit(self, job, ready):
        """Run ``job()`` once the device has done the work ``ready`` (an event, or None) marks."""
        self.pending += 1
        self.jobs.put((job, ready))

    def drain(self):
        """Wait for every submitted job."""
        for _ in range(self.pending):
            self.done.get()
        self.pending = 0

    def stop(self):
        self.jobs.put(None)
        self.thread.join()

    def _serve(self):
        # CuPy's current device and stream are per thread: the gradients' device, a stream of its own.
        backend.use_device(self.device)
        with backend.side_stream(self.device):
            while True:
                item = self.jobs.get()
                if item is None:
                    return
                job, ready = item
                backend.wait_event(ready)  # ordered after backward on the device, not on the host
                job()
                self.done.put(True)


class Reducer:
    """Reduce gradient buckets asynchronously as they become ready (see the module docstring).

    Args:
        comm: communicator (duplicated; the constructor is collective).
        arrays: dict of name -> array (or a list, named by index), in the order
            :meth:`push` will deliver them. Arrays that are consecutive,
            contiguous views of one buffer (such as a model's
            ``grad_buffer``, NumPy or CuPy) are reduced in place, without copies.
        hook: ``hook(state, bucket)`` reduces one :class:`~ringtrain.comm.hooks.GradBucket`
            (default :func:`~ringtrain.comm.hooks.allreduce_hook`: the mean, transport "auto").
        bucket_bytes: largest bucket (default
            :data:`~ringtrain.comm.buckets.DEFAULT_BUCKET_BYTES`).
        threaded: reduce on a communication thread (default: when MPI
            provides ``MPI_THREAD_MULTIPLE`` and there is more than one rank).
        trace: optional ``trace(k)`` returning a context manager around the
            reduction of bucket ``k`` (on the thread that reduces it), e.g. a
            :class:`~ringtrain.training.timeline.Timeline` span.

    Raises:
        UsageError: on every rank, for arguments any rank cannot use.
    """

    def __init__(self, comm, arrays, hook=None, bucket_bytes=None, threaded=None, trace=None):
        from mpi4py import MPI

        self.hook = hook if hook is not None else allreduce_hook()
        if isinstance(arrays, dict):
            names, items = list(arrays), list(arrays.values())
        else:
            items = list(arrays)
            names = list(range(len(items)))
        self.bucket_bytes, self.signature, problem = check_list(items, bucket_bytes,
                                                                getattr(self.hook, "compression", None))
        agree(comm, f"Reducer: {problem[1]}" if problem[0] else None)
        self.comm = comm.Dup()
        self.state = CommState.of(self.comm)
        self.trace = trace
        self.names, self.arrays = names, items
        self._index = {name: i for i, name in enumerate(names)}
        self.buckets = [_Bucket(k, b, items) for k, b in enumerate(plan_buckets(items, self.bucket_bytes))]
        self._bucket_of = {i: bucket for bucket in self.buckets for i in bucket.indices}
        if threaded is None:
            threaded = self.state.size > 1 and MPI.Query_thread() == MPI.THREAD_MULTIPLE
        self._worker = _Worker(backend.device_of(items[0]) if items else None) if threaded else None
        self._error = None
        self._reset()

    def _reset(self):
        self._current = list(self.arrays)
        self._pushed = [False] * len(self.arrays)
        self._missing = [len(b.indices) for b in self.buckets]
        self._next = 0  # the next bucket to start: strictly in order, the same on every rank

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
        self._missing[self._bucket_of[i].index] -= 1
        while self._next < len(self.buckets) and self._missing[self._next] == 0:
            self._start(self._next)

    def wait(self):
        """Finish every bucket (collective); the pushed arrays then hold the results.

        Arrays not pushed this step are reduced as they are, so ``wait()``
        alone reduces every registered array, like ``allreduce_many_``.

        Raises:
            Exception: the first exception a reduction raised (MismatchError
                and UsageError are raised on every rank alike).
        """
        while self._next < len(self.buckets):
            self._start(self._next)
        if self._worker is not None:
            self._worker.drain()
        error, self._error = self._error, None
        self._reset()
        if error is not None:
            raise error

    def close(self):
        """Stop the communication thread and free the duplicate communicator (collective)."""
        if self.comm is None:
            return
        if self._worker is not None:
            self._worker.stop()
            self._worker = None
        release(self.comm)  # its plans' persistent requests first, so the free is immediate
        self.comm = None

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()

    def _start(self, k):
        if self.comm is None:
            raise UsageError("Reducer: used after close()")
        self._next = k + 1
        bucket = self.buckets[k]
        members = [self._current[i] for i in bucket.indices]
        flat, in_place = bucket.buffer_for(members, [self.arrays[i] for i in bucket.indices])
        job = functools.partial(self._reduce, bucket, flat, None if in_place else members)
        if self._worker is not None:
            # Ordered after the gradients' kernels by an event, not a host sync (see the module docstring).
            self._worker.submit(job, backend.record_event(flat))
            return
        job()
        if self._error is not None:
            error, self._error = self._error, None
            self._reset()
            raise error

    def _reduce(self, bucket, flat, unpack_to):
        if self._error is not None:
            # An earlier bucket failed (on every rank alike, for the checked errors): skip the rest.
            return
        try:
            with self.trace(bucket.index) if self.trace is not None else contextlib.nullcontext():
                self.hook(self.state, GradBucket(bucket.index, flat, len(self.arrays), self.signature))
                if unpack_to is not None:
                    unpack(flat, unpack_to)
                # The waiting thread reads the results on another stream: done on the device first.
                backend.synchronize(flat)
        except BaseException as exc:  # noqa: BLE001 - handed to wait() on the main thread
            self._error = exc
