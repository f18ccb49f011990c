"""``horovod.torch.functions``: forwards to ringtrain.torch.functions (and ringtrain.torch for the rest)."""

from ._forward import forward_missing

__getattr__ = forward_missing(("ringtrain.torch.functions", "ringtrain.torch"), __name__)
