"""A convolutional network with an explicit backward pass, written once for NumPy and CuPy.

:class:`CNN` is conv -> ReLU -> 2x2 max-pool blocks (:class:`ringtrain.models.conv.ConvBlock`,
where the method and its reasons are written down), then the dense layers the
MLP is made of (:mod:`ringtrain.models.layers`), then softmax cross-entropy:
the network that takes MNIST-sized digits past what the MLP reaches. It is a
:class:`ringtrain.models.FlatModel`, so the trainer's fast paths (in-place
bucket reduction, the sharded optimizer step) apply to it unchanged. Every
buffer is kept per batch size and reused across steps, as the MLP does.

Example::

    model = CNN((1, 28, 28), 10, channels=(16, 32), kernel=5, hidden=(128,), seed=0)
    loss, grads, correct = model.loss_and_grad(x_batch, y_batch)  # x: (rows, 784) or (rows, 1, 28, 28)
"""

import numpy as np

from ..backend import host_scalars
from .base import FlatModel
from .conv import ConvBlock, check_images, conv_geometry, conv_init
from .layers import (BatchBuffers, activations, check_batch_size, check_labels, check_nonempty, dense_backward,
                     dense_forward, dense_init, evaluate_in_chunks, xent_in_place)

__all__ = ["CNN"]

_EVAL_ROWS = 128  # rows per forward pass in evaluate/logits: bounds the im2col buffers


