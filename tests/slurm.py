"""A real Slurm for the tests: munged, slurmctld and slurmd from Debian's packages.

:class:`Slurm` runs one node, this machine, or (given a :class:`netns.Cluster`)
one ``slurmd`` on each of the suite's network-namespace hosts, with
``slurmctld`` on the first, so a job spans two "machines" joined by a
virtual network. Everything lives in a scratch directory: the munge key and
socket, the configuration (``SLURM_CONF``), state, spool, logs and pid
files; on one node the ports are free ones picked at start; so nothing of
the machine's own Slurm (if any) is read or touched. The node line comes
from ``slurmd -C``: a line claiming more than the hardware leaves the node
drained.

Only one ``slurmctld`` runs at a time on a machine: a start takes a
machine-wide lock (two pytest sessions wait for each other) and refuses, with
the reason, while a ``slurmctld`` it did not start is running. Stopping kills
what it started by pid, waits for it, and removes the directory.

Two settings make a requeued job start again within seconds instead of
minutes: ``cred_expire=5`` (a requeued job waits for its credential to
expire; 120 s by default) and a scheduler that runs every second.
"""

import fcntl
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

from mpirun import ROOT, test_env

__all__ = ["Slurm", "SlurmSession", "why_unavailable", "TOOLS"]

TOOLS = ("slurmctld", "slurmd", "munged", "mungekey", "munge", "unmunge", "srun", "sbatch", "salloc", "scontrol",
         "squeue", "scancel", "sinfo")
LOCK = "/tmp/ringtrain-slurm.lock"
LOCK_WAIT = 300  # seconds another session's Slurm may take to finish its tests


def why_unavailable():
    """A reason a one-node Slurm cannot be started here, or None when it can."""
    if sys.platform != "linux":
        return "Slurm's daemons need Linux"
    if os.geteuid() != 0:
        return "starting slurmctld, slurmd and munged needs root"
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        return f"{', '.join(missing)} not found (apt-get install slurm-wlm munge)"
    try:
        import pwd

        pwd.getpwnam("munge")
    except KeyError:
        return "no 'munge' user (the munge package makes it)"
    other = _running("slurmctld")
    if other:
        return f"a slurmctld this suite did not start is running (pid {other[0]}); only one may run at a time"
    return None


