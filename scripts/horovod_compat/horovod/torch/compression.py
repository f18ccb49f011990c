"""``horovod.torch.compression``: forwards to ringtrain.torch.compression (and ringtrain.torch for the rest)."""

from ._forward import forward_missing

__getattr__ = forward_missing(("ringtrain.torch.compression", "ringtrain.torch"), __name__)
