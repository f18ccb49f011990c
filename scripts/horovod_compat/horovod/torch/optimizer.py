"""``horovod.torch.optimizer``: forwards to ringtrain.torch.optimizer (and ringtrain.torch for the rest)."""

from ._forward import forward_missing

__getattr__ = forward_missing(("ringtrain.torch.optimizer", "ringtrain.torch"), __name__)
