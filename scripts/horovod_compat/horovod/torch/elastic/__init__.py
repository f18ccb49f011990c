"""``horovod.torch.elastic``: forwards to ringtrain.torch.elastic."""

from ringtrain.torch.elastic import *  # noqa: F401,F403 - the forwarding is the point
from ringtrain.torch.elastic import __all__  # noqa: F401
