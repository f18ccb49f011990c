"""The ``ringtrain`` command: one subcommand per module in :mod:`ringtrain.commands`.

A bad flag is one line and exit status 2 on every rank, and no rank is left
waiting in a collective, even when the ranks were given different command
lines (``mpirun -np 1 A : -np 1 B``, a ``--config`` file that one host lacks).
A command whose run is collective (it defines ``prepare``) is checked in two
halves: every rank parses and checks its own input, and then every rank, the
ones that failed included, meets at one agreement before any other
collective. One verdict comes out of it: rank 0 prints the problem once
(naming the rank that saw it when the ranks differ) and every rank exits 2.
"""

import argparse
import importlib
import os
import signal
import sys
import warnings

from . import __version__
from .errors import UsageError
from .failure import abort_on_error
from .io.safeio import printable

__all__ = ["main", "build_parser", "COMMANDS"]

# name -> module under ringtrain.commands; each module defines HELP,
# add_arguments(parser) and run(args) -> exit status. A collective command
# also defines prepare(args) -> what run needs (its input checks, raising
# UsageError), and its run takes (args, prepared).
COMMANDS = {
    "info": "info",
    "train": "train",
    "bench": "bench",
    "launch": "launch",
    "plot": "plot",
}


class _Parser(argparse.ArgumentParser):
    """argparse, but an error is one line raised as UsageError, not usage text and exit.

    Abbreviations are off: ``--epoch 3`` must not be taken silently as
    ``--epochs 3`` (and would change meaning when a flag is added).
    """

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message):
        raise UsageError(f"{message} (see '{self.prog} --help')", everywhere=True)


def _load(name):
    return importlib.import_module(f"ringtrain.commands.{COMMANDS[name]}")


