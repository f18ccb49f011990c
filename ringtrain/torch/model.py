"""Any PyTorch module through the trainer: :class:`TorchModel` adapts an ``nn.Module`` and a loss.

``ringtrain.train(config, model=TorchModel(module))`` trains the module with
everything the built-in models get: sharded data, the sharded optimizer step
over the shared-memory window (or the overlapped allreduce), rank-0
checkpoints with bitwise-exact resume, the watchdog, the timeline, metrics.

How: the adapter is a :class:`ringtrain.models.FlatModel`. The module's
trainable parameters and their ``.grad`` tensors become views of two flat
arrays, ``param_buffer`` and ``grad_buffer`` (NumPy on the CPU; CuPy through
DLPack for CUDA tensors), so

* backward accumulates every gradient straight into ``grad_buffer`` (a
  defined ``.grad`` is added to in place, as DDP's ``gradient_as_bucket_view``
  relies on), and the trainer's collectives reduce it where it lies;
* ringtrain's optimizer updates ``param_buffer`` in place, which IS the
  module's weights: there is no torch optimizer and no copy back;
* :meth:`TorchModel.rebind` moves both buffers into the memory the sharded
  step hands it (its shared-memory window) by re-pointing every parameter's
  ``.data`` and ``.grad`` at the new arrays (``torch.from_numpy``);
* a :class:`GradientFeed` overlaps the trainer's bucketed reduction with
  backward: a hook after each parameter's gradient accumulation marks it
  ready, and the feed hands gradients to the trainer strictly in the order it
  was given (the reverse of the parameters': backward's usual order), each as
  soon as it and every one before it are ready, so the buckets fill and start
  in the same order on every rank. What backward never reached is handed
  over when it ends.

The contract for the module (checked at construction where it can be):

* ``module(x)`` maps a float batch ``(rows, *input_shape)`` to class scores
  ``(rows, classes)``; the trainer hands flat rows, so give ``input_shape``
  (``Shard.image_shape`` for image datasets) or reshape inside the module;
* every trainable parameter has one dtype and one device; frozen ones
  (``requires_grad=False``) are left alone, so build them alike on every rank;
* no persistent buffers (BatchNorm's running statistics): they would be
  neither averaged nor checkpointed, so replicas would drift and a resumed
  run would differ. Use GroupNorm or LayerNorm;
* ``loss(scores, labels)`` returns the batch MEAN (PyTorch's default
  reduction); the default is ``torch.nn.functional.cross_entropy``;
* layers that draw random numbers (dropout) draw from torch's own
  generator, which checkpoints do not hold: such a run resumes correctly
  but not bitwise.

torch is imported only when a :class:`TorchModel` is built; ``import
ringtrain`` never needs it.

Example::

    module = torch.nn.Sequential(torch.nn.Conv2d(1, 16, 5, padding=2), ...)
    model = TorchModel(module, input_shape=data.image_shape)
    result = ringtrain.train(ringtrain.TrainConfig(dataset="mnist5k"), model=model)
"""

import contextlib
import functools
import math

import numpy as np

from .. import backend
from .interop import as_array, as_tensor
from ..models.base import FlatModel

__all__ = ["TorchModel", "GradientFeed"]


