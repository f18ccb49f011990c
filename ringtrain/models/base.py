"""The model protocol: what the trainer asks of a model, and the flat-buffer tier a model opts into.

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
:class:`FlatModel` (the sharded optimizer step, in-place bucket reduction),
checked once by :func:`flat_layout`; any other model is averaged through the
plain allreduce. Arrays are whatever module the parameters live in (``xp``,
CuPy's idiom); no model module imports CuPy.
"""

from ..backend import address
from .layers import check_batch_size, softmax_cross_entropy
from .layout import FlatLayout

__all__ = ["Model", "FlatModel", "flat_layout"]


class Model:
    """The small protocol the trainer codes against (subclass it, or duck-type it).

    A subclass sets ``self.params`` and implements :meth:`loss_and_grad` and
    :meth:`logits`; :meth:`evaluate` then comes for free.
    """

    params = None  # dict[str, array], ordered; updated in place by the optimiser

    def loss_and_grad(self, x, y, on_grad=None):
        """Return ``(mean loss: float, grads: dict like params, correct: int)`` for a batch.

        Call ``on_grad(name, grad)`` for each gradient once it is final, in
        the reverse order of ``params`` (the trainer overlaps communication
        with the rest of backward). ``on_grad`` may reduce ``grad`` in place.
        """
        raise NotImplementedError

    def logits(self, x):
        """Return the unnormalised class scores, shape ``(rows, num_classes)``."""
        raise NotImplementedError

    def evaluate(self, x, y, batch_size=1024):
        """Return ``(loss_sum: float, correct: int)`` summed over the rows of ``x``.

        Sums rather than means so that the trainer can add them across ranks
        whose shards differ in size and divide once by the global count.
        """
        check_batch_size(batch_size)
        loss_sum, correct = 0.0, 0
        for start in range(0, len(x), batch_size):
            stop = start + batch_size
            chunk_loss, chunk_correct, _ = softmax_cross_entropy(self.logits(x[start:stop]), y[start:stop])
            loss_sum += chunk_loss
            correct += chunk_correct
        return loss_sum, correct


class FlatModel(Model):
    """A model whose parameters and gradients are views into one flat buffer each: the fast tier.

    The trainer's fast paths (gradients reduced a bucket at a time in place,
    the sharded optimizer step, the shared-memory window that peers read in
    place) need to know where every parameter lies. A model opts in by
    subclassing this class and calling :meth:`_init_flat` in its
    constructor; the trainer checks the layout once (:meth:`layout`) and
    every fast path uses that one answer. A model that does not opt in is
    trained all the same, through the plain allreduce (the trainer's start-up
    line says which path it took and why).

    The contract, which :meth:`layout` verifies:

    * ``params`` and ``grads`` are ordered dicts of views into
      ``param_buffer`` and ``grad_buffer`` (1-D, one dtype), with the same
      names, shapes and offsets, tiling the buffers with no gap;
    * the layout is in REVERSE order of ``params``: backward finishes the last
      layer first, so each run of gradients ``on_grad`` has delivered is one
      slice of ``grad_buffer``;
    * :meth:`loss_and_grad` writes the gradients into those views and returns
      ``self.grads`` (the same objects every call);
    * :meth:`rebind` moves both buffers elsewhere, keeping the layout (the
      sharded step moves them into memory the other ranks on the host can read).
    """

    param_buffer = None
    grad_buffer = None
    grads = None
    _layout = None

    def _init_from_host(self, host, xp, dtype):
        """Lay out the flat buffers for ``host`` (name -> float64 NumPy array) and copy the values in.

        Drawn on the host in float64, then cast and moved, so CPU and GPU
        runs start identical.
        """
        self._init_flat({name: a.shape for name, a in host.items()}, xp, dtype)
        for name, a in host.items():
            self.params[name][...] = xp.asarray(a.astype(dtype))

    def _init_flat(self, shapes, xp, dtype):
        """Make zeroed ``param_buffer``/``grad_buffer`` and the ``params``/``grads`` views for ``shapes``."""
        self._layout = FlatLayout.from_shapes(shapes, list(reversed(shapes)))
        self.param_buffer = xp.zeros(self._layout.size, dtype=dtype)
        self.grad_buffer = xp.zeros(self._layout.size, dtype=dtype)
        self.params = self._layout.views(self.param_buffer, shapes)
        self.grads = self._layout.views(self.grad_buffer, shapes)

    def layout(self):
        """The verified :class:`~ringtrain.models.layout.FlatLayout` of the buffers.

        Raises:
            ValueError: naming the first parameter or gradient that is not
                where the layout says (a subclass that broke the contract).
        """
        layout, pbuf, gbuf = self._layout, self.param_buffer, self.grad_buffer
        if layout is None or pbuf is None or gbuf is None:
            raise ValueError(f"{type(self).__name__} is a FlatModel but never called _init_flat()")
        if pbuf.ndim != 1 or pbuf.shape != gbuf.shape or pbuf.dtype != gbuf.dtype or pbuf.size != layout.size:
            raise ValueError(f"{type(self).__name__}: param_buffer and grad_buffer must be 1-D arrays of "
                             f"{layout.size} elements of one dtype")
        if list(self.params) != list(self.grads) or sorted(self.params) != sorted(layout.order):
            raise ValueError(f"{type(self).__name__}: params and grads must name {list(reversed(layout.order))}")
        for name, (start, stop) in layout.bounds.items():
            for what, a, buf in (("parameter", self.params[name], pbuf), ("gradient", self.grads[name], gbuf)):
                offset = (address(a) - address(buf)) // buf.itemsize
                if offset != start or a.size != stop - start or a.dtype != buf.dtype or not a.flags.c_contiguous:
                    raise ValueError(f"{type(self).__name__}: {what} {name!r} is not the view of its flat "
                                     f"buffer at [{start}, {stop}); rebuild it with _init_flat() or rebind()")
        return layout

    def rebind(self, param_buffer, grad_buffer):
        """Move the parameters and gradients into the flat arrays given, keeping the layout.

        The new buffers must match :attr:`param_buffer` and :attr:`grad_buffer`
        in size and dtype; their values are copied in. The ``params`` and
        ``grads`` dicts are updated in place, so references to the dicts stay
        valid (references to the old arrays do not).
        """
        for new, old in ((param_buffer, self.param_buffer), (grad_buffer, self.grad_buffer)):
            if new.shape != old.shape or new.dtype != old.dtype:
                raise ValueError(f"rebind needs flat buffers of {old.size} {old.dtype} elements, "
                                 f"got {new.shape} {new.dtype}")
        param_buffer[...] = self.param_buffer
        grad_buffer[...] = self.grad_buffer
        shapes = {name: p.shape for name, p in self.params.items()}
        self.param_buffer, self.grad_buffer = param_buffer, grad_buffer
        self.params.update(self._layout.views(param_buffer, shapes))
        self.grads.update(self._layout.views(grad_buffer, shapes))


def flat_layout(model):
    """The verified layout of a :class:`FlatModel`; None for a model that did not opt in.

    Raises:
        ValueError: for a FlatModel whose buffers break the contract.
    """
    return model.layout() if isinstance(model, FlatModel) else None
