"""``ringtrain launch``: start a job under mpirun from a hostfile, with per-rank logs.

A convenience over plain ``mpirun`` in the spirit of Poseidon's ``psd_run``
and ``horovodrun``: it reads either hostfile syntax, hands MPI the one it
understands, adds the flags that MPI needs, prints the exact command and
returns the job's exit status::

    ringtrain launch -np 4 --hostfile hostfiles/cluster.openmpi -o logs -- ringtrain train --dataset digits
    ringtrain launch -np 4 -H node1:2,node2:2 --dry-run -- ringtrain info
    ringtrain launch -np 8 --hostfile hosts --check --restarts 3 -o logs -- ringtrain train --run-dir runs/a
    ringtrain launch -np 4 --min-np 2 --max-np 8 --host-discovery-script ./hosts.sh -- python train.py

The elastic flags are horovodrun's: see :mod:`ringtrain.cluster.elastic`.
"""

import argparse

from ..errors import UsageError
from . import given
from ..cluster.launch import launch

HELP = "start a job under mpirun from a hostfile or -H list, with per-rank logs"


def add_arguments(parser):
    parser.add_argument("-np", "-n", dest="np", type=int, metavar="N",
                        help="number of ranks (inside a Slurm allocation: SLURM_NTASKS unless given)")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--hostfile", "-f", type=given, metavar="FILE",
                       help="hosts in Open MPI ('host slots=N') or MPICH ('host:N') syntax")
    where.add_argument("-H", "--hosts", dest="host_list", type=given, metavar="HOST:N,...",
                       help="hosts inline, e.g. node1:2,node2:2 (neither: inside a Slurm allocation, its hosts)")
    parser.add_argument("-o", "--output", dest="logdir", type=given, metavar="LOGDIR",
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
    add_elastic_arguments(parser)
    parser.add_argument("--dry-run", action="store_true", help="print the MPI command and stop")
    parser.add_argument("--mpirun", type=given, metavar="PATH",
                        help="the mpirun to use (default: beside python, then PATH)")
    parser.add_argument("command", nargs=argparse.REMAINDER, metavar="-- COMMAND...",
                        help="the program every rank runs")


def add_elastic_arguments(parser):
    """horovodrun's elastic flags; any of the first three makes the launch elastic."""
    from ..cluster.elastic import ELASTIC_TIMEOUT, SAME_ERROR_LIMIT

    group = parser.add_argument_group("elastic (horovodrun's flags): restart the job on the hosts there are")
    group.add_argument("--min-np", "--min-num-proc", dest="min_np", type=int, metavar="N",
                       help="fewest ranks a restart may have (default: -np)")
    group.add_argument("--max-np", "--max-num-proc", dest="max_np", type=int, metavar="N",
                       help="most ranks a restart may have (default: every slot the hosts give)")
    group.add_argument("--host-discovery-script", dest="discovery_script", type=given, metavar="SCRIPT",
                       help="a command that prints the hosts available now, one 'host:slots' a line; "
                            "run every second")
    group.add_argument("--slots-per-host", type=int, metavar="N",
                       help="slots of a host the discovery script prints without ':slots' (default: 1)")
    group.add_argument("--elastic-timeout", type=float, default=ELASTIC_TIMEOUT, metavar="SECONDS",
                       help=f"wait this long for enough slots before giving up (default: {ELASTIC_TIMEOUT:g})")
    group.add_argument("--reset-limit", type=int, metavar="K", help="give up after K restarts (default: no limit)")
    group.add_argument("--same-error-limit", type=int, metavar="N",
                       help=f"give up when the job fails the same way N times in a row: the same exit status, "
                            f"rank and last error line (default: {SAME_ERROR_LIMIT}; 0: never)")
    group.add_argument("--blacklist-cooldown-range", dest="cooldown", type=int, nargs=2, metavar=("MIN", "MAX"),
                       help="a failing host is left out for MIN to MAX seconds, not for good")


def elastic_settings(args):
    """The elastic keyword arguments of :func:`launch`, or None when no elastic flag was given (pure)."""
    if args.min_np is None and args.max_np is None and args.discovery_script is None:
        for flag, value in (("--slots-per-host", args.slots_per_host), ("--reset-limit", args.reset_limit),
                            ("--same-error-limit", args.same_error_limit),
                            ("--blacklist-cooldown-range", args.cooldown)):
            if value is not None:
                raise UsageError(f"{flag} is an elastic flag; give it with --min-np, --max-np or "
                                 "--host-discovery-script")
        return None
    return {"min_np": args.min_np, "max_np": args.max_np, "discovery_script": args.discovery_script,
            "slots_per_host": args.slots_per_host, "elastic_timeout": args.elastic_timeout,
            "reset_limit": args.reset_limit, "cooldown": tuple(args.cooldown) if args.cooldown else None,
            **({} if args.same_error_limit is None else {"same_error_limit": args.same_error_limit})}


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
                      oversubscribe=args.oversubscribe, elastic=elastic_settings(args))
    except UsageError as exc:
        # The launcher runs as one process, before any MPI job exists.
        raise UsageError(str(exc), everywhere=True) from None