class TorchModel(FlatModel):
    """A ``torch.nn.Module`` and a loss, seen by the trainer as a flat-buffer model.

    Args:
        module: the network; its trainable parameters are moved (not
            copied: same tensors, new storage) into the flat buffers.
        loss: ``loss(scores, labels) -> scalar mean``; default cross-entropy.
        input_shape: the shape of one input row, e.g. ``(1, 28, 28)``; the
            trainer's flat rows are reshaped to ``(rows, *input_shape)``.
            None hands the rows to the module as they are.

    Attributes:
        module: the same module, trained in place.
        params, grads: name -> array view (the names are ``named_parameters()``'s).

    Raises:
        ValueError: for a module without trainable parameters, with several
            dtypes or devices, with persistent buffers, or an ``input_shape``
            of no positive sizes.
    """

    def __init__(self, module, loss=None, *, input_shape=None):
        import torch

        self._torch = torch
        named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("the module has no parameters that require gradients")
        dtypes = sorted({str(p.dtype) for _, p in named})
        devices = sorted({str(p.device) for _, p in named})
        if len(dtypes) > 1 or len(devices) > 1:
            raise ValueError(f"TorchModel needs every trainable parameter on one device with one dtype, got "
                             f"{', '.join(devices)} and {', '.join(dtypes)}")
        every_name = {name for name, _ in module.named_parameters(remove_duplicate=False)}  # tied ones too
        buffers = [name for name in module.state_dict(keep_vars=True) if name not in every_name]
        if buffers:
            raise ValueError(f"module buffer {buffers[0]!r} would be neither averaged across ranks nor checkpointed "
                             "(BatchNorm's running statistics are such buffers); use GroupNorm or LayerNorm, or "
                             "register it with persistent=False if it is a constant")
        if input_shape is not None:
            input_shape = tuple(int(s) for s in input_shape)
            if not input_shape or min(input_shape) < 1:
                raise ValueError(f"input_shape must be positive sizes, got {input_shape}")
        self.module, self.input_shape = module, input_shape
        self.loss = loss if loss is not None else torch.nn.functional.cross_entropy
        self._default_loss = loss is None
        first = named[0][1]
        self.device = first.device
        self.xp = np if first.device.type == "cpu" else _cupy_for(first.device)
        self.dtype = torch.empty(0, dtype=first.dtype).numpy().dtype
        self._init_flat({name: tuple(p.shape) for name, p in named}, self.xp, self.dtype)
        self._tensors = dict(named)
        with torch.no_grad():
            for name, p in named:
                self.params[name][...] = as_array(p.detach())
        self._bind()
        # Backward delivers gradients in the reverse of params (the flat layout's order), one run at a time.
        self._feed = GradientFeed([(name, self._tensors[name]) for name in reversed(self.params)],
                                  lambda name: self.grads[name], self._synchronize)

    def __repr__(self):
        shape = f", input_shape={self.input_shape}" if self.input_shape else ""
        return (f"TorchModel({type(self.module).__name__}, {self.param_buffer.size:,} parameters, "
                f"{self.dtype.name} on {self.device}{shape})")

    # -- the flat buffers -------------------------------------------------------
    def _bind(self):
        """Make every trainable parameter and its ``.grad`` the views of ``params``/``grads``."""
        for name, p in self._tensors.items():
            p.data = as_tensor(self.params[name])
            p.grad = as_tensor(self.grads[name])

    def rebind(self, param_buffer, grad_buffer):
        """Move parameters and gradients into the flat arrays given; the module follows (see FlatModel)."""
        super().rebind(param_buffer, grad_buffer)
        self._bind()

    # -- the model protocol -----------------------------------------------------
    def _batch(self, x, y=None):
        """Torch views of a batch: ``x`` cast to the parameters' dtype and shaped, ``y`` as int64 labels."""
        xp = self.xp
        x = xp.ascontiguousarray(xp.asarray(x, dtype=self.dtype))
        if self.input_shape is not None:
            if x.ndim != 2 or x.shape[1] != math.prod(self.input_shape):
                raise ValueError(f"x must have shape (rows, {math.prod(self.input_shape)}) for input_shape "
                                 f"{self.input_shape}, got {tuple(x.shape)}")
            x = x.reshape(x.shape[0], *self.input_shape)
        if y is None:
            return as_tensor(x), None
        y = xp.asarray(y)
        if y.shape != (x.shape[0],) or y.dtype.kind not in "iu":
            raise ValueError(f"y must hold {x.shape[0]} integer class labels, got {y.dtype} {tuple(y.shape)}")
        return as_tensor(x), as_tensor(xp.ascontiguousarray(y, dtype=np.int64))

    def loss_and_grad(self, x, y, on_grad=None):
        """Return ``(mean loss: float, grads, correct: int)``; ``grads`` is :attr:`grads` (reused buffers).

        ``on_grad(name, grad)`` is called for each gradient in the reverse
        order of :attr:`params` as soon as it and every later layer's are
        final (a hook after each gradient's accumulation), so the trainer
        reduces buckets while backward goes on. A parameter that took no part
        in this batch's forward gets a zero gradient, delivered after backward.
        """
        xt, yt = self._batch(x, y)
        if xt.shape[0] == 0:
            raise ValueError("cannot take the loss of an empty batch (0 rows)")
        # Backward ADDS into a defined .grad in place: start from zero, keep the views.
        self.grad_buffer.fill(0)
        self.module.train()
        with self._feed.delivering(on_grad):
            scores = self.module(xt)
            loss = self.loss(scores, yt)
            if loss.ndim != 0:
                raise ValueError(f"the loss must be a scalar (the batch mean), got shape {tuple(loss.shape)}")
            loss.backward()
        self._synchronize()
        correct = int((scores.detach().argmax(dim=1) == yt).sum())
        return float(loss.detach()), self.grads, correct

    def _synchronize(self):
        if self.device.type == "cuda":
            self._torch.cuda.current_stream(self.device).synchronize()

    def logits(self, x):
        """Return the class scores for ``x`` as a new array of the buffers' module (safe to keep)."""
        xt, _ = self._batch(x)
        self.module.eval()
        with self._torch.no_grad():
            return self.xp.array(as_array(self.module(xt)), copy=True)

    def evaluate(self, x, y, batch_size=1024):
        """Return ``(loss_sum: float, correct: int)`` summed over the rows of ``x`` (module in eval mode)."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        torch = self._torch
        self.module.eval()
        loss_sum, correct = 0.0, 0
        with torch.no_grad():
            for start in range(0, len(x), batch_size):
                xt, yt = self._batch(x[start:start + batch_size], y[start:start + batch_size])
                scores = self.module(xt)
                if self._default_loss:
                    loss_sum += float(torch.nn.functional.cross_entropy(scores, yt, reduction="sum"))
                else:  # a mean, by the contract
                    loss_sum += float(self.loss(scores, yt)) * len(yt)
                correct += int((scores.argmax(dim=1) == yt).sum())
        return loss_sum, correct


def _cupy_for(device):
    """CuPy, checked to be on the torch tensors' GPU (the buffers are CuPy's allocations)."""
    if device.type != "cuda":
        raise ValueError(f"TorchModel takes CPU or CUDA tensors, got {device}")
    xp = backend.xp_for("gpu")
    current = xp.cuda.Device().id
    if device.index is not None and device.index != current:
        raise ValueError(f"the module is on {device} but CuPy's current device is cuda:{current}; "
                         "call ringtrain.backend.use_device first, or move the module")
    return xp


class GradientFeed:
    """Deliver ``(name, gradient)`` pairs in order while backward runs.

    Args:
        named: ``[(name, parameter)]`` in delivery order; a hook is registered on each.
        gradient: ``gradient(name)``, the array handed to the consumer.
        synchronize: called before each delivery (a GPU's queued kernels must
            finish before the consumer, MPI or a peer reads the memory).
    """

    def __init__(self, named, gradient, synchronize):
        self.names = [name for name, _ in named]
        self.gradient, self.synchronize = gradient, synchronize
        self._consumer, self._ready, self._delivered = None, [False] * len(self.names), 0
        for i, (_, p) in enumerate(named):
            p.register_post_accumulate_grad_hook(functools.partial(self._grad_ready, i))

    @contextlib.contextmanager
    def delivering(self, consumer):
        """Deliver to ``consumer(name, grad)`` during the block (None: deliver nothing); the rest at its end."""
        self._consumer, self._delivered = consumer, 0
        self._ready = [False] * len(self.names)
        try:
            yield
            if consumer is not None:
                self._flush(len(self.names))
        finally:
            self._consumer = None

    def _grad_ready(self, i, _param):
        # Runs inside backward, once the gradient has been added to .grad.
        if self._consumer is None:
            return
        self._ready[i] = True
        count = self._delivered
        while count < len(self._ready) and self._ready[count]:
            count += 1
        self._flush(count)

    def _flush(self, count):
        """Deliver gradients ``[delivered, count)``."""
        if count <= self._delivered:
            return
        self.synchronize()
        for name in self.names[self._delivered:count]:
            self._consumer(name, self.gradient(name))
        self._delivered = count
