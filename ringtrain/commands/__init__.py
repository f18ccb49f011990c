"""One module per ``ringtrain`` subcommand: ``HELP``, ``add_arguments(parser)``, ``run(args)``."""

import argparse

__all__ = ["given"]


def given(text):
    """The ``type`` of every flag that names a path or a command: an empty value is refused, not taken as absent.

    ``--run-dir "$RUN_DIR"`` with ``RUN_DIR`` unset must not train into a new directory (a requeued job
    would never resume), nor ``-o ''`` write its logs where the launcher happens to stand.
    """
    if text == "":
        raise argparse.ArgumentTypeError("an empty value; give one, or leave the flag out for the default")
    return text
