"""``import horovod.torch as hvd``: ringtrain.torch under Horovod's name."""

from ringtrain.torch import *  # noqa: F401,F403 - the forwarding is the point
from ringtrain.torch import __all__ as _core

from ._forward import forward_missing

# The optimizer wing (DistributedOptimizer, broadcast helpers, Compression,
# SyncBatchNorm) lands in ringtrain.torch separately: whatever of it exists
# is forwarded by name, on first use.
__getattr__ = forward_missing(("ringtrain.torch",), __name__)
__all__ = list(_core)
