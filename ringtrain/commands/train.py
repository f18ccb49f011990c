"""``ringtrain train``: data-parallel training; run it under ``mpirun -np N``.

Every flag is a field of :class:`ringtrain.training.config.TrainConfig`; ``--config
FILE`` (TOML or YAML) sets the same names, and flags override the file.

Stopped by SIGINT, SIGTERM or SIGUSR1, it checkpoints, prints
``stopped at step N (SIGTERM); checkpoint PATH; run the same command to
resume`` and exits 130, 143 or 138 (128 + the signal's number) on every rank.
"""

import argparse
import dataclasses
import sys

from ..training.config import (FIELDS, TrainConfig, flag_name, load_config_file, parse_ints, resolve, type_name,
                               validate)

HELP = "train a model data-parallel (run under mpirun -np N)"

# The exit status of a run that trained to its end but could not write its
# final checkpoint: neither success (0) nor a crash (1) nor bad input (2).
FINAL_CHECKPOINT_MISSING = 3


def add_arguments(parser):
    parser.add_argument("--config", metavar="FILE", help="TOML or YAML file of settings (flags override it)")
    defaults = TrainConfig()
    for field in dataclasses.fields(TrainConfig):
        kind = type_name(field)
        default = getattr(defaults, field.name)
        shown = ",".join(map(str, default)) if isinstance(default, tuple) else default
        help_text = field.metadata["help"] + (f" (default: {shown})" if shown is not None else "")
        kwargs = {"default": None, "help": help_text, "dest": field.name}
        if kind == "bool":
            parser.add_argument(flag_name(field.name), action=argparse.BooleanOptionalAction, **kwargs)
            continue
        if kind == "ints":
            kwargs["type"] = lambda text, _n=field.name: parse_ints(text, _n)
            kwargs["metavar"] = "N[,N...]"
        elif kind in ("int", "float"):
            kwargs["type"] = int if kind == "int" else float
            kwargs["metavar"] = "N" if kind == "int" else "X"
        else:
            kwargs["metavar"] = field.name.upper().replace("_", "-")
        parser.add_argument(flag_name(field.name), **kwargs)


def config_from_args(args):
    """The resolved configuration: defaults < --config file < flags."""
    file_settings = load_config_file(args.config) if args.config else {}
    flags = {name: getattr(args, name) for name in FIELDS if getattr(args, name) is not None}
    return resolve(flags, file_settings)


def prepare(args):
    """This rank's half of the input checks: the configuration, resolved and validated.

    Runs on every rank before any collective, and raises UsageError; the
    command line then has every rank agree on the verdict (see
    :mod:`ringtrain.cli`). The paths only rank 0 touches (``--run-dir``,
    ``--resume``, ``--timeline``) are left to rank 0, inside :func:`train`.
    """
    return validate(config_from_args(args), root=False)


def run(args, cfg):
    """Train; the exit status says how the run ended (see the README's exit statuses).

    0 when it finished with its final checkpoint on disk; 130, 143 or 138
    when a signal stopped it (with its checkpoint, and one line saying how to
    resume); FINAL_CHECKPOINT_MISSING when the run's end is not on disk.
    """
    from mpi4py import MPI

    from ..cluster.signals import exit_at_once_on
    from ..training.loop import train
    from ..training.stopping import EXIT_STATUS, STOP_SIGNALS, stopped_line

    result = train(cfg)
    # The run is over and saved: a signal from here on (a second Ctrl-C while
    # the ranks exit) ends the process quietly, with the status the first promised.
    exit_at_once_on(STOP_SIGNALS, EXIT_STATUS.get(result.stopped))
    master = MPI.COMM_WORLD.Get_rank() == 0
    if result.checkpoint is None:
        if master:
            newest = (f"the newest checkpoint on disk is {result.newest_checkpoint}" if result.newest_checkpoint
                      else "there is no checkpoint of this run on disk")
            print(f"ringtrain: error: the final checkpoint (step {result.step}) was not written; {newest}",
                  file=sys.stderr, flush=True)
        return FINAL_CHECKPOINT_MISSING
    if result.stopped in EXIT_STATUS:
        if master:
            print(stopped_line(result.stopped, result.step, result.checkpoint), file=sys.stderr, flush=True)
        return EXIT_STATUS[result.stopped]
    return 0
