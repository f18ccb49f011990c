"""A small cluster on one machine: hosts made as Linux network namespaces.

Each host is a network namespace with its own address on a private test
subnet and, for every process MPI starts there, its own host name (a UTS
namespace). The hosts are joined by veth links to a bridge that lives in a
namespace of its own, so nothing is added to the machine's real network and
no packet leaves the namespaces made here.

MPICH's Hydra starts its proxy on a remote host by running ``ssh HOST CMD``;
:class:`Cluster` points it (``HYDRA_LAUNCHER_EXEC``) at a generated agent
script that runs ``ip netns exec <namespace of HOST> unshare --uts`` instead,
so a job is launched from a hostfile exactly as on a real cluster. Host names
resolve through ``/etc/netns/<namespace>/hosts``, which ``ip netns exec``
mounts over ``/etc/hosts``.

MPICH on one machine would otherwise move data through shared memory even
between "hosts"; :attr:`Cluster.env` makes it use libfabric's TCP provider on
the veth interface, so the traffic really crosses the virtual network (tests
check the interface's byte counters).
"""

import os
import secrets
import shutil
import subprocess
import sys

from ringtrain.cluster.launch import find_mpirun
from ringtrain.cluster.hostfiles import format_hostfile, Host

from mpirun import ROOT, run, test_env

__all__ = ["Cluster", "why_unavailable", "SUBNET"]

SUBNET = "10.213.0"  # a /24 used only inside the namespaces made here
IFACE = "eth0"  # the veth end inside every host namespace


def why_unavailable():
    """A reason namespaces cannot be made here, or None when they can."""
    if sys.platform != "linux":
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_SYS_ADMIN)"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"'{tool}' not found (install iproute2 / util-linux)"
    mpirun = find_mpirun()
    if mpirun is None:
        return "mpirun not found"
    probe = f"rtp{secrets.token_hex(3)}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=30)
    if made.returncode != 0:
        return f"cannot make a network namespace: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=30)
    uts = subprocess.run(["unshare", "--uts", "true"], capture_output=True, text=True, timeout=30)
    if uts.returncode != 0:
        return f"cannot make a UTS namespace: {uts.stderr.strip()}"
    return None


def _sh(*args):
    subprocess.run(list(args), check=True, capture_output=True, text=True, timeout=30)


