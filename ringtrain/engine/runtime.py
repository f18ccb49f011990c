"""Horovod's basics: ``init``, ``shutdown``, ``rank``, ``size`` and where this rank sits.

``init`` learns the rank's place from ringtrain's topology
(:class:`ringtrain.cluster.topology.TaskSpec`), once, and builds, in plain
sight, what runs the collectives: the process sets and their communicators
(:class:`~ringtrain.engine.process_sets.ProcessSets`) and the engine
(:class:`~ringtrain.engine.core.Engine`, whose docstring is the contract).
Horovod's API is a module-level runtime that every call consults, so this
module keeps one (:func:`current`), made by :func:`init` and dropped by
:func:`shutdown`.

Collective: every rank of the communicator must call :func:`init`, and
:func:`shutdown` (it runs at exit too).
"""

import atexit
import os
import sys
import threading

from .. import backend
from ..comm.guard import timeout_from_env
from ..cluster.commits import elastic_start
from ..cluster.topology import TaskSpec, node_layout
from ..environment import env_flag
from ..errors import UsageError
from ..failure import verdict_of
from ..watchdog import StartupWatchdog, Watchdog
from .core import Engine
from .errors import HorovodInternalError
from .process_sets import ProcessSet, ProcessSets, bind
from .settings import Settings

__all__ = ["init", "shutdown", "is_initialized", "size", "rank", "local_size", "local_rank", "cross_size",
           "cross_rank", "is_homogeneous", "mpi_threads_supported", "communicator", "current", "Runtime",
           "cross_layout", "mpi_built", "mpi_enabled", "gloo_built", "gloo_enabled", "nccl_built", "ddl_built",
           "ccl_built", "cuda_built", "rocm_built", "helper", "add_process_set", "remove_process_set"]

_lock = threading.Lock()
_runtime = None
_at_exit = []  # whether shutdown is registered with atexit (once per process, after MPI's own)


def cross_layout(hosts):
    """``(cross_rank, cross_size)`` of every rank, as lists indexed by rank (pure).

    Horovod's cross communicator joins the ranks that have the same local
    rank, one per host: a rank's cross rank is its host's place among those.
    """
    _, local = node_layout(hosts)
    counts = {}
    cross_rank = []
    for lr in local:
        cross_rank.append(counts.get(lr, 0))
        counts[lr] = cross_rank[-1] + 1
    return cross_rank, [counts[lr] for lr in local]


class Runtime:
    """This process's place in the job, the communicator Horovod's calls run over, its sets and its engine."""

    def __init__(self, comm, owned):
        from mpi4py import MPI

        self.comm = comm
        self.owned = owned  # made by init from a list of ranks (left, as every communicator, to MPI_Finalize)
        self.spec = TaskSpec.from_mpi(comm)
        cross_rank, cross_size = cross_layout(self.spec.hosts)
        self.cross_rank, self.cross_size = cross_rank[self.spec.rank], cross_size[self.spec.rank]
        per_host = {}
        for host in self.spec.hosts:
            per_host[host] = per_host.get(host, 0) + 1
        self.homogeneous = len(set(per_host.values())) == 1
        self.threads_multiple = MPI.Query_thread() == MPI.THREAD_MULTIPLE
        self.sets = None
        self.engine = None
        self.previous_hook = self.hook = None


def _communicator_from(comm):
    """``(communicator, owned)`` from init's argument: None, an mpi4py communicator or a list of world ranks."""
    from mpi4py import MPI

    if comm is None:
        return MPI.COMM_WORLD, False
    if isinstance(comm, MPI.Comm):
        return comm, False
    try:
        ranks = sorted({int(r) for r in comm})
    except TypeError:
        raise ValueError(f"init(comm=...) takes an mpi4py communicator or a list of ranks, got {comm!r}") from None
    world = MPI.COMM_WORLD
    if not ranks or ranks[0] < 0 or ranks[-1] >= world.Get_size():
        raise ValueError(f"init(comm={comm!r}): ranks must lie in 0..{world.Get_size() - 1}")
    group = world.Get_group().Incl(ranks)
    sub = world.Create(group)  # collective over the world, as Horovod's init is
    group.Free()
    if sub == MPI.COMM_NULL:
        raise ValueError(f"init(comm={comm!r}): this process (world rank {world.Get_rank()}) is not in the list")
    return sub, True



