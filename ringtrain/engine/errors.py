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
    """The hosts changed: ``hvd.elastic.run`` resets, or (under an elastic launcher) restarts the job.

    Args:
        skip_sync: True when hosts were only removed, so the state need not
            be synchronized again (Horovod's argument).
    """

    def __init__(self, skip_sync=False):
        super().__init__("the hosts changed" + (" (removed only)" if skip_sync else ""))
        self.skip_sync = skip_sync
