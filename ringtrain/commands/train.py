"""``ringtrain train``: data-parallel training; run it under ``mpirun -np N``.

Every flag is a field of :class:`ringtrain.training.config.TrainConfig`; ``--config
FILE`` (TOML, YAML, or a run directory's config.json) sets the same names,
and flags override the file. ``--resume RUN_DIR`` takes that run's settings.

Stopped by SIGINT, SIGTERM or SIGUSR1, it checkpoints, prints
``stopped at step N (SIGTERM); checkpoint PATH; run the same command to
resume`` (or, without ``--run-dir``, the exact command, run directory
included) and exits 130, 143 or 138 (128 + the signal's number) on every rank.
In a Slurm job with a time limit it stops the same way shortly before the
limit and exits 75 (see :mod:`ringtrain.training.stopping`).
"""

import argparse
import dataclasses
import os
import shlex
import sys

from . import given
from ..training.config import (FIELDS, TrainConfig, flag_name, load_config_file, parse_ints, resolve, type_name,
                               validate)

HELP = "train a model data-parallel (run under mpirun -np N)"

# The file in a run directory that records the run's settings (see ringtrain.io.rundir).
RUN_SETTINGS = "config.json"

# The exit status of a run that trained to its end but could not write its
# final checkpoint: neither success (0) nor a crash (1) nor bad input (2).
FINAL_CHECKPOINT_MISSING = 3
# The exit status of a run whose gradients stayed non-finite: the settings
# (most often --lr) must change; running the same command again cannot help.
DIVERGED = 4


def add_arguments(parser):
    parser.add_argument("--config", type=given, metavar="FILE",
                        help="TOML or YAML file of settings (flags override it)")
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
            kwargs["type"] = given
            kwargs["metavar"] = field.name.upper().replace("_", "-")
        parser.add_argument(flag_name(field.name), **kwargs)


def config_from_args(args):
    """The resolved configuration: defaults < --config file < flags.

    ``--resume RUN_DIR`` without ``--config`` takes that run's settings from
    its ``config.json``, so a run is resumed without retyping its command
    line; flags still override them.
    """
    config = args.config
    if config is None and args.resume not in (None, "auto", "none"):
        recorded = os.path.join(args.resume, RUN_SETTINGS)
        if os.path.isdir(args.resume) and os.path.isfile(recorded):
            config = recorded
    file_settings = load_config_file(config) if config else {}
    if config and os.path.basename(config) == RUN_SETTINGS and "run_dir" in file_settings:
        # A run directory's own record: the run lives where the file is, whatever
        # directory it was started from (its run_dir may be relative to that).
        file_settings["run_dir"] = os.path.dirname(config) or "."
    flags = {name: getattr(args, name) for name in FIELDS if getattr(args, name) is not None}
    return resolve(flags, file_settings)


def resume_command(run_dir, ranks):
    """The exact command that resumes the run in ``run_dir`` with its own settings (pure)."""
    launcher = f"mpirun -np {ranks} " if ranks > 1 else ""
    return f"{launcher}ringtrain train --resume {shlex.quote(run_dir)}"


def prepare(args):
    """This rank's half of the input checks: the configuration, resolved and validated.

    Runs on every rank before any collective, and raises UsageError; the
    command line then has every rank agree on the verdict (see
    :mod:`ringtrain.cli`). The paths only rank 0 touches (``--run-dir``,
    ``--resume``, ``--timeline``) are left to rank 0, inside :func:`train`.
    """
    return validate(config_from_args(args), root=False)


def run(args, cfg):
    """Train; the exit status says how the run ended (docs/troubleshooting.md lists the exit statuses).

    0 when it finished with its final checkpoint on disk; 130, 143 or 138
    when a signal stopped it, 75 when it stopped before the Slurm job's time
    limit (with its checkpoint, and one line saying how to resume);
    FINAL_CHECKPOINT_MISSING when the run's end is not on disk;
    DIVERGED when its gradients stayed non-finite (one line names the last
    good checkpoint and how to go on from it with a lower --lr).
    """
    from mpi4py import MPI

    from ..cluster.signals import exit_at_once_on
    from ..io.console import bypass_forwarding
    from ..training.loop import Diverged, train
    from ..training.stopping import EXIT_STATUS, STOP_SIGNALS, stopped_line

    master = MPI.COMM_WORLD.Get_rank() == 0
    if master:
        # Rank 0 prints straight to mpirun's output, where a closed or full one
        # is a warning; through MPI's forwarding it would end the job (see
        # ringtrain.io.console).
        bypass_forwarding()
    try:
        result = train(cfg)
    except Diverged as exc:  # raised on every rank at the same step: nobody waits, no abort
        if master:
            say(f"ringtrain: error: {exc.advice}")
        return DIVERGED
    # The run is over and saved: a signal from here on (a second Ctrl-C while
    # the ranks exit) ends the process quietly, with the status the first promised.
    exit_at_once_on(STOP_SIGNALS, EXIT_STATUS.get(result.stopped))
    if result.checkpoint is None:
        if master:
            newest = (f"the newest checkpoint on disk is {result.newest_checkpoint}" if result.newest_checkpoint
                      else "there is no checkpoint of this run on disk")
            say(f"ringtrain: error: the final checkpoint (step {result.step}) was not written; {newest}")
        return FINAL_CHECKPOINT_MISSING
    if result.stopped in EXIT_STATUS:
        if master:
            # Without --run-dir the same command would start afresh in a new directory.
            how = None if cfg.run_dir else resume_command(result.run_dir, MPI.COMM_WORLD.Get_size())
            say(stopped_line(result.stopped, result.step, result.checkpoint, how))
        return EXIT_STATUS[result.stopped]
    return 0


def say(line):
    """One line on stderr, escaped; a closed or full stderr is no reason to change the exit status."""
    from ..io.safeio import printable
    from ..training.runlog import print_safely

    print_safely(printable(line), sys.stderr)