# Horovod's run-time variables (its runner's config_parser.py, and its docs) that the engine does not act
# on. Those it serves: HOROVOD_FUSION_THRESHOLD, HOROVOD_CYCLE_TIME, the three HOROVOD_STALL_* (settings)
# and HOROVOD_TIMELINE (here). Build-time ones (HOROVOD_WITH_*, HOROVOD_GPU_*, ...) are pip's, not a run's,
# and go unnamed.
UNSERVED = ("HOROVOD_CACHE_CAPACITY", "HOROVOD_HIERARCHICAL_ALLREDUCE", "HOROVOD_HIERARCHICAL_ALLGATHER",
            "HOROVOD_TORUS_ALLREDUCE", "HOROVOD_AUTOTUNE", "HOROVOD_AUTOTUNE_LOG", "HOROVOD_AUTOTUNE_WARMUP_SAMPLES",
            "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE", "HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES",
            "HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE", "HOROVOD_MPI_THREADS_DISABLE", "HOROVOD_NUM_NCCL_STREAMS",
            "HOROVOD_THREAD_AFFINITY", "HOROVOD_GLOO_TIMEOUT_SECONDS", "HOROVOD_LOG_LEVEL", "HOROVOD_LOG_HIDE_TIME",
            "HOROVOD_ELASTIC_TIMEOUT", "HOROVOD_DYNAMIC_PROCESS_SETS", "HOROVOD_CCL_CACHE", "HOROVOD_ENABLE_XLA_OPS")
_WARNING = "[ringtrain] WARNING "


def timeline_setting(env):
    """``(path, mark_cycles)`` from ``HOROVOD_TIMELINE`` and ``HOROVOD_TIMELINE_MARK_CYCLES`` (pure).

    ``path`` is None when the timeline is off: the variable unset, blank, or
    Horovod's ``DYNAMIC`` (only ``hvd.start_timeline`` starts it then). A
    relative path is made absolute here, where the job started.
    """
    path = env.get("HOROVOD_TIMELINE", "").strip()
    mark_cycles = env_flag(env, "HOROVOD_TIMELINE_MARK_CYCLES", everywhere=True)
    if not path or path == "DYNAMIC":
        return None, mark_cycles
    return os.path.abspath(path), mark_cycles


def unserved_lines(env):
    """One warning line for each of Horovod's variables set in ``env`` that the engine ignores (pure)."""
    lines = [f"{_WARNING}{name} is set, but ringtrain does not act on it: ignored"
             for name in UNSERVED if env.get(name, "").strip()]
    _, mark_cycles = timeline_setting(env)
    if mark_cycles:
        lines.append(f"{_WARNING}HOROVOD_TIMELINE_MARK_CYCLES is set, but ringtrain's timeline draws each "
                     "op, not the engine's cycles: no cycle markers")
    return lines


def _rank_0_timeline(comm):
    """Rank 0's timeline setting, the same on every rank, and its warnings printed there (collective)."""
    setting = None
    if comm.Get_rank() == 0:
        try:
            setting = timeline_setting(os.environ)
            for line in unserved_lines(os.environ):
                sys.stderr.write(line + "\n")
        except UsageError as exc:
            setting = str(exc)
    setting = comm.bcast(setting, root=0)  # every rank starts the timeline, or none: its stop is collective
    if isinstance(setting, str):
        if comm.Get_rank() == 0:
            print(f"ringtrain: error: {setting}", file=sys.stderr, flush=True)
        raise SystemExit(2)
    return setting


def start_timeline(file_path, mark_cycles=False):
    """Start recording every op this rank runs; ``stop_timeline`` writes them to ``file_path`` (collective).

    ``mark_cycles`` is accepted, as Horovod's is; the timeline draws ops, not the engine's cycles.
    """
    from ..training.timeline import Timeline

    engine = current().engine
    engine.timeline = Timeline(rank())
    engine.timeline_path = str(file_path)


