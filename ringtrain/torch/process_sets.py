"""Process sets: the ranks a collective runs over (Horovod's ``ProcessSet``).

The global set (id 0) is every rank of the runtime's communicator and
always exists. Subsets are registered with :func:`add_process_set` on every
rank (collective, :mod:`ringtrain.torch.process_set_ops`); their
communicators are made on the engine's thread, the only caller of MPI for
these ops.
"""

from . import runtime

__all__ = ["ProcessSet", "global_process_set", "Registry"]


class ProcessSet:
    """A set of ranks (of the runtime's communicator) that collectives can run over.

    Args:
        ranks_or_comm: a list of ranks, or an mpi4py communicator whose ranks
            are all in the runtime's communicator.
    """

    def __init__(self, ranks_or_comm):
        self.process_set_id = None
        self.mpi_comm = None
        if hasattr(ranks_or_comm, "Get_group"):
            self.mpi_comm = ranks_or_comm
            self.ranks = None  # translated to the runtime's ranks when registered
        else:
            self.ranks = sorted({int(r) for r in ranks_or_comm})

    def _require(self):
        if self.process_set_id is None:
            raise ValueError("this process set is not registered; call hvd.add_process_set() on every rank")

    def size(self):
        """Number of ranks in the set."""
        self._require()
        return len(self.ranks)

    def rank(self):
        """This process's rank within the set, or -1 if it is not in it."""
        self._require()
        me = runtime.rank()
        return self.ranks.index(me) if me in self.ranks else -1

    def included(self):
        """True when this process is in the set."""
        self._require()
        return runtime.rank() in self.ranks

    def __repr__(self):
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"


class _GlobalProcessSet(ProcessSet):
    """Every rank; its ranks are read from the runtime, which may be re-initialised."""

    def __init__(self):
        super().__init__([])
        self.process_set_id = 0

    @property
    def ranks(self):
        return list(range(runtime.size())) if runtime.is_initialized() else []

    @ranks.setter
    def ranks(self, value):
        pass


global_process_set = _GlobalProcessSet()


class Registry:
    """The process sets of one runtime: ranks and communicator by id."""

    def __init__(self):
        self.sets = {0: global_process_set}
        self.comms = {}
        self.next_id = 1

    def ranks_of(self, ps_id):
        return tuple(self.sets[ps_id].ranks)

    def comm_of(self, ps_id):
        return self.comms[ps_id]


@runtime.start_hook
def _start(rt):
    rt.extras["process_sets"] = Registry()
