"""The layers every built-in model shares: dense layers, softmax cross-entropy, the batch checks.

The MLP is these dense layers alone; the CNN puts its conv blocks
(:mod:`ringtrain.models.conv`) in front of them. Both keep their activations
in buffers they reuse step after step, so the functions here write into
arrays they are given (``out=``) and allocate nothing on a training step.
Written once for NumPy and CuPy: ``xp`` is the array module of the
parameters.

Dense layer ``i`` (from 1) is ``x @ fc{i}.weight + fc{i}.bias``, the weight
stored ``(fan_in, fan_out)``, with a ReLU after every layer but the last,
whose output is the logits.
"""

import numpy as np

from ..backend import get_array_module

__all__ = ["dense_init", "dense_forward", "dense_backward", "activations", "BatchBuffers", "softmax_cross_entropy",
           "xent_in_place", "evaluate_in_chunks", "check_labels", "check_nonempty", "check_batch_size"]


def dense_init(rng, sizes, host):
    """Add ``fc1`` ... weights and zero biases for layer ``sizes`` to ``host``, drawn from ``rng``.

    He init for layers feeding a ReLU; LeCun (std 1/sqrt(fan_in)) for the
    last, the logits.
    """
    last = len(sizes) - 2
    for i, (fan_in, fan_out) in enumerate(zip(sizes, sizes[1:])):
        std = np.sqrt((2.0 if i < last else 1.0) / fan_in)
        host[f"fc{i + 1}.weight"] = rng.standard_normal((fan_in, fan_out)) * std
        host[f"fc{i + 1}.bias"] = np.zeros(fan_out)
    return host


def activations(xp, rows, widths, dtype):
    """One uninitialised ``(rows, width)`` buffer per width: a layer's outputs, or its gradients."""
    return [xp.empty((rows, width), dtype=dtype) for width in widths]


class BatchBuffers:
    """A model's buffers for each batch size, made by ``make(rows)`` on first use and reused after.

    The last batch of an epoch and the evaluation chunks differ from the
    training batch, so a few sizes are kept (``keep``) rather than
    reallocating every step; one size more and the kept ones are dropped.
    """

    def __init__(self, make, keep=4):
        self._make, self._keep, self._by_rows = make, keep, {}

    def __call__(self, rows):
        bufs = self._by_rows.get(rows)
        if bufs is None:
            if len(self._by_rows) >= self._keep:
                self._by_rows.clear()
            bufs = self._by_rows[rows] = self._make(rows)
        return bufs


def dense_forward(xp, params, h, acts):
    """Run ``h`` through the dense layers into ``acts`` (one buffer per layer); return the logits, ``acts[-1]``.

    ``acts[i]`` is left holding layer ``i + 1``'s output after its ReLU,
    which :func:`dense_backward` needs.
    """
    last = len(acts) - 1
    for i, z in enumerate(acts):
        xp.matmul(h, params[f"fc{i + 1}.weight"], out=z)
        z += params[f"fc{i + 1}.bias"]
        if i < last:
            xp.maximum(z, 0, out=z)  # ReLU in place; z > 0 is also its derivative mask
        h = z
    return h


def dense_backward(xp, params, grads, g, x, acts, deltas, on_grad=None, dx=None):
    """Backward through the dense layers, last first, writing ``grads``; return d(loss)/d(x) or None.

    Args:
        g: d(loss)/d(logits), ``(rows, classes)``.
        x: the input :func:`dense_forward` was given; ``acts`` its outputs.
        deltas: one buffer per hidden layer, for the gradients between layers.
        on_grad: called as ``on_grad(name, grad)`` for each gradient once it
            is final, bias first, last layer first.
        dx: where to write d(loss)/d(x), ``(rows, fan_in)``; None when the
            input needs no gradient (the MLP's data), which saves a product.
    """
    for i in range(len(acts) - 1, -1, -1):
        h = acts[i - 1] if i > 0 else x
        gw, gb = grads[f"fc{i + 1}.weight"], grads[f"fc{i + 1}.bias"]
        xp.sum(g, axis=0, out=gb)
        xp.matmul(h.T, g, out=gw)
        if on_grad is not None:
            on_grad(f"fc{i + 1}.bias", gb)
            on_grad(f"fc{i + 1}.weight", gw)
        if i == 0 and dx is None:
            return None
        d = deltas[i - 1] if i > 0 else dx
        xp.matmul(g, params[f"fc{i + 1}.weight"].T, out=d)
        if i > 0:
            d *= h > 0  # through the ReLU of the layer below; dx's caller applies its own
        g = d
    return g


