"""Process sets: the ranks a collective runs over (Horovod's ``ProcessSet``), and their communicators.

The global set (id 0) is every rank of the runtime's communicator and
always exists. Subsets are registered with :func:`add_process_set` on every
rank (collective, in the same order everywhere) and get ids 1, 2, ...

:class:`ProcessSets` is the one place that owns a set's communicators: the
engine's two (``data`` for the collectives, ``control`` for matching them;
:class:`~ringtrain.engine.channel.Channel`) and, made on first use, the one
Horovod's helpers run over on the caller's thread (``broadcast_parameters``,
``DistributedOptimizer``; :func:`communicator_of`). Two threads must never
run collectives on one communicator, hence the separate ones. They are
freed together when the set is removed (collective, so every member frees
them at the same point). ``shutdown`` leaves them to ``MPI_Finalize``:
freeing ringtrain's windows on them waits for every member, and no rank
may wait in ``shutdown`` for a peer that has not shut down; and a freed
communicator's id may be reused by the next ``init`` while a late peer's
message to the old one is still on its way.

The running runtime's sets are reached through :data:`global_process_set`,
which ``init`` binds to them and ``shutdown`` unbinds: Horovod's API is
module-level (``hvd.add_process_set(...)``), and this is its one anchor here.
"""

from ..comm import release

__all__ = ["ProcessSet", "ProcessSets", "global_process_set", "add_process_set", "remove_process_set",
           "communicator_of", "included", "set_rank"]

NOT_INITIALIZED = "Horovod has not been initialized; use hvd.init()."


class ProcessSet:
    """A set of ranks (of the runtime's communicator) that collectives can run over.

    Args:
        ranks_or_comm: a list of ranks, or an mpi4py communicator whose ranks
            are all in the runtime's communicator.
    """

    def __init__(self, ranks_or_comm):
        self.process_set_id = None
        self.mpi_comm = None
        self.registry = None  # the ProcessSets it is registered with
        if hasattr(ranks_or_comm, "Get_group"):
            self.mpi_comm = ranks_or_comm
            self.ranks = None  # translated to the runtime's ranks when registered
        else:
            self.ranks = sorted({int(r) for r in ranks_or_comm})

    def _require(self):
        if self.process_set_id is None or self.registry is None:
            raise ValueError("this process set is not registered; call hvd.add_process_set() on every rank")
        return self.registry

    def size(self):
        """Number of ranks in the set."""
        self._require()
        return len(self.ranks)

    def rank(self):
        """This process's rank within the set, or -1 if it is not in it."""
        me = self._require().rank
        return self.ranks.index(me) if me in self.ranks else -1

    def included(self):
        """True when this process is in the set."""
        return self._require().rank in self.ranks

    def __repr__(self):
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"


class _GlobalProcessSet(ProcessSet):
    """Every rank; its ranks are read from the running runtime's sets, which may be re-initialised."""

    def __init__(self):
        super().__init__([])
        self.process_set_id = 0

    @property
    def ranks(self):
        return list(range(self.registry.size)) if self.registry is not None else []

    @ranks.setter
    def ranks(self, value):
        pass


global_process_set = _GlobalProcessSet()


