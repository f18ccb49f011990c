"""``horovod.torch.mpi_ops``: forwards to ringtrain.torch.mpi_ops (and ringtrain.torch for the rest)."""

from ._forward import forward_missing

__getattr__ = forward_missing(("ringtrain.torch.mpi_ops", "ringtrain.torch"), __name__)
