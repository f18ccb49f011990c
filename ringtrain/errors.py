"""The two kinds of failure ringtrain tells apart.

A :class:`UsageError` is the user's to fix (a bad flag, a missing file, ranks
that disagree on the configuration): the command line prints it as one line
and exits with status 2, no traceback. Anything else is a bug or a fault and
aborts the whole MPI job (see :mod:`ringtrain.failure`).
"""

__all__ = ["UsageError", "MismatchError"]


class UsageError(Exception):
    """A problem with the user's input, reported as one line, exit status 2.

    Args:
        message: one line naming the problem and, where it helps, the fix.
        everywhere: True when every rank raises this same error at the same
            point (argument parsing, a check agreed through a collective), so
            the ranks can simply exit; False when it may be local to one rank,
            in which case the job must be aborted so no peer waits forever.
    """

    def __init__(self, message, everywhere=False):
        super().__init__(message)
        self.everywhere = everywhere


class MismatchError(UsageError):
    """Ranks called the same collective with arguments that do not agree.

    Raised on every rank (``everywhere=True``) once the ranks have compared
    what they were given, so no rank is left inside a collective alone.
    """

    def __init__(self, message):
        super().__init__(message, everywhere=True)
