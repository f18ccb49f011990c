"""``horovod.torch.compression``: forwards to ringtrain.torch.optimizer (the compressors), then ringtrain.torch."""

from ._forward import forward_missing

__getattr__ = forward_missing(("ringtrain.torch.optimizer", "ringtrain.torch"), __name__)