def stop_timeline():
    """Stop recording; rank 0 writes every rank's ops to the path given to ``start_timeline`` (collective)."""
    _stop_timeline(current().engine)


def _stop_timeline(engine):
    timeline, path = engine.timeline, engine.timeline_path
    engine.timeline = None
    engine.call("stop_timeline", args=(timeline.events if timeline is not None else [], path))


def _write_timeline(runtime):
    """Write a timeline still running at shutdown, as Horovod's is written (collective; skipped once broken)."""
    engine = runtime.engine
    if engine.timeline is None or engine.broken is not None:
        return
    try:
        _stop_timeline(engine)
    except HorovodInternalError:
        pass  # a peer failed meanwhile: the job is ending, and its ranks have said why


def init(comm=None, process_sets=None):
    """Start the runtime over ``comm`` (default ``MPI.COMM_WORLD``); a second call does nothing.

    Collective over ``comm`` (over the world when ``comm`` is a list of ranks).

    Args:
        comm: an mpi4py communicator, or a list of ``MPI.COMM_WORLD`` ranks to run over.
        process_sets: extra :class:`~ringtrain.engine.process_sets.ProcessSet` objects to register.
    """
    global _runtime
    with _lock:
        if _runtime is not None:
            return
        dog = _start_watch(comm)
        try:
            with dog.watch("hvd.init (every rank must call it)"):
                communicator_, owned = _communicator_from(comm)
                runtime = Runtime(communicator_, owned)
                settings = _agreed_settings(communicator_)
                timeline_path, mark_cycles = _rank_0_timeline(communicator_)
        finally:
            dog.close()
        if not runtime.threads_multiple and runtime.spec.size > 1:
            raise ValueError("ringtrain's engine needs MPI_THREAD_MULTIPLE (mpi4py's default): its engine calls MPI "
                             "from more than one thread; do not lower mpi4py.rc.thread_level")
        runtime.sets = ProcessSets(communicator_)
        runtime.engine = Engine(communicator_, runtime.sets, settings)
        bind(runtime.sets)
        # An uncaught exception must end the job, not leave the other ranks waiting on this one.
        runtime.previous_hook = sys.excepthook
        sys.excepthook = runtime.hook = runtime.engine.excepthook(sys.excepthook)
        if not _at_exit:
            atexit.register(shutdown)  # runs before mpi4py's MPI_Finalize, which was registered first
            _at_exit.append(True)
        _runtime = runtime
    for ps in process_sets or []:
        add_process_set(ps)
    if timeline_path is not None:
        start_timeline(timeline_path, mark_cycles)


def _start_watch(comm):
    """Start MPI, and a watchdog over init's collectives, at ringtrain's bound (``RINGTRAIN_TIMEOUT``; none unset).

    Init waits for every rank, in ``MPI_Init`` (mpi4py's import) and in its
    collectives; one that exited, raised or hangs before its own init would
    hold the others there for good. Past the bound each waiting rank prints
    one line and the job ends, as at any other op: the rank that printed none
    never came. A bad value is left to the settings' agreement, which refuses
    it on every rank.
    """
    try:
        bound = timeout_from_env()
    except UsageError:
        bound = None
    started = sys.modules.get("mpi4py.MPI")
    if started is None or not started.Is_initialized():  # (a watcher process is forked for the wait)
        with StartupWatchdog(bound, "hvd.init: MPI start (every rank must call it)", hint=_NEVER_CAME):
            from mpi4py import MPI  # noqa: F401 - importing it starts MPI
    from mpi4py import MPI
    return Watchdog(comm if isinstance(comm, MPI.Comm) else MPI.COMM_WORLD, bound, hint=_NEVER_CAME)


_NEVER_CAME = "a rank that printed no such line never reached it: it exited, raised or hangs before it"


