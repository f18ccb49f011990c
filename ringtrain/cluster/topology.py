"""Where a rank sits in the cluster, learned from MPI itself.

Distributed TensorFlow made users write a ClusterSpec by hand (every host and
port) and TensorLayer read a TaskSpec from an environment variable; under MPI
the launcher already knows all of it, so :meth:`TaskSpec.from_mpi` asks the
communicator instead.

It also checks that MPI's view agrees with the launcher's: ``srun`` without
an MPI plugin, ``torchrun`` or another MPI's ``mpirun`` start N processes
that MPI sees as N separate jobs of one rank, which would each train alone
into the same run directory. :func:`launcher_mismatch` says so in one line
(pure), and :meth:`TaskSpec.from_mpi` refuses to go on.
"""

import contextlib
import dataclasses
import os
import socket
import sys

from .. import backend
from ..environment import env_int
from ..errors import UsageError
from .launch import torchrun_size
from .slurm import step_tasks

__all__ = ["TaskSpec", "node_layout", "threads_per_rank", "THREAD_VARIABLES", "launcher_mismatch",
           "refuse_launcher_mismatch"]

# Set any of these and ringtrain leaves the BLAS thread count alone.
THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def threads_per_rank(cores, local_size):
    """This rank's fair share of the host's cores: at least 1.

    Without a limit every rank's BLAS starts one thread per core, so N ranks
    on a host run N times as many threads as cores, fighting each other and
    MPI's busy-polling (measured here: a 2-rank digits run took 19 s instead
    of 2 s). torchrun answers the same problem by defaulting to 1 thread.
    """
    return max(1, cores // max(1, local_size))


def node_layout(hosts):
    """Number the distinct hosts in order of their lowest rank.

    A pure function, so it is tested without MPI.

    Args:
        hosts: every rank's host name, indexed by rank.

    Returns:
        ``(node_of_rank, local_rank_of_rank)``: two lists indexed by rank.
    """
    node_ids = {}
    local_counts = {}
    node_of_rank, local_rank = [], []
    for host in hosts:
        node_ids.setdefault(host, len(node_ids))
        node_of_rank.append(node_ids[host])
        local_rank.append(local_counts.get(host, 0))
        local_counts[host] = local_rank[-1] + 1
    return node_of_rank, local_rank


def _count(env, *names):
    """The first of ``names`` set in ``env``, as a number, with its name, or ``(None, None)`` (pure)."""
    for name in names:
        value = env_int(env, name, None, fix="MPI launchers set it; unset it, or start the program with mpirun",
                        everywhere=True)
        if value is not None:
            return value, name
    return None, None


def launcher_mismatch(env, mpi_size):
    """One line naming the launcher that started N processes MPI did not join, and the fix; or None (pure).

    Only a world of one rank is checked: MPI's answer is the truth whenever
    it joined several. The launcher is named from its variables, Slurm's
    step first (its tasks also carry PMI variables with ``--mpi=pmi2``), then
    an ``mpirun`` (Open MPI's or Hydra's), then torchrun. A batch script or
    an ``salloc`` shell has ``SLURM_NTASKS`` but no step, and is one process:
    not refused; nor is a process with ``WORLD_SIZE`` and none of torchrun's
    own variables (:data:`~ringtrain.cluster.launch.TORCHRUN_VARIABLES`).

    Raises:
        EnvironmentValueError: a launcher's variable that holds no count, naming it.

    Args:
        env: the process's environment.
        mpi_size: ``MPI.COMM_WORLD``'s size.
    """
    if mpi_size != 1:
        return None
    tasks = step_tasks(env)
    if tasks is not None and tasks > 1:
        plugin = " (its pmi2 plugin was used, but this MPI did not take it)" if env.get("PMI_FD") else ""
        return (f"srun started {tasks} tasks (SLURM_STEP_NUM_TASKS={tasks}) but MPI sees 1 rank in each{plugin}, "
                f"so they would train as {tasks} separate jobs; start them with srun --mpi=pmi2 (MPICH, Intel "
                f"MPI) or srun --mpi=pmix (Open MPI), see srun --mpi=list, or with mpirun -np {tasks} inside the "
                "allocation")
    size, name = _count(env, "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
    if size is not None and size > 1:
        which = "Open MPI's mpirun" if name.startswith("OMPI") else "an MPICH (Hydra) mpirun"
        return (f"{which} started {size} processes ({name}={size}) but MPI sees 1 rank in each, so they would "
                f"train as {size} separate jobs: that mpirun belongs to another MPI than the one mpi4py was built "
                "with; use the mpirun of mpi4py's MPI (ringtrain launch finds it)")
    size, name = torchrun_size(env)
    if size is not None:
        return (f"torchrun started {size} processes ({name}={size}) but MPI sees 1 rank in each, so they would "
                f"train as {size} separate jobs; ringtrain runs under MPI: use mpirun -np {size} (or srun "
                "--mpi=pmi2) instead of torchrun")
    return None


def refuse_launcher_mismatch(mpi_size, env=None, stream=None):
    """Exit with status 2 and one line on ``stream`` when :func:`launcher_mismatch` finds one.

    The process is a world of one rank, so no peer waits on it; it exits
    before it writes anything. A library script gets the same one line and
    status as the command line (``SystemExit``, no traceback).
    """
    try:
        problem = launcher_mismatch(os.environ if env is None else env, mpi_size)
    except UsageError as exc:  # a launcher's variable set by hand to no number: no launcher to blame
        problem = str(exc)
    if problem is None:
        return
    stream = stream or sys.stderr
    print(f"ringtrain: error: {problem}", file=stream, flush=True)
    raise SystemExit(2)


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    """One rank's place in the job: a plain, frozen record.

    Attributes:
        rank: this process's rank in the communicator.
        size: number of ranks.
        local_rank: rank among the processes sharing this host's memory.
        local_size: number of ranks on this host.
        node_rank: index of this host, hosts numbered by their lowest rank.
        num_nodes: number of distinct hosts.
        hostname: this host's name as MPI reports it.
        hosts: every rank's host name, indexed by rank (the cluster view).
        device: the GPU this rank should use (``local_rank % device_count``),
            or ``None`` when CuPy sees no GPU.
    """

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    local_size: int = 1
    node_rank: int = 0
    num_nodes: int = 1
    hostname: str = dataclasses.field(default_factory=socket.gethostname)
    hosts: tuple = ()
    device: object = None

    @property
    def is_master(self):
        """True on rank 0, the only rank that logs and writes files."""
        return self.rank == 0

    @property
    def nodes(self):
        """Host name of each node, indexed by node rank."""
        seen = []
        for host in self.hosts:
            if host not in seen:
                seen.append(host)
        return tuple(seen)

    def ranks_on(self, node):
        """The ranks that run on node ``node`` (an index or a host name)."""
        host = self.nodes[node] if isinstance(node, int) else node
        return tuple(r for r, h in enumerate(self.hosts) if h == host)

    @classmethod
    def from_mpi(cls, comm=None, device_count=None):
        """Build this rank's TaskSpec from a communicator.

        Collective: every rank of ``comm`` must call it. Without ``mpirun``
        the process is rank 0 of a world of 1. A world of 1 that a launcher
        started as one of several processes exits 2 with one line
        (:func:`refuse_launcher_mismatch`).

        Args:
            comm: the communicator (default ``MPI.COMM_WORLD``).
            device_count: GPUs per host; default asks CuPy (0 without one).
        """
        from mpi4py import MPI

        refuse_launcher_mismatch(MPI.COMM_WORLD.Get_size())
        comm = comm if comm is not None else MPI.COMM_WORLD
        hostname = MPI.Get_processor_name()
        hosts = tuple(comm.allgather(hostname))
        # The node numbering comes from host names, which every rank sees the
        # same; the local rank comes from MPI's shared-memory split, which is
        # what "on this host" means to the MPI library.
        node_of_rank, _ = node_layout(hosts)
        local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
        try:
            local_rank, local_size = local.Get_rank(), local.Get_size()
        finally:
            local.Free()
        count = backend.device_count() if device_count is None else device_count
        rank = comm.Get_rank()
        return cls(
            rank=rank,
            size=comm.Get_size(),
            local_rank=local_rank,
            local_size=local_size,
            node_rank=node_of_rank[rank],
            num_nodes=max(node_of_rank) + 1,
            hostname=hostname,
            hosts=hosts,
            device=(local_rank % count) if count else None,
        )

    def thread_cap(self, environ=None):
        """This rank's share of the host's cores, as a BLAS thread count; None if the user chose one.

        None when the user has set one of :data:`THREAD_VARIABLES`: an
        explicit choice wins.
        """
        import os

        environ = os.environ if environ is None else environ
        if any(var in environ for var in THREAD_VARIABLES):
            return None
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        return threads_per_rank(cores, self.local_size)

    @contextlib.contextmanager
    def limited_threads(self, environ=None):
        """Cap BLAS threads at :meth:`thread_cap` while the block runs, and restore them after.

        Yields the cap (None when the user set one of :data:`THREAD_VARIABLES`
        and nothing was changed). Ranks sharing a host would otherwise each
        start a BLAS thread per core and fight over the cores.
        """
        threads = self.thread_cap(environ)
        if threads is None:
            yield None
            return
        from threadpoolctl import threadpool_limits

        with threadpool_limits(threads):
            yield threads
