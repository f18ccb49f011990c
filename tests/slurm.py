"""A real one-node Slurm for the tests: munged, slurmctld and slurmd from Debian's packages.

Everything lives in a scratch directory: the munge key and socket, the
configuration (``SLURM_CONF``), state, spool, logs and pid files, and the
ports are free ones picked at start, so nothing of the machine's own Slurm
(if any) is read or touched. The node line comes from ``slurmd -C``: a line
claiming more than the hardware leaves the node drained.

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

__all__ = ["Slurm", "why_unavailable", "TOOLS"]

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


def _free_port():
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _sh(args, **kw):
    return subprocess.run(args, capture_output=True, text=True, timeout=60, **kw)


class Slurm:
    """A started one-node Slurm; use as a context manager (always stopped and removed).

    Attributes:
        env: the environment for Slurm's commands (``SLURM_CONF``, and the
            virtual environment's ``bin`` first on PATH, so ``ringtrain`` and
            ``mpirun`` in a job are this checkout's).
        node: the node's name.
        workdir: the scratch directory.
    """

    def __init__(self):
        self.workdir = None
        self._lock = None
        self._pids = {}
        self.env = {}
        self.node = None

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
                            PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
        for daemon in ("slurmctld", "slurmd"):
            done = _sh([daemon, "-f", self.path("slurm.conf")], env=self.env)
            if done.returncode != 0:
                raise RuntimeError(f"{daemon} did not start: {done.stderr.strip()}\n{self.log(daemon)}")
            self._pids[daemon] = self._pid_from(self.path(f"{daemon}.pid"))
        self._wait_idle()

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
        self._pids["munged"] = self._pid_from(f"{munge}/pid")
        token = _sh(["munge", "-n", f"--socket={munge}/socket"])
        check = _sh(["unmunge", f"--socket={munge}/socket"], input=token.stdout)
        if "Success" not in check.stdout:
            raise RuntimeError(f"munge does not work: {check.stdout}{check.stderr}")

    def _write_config(self):
        hardware = _sh(["slurmd", "-C"]).stdout.splitlines()[0]  # "NodeName=vm CPUs=2 ... RealMemory=N"
        self.node = hardware.split()[0].split("=", 1)[1]
        for sub in ("state", "spool", "log"):
            os.makedirs(self.path(sub))
        lines = [
            "ClusterName=ringtrain-tests",
            f"SlurmctldHost={self.node}",
            f"SlurmctldPort={_free_port()}",
            f"SlurmdPort={_free_port()}",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            # A requeued job waits cred_expire seconds before it may start again (120 by default; 5 is the least).
            f"AuthInfo=socket={self.path('munge', 'socket')},cred_expire=5",
            "SlurmUser=root",
            "SlurmdUser=root",
            f"StateSaveLocation={self.path('state')}",
            f"SlurmdSpoolDir={self.path('spool')}",
            f"SlurmctldPidFile={self.path('slurmctld.pid')}",
            f"SlurmdPidFile={self.path('slurmd.pid')}",
            f"SlurmctldLogFile={self.path('log', 'slurmctld.log')}",
            f"SlurmdLogFile={self.path('log', 'slurmd.log')}",
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
            f"{hardware} State=UNKNOWN",
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
        state = ""
        while time.monotonic() < until:
            state = self.run(["sinfo", "-h", "-o", "%t"]).stdout.strip()
            if state == "idle":
                return
            if state in ("drain", "drained", "inval"):
                self.run(["scontrol", "update", f"nodename={self.node}", "state=resume"])
            time.sleep(0.2)
        raise RuntimeError(f"node {self.node} is {state!r}, not idle, after {wait} s\n{self.log('slurmctld')}")

    def log(self, daemon):
        try:
            with open(self.path("log", f"{daemon}.log")) as f:
                return f.read()[-3000:]
        except (OSError, TypeError):
            return ""

    def run(self, args, timeout=60, cwd=None):
        """Run a Slurm command (or any) with :attr:`env`; a CompletedProcess with text output."""
        return subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=self.env,
                              cwd=cwd or ROOT)

    def job(self, job_id):
        """``scontrol show job``'s fields for a job, as a dict of strings."""
        out = self.run(["scontrol", "show", "job", "-o", str(job_id)]).stdout
        return dict(word.split("=", 1) for word in out.split() if "=" in word)

    def close(self):
        """Cancel every job, stop the daemons this started (by pid), remove the directory, release the lock."""
        if self._pids.get("slurmctld"):
            subprocess.run(["scancel", "--full", "--user", "root"], capture_output=True, timeout=30, env=self.env)
        for name in ("slurmd", "slurmctld", "munged"):
            pid = self._pids.pop(name, None)
            if pid is not None:
                _stop(pid)
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None
        if self._lock is not None:
            self._lock.close()  # releases the flock
            self._lock = None


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
