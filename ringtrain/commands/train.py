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

from ..training.config import FIELDS, TrainConfig, flag_name, load_config_file, parse_ints, resolve, type_name

HELP = "train a model data-parallel (run under mpirun -np N)"


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


def run(args):
    from mpi4py import MPI

    from ..training.loop import train
    from ..training.stopping import EXIT_STATUS, stopped_line

    cfg = config_from_args(args)
    result = train(cfg)
    if result.stopped not in EXIT_STATUS:
        return 0
    if MPI.COMM_WORLD.Get_rank() == 0:
        print(stopped_line(result.stopped, result.step, result.checkpoint), file=sys.stderr, flush=True)
    return EXIT_STATUS[result.stopped]