def _running(name):
    """Pids of processes called ``name`` (read from /proc: no pkill, nothing is signalled)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/comm") as f:
                    if f.read().strip() == name:
                        pids.append(int(entry))
            except OSError:
                continue
    return pids


def _first_job_id():
    """A first job id no other Slurm started on this machine lately has used (ids below Slurm's 67,108,863)."""
    return 1000 + (time.time_ns() // 1_000_000) % 60_000_000


def _free_port():
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _sh(args, **kw):
    return subprocess.run(args, capture_output=True, text=True, timeout=60, **kw)


class Slurm:
    """A started Slurm; use as a context manager (always stopped and removed).

    Args:
        cluster: a :class:`netns.Cluster` (entered by the caller): one node
            per host, daemons and commands inside the hosts' namespaces.
            None: one node, this machine.

    Attributes:
        env: the environment for Slurm's commands (``SLURM_CONF``, and the
            virtual environment's ``bin`` first on PATH, so ``ringtrain`` and
            ``mpirun`` in a job are this checkout's; with a cluster, its
            variables that send MPI's traffic over the virtual network).
        nodes: the nodes' names.
        node: the first node's name (where commands run).
        workdir: the scratch directory.
    """

    def __init__(self, cluster=None):
        self.cluster = cluster
        self.workdir = None
        self._lock = None
        self._pids = {}
        self.env = {}
        self.nodes = []
        self.node = None

    def _on(self, node, args):
        """``args`` to run on ``node``: as they are on one machine, else inside its namespaces."""
        return list(args) if self.cluster is None else self.cluster.enter(node, args)

    def __enter__(self):
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc):
        self.close()

    def path(self, *names):
        return os.path.join(self.workdir, *names)

    def _start(self):
        self._lock = open(LOCK, "w")
        waited = time.monotonic()
        while True:
            try:
                fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() - waited > LOCK_WAIT:
                    raise RuntimeError(f"another test session held {LOCK} for {LOCK_WAIT} s") from None
                time.sleep(1)
        self.workdir = tempfile.mkdtemp(prefix="ringtrain-slurm-")
        os.chmod(self.workdir, 0o755)  # munged (user munge) must reach its socket inside
        self._start_munge()
        self._write_config()
        self.env = test_env(SLURM_CONF=self.path("slurm.conf"),
                            PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""),
                            **(self.cluster.env if self.cluster is not None else {}))
        self._daemon("slurmctld", self.node, "slurmctld.pid")
        for node in self.nodes:
            self._daemon("slurmd", node, f"slurmd-{node}.pid")
        self._wait_idle()

    def _daemon(self, daemon, node, pid_file):
        done = _sh(self._on(node, [daemon, "-f", self.path("slurm.conf")]), env=self.env)
        if done.returncode != 0:
            raise RuntimeError(f"{daemon} on {node} did not start: {done.stderr.strip()}\n{self.log(daemon)}")
        self._pids[pid_file] = self._pid_from(self.path(pid_file))

    def _start_munge(self):
        munge = self.path("munge")
        os.makedirs(munge)
        done = _sh(["mungekey", "-c", "-k", os.path.join(munge, "munge.key")])
        if done.returncode != 0:
            raise RuntimeError(f"mungekey: {done.stderr.strip()}")
        shutil.chown(munge, "munge", "munge")
        shutil.chown(os.path.join(munge, "munge.key"), "munge", "munge")
        os.chmod(os.path.join(munge, "munge.key"), 0o400)
        args = ["runuser", "-u", "munge", "--", "munged", f"--socket={munge}/socket", f"--key-file={munge}/munge.key",
                f"--log-file={munge}/log", f"--pid-file={munge}/pid", f"--seed-file={munge}/seed"]
        done = _sh(args)
        if done.returncode != 0:
            raise RuntimeError(f"munged did not start: {done.stderr.strip()}")
        self._pids["munge/pid"] = self._pid_from(f"{munge}/pid")
        token = _sh(["munge", "-n", f"--socket={munge}/socket"])
        check = _sh(["unmunge", f"--socket={munge}/socket"], input=token.stdout)
        if "Success" not in check.stdout:
            raise RuntimeError(f"munge does not work: {check.stdout}{check.stderr}")

    def _write_config(self):
        # "NodeName=vm CPUs=2 ... RealMemory=N": every namespace host is this machine, so the same hardware.
        name, hardware = _sh(["slurmd", "-C"]).stdout.splitlines()[0].split(None, 1)
        if self.cluster is None:
            self.nodes = [name.split("=", 1)[1]]
            node_lines = [f"NodeName={self.nodes[0]} {hardware}"]
            where = [f"SlurmctldHost={self.nodes[0]}", f"SlurmctldPort={_free_port()}", f"SlurmdPort={_free_port()}"]
        else:
            self.nodes = list(self.cluster.names)
            node_lines = [f"NodeName={n} NodeAddr={self.cluster.address[n]} {hardware}" for n in self.nodes]
            where = [f"SlurmctldHost={self.nodes[0]}({self.cluster.address[self.nodes[0]]})"]
        self.node = self.nodes[0]
        for sub in ["state", "log"] + [os.path.join("spool", n) for n in self.nodes]:
            os.makedirs(self.path(sub))
        lines = where + [
            "ClusterName=ringtrain-tests",
            # Job ids unique to this Slurm: MPICH names a step's shared state after its job and step, so a
            # job 5 of an earlier Slurm on this machine (an earlier run's, or an aborted one's) could meet
            # this one's job 5 in MPI_Init.
            f"FirstJobId={_first_job_id()}",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            # A requeued job waits cred_expire seconds before it may start again (120 by default; 5 is the least).
            f"AuthInfo=socket={self.path('munge', 'socket')},cred_expire=5",
            "SlurmUser=root",
            "SlurmdUser=root",
            f"StateSaveLocation={self.path('state')}",
            f"SlurmdSpoolDir={self.path('spool', '%n')}",
            f"SlurmctldPidFile={self.path('slurmctld.pid')}",
            f"SlurmdPidFile={self.path('slurmd-%n.pid')}",
            f"SlurmctldLogFile={self.path('log', 'slurmctld.log')}",
            f"SlurmdLogFile={self.path('log', 'slurmd-%n.log')}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "SchedulerType=sched/backfill",
            "SchedulerParameters=sched_interval=1,bf_interval=1",
            "JobRequeue=1",
            "ReturnToService=2",
            "MpiDefault=none",
            "KillWait=5",
            "InactiveLimit=0",
            "MinJobAge=600",
            *(f"{line} State=UNKNOWN" for line in node_lines),
            "PartitionName=tests Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
        ]
        with open(self.path("slurm.conf"), "w") as f:
            f.write("\n".join(lines) + "\n")

    @staticmethod
    def _pid_from(path, wait=10):
        until = time.monotonic() + wait
        while time.monotonic() < until:
            try:
                with open(path) as f:
                    return int(f.read().split()[0])
            except (OSError, ValueError, IndexError):
                time.sleep(0.05)
        raise RuntimeError(f"no pid in {path} after {wait} s")

    def _wait_idle(self, wait=60):
        until = time.monotonic() + wait
        states = {}
        while time.monotonic() < until:
            states = dict(line.split() for line in self.run(["sinfo", "-h", "-N", "-o", "%N %t"]).stdout.splitlines()
                          if len(line.split()) == 2)
            if sorted(states) == sorted(self.nodes) and set(states.values()) == {"idle"}:
                return
            for node, state in states.items():
                if state in ("drain", "drained", "inval"):
                    self.run(["scontrol", "update", f"nodename={node}", "state=resume"])
            time.sleep(0.2)
        raise RuntimeError(f"nodes {states}, not all idle, after {wait} s\n{self.log('slurmctld')}")

    def log(self, daemon):
        name = f"{daemon}.log" if daemon == "slurmctld" else f"{daemon}-{self.node}.log"
        try:
            with open(self.path("log", name)) as f:
                return f.read()[-3000:]
        except (OSError, TypeError):
            return ""

    def command(self, args):
        """``args`` as they must be run to talk to this Slurm: on its first node."""
        return self._on(self.node, args)

    def run(self, args, timeout=60, cwd=None):
        """Run a Slurm command (or any) on the first node with :attr:`env`; a CompletedProcess with text output."""
        return subprocess.run(self.command(args), capture_output=True, text=True, timeout=timeout, env=self.env,
                              cwd=cwd or ROOT)

    def job(self, job_id):
        """``scontrol show job``'s fields for a job, as a dict of strings."""
        out = self.run(["scontrol", "show", "job", "-o", str(job_id)]).stdout
        return dict(word.split("=", 1) for word in out.split() if "=" in word)

    def close(self):
        """Cancel every job, stop the daemons this started (by pid), remove the directory, release the lock."""
        if self._pids.get("slurmctld.pid"):
            subprocess.run(self.command(["scancel", "--full", "--user", "root"]), capture_output=True, timeout=30,
                           env=self.env)
        # The slurmds first, then the controller, then munge, which they all use.
        for name in [n for n in self._pids if n.startswith("slurmd-")] + ["slurmctld.pid", "munge/pid"]:
            if name in self._pids:
                _stop(self._pids.pop(name))
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None
        if self._lock is not None:
            self._lock.close()  # releases the flock
            self._lock = None


