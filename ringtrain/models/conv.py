"""Conv blocks for the CNN: im2col windows, 2x2 max-pooling, and :class:`ConvBlock`.

A block is conv ('same' padding, stride 1) -> 2x2 max-pool -> bias -> ReLU,
computed as follows, and why:

* Activations are NHWC (channels last). A convolution is then one matrix
  product: im2col copies every k x k window of the zero-padded input into a
  ``(rows * H * W, k * k * C)`` matrix (one strided copy, no Python loop over
  pixels), and ``cols @ W`` gives the output already in NHWC order. Weights
  are stored HWIO, ``(k, k, in, out)``, so ``W.reshape(-1, out)`` is the
  matrix with no copy, as the dense layers store ``(fan_in, fan_out)``.
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
"""

import functools

import numpy as np

__all__ = ["ConvBlock", "conv_geometry", "conv_init", "check_images", "windows", "max_pool", "max_unpool"]


def windows(xp, a, k):
    """Every k x k window of the NHWC array ``a``, as a view of shape (n, H', W', k, k, C)."""
    n, hp, wp, c = a.shape
    sn, sh, sw, sc = a.strides
    return xp.lib.stride_tricks.as_strided(a, (n, hp - k + 1, wp - k + 1, k, k, c), (sn, sh, sw, sh, sw, sc))


def conv_geometry(input_shape, channels):
    """``(in_channels, height, width, out_channels)`` at each block's input, and the last block's output ``(c, h, w)``.

    Raises:
        ValueError: when a 2x2 pool would get an image smaller than 2x2.
    """
    geometry = []
    c, h, w = input_shape
    for i, f in enumerate(channels):
        if h < 2 or w < 2:
            raise ValueError(f"images of {input_shape[1]}x{input_shape[2]} are too small for {len(channels)} "
                             f"conv blocks: each 2x2 max-pool halves them, and block {i + 1} would get {h}x{w}")
        geometry.append((c, h, w, f))
        c, h, w = f, h // 2, w // 2
    return geometry, (c, h, w)


def conv_init(rng, geometry, kernel, host):
    """Add ``conv1`` ... weights (HWIO) and zero biases for ``geometry`` to ``host``, drawn from ``rng``."""
    for i, (c, _, _, f) in enumerate(geometry):
        # He init: every conv feeds a ReLU (through the pool, which keeps the scale of the maxima).
        std = np.sqrt(2.0 / (kernel * kernel * c))
        host[f"conv{i + 1}.weight"] = rng.standard_normal((kernel, kernel, c, f)) * std
        host[f"conv{i + 1}.bias"] = np.zeros(f)
    return host


def check_images(xp, x, input_shape, dtype):
    """``x`` as ``(rows, C, H, W)`` of ``dtype``, from flat rows, NCHW, or NHW when C is 1; ValueError otherwise."""
    c, h, w = input_shape
    x = xp.asarray(x, dtype=dtype)
    if x.ndim == 2 and x.shape[1] == c * h * w or x.ndim == 3 and c == 1 and x.shape[1:] == (h, w):
        return x.reshape(x.shape[0], c, h, w)
    if not (x.ndim == 4 and x.shape[1:] == (c, h, w)):
        alone = f", (rows, {h}, {w})" if c == 1 else ""
        raise ValueError(f"x must have shape (rows, {c * h * w}){alone} or (rows, {c}, {h}, {w}), "
                         f"got {tuple(x.shape)}")
    return x


