"""The PyTorch wing: the only part of ringtrain that touches torch.

* :mod:`ringtrain.torch.interop`: zero-copy views between tensors and
  ringtrain arrays, parameter broadcast and gradient averaging;
* :class:`ringtrain.torch.TorchModel`: any ``nn.Module`` through the trainer.
"""

from . import interop
from .model import TorchModel

__all__ = ["interop", "TorchModel"]
