"""The models by name: ``build_model("mlp", ...)``, and :func:`register_model` to add one.

The built-ins are ``mlp`` and ``softmax`` (:class:`ringtrain.models.mlp.MLP`,
the latter with no hidden layers) and ``cnn`` (:class:`ringtrain.models.cnn.CNN`).
A name maps to a builder, a plain function; what a model must provide is the
protocol of :mod:`ringtrain.models.base`.

Example::

    model = build_model("mlp", 64, 10, hidden=(128,), seed=0)
    loss, grads, correct = model.loss_and_grad(x_batch, y_batch)
"""

import inspect
import operator

import numpy as np

from .cnn import CNN
from .mlp import MLP

__all__ = ["MODELS", "MAX_PARAMETERS", "build_model", "register_model", "takes_option"]


def _size(what, value, minimum):
    try:
        if isinstance(value, bool):
            raise TypeError
        value = operator.index(value)
    except TypeError:
        raise ValueError(f"{what} must be an integer, got {value!r}") from None
    if value < minimum:
        raise ValueError(f"{what} must be at least {minimum}, got {value}")
    return value


def _mlp(num_features, num_classes, hidden, xp, seed, dtype):
    hidden = tuple(_size("hidden layer size", h, 1) for h in hidden)
    return MLP((num_features, *hidden, num_classes), xp=xp, seed=seed, dtype=dtype)


def _softmax(num_features, num_classes, hidden, xp, seed, dtype):
    if tuple(hidden):
        raise ValueError(f"model 'softmax' has no hidden layers, got hidden={tuple(hidden)}; use model 'mlp'")
    return MLP((num_features, num_classes), xp=xp, seed=seed, dtype=dtype)


def _cnn(num_features, num_classes, hidden, xp, seed, dtype, input_shape=None, channels=(16, 32), kernel=5):
    if input_shape is None:
        raise ValueError("model 'cnn' needs image data: digits, mnist5k, or an .npz whose x is N x H x W "
                         "or N x C x H x W")
    input_shape = tuple(_size("image size", s, 1) for s in input_shape)
    if int(np.prod(input_shape)) != num_features:
        raise ValueError(f"input_shape {input_shape} does not hold {num_features} features")
    hidden = tuple(_size("hidden layer size", h, 1) for h in hidden)
    channels = tuple(_size("conv channels", c, 1) for c in ((channels,) if np.ndim(channels) == 0 else channels))
    return CNN(input_shape, num_classes, channels=channels, kernel=_size("kernel", kernel, 1), hidden=hidden,
               xp=xp, seed=seed, dtype=dtype)


# name -> builder(num_features, num_classes, hidden, xp, seed, dtype) returning a Model. A builder
# that also takes ``input_shape`` gets the image shape (or None); one that takes further keywords
# (the cnn's ``channels``, ``kernel``) gets those given to build_model.
MODELS = {"mlp": _mlp, "softmax": _softmax, "cnn": _cnn}


def register_model(name, builder):
    """Make ``build_model(name, ...)`` call ``builder(num_features, num_classes, hidden, xp, seed, dtype)``.

    A builder that declares an ``input_shape`` parameter is also passed the
    data's image shape, ``(channels, height, width)`` or None; any other
    keyword given to :func:`build_model` is passed on as is.
    """
    if name in MODELS:
        raise ValueError(f"model {name!r} is already registered")
    MODELS[name] = builder


MAX_PARAMETERS = 1 << 31
"""The most parameters :func:`build_model` builds: 8 GiB of float32 weights,
about 32 GiB with gradients and Adam's two moments, on every rank."""


def build_model(name, num_features, num_classes, hidden=(), xp=np, seed=0, dtype=np.float32, *, input_shape=None,
                **options):
    """Build a registered model with parameters drawn from ``numpy.random.default_rng(seed)``.

    Every rank that builds with the same arguments gets bitwise the same
    parameters, on the CPU or the GPU.

    Args:
        input_shape: ``(channels, height, width)`` when the rows are images
            (:attr:`ringtrain.data.load.Shard.image_shape`), else None. Given
            only to builders that take it: flat models ignore it.
        options: model-specific settings, e.g. ``channels`` and ``kernel``
            for ``"cnn"``.

    Raises:
        ValueError: for an unknown name, a bad size, a model of more than
            :data:`MAX_PARAMETERS` parameters (checked before anything is
            allocated), an unsupported dtype, or an option the model does
            not take.
    """
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(sorted(MODELS))}")
    num_features = _size("num_features", num_features, 1)
    num_classes = _size("num_classes", num_classes, 2)
    if isinstance(hidden, (int, np.integer)):
        hidden = (hidden,)
    dtype = np.dtype(dtype)
    if dtype not in (np.float32, np.float64):
        raise ValueError(f"dtype must be float32 or float64, got {dtype.name}")
    hidden = tuple(hidden)
    if name in ("mlp", "softmax"):  # a registered model's size is its builder's business
        widths = (num_features, *(_size("hidden layer size", h, 1) for h in hidden), num_classes)
        count = sum((a + 1) * b for a, b in zip(widths, widths[1:]))
        if count > MAX_PARAMETERS:
            raise ValueError(f"model {name!r} with layers {'-'.join(map(str, widths))} would have {count:,} "
                             f"parameters ({count * dtype.itemsize / 2**30:,.0f} GiB of {dtype.name} weights, "
                             f"about 4x that with gradients and optimizer state); ringtrain builds models of at "
                             f"most 2^31 ({MAX_PARAMETERS:,}) parameters")
    builder = MODELS[name]
    accepted = _keywords(builder)
    for key in options:
        if accepted is not None and key not in accepted:
            raise ValueError(f"model {name!r} takes no option {key!r}")
    if input_shape is not None and (accepted is None or "input_shape" in accepted):
        options["input_shape"] = tuple(input_shape)
    return builder(num_features, num_classes, hidden, xp, seed, dtype, **options)


def takes_option(name, option):
    """Whether the registered model ``name``'s builder takes the keyword ``option`` (e.g. ``"channels"``)."""
    accepted = _keywords(MODELS[name])
    return accepted is None or option in accepted


def _keywords(builder):
    """The names ``builder`` takes as keywords; None when it takes any (``**kwargs``)."""
    try:
        parameters = inspect.signature(builder).parameters.values()
    except (TypeError, ValueError):  # some builtins and C callables have no signature
        return set()
    if any(p.kind is p.VAR_KEYWORD for p in parameters):
        return None
    return {p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
