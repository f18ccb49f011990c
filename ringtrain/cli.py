"""The ``ringtrain`` command: one subcommand per module in :mod:`ringtrain.commands`.

Every rank parses the same arguments, so a bad flag is found on every rank at
once: rank 0 prints one line, every rank exits with status 2, and no rank is
left waiting in a collective.
"""

import argparse
import importlib
import sys

from . import __version__
from .errors import UsageError
from .failure import abort_on_error

__all__ = ["main", "build_parser", "COMMANDS"]

# name -> module under ringtrain.commands; each module defines HELP,
# add_arguments(parser) and run(args) -> exit status.
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
        p.set_defaults(_run=module.run)
    return parser


def _rank0():
    # Without importing MPI: argument errors may happen before MPI is needed.
    import os

    from .launch import rank_from_env

    return rank_from_env(os.environ) in (None, 0)


def main(argv=None):
    """Entry point of ``ringtrain`` and ``python -m ringtrain``; returns the exit status."""
    try:
        with abort_on_error():
            args = build_parser().parse_args(argv)
            if args.command is None:
                raise UsageError("no command given; choose one of " + ", ".join(COMMANDS), everywhere=True)
            return args._run(args) or 0
    except UsageError as exc:
        if _rank0():
            print(f"ringtrain: error: {exc}", file=sys.stderr)
        return 2


def console():
    """The ``ringtrain`` console script: exit with :func:`main`'s status."""
    sys.exit(main())


if __name__ == "__main__":
    console()