class ConvBlock:
    """One conv -> 2x2 max-pool -> bias -> ReLU block at one batch size: its buffers, forward and backward.

    Args:
        xp: array module (NumPy or CuPy).
        rows: the batch size these buffers are for.
        geometry: ``(in_channels, height, width, out_channels)`` at the input.
        kernel: odd kernel size.
        dtype: float32 or float64.
        out: where the block writes its output, ``(rows, H // 2, W // 2, F)``;
            a view of the next block's padded input, so the output needs no
            copy there. By default a buffer of its own.
        needs_input_grad: whether :meth:`input_grad` will be called, so its
            buffers are made (not for the first block: the images need no gradient).
    """

    def __init__(self, xp, rows, geometry, kernel, dtype, out=None, needs_input_grad=True):
        c, h, w, f = geometry
        p = kernel // 2
        self.xp, self.kernel, self.dtype, self.needs_input_grad = xp, kernel, dtype, needs_input_grad
        self.xpad = xp.zeros((rows, h + 2 * p, w + 2 * p, c), dtype=dtype)  # the border is never written
        self.cols = xp.empty((rows, h, w, kernel, kernel, c), dtype=dtype)  # im2col of xpad
        self.z = xp.empty((rows, h, w, f), dtype=dtype)  # the convolution
        self.m1 = xp.empty((rows, h // 2, w, f), dtype=dtype)  # max over pairs of rows
        self.c1 = xp.empty((rows, h // 2, w, f), dtype=bool)  # the lower row won
        self.c2 = xp.empty((rows, h // 2, w // 2, f), dtype=bool)  # the right column won
        self.out = xp.empty((rows, h // 2, w // 2, f), dtype=dtype) if out is None else out
        self.mask = None  # the backward buffers, made on the first backward

    @property
    def input(self):
        """The interior of the padded input: where the previous block (or the images) go."""
        return _interior(self.xpad, self.kernel // 2)

    def forward(self, weight, bias):
        """``out = relu(pool(conv(input, weight)) + bias)``, recording the pool's winners."""
        xp, f = self.xp, weight.shape[3]
        rows = self.z.size // f
        self.cols[...] = windows(xp, self.xpad, self.kernel)  # im2col: one strided copy
        xp.matmul(self.cols.reshape(rows, -1), weight.reshape(-1, f), out=self.z.reshape(rows, f))
        max_pool(xp, self.z, self.m1, self.c1, self.c2, self.out)
        self.out += bias
        xp.maximum(self.out, 0, out=self.out)

    def weight_grads(self, g, gw, gb):
        """Write the weight and bias gradients given ``g`` = d(loss)/d(out), which is overwritten."""
        xp, f = self.xp, gw.shape[3]
        rows = self.z.size // f
        if self.mask is None:
            self._add_backward_buffers()
        xp.greater(self.out, 0, out=self.mask)
        g *= self.mask  # ReLU: out > 0 exactly where its input was
        xp.sum(g, axis=(0, 1, 2), out=gb)
        max_unpool(xp, g, self.c1, self.c2, self.gm1, self.gz)
        xp.matmul(self.cols.reshape(rows, -1).T, self.gz.reshape(rows, f), out=gw.reshape(-1, f))

    def input_grad(self, weight):
        """d(loss)/d(input), after :meth:`weight_grads`: the transposed convolution (im2col, flipped kernel)."""
        xp, c, f = self.xp, weight.shape[2], weight.shape[3]
        rows = self.z.size // f
        _interior(self.gzpad, self.kernel // 2)[...] = self.gz
        self.tcols[...] = windows(xp, self.gzpad, self.kernel)
        self.wflip[...] = weight[::-1, ::-1].transpose(0, 1, 3, 2)
        xp.matmul(self.tcols.reshape(rows, -1), self.wflip.reshape(-1, c), out=self.dx.reshape(rows, c))
        return self.dx

    def _add_backward_buffers(self):
        xp, dt, k = self.xp, self.dtype, self.kernel
        rows, h, w, f = self.z.shape
        c = self.xpad.shape[3]
        self.mask = xp.empty(self.out.shape, dtype=bool)  # out > 0
        self.gm1 = xp.zeros_like(self.m1)  # a column the pool dropped stays zero
        self.gz = xp.zeros_like(self.z)  # rows and columns a 2x2 pool drops stay zero
        if self.needs_input_grad:
            self.gzpad = xp.zeros((rows, h + 2 * (k // 2), w + 2 * (k // 2), f), dtype=dt)  # gz zero-padded
            self.tcols = xp.empty((rows, h, w, k, k, f), dtype=dt)  # im2col of gzpad
            self.wflip = xp.empty((k, k, f, c), dtype=dt)  # the kernel flipped and transposed
            self.dx = xp.empty((rows, h, w, c), dtype=dt)


def _interior(padded, p):
    _, hp, wp, _ = padded.shape
    return padded[:, p:hp - p, p:wp - p, :]


def max_pool(xp, z, m1, c1, c2, out):
    """2x2 max-pool of ``z`` into ``out``, recording which element of each window won in ``c1``, ``c2``.

    Rows first (into ``m1``): a pair of rows is a run of width x channels
    contiguous elements, so the larger pass goes at memory speed; then column
    pairs. A tie goes to the top row, then to the left column.
    """
    h2, w2 = 2 * m1.shape[1], 2 * out.shape[2]
    top, bottom = z[:, 0:h2:2], z[:, 1:h2:2]
    xp.greater(bottom, top, out=c1)
    xp.maximum(top, bottom, out=m1)
    left, right = m1[:, :, 0:w2:2], m1[:, :, 1:w2:2]
    xp.greater(right, left, out=c2)
    xp.maximum(left, right, out=out)


def max_unpool(xp, g, c1, c2, gm1, gz):
    """Route ``g`` (like the pool's output) to the element of each window that won, into ``gz``.

    A row or column the pool dropped (odd sizes) is never written, so it
    keeps the zero it was allocated with.
    """
    h2, w2 = 2 * gm1.shape[1], 2 * g.shape[2]
    _split(xp, g, c2, gm1[:, :, 1:w2:2], gm1[:, :, 0:w2:2])  # columns: the right one won where c2
    _split(xp, gm1, c1, gz[:, 1:h2:2], gz[:, 0:h2:2])  # rows: the lower one won where c1


def _split(xp, g, won, winner, loser):
    """``winner = g * won``, ``loser = g - winner``: the gradient of a max over pairs, for each of the pair.

    Subtracting what went to the winner leaves exactly g or 0 for the other:
    no second mask.
    """
    kernel = _split_kernel(xp)
    if kernel is not None:
        kernel(g, won, winner, loser)
        return
    xp.multiply(g, won, out=winner)
    xp.subtract(g, winner, out=loser)


@functools.cache
def _split_kernel(xp):
    """On CuPy, :func:`_split` as one kernel; None on NumPy.

    ``winner`` and ``loser`` are interleaved views of one array, and a CuPy
    ufunc first copies any input whose memory bounds overlap its output (a
    fresh allocation and a copy, twice per block per step). An
    ElementwiseKernel copies nothing and writes both in one pass. The bits are
    the ufuncs': ``won`` is 0 or 1, so ``g * won`` is exact, and ``g - winner``
    rounds the same whether or not the compiler fuses it into a multiply-add.
    """
    make = getattr(xp, "ElementwiseKernel", None)
    if make is None:
        return None
    return make("T g, bool won", "T winner, T loser", "winner = g * (T)won; loser = g - winner;",
                "ringtrain_max_unpool_split")
