"""``ringtrain bench``: not written yet."""

from ..errors import UsageError

HELP = "(not available yet)"


def add_arguments(parser):
    pass


def run(args):
    raise UsageError("'ringtrain bench' is not available yet", everywhere=True)
