"""``hvd.elastic``: Horovod's elastic training API, on MPI jobs that restart.

Horovod keeps its workers alive and rebuilds its Gloo world around them; an
MPI world cannot shrink or grow, so here the launcher
(``ringtrain launch --min-np ... --host-discovery-script ...``, see
:mod:`ringtrain.cluster.elastic`) restarts the whole job on the hosts there
are, and :func:`run` resumes it from its last commit::

    state = hvd.elastic.TorchState(model, optimizer, epoch=0, batch=0)
    state.register_reset_callbacks([rescale_learning_rate])

    @hvd.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            ...
            state.commit()

    train(state)

What differs from Horovod, and why:

* a commit also writes the state to disk on rank 0 (under an elastic
  launcher): that is what survives a process, so it costs a file write;
* a failed worker ends the whole MPI job, and the job restarts from the last
  commit (Horovod's survivors restore theirs in memory); the reset callbacks
  run after the restart, as after Horovod's reset;
* when the launcher's hosts change, the next commit (or
  ``check_host_updates``) raises ``HostsUpdatedInterrupt`` on every rank and
  :func:`run` ends the process with status 75 for the launcher to restart it
  on the new hosts; an interrupt the script raises itself is handled in
  the process, as Horovod does;
* a function :func:`run` already ran to its end is not run again after a
  restart: its final state and return value are restored.

Without an elastic launcher (plain ``mpirun``), commits stay in memory as
in Horovod, unless ``RINGTRAIN_ELASTIC_DIR`` names a directory for them.
"""

import functools
import pickle
import sys

from ...io.checkpoint import CheckpointError
from ...io.safeio import printable
from ..errors import HorovodInternalError, HostsUpdatedInterrupt
from ..runtime import current, rank, size
from ...cluster.elastic import RESTART_STATUS
from ...errors import UsageError
from .commits import CommitStore
from .sampler import ElasticSampler
from .state import CommitFailed, ObjectState, State, TorchState

__all__ = ["run", "State", "ObjectState", "TorchState", "ElasticSampler", "HostsUpdatedInterrupt",
           "HorovodInternalError", "CommitFailed", "RESTART_STATUS"]


def run(func):
    """Run ``func(state, ...)`` elastically: from the last commit after a restart, again after a reset.

    ``func``'s first argument is a :class:`State`. As in Horovod, ``func``
    must not start with a collective of its own: :func:`run` synchronizes
    the state first. Collective: every rank calls the wrapped function.
    """
    @functools.wraps(func)
    def wrapper(state, *args, **kwargs):
        return _run(func, state, args, kwargs, CommitStore.from_env())
    return wrapper


def _run(func, state, args, kwargs, store):
    state._store = store
    resumed = _resume(state, store)
    if resumed is not None:
        if resumed["finished"]:
            state.sync()
            return resumed["result"]
        state.on_reset()
    skip_sync = False
    while True:
        try:
            if not skip_sync:
                state.sync()
            result = func(state, *args, **kwargs)
            break
        except HostsUpdatedInterrupt as exc:
            if state._restart_wanted:
                _stop_for_restart(state, getattr(exc, "committed", False))
            skip_sync = exc.skip_sync
        except HorovodInternalError as exc:
            if isinstance(exc, UsageError):  # ranks that disagree: the same mismatch on every try
                raise
            if current().engine.broken is not None:
                # A peer shut down, failed or stalled: the engine stays broken, and an MPI world cannot lose a
                # rank, so no try in this process can succeed. Ending it lets the launcher restart the job.
                raise
            state.restore()
            skip_sync = False
        state.on_reset()
    if store is not None:
        state.save()
        error = state._persist(finished=True, result=result if _picklable(result) else None)[0]
        if error is not None:
            raise CommitFailed(error)
    return result


def _resume(state, store):
    """Rank 0 reads the last commit and restores it; every rank learns whether there was one (collective)."""
    if store is None:
        return None
    header, problem = None, None
    if rank() == 0:
        try:
            found = store.latest(warn=lambda line: _say(f"warning: {line}"))
            if found is not None:
                sequence, snapshot, meta = found
                state._load_snapshot(snapshot["state"])
                state.restore()
                state._sequence = sequence
                header = {"finished": snapshot["finished"], "result": snapshot["result"], "sequence": sequence,
                          "then": meta.get("size")}
            store.listen()
        except CheckpointError as exc:  # a commit there that cannot be restored
            problem = f"cannot resume from the last commit in {store.commits}: {exc}"
        except UsageError as exc:  # the directory or its key refused: that, not a commit, is what is wrong
            problem = str(exc)
        except Exception as exc:  # noqa: BLE001 - every rank must hear of it
            problem = f"cannot resume from the last commit in {store.commits}: {exc}"
    header, problem = state._bcast_object((header, problem))
    if problem is not None:
        _say(f"error: {problem}")
        raise SystemExit(2)
    if header is not None:
        what = "the end of the run" if header["finished"] else f"commit {header['sequence']}"
        _say(f"resuming from {what} (made at {header['then']} rank(s)) at {size()} rank(s)")
    return header


def _stop_for_restart(state, committed):
    """End the process for the launcher to restart the job on its new hosts, with the state on disk."""
    if not committed:  # the interrupt came from check_host_updates: keep what the state holds now
        state.save()
        error = state._persist()[0]
        if error is not None:
            raise CommitFailed(error)
    _say(f"the hosts changed: stopping at commit {state._sequence} for the launcher to restart the job")
    sys.stdout.flush()
    raise SystemExit(RESTART_STATUS)


def _say(line):
    if rank() == 0:
        print(f"ringtrain elastic: {printable(line)}", file=sys.stderr, flush=True)


def _picklable(value):
    try:
        pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
        return True
    except Exception:  # noqa: BLE001 - anything pickle refuses
        return False
