"""``ringtrain launch``: start a job under mpirun from a hostfile, with per-rank logs.

A convenience over plain ``mpirun`` in the spirit of Poseidon's ``psd_run``
and ``horovodrun``: it reads either hostfile syntax, hands MPI the one it
understands, adds the flags that MPI needs, prints the exact command and
returns the job's exit status::

    ringtrain launch -np 4 --hostfile hostfiles/cluster.openmpi -o logs -- ringtrain train --dataset digits
    ringtrain launch -np 4 -H node1:2,node2:2 --dry-run -- ringtrain info
    ringtrain launch -np 8 --hostfile hosts --check --restarts 3 -o logs -- ringtrain train --run-dir runs/a
"""

import argparse

from ..errors import UsageError
from ..cluster.launch import launch

HELP = "start a job under mpirun from a hostfile or -H list, with per-rank logs"


def add_arguments(parser):
    parser.add_argument("-np", "-n", dest="np", type=int, metavar="N",
                        help="number of ranks (inside a Slurm allocation: SLURM_NTASKS unless given)")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--hostfile", "-f", metavar="FILE",
                       help="hosts in Open MPI ('host slots=N') or MPICH ('host:N') syntax")
    where.add_argument("-H", "--hosts", dest="host_list", metavar="HOST:N,...",
                       help="hosts inline, e.g. node1:2,node2:2 (neither: inside a Slurm allocation, its hosts)")
    parser.add_argument("-o", "--output", dest="logdir", metavar="LOGDIR",
                        help="write each rank's output to LOGDIR/rank-R.log")
    parser.add_argument("--oversubscribe", action="store_true",
                        help="allow more ranks than the hosts' slots, or than 64 per core on this host")
    parser.add_argument("--check", action="store_true",
                        help="first check that every host resolves and answers password-less ssh")
    parser.add_argument("--restarts", type=int, default=0, metavar="K",
                        help="start the job again after a failure, up to K times (default: 0); "
                             "ringtrain train resumes from its newest checkpoint")
    parser.add_argument("--restart-delay", type=float, default=3.0, metavar="SECONDS",
                        help="wait this long before each restart (default: 3)")
    parser.add_argument("--dry-run", action="store_true", help="print the MPI command and stop")
    parser.add_argument("--mpirun", metavar="PATH", help="the mpirun to use (default: beside python, then PATH)")
    parser.add_argument("command", nargs=argparse.REMAINDER, metavar="-- COMMAND...",
                        help="the program every rank runs")


def run(args):
    command = list(args.command)
    if command[:1] == ["--"]:
        command = command[1:]
    if command and command[0].startswith("-") and command[0] != "-":
        raise UsageError(f"unknown option {command[0]!r}; put the command after '--'", everywhere=True)
    try:
        return launch(args.np, command, hostfile=args.hostfile, host_list=args.host_list,
                      logdir=args.logdir, dry_run=args.dry_run, mpirun=args.mpirun, check=args.check,
                      restarts=args.restarts, restart_delay=args.restart_delay,
                      oversubscribe=args.oversubscribe)
    except UsageError as exc:
        # The launcher runs as one process, before any MPI job exists.
        raise UsageError(str(exc), everywhere=True) from None
