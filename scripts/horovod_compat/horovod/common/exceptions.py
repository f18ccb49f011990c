"""``horovod.common.exceptions``: ringtrain.torch's errors under Horovod's names."""

from ringtrain.torch.errors import HorovodInternalError, HostsUpdatedInterrupt

__all__ = ["HorovodInternalError", "HostsUpdatedInterrupt"]
