"""Models with an explicit backward pass, written once for NumPy and CuPy.

* :mod:`~ringtrain.models.base`: the protocol (:class:`Model`) and the flat-buffer tier (:class:`FlatModel`);
* :mod:`~ringtrain.models.layout`: which range of the flat buffers holds which parameter (pure);
* :mod:`~ringtrain.models.registry`: the MLP and the models by name (``build_model``, ``register_model``);
* :mod:`~ringtrain.models.cnn`: conv blocks, then dense layers.
"""

from .base import FlatModel, Model, flat_layout, softmax_cross_entropy
from .cnn import CNN
from .layout import FlatLayout
from .registry import MAX_PARAMETERS, MLP, MODELS, build_model, register_model, takes_option

__all__ = ["Model", "FlatModel", "FlatLayout", "flat_layout", "softmax_cross_entropy", "MLP", "CNN", "MODELS",
           "MAX_PARAMETERS", "build_model", "register_model", "takes_option"]