class Cluster:
    """``hosts`` namespaces on a bridge; use as a context manager (always torn down).

    Attributes:
        names: the host names, ``h1``, ``h2``, ...
        hostfile: path of a hostfile (MPICH syntax) giving each host ``slots`` slots.
        env: the environment a job needs (launch agent, TCP over the veth).
        agent: path of the ssh stand-in script.
    """

    def __init__(self, hosts=2, slots=2):
        self.names = [f"h{i + 1}" for i in range(hosts)]
        self.slots = slots
        self.tag = f"rt{secrets.token_hex(3)}"  # unique, and short: interface names max 15 chars
        self.switch = f"{self.tag}sw"
        self.namespaces = {name: f"{self.tag}{name}" for name in self.names}
        self.address = {name: f"{SUBNET}.{i + 2}" for i, name in enumerate(self.names)}
        self.workdir = None
        self._made_etc_netns = False
        self.hostfile = self.agent = None
        self.env = {}

    def __enter__(self):
        try:
            self._up()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc):
        self.close()

    def _up(self):
        import tempfile

        self.workdir = tempfile.mkdtemp(prefix=f"ringtrain-{self.tag}-")
        self._made_etc_netns = not os.path.isdir("/etc/netns")
        _sh("ip", "netns", "add", self.switch)
        _sh("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        _sh("ip", "-n", self.switch, "link", "set", "br0", "up")
        hosts_text = "127.0.0.1 localhost\n" + "".join(f"{self.address[n]} {n}\n" for n in self.names)
        for i, name in enumerate(self.names):
            ns = self.namespaces[name]
            _sh("ip", "netns", "add", ns)
            # Both ends are created directly inside their namespaces, never in
            # the machine's own network namespace.
            _sh("ip", "link", "add", IFACE, "netns", ns, "type", "veth", "peer", "name", f"p{i}", "netns", self.switch)
            _sh("ip", "-n", self.switch, "link", "set", f"p{i}", "master", "br0", "up")
            _sh("ip", "-n", ns, "addr", "add", f"{self.address[name]}/24", "dev", IFACE)
            _sh("ip", "-n", ns, "link", "set", IFACE, "up")
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
            os.makedirs(f"/etc/netns/{ns}", exist_ok=True)
            with open(f"/etc/netns/{ns}/hosts", "w") as f:
                f.write(hosts_text)
        self.hostfile = os.path.join(self.workdir, "hostfile")
        with open(self.hostfile, "w") as f:
            f.write(format_hostfile([Host(n, self.slots) for n in self.names], "mpich"))
        self.agent = os.path.join(self.workdir, "agent")
        cases = "".join(f"  {n}) ns={self.namespaces[n]} ;;\n" for n in self.names)
        with open(self.agent, "w") as f:
            f.write(
                "#!/bin/sh\n"
                "# ssh stand-in for Hydra: agent [-x ...] HOST COMMAND... -> run COMMAND in HOST's namespaces.\n"
                "while [ $# -gt 0 ]; do case \"$1\" in -*) shift ;; *) break ;; esac; done\n"
                "host=$1; shift\n"
                f"case \"$host\" in\n{cases}"
                "  *) echo \"agent: unknown host $host\" >&2; exit 255 ;;\n"
                "esac\n"
                # Like sshd, the remote side gets one command line for a shell.
                "exec ip netns exec \"$ns\" unshare --uts sh -c 'hostname \"$1\"; shift; exec sh -c \"$*\"' "
                "sh \"$host\" \"$@\"\n"
            )
        os.chmod(self.agent, 0o755)
        self.env = {
            "HYDRA_LAUNCHER": "ssh",
            "HYDRA_LAUNCHER_EXEC": self.agent,
            # Without these MPICH moves data between namespaces on one machine
            # through shared memory; force TCP on the veth, as on a real network.
            "MPICH_CH4_NETMOD": "ofi",
            "FI_PROVIDER": "tcp",
            "FI_TCP_IFACE": IFACE,
        }

    def close(self):
        """Remove every namespace, link and file this cluster made (safe to call twice)."""
        for ns in list(self.namespaces.values()) + [self.switch]:
            # Deleting a namespace deletes its veth end, and with it the peer.
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
            shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)
        if self._made_etc_netns:
            try:
                os.rmdir("/etc/netns")  # only if empty: another cluster may be using it
            except OSError:
                pass
            self._made_etc_netns = False
        if self.workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None

    def on(self, host, args):
        """``args`` prefixed so that they run on ``host`` (its namespaces and host name)."""
        return ["ip", "netns", "exec", self.namespaces[host], "unshare", "--uts",
                "sh", "-c", 'hostname "$1"; shift; exec "$@"', "sh", host, *args]

    def enter(self, host, args):
        """Like :meth:`on`, but only the network namespace is entered, not a copy of ``/sys``.

        ``ip netns exec`` mounts a fresh sysfs, which hides the cgroup
        mounts a daemon such as ``slurmd`` needs; this enters the network
        namespace, then makes private mount and UTS namespaces with the
        host's ``/etc/hosts`` and host name.
        """
        ns = self.namespaces[host]
        return ["nsenter", f"--net=/run/netns/{ns}", "unshare", "--mount", "--uts", "sh", "-c",
                'mount --bind "$2" /etc/hosts && hostname "$1" && shift 2 && exec "$@"', "sh", host,
                f"/etc/netns/{ns}/hosts", *args]

    def job_env(self, **extra):
        env = test_env(**self.env)
        env.update(extra)
        return env

    def run(self, np, command, timeout=120, launcher=None, **env):
        """Run ``command`` on ``np`` ranks across the hosts, launched from the first host.

        By default through ``ringtrain launch --hostfile``; ``launcher`` may be
        any argument list that starts the job (it runs on the first host).
        """
        launcher = launcher or [sys.executable, "-m", "ringtrain", "launch", "-np", str(np),
                                "--hostfile", self.hostfile, "--"]
        return run(self.on(self.names[0], [*launcher, *command]), timeout=timeout,
                   env=self.job_env(**env), cwd=ROOT)

    def iface_bytes(self, host):
        """(rx, tx) byte counters of ``host``'s veth interface."""
        out = subprocess.run(["ip", "netns", "exec", self.namespaces[host], "cat",
                              f"/sys/class/net/{IFACE}/statistics/rx_bytes",
                              f"/sys/class/net/{IFACE}/statistics/tx_bytes"],
                             check=True, capture_output=True, text=True, timeout=30).stdout.split()
        return int(out[0]), int(out[1])


def cluster_fixture(hosts=2, slots=2):
    """A module-scope pytest fixture yielding a :class:`Cluster`, skipped where none can be made.

    Use in a test module as ``cluster = cluster_fixture()``.
    """
    import pytest

    @pytest.fixture(scope="module")
    def cluster():
        reason = why_unavailable()
        if reason is not None:
            if os.environ.get("RINGTRAIN_REQUIRE_NETNS") == "1":
                pytest.fail(f"RINGTRAIN_REQUIRE_NETNS=1 but no namespace cluster: {reason}")
            pytest.skip(f"no namespace cluster: {reason}")
        with Cluster(hosts=hosts, slots=slots) as made:
            yield made

    return cluster


# The usual two hosts with two slots each: ``from netns import cluster`` in a test module.
cluster = cluster_fixture()
