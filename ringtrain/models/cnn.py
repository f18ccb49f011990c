"""A convolutional network with an explicit backward pass, written once for NumPy and CuPy.

:class:`CNN` is conv -> ReLU -> 2x2 max-pool blocks, then fully connected
layers, then softmax cross-entropy: the network that takes MNIST-sized
digits past what the MLP reaches. It is a :class:`ringtrain.models.FlatModel`,
so the trainer's fast paths (in-place bucket reduction, the sharded
optimizer step) apply to it unchanged.

How it is computed, and why:

* Activations are NHWC (channels last). A convolution is then one matrix
  product: im2col copies every k x k window of the zero-padded input into a
  ``(rows * H * W, k * k * C)`` matrix (one strided copy, no Python loop over
  pixels), and ``cols @ W`` gives the output already in NHWC order. Weights
  are stored HWIO, ``(k, k, in, out)``, so ``W.reshape(-1, out)`` is the
  matrix with no copy, as the MLP stores ``(fan_in, fan_out)``.
* The bias and the ReLU are applied after the max-pool. A per-channel bias is
  constant over a pooling window and ReLU is monotone, so
  ``relu(pool(z) + b) == pool(relu(z + b))`` exactly, at a quarter of the work.
* The pool keeps which element of each window won (on a tie, the top left
  one, as PyTorch), so every window passes its gradient to exactly one
  input. Ties are common: blank image regions give equal outputs.
* The gradient with respect to a block's input is the transposed
  convolution, computed as another im2col of the zero-padded output gradient
  times the flipped kernel: one copy and one matrix product, about 1.5x as
  fast in NumPy as scattering the columns back (col2im) offset by offset.

Every buffer is kept per batch size and reused across steps, as the MLP does.

Example::

    model = CNN((1, 28, 28), 10, channels=(16, 32), kernel=5, hidden=(128,), seed=0)
    loss, grads, correct = model.loss_and_grad(x_batch, y_batch)  # x: (rows, 784) or (rows, 1, 28, 28)
"""

import dataclasses

import numpy as np

from .base import FlatModel, dense_init, evaluate_in_chunks, xent_in_place

__all__ = ["CNN"]

_EVAL_ROWS = 128  # rows per forward pass in evaluate/logits: bounds the im2col buffers


def _windows(xp, a, k):
    """Every k x k window of the NHWC array ``a``, as a view of shape (n, H', W', k, k, C)."""
    n, hp, wp, c = a.shape
    sn, sh, sw, sc = a.strides
    return xp.lib.stride_tricks.as_strided(a, (n, hp - k + 1, wp - k + 1, k, k, c), (sn, sh, sw, sh, sw, sc))


@dataclasses.dataclass
class _Block:
    """One conv block's buffers for one batch size (NHWC; ``out`` may be a view into the next block's input)."""

    xpad: object  # (n, H + 2p, W + 2p, C): the input, zero-padded; the border is never written
    cols: object  # (n, H, W, k, k, C): im2col of xpad
    z: object  # (n, H, W, F): the convolution
    m1: object  # (n, Ho, W, F): max over pairs of rows
    c1: object  # bool, like m1: the lower row won
    c2: object  # bool (n, Ho, Wo, F): the right column won
    out: object  # (n, Ho, Wo, F): relu(pool(z) + bias)
    grad: object = None  # _BlockGrad, made on the first loss_and_grad at this batch size


