"""``horovod.torch.sync_batch_norm``: forwards to ringtrain.torch.sync_batch_norm (and ringtrain.torch for the rest)."""

from ._forward import forward_missing

__getattr__ = forward_missing(("ringtrain.torch.sync_batch_norm", "ringtrain.torch"), __name__)