def _agreed_settings(comm):
    """The engine's :class:`Settings`, once every rank has read its own (collective over ``comm``).

    A bad value on any rank ends the job on every rank, one line from the
    first and status 2, before anything starts: a rank that left alone would
    hold the others in their first op, and a bound must not be switched off
    in silence.
    """
    try:
        settings, problem = Settings.from_env(), None
        elastic_start(os.environ)  # read by hvd.elastic.run, which may come long after: refuse it now
    except UsageError as exc:
        settings, problem = None, str(exc)
    verdict = verdict_of(comm.allgather(problem))
    if verdict is None:
        return settings
    if comm.Get_rank() == 0:
        print(f"ringtrain: error: {verdict}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def add_process_set(process_set):
    """Register a process set (a :class:`ProcessSet`, a list of ranks or a communicator) on every rank.

    Collective: every rank must call it, in the same order as other
    process-set changes. Returns the registered :class:`ProcessSet`.
    """
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    return current().engine.add_process_set(ps)


def remove_process_set(process_set):
    """Unregister a process set on every rank and free its communicators (collective over every rank)."""
    return current().engine.remove_process_set(process_set)


def shutdown():
    """Stop the runtime: fail what is pending and tell the other ranks (no-op if not started).

    Ops still pending here, and ops any rank submits after this, fail, as in
    Horovod. It never waits for another rank to shut down, but for one thing:
    a timeline still running (``HOROVOD_TIMELINE``, or ``start_timeline``
    with no stop) is written first, as ``stop_timeline`` does, which is
    collective (skipped once the engine is broken).
    """
    global _runtime
    from mpi4py import MPI

    runtime = _runtime
    if runtime is not None and not MPI.Is_finalized():
        _write_timeline(runtime)
    with _lock:
        runtime, _runtime = _runtime, None
    if runtime is None:
        return
    if MPI.Is_finalized():
        return
    runtime.engine.shutdown()
    runtime.sets.close()  # (no communicator is freed here: process_sets says why)
    if sys.excepthook is runtime.hook:
        sys.excepthook = runtime.previous_hook


def is_initialized():
    """True between :func:`init` and :func:`shutdown`."""
    return _runtime is not None


def current():
    """The running :class:`Runtime`; raises ValueError (as Horovod does) before :func:`init`."""
    runtime = _runtime
    if runtime is None:
        raise ValueError("Horovod has not been initialized; use hvd.init().")
    return runtime


def communicator():
    """The mpi4py communicator the runtime runs over (the one given to :func:`init`)."""
    return current().comm


def size():
    """Number of ranks."""
    return current().spec.size


def rank():
    """This process's rank."""
    return current().spec.rank


def local_size():
    """Number of ranks on this host."""
    return current().spec.local_size


def local_rank():
    """This process's rank among the ranks on its host."""
    return current().spec.local_rank


def cross_size():
    """Number of ranks with this rank's local rank: one per host that has one."""
    return current().cross_size


def cross_rank():
    """This rank's host's place among the ranks with its local rank."""
    return current().cross_rank


def is_homogeneous():
    """True when every host runs the same number of ranks."""
    return current().homogeneous


def mpi_threads_supported():
    """True when MPI granted ``MPI_THREAD_MULTIPLE``."""
    return current().threads_multiple


def mpi_built(verbose=False):
    """True: ringtrain runs over MPI (mpi4py)."""
    return True


def mpi_enabled():
    """True: every collective runs over MPI."""
    return True


def gloo_built(verbose=False):
    """False: there is no Gloo controller."""
    return False


def gloo_enabled():
    """False: there is no Gloo controller."""
    return False


def nccl_built(verbose=False):
    """0: NCCL is never used (CUDA tensors go through CUDA IPC or MPI)."""
    return 0


def ddl_built(verbose=False):
    """False: IBM DDL is not used."""
    return False


def ccl_built(verbose=False):
    """False: oneCCL is not used."""
    return False


def cuda_built(verbose=False):
    """True when CuPy sees a GPU, so CUDA tensors take ringtrain's GPU path."""
    return backend.device_count() > 0


def rocm_built(verbose=False):
    """False: ROCm is not supported."""
    return False


def helper(label):
    """The running engine's context for a plain collective run around it (:meth:`Engine.helper`).

    Raises HorovodInternalError at once if the engine is broken, and ends
    the job if the collective is stuck once a peer has gone (see
    :mod:`ringtrain.engine.core`); ValueError before :func:`init`.
    """
    return current().engine.helper(label)
