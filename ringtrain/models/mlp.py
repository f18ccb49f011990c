"""The multilayer perceptron: the shared dense layers, and nothing in front of them.

Example::

    model = MLP((64, 128, 10), seed=0)
    loss, grads, correct = model.loss_and_grad(x_batch, y_batch)
"""

import numpy as np

from ..backend import host_scalars
from .base import FlatModel
from .layers import (BatchBuffers, activations, check_batch_size, check_labels, check_nonempty, dense_backward,
                     dense_forward, dense_init, evaluate_in_chunks, xent_in_place)

__all__ = ["MLP"]


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
        self._buffers_for = BatchBuffers(self._make_buffers)

    def __repr__(self):
        return f"MLP(sizes={self.sizes}, dtype={self.dtype.name}, xp={self.xp.__name__})"

    def _make_buffers(self, n):
        """Activations, the gradients between layers, and ``arange(n)`` for batches of ``n`` rows."""
        xp, dt = self.xp, self.dtype
        return activations(xp, n, self.sizes[1:], dt), activations(xp, n, self.sizes[1:-1], dt), xp.arange(n)

    def _check(self, x, y=None):
        x = self.xp.asarray(x, dtype=self.dtype)
        if x.ndim != 2 or x.shape[1] != self.sizes[0]:
            raise ValueError(f"x must have shape (rows, {self.sizes[0]}), got {tuple(x.shape)}")
        return x if y is None else (x, check_labels(self.xp, y, x.shape[0]))

    def logits(self, x):
        """Return the logits for ``x`` as a new array (safe to keep)."""
        x = self._check(x)
        return dense_forward(self.xp, self.params, x, activations(self.xp, x.shape[0], self.sizes[1:], self.dtype))

    def evaluate(self, x, y, batch_size=1024):
        """Return ``(loss_sum: float, correct: int)`` summed over the rows of ``x``."""
        check_batch_size(batch_size)
        x, y = self._check(x, y)

        def logits_and_rows(xb):
            acts, _, rows = self._buffers_for(xb.shape[0])
            return dense_forward(self.xp, self.params, xb, acts), rows

        return evaluate_in_chunks(self.xp, x, y, batch_size, logits_and_rows)

    def loss_and_grad(self, x, y, on_grad=None):
        """Return ``(loss, grads, correct)`` for one batch; see :class:`ringtrain.models.Model`.

        ``grads`` holds this model's reused buffers (see the class docstring).
        With CuPy, ``on_grad`` receives ``grad`` while its kernel may still be
        queued: synchronise (``backend.synchronize``) before giving it to MPI.
        """
        xp = self.xp
        x, y = self._check(x, y)
        n = x.shape[0]
        check_nonempty(n)
        acts, deltas, rows = self._buffers_for(n)
        logits = dense_forward(xp, self.params, x, acts)
        loss_sum, correct = xent_in_place(xp, logits, y, rows, grad_scale=1.0 / n)
        # logits now hold d(mean loss)/d(logits); the input layer needs no gradient with respect to x.
        dense_backward(xp, self.params, self.grads, logits, x, acts, deltas, on_grad)
        loss_sum, correct = host_scalars(loss_sum, correct)  # one wait for the device, not two
        return loss_sum / n, self.grads, int(correct)