@dataclasses.dataclass
class _BlockGrad:
    """One conv block's backward buffers for one batch size."""

    mask: object  # bool, like out: out > 0
    gm1: object  # like m1; a column the pool dropped stays zero
    gz: object  # like z; rows and columns a 2x2 pool drops stay zero
    gzpad: object = None  # (n, H + 2p, W + 2p, F): gz zero-padded (not for the first block)
    tcols: object = None  # (n, H, W, k, k, F): im2col of gzpad
    wflip: object = None  # (k, k, F, C): the kernel flipped and transposed
    dx: object = None  # (n, H, W, C): the gradient with respect to the block's input


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

        # (in_channels, height, width, out_channels) at each block's input.
        self._geometry = []
        c, h, w = input_shape
        for i, f in enumerate(channels):
            if h < 2 or w < 2:
                raise ValueError(f"images of {input_shape[1]}x{input_shape[2]} are too small for {len(channels)} "
                                 f"conv blocks: each 2x2 max-pool halves them, and block {i + 1} would get {h}x{w}")
            self._geometry.append((c, h, w, f))
            c, h, w = f, h // 2, w // 2
        self.dense_sizes = (c * h * w, *hidden, num_classes)

        rng = np.random.default_rng(seed)
        host = {}
        for i, (c, _, _, f) in enumerate(self._geometry):
            # He init: every conv feeds a ReLU (through the pool, which keeps the scale of the maxima).
            std = np.sqrt(2.0 / (kernel * kernel * c))
            host[f"conv{i + 1}.weight"] = rng.standard_normal((kernel, kernel, c, f)) * std
            host[f"conv{i + 1}.bias"] = np.zeros(f)
        self._init_from_host(dense_init(rng, self.dense_sizes, host), xp, self.dtype)
        self._buffers = {}

    def __repr__(self):
        return (f"CNN(input_shape={self.input_shape}, channels={self.channels}, kernel={self.kernel}, "
                f"hidden={self.hidden}, num_classes={self.num_classes}, dtype={self.dtype.name}, "
                f"xp={self.xp.__name__})")

    # --- buffers --------------------------------------------------------------

    def _buffers_for(self, n, backward=False):
        # Kept per batch size: the last batch of an epoch and the evaluation
        # chunks differ, so keep a few sizes rather than reallocating every step.
        bufs = self._buffers.get(n)
        if bufs is None:
            if len(self._buffers) >= 4:
                self._buffers.clear()
            bufs = self._buffers[n] = self._forward_buffers(n)
        if backward and bufs["dflat"] is None:
            self._add_backward_buffers(n, bufs)
        return bufs

    def _forward_buffers(self, n):
        xp, dt, k = self.xp, self.dtype, self.kernel
        p = k // 2
        blocks = []
        for c, h, w, f in self._geometry:
            blocks.append(_Block(
                xpad=xp.zeros((n, h + 2 * p, w + 2 * p, c), dtype=dt),
                cols=xp.empty((n, h, w, k, k, c), dtype=dt),
                z=xp.empty((n, h, w, f), dtype=dt),
                m1=xp.empty((n, h // 2, w, f), dtype=dt),
                c1=xp.empty((n, h // 2, w, f), dtype=bool),
                c2=xp.empty((n, h // 2, w // 2, f), dtype=bool),
                out=None))
        for block, after in zip(blocks, blocks[1:]):
            # A block writes its output straight into the interior of the next block's padded input.
            _, hp, wp, _ = after.xpad.shape
            block.out = after.xpad[:, p:hp - p, p:wp - p, :]
        _, h, w, f = self._geometry[-1]
        blocks[-1].out = xp.empty((n, h // 2, w // 2, f), dtype=dt)
        acts = [xp.empty((n, width), dtype=dt) for width in self.dense_sizes[1:]]
        return {"blocks": blocks, "acts": acts, "rows": xp.arange(n), "deltas": None, "dflat": None}

    def _add_backward_buffers(self, n, bufs):
        xp, dt, k = self.xp, self.dtype, self.kernel
        p = k // 2
        for i, (block, (c, h, w, f)) in enumerate(zip(bufs["blocks"], self._geometry)):
            grad = _BlockGrad(mask=xp.empty(block.out.shape, dtype=bool), gm1=xp.zeros_like(block.m1),
                              gz=xp.zeros_like(block.z))
            if i > 0:  # the first block needs no gradient with respect to the images
                grad.gzpad = xp.zeros((n, h + 2 * p, w + 2 * p, f), dtype=dt)
                grad.tcols = xp.empty((n, h, w, k, k, f), dtype=dt)
                grad.wflip = xp.empty((k, k, f, c), dtype=dt)
                grad.dx = xp.empty((n, h, w, c), dtype=dt)
            block.grad = grad
        bufs["deltas"] = [xp.empty((n, width), dtype=dt) for width in self.dense_sizes[1:-1]]
        bufs["dflat"] = xp.empty((n, self.dense_sizes[0]), dtype=dt)

    # --- checks -----------------------------------------------------------------

    def _check(self, x, y=None):
        xp = self.xp
        c, h, w = self.input_shape
        x = xp.asarray(x, dtype=self.dtype)
        if x.ndim == 2 and x.shape[1] == c * h * w or x.ndim == 3 and c == 1 and x.shape[1:] == (h, w):
            x = x.reshape(x.shape[0], c, h, w)
        elif not (x.ndim == 4 and x.shape[1:] == (c, h, w)):
            alone = f", (rows, {h}, {w})" if c == 1 else ""
            raise ValueError(f"x must have shape (rows, {c * h * w}){alone} or (rows, {c}, {h}, {w}), "
                             f"got {tuple(x.shape)}")
        if y is None:
            return x
        y = xp.asarray(y)
        if y.shape != (x.shape[0],):
            raise ValueError(f"y must have shape ({x.shape[0]},) to match x, got {tuple(y.shape)}")
        if y.dtype.kind not in "iu":
            raise ValueError(f"y must hold integer class labels, got dtype {y.dtype}")
        return x, y

    # --- forward ----------------------------------------------------------------

    def _forward(self, x, bufs):
        """The logits of ``x`` (rows, C, H, W), in ``bufs["acts"][-1]``."""
        xp, k = self.xp, self.kernel
        p = k // 2
        blocks = bufs["blocks"]
        _, h, w = self.input_shape
        blocks[0].xpad[:, p:p + h, p:p + w, :] = x.transpose(0, 2, 3, 1)
        for i, b in enumerate(blocks):
            weight, bias = self.params[f"conv{i + 1}.weight"], self.params[f"conv{i + 1}.bias"]
            f = weight.shape[3]
            rows = b.z.size // f
            b.cols[...] = _windows(xp, b.xpad, k)  # im2col: one strided copy
            xp.matmul(b.cols.reshape(rows, -1), weight.reshape(-1, f), out=b.z.reshape(rows, f))
            _max_pool(xp, b)
            b.out += bias
            xp.maximum(b.out, 0, out=b.out)
        h = blocks[-1].out.reshape(x.shape[0], -1)
        acts = bufs["acts"]
        last = len(acts) - 1
        for i, z in enumerate(acts):
            xp.matmul(h, self.params[f"fc{i + 1}.weight"], out=z)
            z += self.params[f"fc{i + 1}.bias"]
            if i < last:
                xp.maximum(z, 0, out=z)  # ReLU in place; z > 0 is also its derivative mask
            h = z
        return h

    def logits(self, x):
        """Return the logits for ``x`` as a new array (safe to keep)."""
        x = self._check(x)
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
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        x, y = self._check(x, y)

        def logits_and_rows(xb):
            bufs = self._buffers_for(xb.shape[0])
            return self._forward(xb, bufs), bufs["rows"]

        return evaluate_in_chunks(self.xp, x, y, min(batch_size, _EVAL_ROWS), logits_and_rows)

    # --- backward ---------------------------------------------------------------

    def loss_and_grad(self, x, y, on_grad=None):
        """Return ``(loss, grads, correct)`` for one batch; see :class:`ringtrain.models.Model`.

        ``grads`` holds this model's reused buffers (see the class docstring).
        With CuPy, ``on_grad`` receives ``grad`` while its kernel may still be
        queued: synchronise (``backend.synchronize``) before giving it to MPI.
        """
        xp = self.xp
        x, y = self._check(x, y)
        n = x.shape[0]
        if n == 0:
            raise ValueError("cannot take the loss of an empty batch (0 rows)")
        bufs = self._buffers_for(n, backward=True)
        logits = self._forward(x, bufs)
        loss_sum, correct = xent_in_place(xp, logits, y, bufs["rows"], grad_scale=1.0 / n)
        g = logits  # now d(mean loss)/d(logits)
        acts, deltas = bufs["acts"], bufs["deltas"]
        flat = bufs["blocks"][-1].out.reshape(n, -1)
        for i in range(len(acts) - 1, -1, -1):
            w = self.params[f"fc{i + 1}.weight"]
            h = acts[i - 1] if i > 0 else flat
            gw, gb = self.grads[f"fc{i + 1}.weight"], self.grads[f"fc{i + 1}.bias"]
            xp.sum(g, axis=0, out=gb)
            xp.matmul(h.T, g, out=gw)
            if on_grad is not None:
                on_grad(f"fc{i + 1}.bias", gb)
                on_grad(f"fc{i + 1}.weight", gw)
            d = deltas[i - 1] if i > 0 else bufs["dflat"]
            xp.matmul(g, w.T, out=d)
            if i > 0:
                d *= h > 0
            g = d
        g = g.reshape(bufs["blocks"][-1].out.shape)  # the ReLU mask is applied in the block
        for i in range(len(self._geometry) - 1, -1, -1):
            g = self._block_backward(i, bufs["blocks"][i], g, on_grad)
        return float(loss_sum) / n, self.grads, int(correct)

    def _block_backward(self, i, b, g, on_grad):
        """Backward through block ``i`` given ``g`` = d(loss)/d(out) (overwritten); returns d(loss)/d(input)."""
        xp, k = self.xp, self.kernel
        p = k // 2
        gr = b.grad
        weight = self.params[f"conv{i + 1}.weight"]
        gw, gb = self.grads[f"conv{i + 1}.weight"], self.grads[f"conv{i + 1}.bias"]
        f = weight.shape[3]
        rows = b.z.size // f
        xp.greater(b.out, 0, out=gr.mask)
        g *= gr.mask  # ReLU: out > 0 exactly where its input was
        xp.sum(g, axis=(0, 1, 2), out=gb)
        _max_unpool(xp, b, g)
        xp.matmul(b.cols.reshape(rows, -1).T, gr.gz.reshape(rows, f), out=gw.reshape(-1, f))
        if on_grad is not None:
            on_grad(f"conv{i + 1}.bias", gb)
            on_grad(f"conv{i + 1}.weight", gw)
        if i == 0:
            return None
        _, hp, wp, _ = gr.gzpad.shape
        gr.gzpad[:, p:hp - p, p:wp - p, :] = gr.gz
        gr.tcols[...] = _windows(xp, gr.gzpad, k)
        gr.wflip[...] = weight[::-1, ::-1].transpose(0, 1, 3, 2)
        c = weight.shape[2]
        xp.matmul(gr.tcols.reshape(rows, -1), gr.wflip.reshape(-1, c), out=gr.dx.reshape(rows, c))
        return gr.dx


def _max_pool(xp, b):
    """2x2 max-pool of ``b.z`` into ``b.out``, recording which element of each window won.

    Rows first: a pair of rows is a run of width x channels contiguous
    elements, so the larger pass goes at memory speed; then column pairs.
    A tie goes to the top row, then to the left column.
    """
    h2, w2 = 2 * b.m1.shape[1], 2 * b.out.shape[2]
    top, bottom = b.z[:, 0:h2:2], b.z[:, 1:h2:2]
    xp.greater(bottom, top, out=b.c1)
    xp.maximum(top, bottom, out=b.m1)
    left, right = b.m1[:, :, 0:w2:2], b.m1[:, :, 1:w2:2]
    xp.greater(right, left, out=b.c2)
    xp.maximum(left, right, out=b.out)


def _max_unpool(xp, b, g):
    """Route ``g`` (like ``b.out``) to the element of each window that won, into ``b.grad.gz``.

    A row or column the pool dropped (odd sizes) is never written, so it
    keeps the zero it was allocated with.
    """
    gm1, gz = b.grad.gm1, b.grad.gz
    h2, w2 = 2 * gm1.shape[1], 2 * g.shape[2]
    # Subtracting what went to the winner leaves exactly g or 0 for the other: no second mask.
    xp.multiply(g, b.c2, out=gm1[:, :, 1:w2:2])
    xp.subtract(g, gm1[:, :, 1:w2:2], out=gm1[:, :, 0:w2:2])
    xp.multiply(gm1, b.c1, out=gz[:, 1:h2:2])
    xp.subtract(gm1, gz[:, 1:h2:2], out=gz[:, 0:h2:2])
