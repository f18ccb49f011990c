"""The errors Horovod's API raises, under Horovod's names.

Horovod's tests catch ``RuntimeError`` for ranks that disagree and
``ValueError`` for a name already in flight, so both are kept as bases.
"""

from ..errors import UsageError

__all__ = ["HorovodInternalError", "HostsUpdatedInterrupt", "CollectiveMismatchError", "DuplicateNameError"]


class HorovodInternalError(RuntimeError):
    """A collective failed on every rank that took part (Horovod's name for it)."""


class CollectiveMismatchError(HorovodInternalError, UsageError):
    """Ranks submitted the same named op with different shapes, dtypes, ops, roots or splits.

    Raised on every rank that submitted it, once the ranks have compared
    what they were given, so none is left waiting.
    """

    def __init__(self, message):
        HorovodInternalError.__init__(self, message)
        self.everywhere = True


class DuplicateNameError(ValueError):
    """A name was submitted while an op of the same name was still in flight on this rank."""


class HostsUpdatedInterrupt(RuntimeError):
    """Horovod's elastic interrupt; ringtrain has no elastic mode, so it is never raised."""