class ProcessSets:
    """The process sets of one runtime: ranks by id, and every communicator they own.

    Collective over ``comm`` (``init`` makes it on every rank). ``engine`` is
    set by ``init`` once the engine exists; sets are added and removed
    through it, on every rank in the same order.
    """

    def __init__(self, comm):
        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.engine = None
        self.sets = {0: global_process_set}
        self.next_id = 1
        data = comm.Dup()
        self._comms = {0: [data, data.Dup(), comm]}  # id -> [data, control, caller's (None until asked)]
        global_process_set.registry = self

    def engine_comms(self, set_id):
        """``(data, control)``: the engine's communicators of a set this rank is in."""
        data, control, _ = self._comms[set_id]
        return data, control

    def add(self, ps):
        """Register ``ps`` on every rank (collective over every rank); returns it."""
        problem = self._problem(ps)
        ranks = tuple(ps.ranks or ())
        if problem is not None:
            self.engine.refuse("add_process_set", problem)
            raise ValueError(problem)

        def make(comm):  # on every rank, in the order of the global set's ops
            set_id, self.next_id = self.next_id, self.next_id + 1
            if self.rank in ranks:
                group = comm.Get_group().Incl(list(ranks))
                data = comm.Create_group(group)  # collective over the set's ranks only
                group.Free()
                self._comms[set_id] = [data, data.Dup(), None]
                self.engine.add_channel(set_id, ranks, *self.engine_comms(set_id))
            ps.process_set_id, ps.registry = set_id, self
            self.sets[set_id] = ps
            return ps

        return self.engine.call("add_process_set", make, detail=ranks)

    def _problem(self, ps):
        if ps.process_set_id is not None:
            return f"add_process_set: {ps} is already registered"
        if ps.mpi_comm is not None:
            from mpi4py import MPI

            group = ps.mpi_comm.Get_group()
            ranks = MPI.Group.Translate_ranks(group, range(ps.mpi_comm.Get_size()), self.comm.Get_group())
            if MPI.UNDEFINED in ranks:
                return "add_process_set: the communicator has ranks outside the one hvd.init() was given"
            ps.ranks = sorted(ranks)
        if not ps.ranks or ps.ranks[0] < 0 or ps.ranks[-1] >= self.size:
            return f"add_process_set: ranks must lie in 0..{self.size - 1}, got {ps.ranks}"
        return None

    def remove(self, ps):
        """Unregister ``ps`` on every rank and free its communicators (collective over every rank)."""
        set_id = ps.process_set_id
        if set_id == 0:
            raise ValueError("the global process set cannot be removed")
        if set_id not in self.sets:
            raise ValueError(f"remove_process_set: {ps} is not registered")

        def drop(comm):
            self.engine.drop_channel(set_id, f"process set {set_id} was removed")
            self.free(set_id)
            self.sets.pop(set_id, None)
            ps.process_set_id, ps.registry = None, None
            return True

        return self.engine.call("remove_process_set", drop, detail=(set_id,))

    def communicator(self, ps):
        """The communicator Horovod's helpers run over for ``ps`` (made on first use: collective over its ranks)."""
        comms = self._comms.get(ps.process_set_id)
        if comms is None:
            raise ValueError(f"{ps!r}: this rank ({self.rank}) is not in the process set")
        if comms[2] is None:
            group = self.comm.Get_group().Incl(list(ps.ranks))
            comms[2] = self.comm.Create_group(group)
            group.Free()
        return comms[2]

    def free(self, set_id):
        """Free a set's communicators (collective over its ranks: ringtrain's windows on them are freed too)."""
        comms = self._comms.pop(set_id, None)
        if comms is None:
            return
        data, control, caller = comms
        release(data)
        control.Free()
        if caller is not None and caller is not self.comm:
            release(caller)

    def close(self):
        """At shutdown: forget every set (their communicators are left to ``MPI_Finalize``); unbind."""
        for ps in self.sets.values():
            if ps is not global_process_set:
                ps.process_set_id, ps.registry = None, None
        self._comms, self.sets = {}, {}
        if global_process_set.registry is self:
            global_process_set.registry = None


def _sets():
    registry = global_process_set.registry
    if registry is None:
        raise ValueError(NOT_INITIALIZED)
    return registry


def add_process_set(process_set):
    """Register a process set (a :class:`ProcessSet`, a list of ranks or a communicator) on every rank.

    Collective: every rank must call it, in the same order as other
    process-set changes. Returns the registered :class:`ProcessSet`.
    """
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    return _sets().add(ps)


def remove_process_set(process_set):
    """Unregister a process set on every rank and free its communicators (collective over every rank)."""
    return _sets().remove(process_set)


def _is_global(process_set):
    return process_set is None or getattr(process_set, "process_set_id", None) == 0


def included(process_set=None):
    """Whether this rank belongs to ``process_set`` (every rank belongs to the global one)."""
    return True if _is_global(process_set) else bool(process_set.included())


def communicator_of(process_set=None):
    """The communicator Horovod's helpers run over: the runtime's for the global set (ValueError before ``init``).

    A subset gets one of its own, made from the runtime's on first use
    (collective over the set's ranks) and freed with the set.
    """
    registry = _sets()
    if _is_global(process_set):
        return registry.comm
    if getattr(process_set, "process_set_id", None) is None or process_set.registry is not registry:
        raise ValueError(f"{process_set!r} is not registered; call hvd.add_process_set() on every rank")
    return registry.communicator(process_set)


def set_rank(process_set, rank):
    """``rank`` (of the runtime, as Horovod's ``root_rank`` is given) as a rank of ``process_set``'s communicator.

    Raises:
        ValueError: on every rank of the set, for a rank outside it (passed
            on as it is, it could name another member of the set's
            communicator and broadcast the wrong rank's values).
    """
    if _is_global(process_set):
        return rank
    ranks = list(process_set.ranks)
    if rank not in ranks:
        raise ValueError(f"root_rank {rank} is not in the process set (ranks {ranks})")
    return ranks.index(rank)
