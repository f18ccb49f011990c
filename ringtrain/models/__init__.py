"""Models with an explicit backward pass, written once for NumPy and CuPy.

* :mod:`~ringtrain.models.base`: the protocol (:class:`Model`) and the flat-buffer tier (:class:`FlatModel`);
* :mod:`~ringtrain.models.layout`: which range of the flat buffers holds which parameter (pure);
* :mod:`~ringtrain.models.layers`: dense layers, softmax cross-entropy and the batch checks, shared by every model;
* :mod:`~ringtrain.models.mlp`: the MLP (the dense layers alone);
* :mod:`~ringtrain.models.conv`: im2col windows, max-pooling, and the CNN's :class:`~ringtrain.models.conv.ConvBlock`;
* :mod:`~ringtrain.models.cnn`: conv blocks, then dense layers;
* :mod:`~ringtrain.models.registry`: the models by name (``build_model``, ``register_model``).
"""

from .base import FlatModel, Model, flat_layout
from .cnn import CNN
from .layers import softmax_cross_entropy
from .layout import FlatLayout
from .mlp import MLP
from .registry import MAX_PARAMETERS, MODELS, build_model, register_model, takes_option

__all__ = ["Model", "FlatModel", "FlatLayout", "flat_layout", "softmax_cross_entropy", "MLP", "CNN", "MODELS",
           "MAX_PARAMETERS", "build_model", "register_model", "takes_option"]