def build_parser():
    """The full argument parser, every subcommand included."""
    parser = _Parser(
        prog="ringtrain",
        description="Data-parallel training under MPI with a ring allreduce.",
        epilog="Run under MPI: mpirun -np 2 ringtrain train --dataset digits",
    )
    parser.add_argument("--version", action="version", version=f"ringtrain {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name in COMMANDS:
        module = _load(name)
        p = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(p)
        p.set_defaults(_run=module.run, _prepare=getattr(module, "prepare", None))
    return parser


def _command_of(argv):
    # The top-level options (--help, --version) take no value, so the first
    # word that is not an option names the command.
    return next((word for word in argv if not word.startswith("-")), None)


def _is_collective(name):
    return name in COMMANDS and hasattr(_load(name), "prepare")


# Said by every rank whose start-up watchdog fires: the rank to look at is the one that said nothing.
_STARTUP_HINT = "a rank that printed no such line never got there; raise --timeout if this is expected"
# What a rank that printed --help (or --version) reports to the agreement.
_HELP = "asked for --help instead of a run; give every rank the same command line"


def wants_gpu(argv):
    """True when the command line asks for ``--device gpu`` (pure; a config file's choice is found later)."""
    return any(word == "--device=gpu" or (word == "--device" and nxt == "gpu")
               for word, nxt in zip(argv, argv[1:] + [None]))


def _device_before_mpi(argv):
    # A CUDA-aware MPI (Open MPI with UCX, GPU-enabled MPICH) may set up CUDA
    # on the current device inside MPI_Init, which mpi4py calls on import:
    # left alone, every rank would hold a context on GPU 0 and get GPU 0's
    # affinity. The launcher's local rank is known before then; the trainer
    # makes the same choice later from MPI's own view (TaskSpec.device).
    import os

    from . import backend
    from .cluster.launch import local_rank_from_env

    local = local_rank_from_env(os.environ)
    if local is not None and wants_gpu(argv) and backend.gpu_available():
        backend.use_device(local % backend.device_count())


def _main_collective(argv):
    """Parse and check on this rank, agree with every rank, then run (collective)."""
    _device_before_mpi(argv)
    from .failure import verdict_of

    args = prepared = problem = None
    try:
        args = build_parser().parse_args(argv)
        prepared = args._prepare(args)
    except UsageError as exc:
        problem = str(exc)
    except SystemExit as exc:  # --help or --version was printed
        if exc.code not in (None, 0):
            raise
        problem = _HELP
    problems = _agree_at_start_up(problem, getattr(prepared, "timeout", None) or _default_timeout())
    if all(p == _HELP for p in problems):
        return 0
    verdict = verdict_of(problems)
    if verdict is not None:
        raise UsageError(verdict, everywhere=True)
    return args._run(args, prepared) or 0


def _agree_at_start_up(problem, timeout):
    """Start MPI and gather every rank's problem, all within ``timeout`` seconds (collective).

    The one agreement point: every rank reaches it, whatever it found, and
    nothing collective happens before it. The watchdog is armed before MPI
    starts, because ``MPI_Init`` itself waits for every rank: a rank stopped
    before it gets there (SIGSTOP, a sleep before the program, stuck reading
    its --config) would otherwise hold the others there for ever
    (:class:`ringtrain.watchdog.StartupWatchdog`). Every rank that waits
    prints a line; the one that printed none is the one to look at.
    """
    from .watchdog import StartupWatchdog

    with StartupWatchdog(timeout, "start-up: MPI start and settings agreement", hint=_STARTUP_HINT):
        from mpi4py import MPI

        return MPI.COMM_WORLD.allgather(problem)


# The commands besides train that start MPI (and so wait in MPI_Init for every rank).
_STARTS_MPI = ("info", "bench")


def _start_mpi():
    """Start MPI within a bound, so a rank that never arrives cannot hold the others for ever.

    The bound is the library's (``RINGTRAIN_TIMEOUT``) when set, else train's default ``--timeout``.
    """
    from .comm.guard import timeout_from_env
    from .watchdog import StartupWatchdog

    bound = timeout_from_env() or _default_timeout()
    with StartupWatchdog(bound, "start-up: MPI start", hint=_STARTUP_HINT):
        from mpi4py import MPI  # noqa: F401 - importing it starts MPI


def _default_timeout():
    from .training.config import TrainConfig

    return TrainConfig.timeout


def _rank0():
    # Without importing MPI: argument errors may happen before MPI is needed.
    return _rank_from_env() in (None, 0)


def _who_reports():
    """``(whether this process prints the error, the stale rank variable or None)``.

    Once MPI is up, MPI's rank decides: a rank variable left in the
    environment (``PMI_RANK=1`` exported in a shell, a job script run by
    hand) must not silence the only process there is. Before MPI, a
    ``PMI_RANK`` that no Hydra connection came with is stale too.
    """
    mpi = sys.modules.get("mpi4py.MPI")
    env_rank = _rank_from_env()
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        world = mpi.COMM_WORLD
        stale = world.Get_size() == 1 and env_rank not in (None, 0)
        return world.Get_rank() == 0, _rank_variable() if stale else None
    if env_rank not in (None, 0) and os.environ.get("PMI_RANK") and not _HYDRA_CONNECTION & set(os.environ):
        return True, "PMI_RANK"
    return env_rank in (None, 0), None


# What Hydra (and Slurm's PMI-2) set beside PMI_RANK for the rank to reach them.
_HYDRA_CONNECTION = {"PMI_FD", "PMI_PORT"}


def _rank_from_env():
    # Asked while an error is reported: a rank variable that holds no number (the error, perhaps) is no rank.
    from .cluster.launch import rank_from_env

    try:
        return rank_from_env(os.environ)
    except UsageError:
        return None


def _rank_variable():
    from .cluster.launch import RANK_VARIABLES

    return next(name for name in RANK_VARIABLES if os.environ.get(name, "").strip())


def main(argv=None):
    """Entry point of ``ringtrain`` and ``python -m ringtrain``; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    # mpi4py warns in four lines at import when another MPI's mpirun started
    # it; the launcher check (TaskSpec.from_mpi) says the same in one.
    warnings.filterwarnings("ignore", message="suspicious MPI execution environment", category=RuntimeWarning)
    try:
        if _command_of(argv) in _NOT_A_RANK:
            return _run_launcher(argv)
        with abort_on_error():
            if _is_collective(_command_of(argv)):
                return _main_collective(argv)
            args = build_parser().parse_args(argv)
            if args.command is None:
                raise UsageError("no command given; choose one of " + ", ".join(COMMANDS), everywhere=True)
            if args.command in _STARTS_MPI:
                _start_mpi()
            return args._run(args) or 0
    except UsageError as exc:
        prints, stale = _who_reports()
        if prints:
            # Escaped: the message may quote a config file or a path, whose
            # escape sequences must not reach the terminal.
            print(f"ringtrain: error: {printable(exc)}", file=sys.stderr)
        if stale:
            print(f"ringtrain: warning: {stale}={os.environ[stale]} is set, but no MPI launcher started this "
                  f"process; unset {stale}, or start it with mpirun", file=sys.stderr)
        return 2


# Commands that run no rank: an error or Ctrl-C there is this process's alone, so it is not MPI_Abort's
# business (which would start MPI in the launcher only to call it "rank 0").
_NOT_A_RANK = ("launch",)


def _run_launcher(argv):
    # Every copy says its error: a rank variable in the environment (stale, or an mpirun that started the
    # launcher itself) must not silence the only process there may be.
    try:
        args = build_parser().parse_args(argv)
        try:
            return args._run(args) or 0
        except KeyboardInterrupt:
            print(f"ringtrain {args.command}: interrupted", file=sys.stderr, flush=True)
            return 128 + signal.SIGINT
    except UsageError as exc:
        print(f"ringtrain: error: {printable(exc)}", file=sys.stderr)
        return 2


def console():
    """The ``ringtrain`` console script: exit with :func:`main`'s status."""
    sys.exit(main())


if __name__ == "__main__":
    console()