def softmax_cross_entropy(logits, y, grad_scale=None):
    """Return ``(loss_sum: float, correct: int, dlogits)`` for a batch of logits.

    The loss is computed as ``logsumexp(z) - z[y]`` with the row maximum
    subtracted first, so large logits cannot overflow ``exp``. With
    ``grad_scale`` given, ``logits`` is OVERWRITTEN with
    ``grad_scale * (softmax(z) - onehot(y))`` (pass ``1 / rows`` for the
    gradient of the mean) and returned as ``dlogits``; otherwise ``logits``
    is left alone and ``dlogits`` is None.
    """
    xp = get_array_module(logits)
    rows = xp.arange(logits.shape[0])
    z = logits if grad_scale is not None else logits.copy()
    loss_sum, correct = xent_in_place(xp, z, xp.asarray(y), rows, grad_scale)
    return float(loss_sum), int(correct), (z if grad_scale is not None else None)


def xent_in_place(xp, z, y, rows, grad_scale):
    """Softmax cross-entropy of logits ``z`` in place: ``(loss_sum, correct)`` as device scalars.

    With ``grad_scale`` given, ``z`` is left holding ``grad_scale * (softmax(z) - onehot(y))``;
    otherwise ``z`` is left holding ``exp(z - max)``. ``rows`` is ``xp.arange(len(z))``. Models'
    fast paths use it; :func:`softmax_cross_entropy` is the safe wrapper.
    """
    # Works in place on z and returns device scalars: on a GPU, turning them
    # into Python numbers would wait for the kernels, so callers do it last.
    correct = xp.count_nonzero(xp.argmax(z, axis=1) == y)
    z -= z.max(axis=1, keepdims=True)
    picked = z[rows, y]
    xp.exp(z, out=z)
    sumexp = z.sum(axis=1, keepdims=True)
    # float64 accumulation keeps the batch sum from drifting with batch size.
    loss_sum = (xp.log(sumexp[:, 0]) - picked).sum(dtype=np.float64)
    if grad_scale is not None:
        z /= sumexp
        z[rows, y] -= 1.0
        z *= grad_scale
    return loss_sum, correct


def evaluate_in_chunks(xp, x, y, rows_per_chunk, logits_and_rows):
    """``(loss_sum: float, correct: int)`` over ``x`` a chunk at a time, for models with reused buffers.

    ``logits_and_rows(xb)`` runs the forward pass into the model's own
    buffers and returns the logits (which the loss may overwrite) and
    ``xp.arange(len(xb))``. The sums stay on the device until the end, so a
    GPU is not waited on once per chunk.
    """
    loss_sum, correct = 0.0, 0
    for start in range(0, x.shape[0], rows_per_chunk):
        xb, yb = x[start:start + rows_per_chunk], y[start:start + rows_per_chunk]
        logits, rows = logits_and_rows(xb)
        chunk_loss, chunk_correct = xent_in_place(xp, logits, yb, rows, None)
        loss_sum, correct = loss_sum + chunk_loss, correct + chunk_correct
    return float(loss_sum), int(correct)


def check_labels(xp, y, rows):
    """``y`` as an array of ``rows`` integer class labels; ValueError naming the shape or dtype otherwise."""
    y = xp.asarray(y)
    if y.shape != (rows,):
        raise ValueError(f"y must have shape ({rows},) to match x, got {tuple(y.shape)}")
    if y.dtype.kind not in "iu":
        raise ValueError(f"y must hold integer class labels, got dtype {y.dtype}")
    return y


def check_nonempty(rows):
    """Refuse a training batch of no rows: its mean loss is undefined."""
    if rows == 0:
        raise ValueError("cannot take the loss of an empty batch (0 rows)")


def check_batch_size(batch_size):
    """Refuse an evaluation batch size below 1."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
