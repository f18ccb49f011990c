"""Models with an explicit backward pass, written once for NumPy and CuPy.

The trainer needs three things from a model (micrograd's spirit: a protocol
you can hold in your head):

``params``
    An ordered dict ``name -> array``. The names are stable ("fc1.weight",
    "fc1.bias", ...) because checkpoints and the cross-rank agreement check
    use them; the arrays are updated in place by the optimiser.
``loss_and_grad(x, y, on_grad=None) -> (loss, grads, correct)``
    The mean softmax cross-entropy of the batch as a Python float, the
    gradients (a dict with the keys, shapes and dtypes of ``params``) and the
    number of rows whose argmax is the label. ``on_grad(name, grad)``, if
    given, is called as each gradient becomes final, last layer first, so the
    trainer can start averaging them while backward continues.
``evaluate(x, y, batch_size=...) -> (loss_sum, correct)``
    Sums, not means, over the given rows: the trainer adds them across ranks.

Subclass :class:`Model` (which derives ``evaluate`` from ``logits``) or write
any object with those three members. A model that also keeps its parameters
and gradients in one flat buffer each opts in to the fast tier by subclassing
:class:`FlatModel` (the sharded optimizer step, in-place bucket reduction);
any other model is averaged through the plain allreduce. The protocol lives
in :mod:`ringtrain.models.base`; this module holds the MLP and the registry
of models by name (``mlp``, ``softmax``, and the CNN of :mod:`ringtrain.models.cnn`).
Arrays are whatever module the parameters live in (``xp``, CuPy's idiom);
this module never imports CuPy.

Example::

    model = build_model("mlp", 64, 10, hidden=(128,), seed=0)
    loss, grads, correct = model.loss_and_grad(x_batch, y_batch)
"""

import inspect
import operator

import numpy as np

from .cnn import CNN
from .base import (FlatModel, Model, dense_init, evaluate_in_chunks, flat_layout, softmax_cross_entropy,
                         xent_in_place)

__all__ = [
    "Model",
    "FlatModel",
    "flat_layout",
    "MLP",
    "MODELS",
    "build_model",
    "register_model",
    "takes_option",
    "softmax_cross_entropy",
    "xent_in_place",
]


class MLP(FlatModel):
    """Fully connected layers with ReLU between them and softmax cross-entropy on top.

    With no hidden layers this is multinomial logistic regression (the
    "softmax" model). Layer ``i`` (from 1) has ``fc{i}.weight`` of shape
    ``(fan_in, fan_out)`` (so a layer is ``x @ W + b``) and ``fc{i}.bias``.

    Buffers: the gradients returned by :meth:`loss_and_grad` are the SAME
    array objects on every call, overwritten each time (the trainer reduces
    them in place; copy them to keep them). They are views into one flat
    array, :attr:`grad_buffer`, laid out in the order ``on_grad`` delivers
    them, so a run of consecutive gradients is one contiguous slice. The
    parameters are views into :attr:`param_buffer`, laid out the same way,
    so element ``i`` of one buffer is the gradient of element ``i`` of the
    other (a rank updating a range of the parameters reads that range of the
    gradients). Activations are kept per batch size and reused across steps.
    """

    def __init__(self, sizes, xp=np, seed=0, dtype=np.float32):
        self.sizes = tuple(sizes)
        self.dtype = np.dtype(dtype)
        self.xp = xp
        rng = np.random.default_rng(seed)
        self._init_from_host(dense_init(rng, self.sizes, {}), xp, self.dtype)
        self._buffers = {}

    def __repr__(self):
        return f"MLP(sizes={self.sizes}, dtype={self.dtype.name}, xp={self.xp.__name__})"

    def _layers(self):
        return [(self.params[f"fc{i}.weight"], self.params[f"fc{i}.bias"]) for i in range(1, len(self.sizes))]

    def _buffers_for(self, n):
        # Activations for one batch size; the last batch of an epoch may differ,
        # so keep a few sizes rather than reallocating every step.
        bufs = self._buffers.get(n)
        if bufs is None:
            if len(self._buffers) >= 4:
                self._buffers.clear()
            xp, dt = self.xp, self.dtype
            acts = [xp.empty((n, width), dtype=dt) for width in self.sizes[1:]]
            deltas = [xp.empty((n, width), dtype=dt) for width in self.sizes[1:-1]]
            bufs = self._buffers[n] = (acts, deltas, xp.arange(n))
        return bufs

    def _check(self, x, y=None):
        xp = self.xp
        x = xp.asarray(x, dtype=self.dtype)
        if x.ndim != 2 or x.shape[1] != self.sizes[0]:
            raise ValueError(f"x must have shape (rows, {self.sizes[0]}), got {tuple(x.shape)}")
        if y is None:
            return x
        y = xp.asarray(y)
        if y.shape != (x.shape[0],):
            raise ValueError(f"y must have shape ({x.shape[0]},) to match x, got {tuple(y.shape)}")
        if y.dtype.kind not in "iu":
            raise ValueError(f"y must hold integer class labels, got dtype {y.dtype}")
        return x, y

    def _forward(self, x, acts):
        h = x
        layers = self._layers()
        for i, (w, b) in enumerate(layers):
            z = acts[i]
            self.xp.matmul(h, w, out=z)
            z += b
            if i < len(layers) - 1:
                self.xp.maximum(z, 0, out=z)  # ReLU in place; z > 0 is also its derivative mask
            h = z
        return h

    def logits(self, x):
        """Return the logits for ``x`` as a new array (safe to keep)."""
        x = self._check(x)
        acts = [self.xp.empty((x.shape[0], width), dtype=self.dtype) for width in self.sizes[1:]]
        return self._forward(x, acts)

    def evaluate(self, x, y, batch_size=1024):
        """Return ``(loss_sum: float, correct: int)`` summed over the rows of ``x``."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        x, y = self._check(x, y)

        def logits_and_rows(xb):
            acts, _, rows = self._buffers_for(xb.shape[0])
            return self._forward(xb, acts), rows

        return evaluate_in_chunks(self.xp, x, y, batch_size, logits_and_rows)

    def loss_and_grad(self, x, y, on_grad=None):
        """Return ``(loss, grads, correct)`` for one batch; see the module docstring.

        ``grads`` holds this model's reused buffers (see the class docstring).
        With CuPy, ``on_grad`` receives ``grad`` while its kernel may still be
        queued: synchronise (``backend.synchronize``) before giving it to MPI.
        """
        xp = self.xp
        x, y = self._check(x, y)
        n = x.shape[0]
        if n == 0:
            raise ValueError("cannot take the loss of an empty batch (0 rows)")
        acts, deltas, rows = self._buffers_for(n)
        logits = self._forward(x, acts)
        loss_sum, correct = xent_in_place(xp, logits, y, rows, grad_scale=1.0 / n)
        g = logits  # now d(mean loss)/d(logits)
        layers = self._layers()
        for i in range(len(layers) - 1, -1, -1):
            w = layers[i][0]
            h = acts[i - 1] if i > 0 else x
            gw, gb = self.grads[f"fc{i + 1}.weight"], self.grads[f"fc{i + 1}.bias"]
            xp.sum(g, axis=0, out=gb)
            xp.matmul(h.T, g, out=gw)
            if on_grad is not None:
                on_grad(f"fc{i + 1}.bias", gb)
                on_grad(f"fc{i + 1}.weight", gw)
            if i > 0:  # the input layer needs no gradient with respect to x
                d = deltas[i - 1]
                xp.matmul(g, w.T, out=d)
                d *= h > 0
                g = d
        return float(loss_sum) / n, self.grads, int(correct)


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