class SlurmSession:
    """The test session's Slurm: one at a time, started when first asked for, stopped at the end.

    :meth:`one_node` and :meth:`two_nodes` each stop the other kind first,
    so the session never runs two ``slurmctld``; tests of one kind should
    follow each other (the two-node test comes last in its file).
    """

    def __init__(self):
        self.kind, self._stack, self.current = None, None, None

    def one_node(self):
        """The one-node Slurm on this machine."""
        return self._switch("one node", lambda stack: stack.enter_context(Slurm()))

    def two_nodes(self):
        """A Slurm whose two nodes are network-namespace hosts (tests/netns.py); skips where none can be made."""
        import pytest

        from netns import Cluster, why_unavailable as no_namespaces

        reason = no_namespaces()
        if reason is not None:
            pytest.skip(f"no namespace hosts for a two-node Slurm: {reason}")
        return self._switch("two nodes", lambda stack: stack.enter_context(Slurm(stack.enter_context(Cluster()))))

    def _switch(self, kind, start):
        import contextlib

        if self.kind != kind:
            self.close()
            self._stack = contextlib.ExitStack()
            try:
                self.current = start(self._stack)
            except BaseException:
                self.close()
                raise
            self.kind = kind
        return self.current

    def close(self):
        if self._stack is not None:
            self._stack.close()
        self.kind, self._stack, self.current = None, None, None


def _stop(pid, wait=15):
    """SIGTERM, then SIGKILL after ``wait`` seconds; returns once the process is gone."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    until = time.monotonic() + wait
    while time.monotonic() < until:
        if not _alive(pid):
            return
        time.sleep(0.05)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False