class CNN(FlatModel):
    """Conv -> ReLU -> 2x2 max-pool blocks, then dense layers with ReLU, softmax cross-entropy on top.

    Block ``i`` (from 1) convolves with ``conv{i}.weight`` of shape
    ``(kernel, kernel, in_channels, out_channels)`` ('same' padding, stride 1)
    and adds ``conv{i}.bias``; a 2x2 max-pool of stride 2 halves the height
    and width (an odd last row or column is dropped, as PyTorch does). The
    last block's output is flattened in (height, width, channel) order and
    fed to dense layers ``fc{i}.weight`` ``(fan_in, fan_out)`` and
    ``fc{i}.bias`` as in :class:`ringtrain.models.MLP`; the last one gives
    the logits.

    Args:
        input_shape: ``(channels, height, width)`` of one image.
        num_classes: number of classes (logits).
        channels: output channels of each conv block.
        kernel: kernel height and width; odd, so 'same' padding is symmetric.
        hidden: widths of the dense hidden layers (may be empty).
        xp: array module (NumPy or CuPy).
        seed: parameters are drawn from ``numpy.random.default_rng(seed)``
            on the host in float64, so CPU and GPU start identical.
        dtype: float32 or float64.

    ``x`` may be ``(rows, C * H * W)`` (rows flattened in C, H, W order, as
    the datasets store them), ``(rows, C, H, W)``, or ``(rows, H, W)`` when
    ``C`` is 1. Buffers and the gradient dict behave as the MLP's: the
    returned gradients are views into :attr:`grad_buffer`, overwritten by
    every call.
    """

    def __init__(self, input_shape, num_classes, channels=(16, 32), kernel=5, hidden=(128,), xp=np, seed=0,
                 dtype=np.float32):
        input_shape, channels, hidden = tuple(input_shape), tuple(channels), tuple(hidden)
        if len(input_shape) != 3 or min(input_shape) < 1:
            raise ValueError(f"input_shape must be (channels, height, width) of positive sizes, got {input_shape}")
        if not channels or min(channels) < 1:
            raise ValueError(f"channels must be one or more positive sizes, got {channels}")
        if kernel < 1 or kernel % 2 == 0:
            raise ValueError(f"kernel must be odd and at least 1 ('same' padding), got {kernel}")
        self.input_shape, self.num_classes = input_shape, num_classes
        self.channels, self.kernel, self.hidden = channels, kernel, hidden
        self.dtype = np.dtype(dtype)
        self.xp = xp
        self._geometry, (c, h, w) = conv_geometry(input_shape, channels)
        self.dense_sizes = (c * h * w, *hidden, num_classes)
        rng = np.random.default_rng(seed)
        host = conv_init(rng, self._geometry, kernel, {})
        self._init_from_host(dense_init(rng, self.dense_sizes, host), xp, self.dtype)
        self._buffers_for = BatchBuffers(self._make_buffers)

    def __repr__(self):
        return (f"CNN(input_shape={self.input_shape}, channels={self.channels}, kernel={self.kernel}, "
                f"hidden={self.hidden}, num_classes={self.num_classes}, dtype={self.dtype.name}, "
                f"xp={self.xp.__name__})")

    def _make_buffers(self, n):
        """The conv blocks and dense activations for batches of ``n`` rows; the backward ones come later."""
        xp, dt = self.xp, self.dtype
        blocks, out = [], None
        for i in range(len(self._geometry) - 1, -1, -1):  # last first: each writes into the next one's input
            blocks.insert(0, ConvBlock(xp, n, self._geometry[i], self.kernel, dt, out, needs_input_grad=i > 0))
            out = blocks[0].input
        return {"blocks": blocks, "acts": activations(xp, n, self.dense_sizes[1:], dt), "rows": xp.arange(n),
                "deltas": None, "dflat": None}

    def _forward(self, x, bufs):
        """The logits of ``x`` (rows, C, H, W), in ``bufs["acts"][-1]``."""
        blocks = bufs["blocks"]
        blocks[0].input[...] = x.transpose(0, 2, 3, 1)
        for i, block in enumerate(blocks):
            block.forward(self.params[f"conv{i + 1}.weight"], self.params[f"conv{i + 1}.bias"])
        return dense_forward(self.xp, self.params, blocks[-1].out.reshape(x.shape[0], -1), bufs["acts"])

    def logits(self, x):
        """Return the logits for ``x`` as a new array (safe to keep)."""
        x = check_images(self.xp, x, self.input_shape, self.dtype)
        parts = []
        for start in range(0, x.shape[0], _EVAL_ROWS):
            chunk = x[start:start + _EVAL_ROWS]
            parts.append(self._forward(chunk, self._buffers_for(chunk.shape[0])).copy())
        if not parts:
            return self.xp.empty((0, self.num_classes), dtype=self.dtype)
        return self.xp.concatenate(parts)

    def evaluate(self, x, y, batch_size=1024):
        """Return ``(loss_sum: float, correct: int)`` summed over the rows of ``x``.

        Rows go through the network at most 128 at a time whatever
        ``batch_size`` says: the im2col buffers grow with the rows.
        """
        check_batch_size(batch_size)
        x = check_images(self.xp, x, self.input_shape, self.dtype)
        y = check_labels(self.xp, y, x.shape[0])

        def logits_and_rows(xb):
            bufs = self._buffers_for(xb.shape[0])
            return self._forward(xb, bufs), bufs["rows"]

        return evaluate_in_chunks(self.xp, x, y, min(batch_size, _EVAL_ROWS), logits_and_rows)

    def loss_and_grad(self, x, y, on_grad=None):
        """Return ``(loss, grads, correct)`` for one batch; see :class:`ringtrain.models.Model`.

        ``grads`` holds this model's reused buffers (see the class docstring).
        With CuPy, ``on_grad`` receives ``grad`` while its kernel may still be
        queued: synchronise (``backend.synchronize``) before giving it to MPI.
        """
        xp = self.xp
        x = check_images(xp, x, self.input_shape, self.dtype)
        y = check_labels(xp, y, x.shape[0])
        n = x.shape[0]
        check_nonempty(n)
        bufs = self._buffers_for(n)
        if bufs["dflat"] is None:
            bufs["deltas"] = activations(xp, n, self.dense_sizes[1:-1], self.dtype)
            bufs["dflat"] = xp.empty((n, self.dense_sizes[0]), dtype=self.dtype)
        logits = self._forward(x, bufs)
        loss_sum, correct = xent_in_place(xp, logits, y, bufs["rows"], grad_scale=1.0 / n)
        blocks = bufs["blocks"]
        flat = blocks[-1].out.reshape(n, -1)
        # logits now hold d(mean loss)/d(logits); the ReLU mask of the last block is applied in the block.
        g = dense_backward(xp, self.params, self.grads, logits, flat, bufs["acts"], bufs["deltas"], on_grad,
                           dx=bufs["dflat"]).reshape(blocks[-1].out.shape)
        for i in range(len(blocks) - 1, -1, -1):
            name = f"conv{i + 1}"
            gw, gb = self.grads[f"{name}.weight"], self.grads[f"{name}.bias"]
            blocks[i].weight_grads(g, gw, gb)
            if on_grad is not None:
                on_grad(f"{name}.bias", gb)
                on_grad(f"{name}.weight", gw)
            if i > 0:  # the first block needs no gradient with respect to the images
                g = blocks[i].input_grad(self.params[f"{name}.weight"])
        loss_sum, correct = host_scalars(loss_sum, correct)  # one wait for the device, not two
        return loss_sum / n, self.grads, int(correct)
