"""The errors Horovod's API raises, under Horovod's names (the engine's: :mod:`ringtrain.engine.errors`).

Served as ``horovod.common.exceptions`` under ``python -m ringtrain.horovod``.
"""

from ..engine.errors import CollectiveMismatchError, DuplicateNameError, HorovodInternalError, HostsUpdatedInterrupt

__all__ = ["HorovodInternalError", "HostsUpdatedInterrupt", "CollectiveMismatchError", "DuplicateNameError"]
