"""Optimisers that update parameters in place, and pure learning-rate schedules.

Written once for NumPy and CuPy: the state lives in the parameters' array
module, and every update uses in-place ufuncs (``out=``) on buffers made at
construction, so a step allocates nothing and the trainer keeps the same
parameter arrays for the whole run.

State round-trips exactly: ``opt.load_state_dict(opt.state_dict())`` into a
fresh optimiser continues bitwise as the original would, which is what makes
a resumed run equal one that went straight through.

Example::

    opt = build_optimizer("sgd", model.params, lr=0.1, momentum=0.9)
    for step in range(steps):
        loss, grads, _ = model.loss_and_grad(x, y)
        opt.step(model.params, grads, learning_rate(step, 0.1, warmup_steps=100))
"""

import math

import numpy as np

from . import backend

__all__ = [
    "Optimizer",
    "SGD",
    "Adam",
    "OPTIMIZERS",
    "SCHEDULES",
    "build_optimizer",
    "learning_rate",
    "scaled_lr",
]


class Optimizer:
    """Base class: state buffers shaped like the parameters, saved as flat NumPy dicts.

    Subclasses list their per-parameter buffers in ``self._slots`` (slot name
    -> dict name -> array) and any scalar counters in ``self._scalars``, and
    write the update once, elementwise, in :meth:`_update`.

    When every parameter has one dtype, each slot is one flat array laid out
    in ``order`` (default: the order of ``params``) and the per-name arrays
    are views into it. :meth:`step_slice` then updates any contiguous range
    of that layout, which is how a rank updates only its shard of the
    parameters (:mod:`ringtrain.training.sharded`). The update is elementwise, so a
    range updated by :meth:`step_slice` is bitwise what :meth:`step` gives.
    """

    def __init__(self, params, order=None):
        if not params:
            raise ValueError("cannot optimise an empty parameter dict")
        self.names = tuple(params)
        self.order = tuple(order) if order is not None else self.names
        if sorted(self.order) != sorted(self.names):
            raise ValueError(f"order must name each parameter once: got {list(self.order)} for {list(self.names)}")
        self.xp = backend.get_array_module(next(iter(params.values())))
        self._shapes = {name: tuple(params[name].shape) for name in self.names}
        dtypes = {params[name].dtype for name in self.names}
        self._dtype = dtypes.pop() if len(dtypes) == 1 else None
        self._slots = {}
        self._flat = {}  # slot name -> its flat array (only with one dtype)
        self._scalars = {}
        # Scratch space so a step never allocates and never overwrites the
        # caller's gradients (the trainer may still log them).
        self._tmp_flat, self._tmp = self._state_like(params)

    def _state_like(self, params):
        """Zeros shaped like ``params``: ``(flat array or None, name -> array)``."""
        if self._dtype is None:
            return None, {name: self.xp.zeros_like(params[name]) for name in self.names}
        flat = self.xp.zeros(sum(math.prod(self._shapes[n]) for n in self.order), dtype=self._dtype)
        views, offset = {}, 0
        for name in self.order:
            size = math.prod(self._shapes[name])
            views[name] = flat[offset:offset + size].reshape(self._shapes[name])
            offset += size
        return flat, {name: views[name] for name in self.names}

    def _add_slot(self, slot, params):
        self._flat[slot], self._slots[slot] = self._state_like(params)

    def _check(self, params, grads):
        if params.keys() != grads.keys() or tuple(params) != self.names:
            raise ValueError(
                f"step expects parameters and gradients named {list(self.names)}, "
                f"got {list(params)} and {list(grads)}"
            )

    def _begin(self, lr):
        """Per-step constants for :meth:`_update` (and any step counter); called once per step."""
        return None

    def _update(self, p, g, tmp, state, lr, constants):
        """Update ``p`` in place from ``g``, elementwise; ``state`` maps slot -> array like ``p``."""
        raise NotImplementedError

    def step(self, params, grads, lr):
        """Update ``params`` in place from ``grads`` with learning rate ``lr``.

        Parameters and gradients that are views of one flat buffer each, in
        ``self.order`` (a FlatModel's), are updated in one pass over the
        buffers (:meth:`step_slice`), elementwise the same arithmetic: on a
        GPU a few kernels in all instead of a few per parameter.
        """
        self._check(params, grads)
        if self._tmp_flat is not None:
            p = backend.contiguous_span([params[name] for name in self.order])
            g = backend.contiguous_span([grads[name] for name in self.order])
            if p is not None and g is not None:
                self.step_slice(p, g, lr, 0, self._tmp_flat.size)
                return
        lr = float(lr)
        constants = self._begin(lr)
        for name in self.names:
            state = {slot: arrays[name] for slot, arrays in self._slots.items()}
            self._update(params[name], grads[name], self._tmp[name], state, lr, constants)

    def step_slice(self, p, g, lr, start, stop):
        """Update elements ``[start, stop)`` of the flat layout: ``p`` and ``g`` are those elements.

        ``p`` and ``g`` are 1-D arrays of ``stop - start`` elements (slices of
        a flat parameter and gradient buffer laid out in ``self.order``). Only
        this range of the state advances; scalar counters advance as in :meth:`step`.
        """
        if self._tmp_flat is None:
            raise ValueError("step_slice needs every parameter to have the same dtype")
        if not 0 <= start <= stop <= self._tmp_flat.size or p.shape != (stop - start,) or g.shape != p.shape:
            raise ValueError(f"step_slice: range [{start}, {stop}) and arrays of shape {p.shape} and {g.shape} "
                             f"do not fit a layout of {self._tmp_flat.size} elements")
        lr = float(lr)
        constants = self._begin(lr)
        state = {slot: flat[start:stop] for slot, flat in self._flat.items()}
        self._update(p, g, self._tmp_flat[start:stop], state, lr, constants)

    @property
    def flat(self):
        """True when the state is laid out flat (every parameter has one dtype): :meth:`step_slice` works."""
        return self._tmp_flat is not None

    def flat_state(self):
        """The flat state arrays, one per slot, laid out in ``self.order`` (empty without one dtype)."""
        return list(self._flat.values()) if self._tmp_flat is not None else []

    def state_dict(self):
        """Return the state as a flat dict of NumPy arrays (copies), e.g. ``"momentum/fc1.weight"``."""
        out = {}
        for slot, arrays in self._slots.items():
            for name, a in arrays.items():
                out[f"{slot}/{name}"] = np.array(backend.to_numpy(a), copy=True)
        for key, value in self._scalars.items():
            out[key] = np.array(value, dtype=np.int64)
        return out

    def load_state_dict(self, state):
        """Restore a :meth:`state_dict` exactly, into the existing buffers.

        Raises:
            ValueError: when keys are missing or extra, or a shape or dtype differs.
        """
        expected = set(self.state_dict_keys())
        missing, extra = sorted(expected - set(state)), sorted(set(state) - expected)
        if missing or extra:
            raise ValueError(f"optimizer state does not match: missing {missing}, unexpected {extra}")
        for slot, arrays in self._slots.items():
            for name, a in arrays.items():
                key = f"{slot}/{name}"
                value = np.asarray(state[key])
                if value.shape != a.shape or value.dtype != a.dtype:
                    raise ValueError(
                        f"optimizer state {key!r} has shape {value.shape} and dtype {value.dtype}, "
                        f"expected {a.shape} and {a.dtype}"
                    )
        for slot, arrays in self._slots.items():
            for name, a in arrays.items():
                a[...] = self.xp.asarray(state[f"{slot}/{name}"])
        for key in self._scalars:
            self._scalars[key] = int(state[key])

    def state_dict_keys(self):
        """The keys :meth:`state_dict` returns, in order."""
        keys = [f"{slot}/{name}" for slot, arrays in self._slots.items() for name in arrays]
        return keys + list(self._scalars)


class SGD(Optimizer):
    """SGD with heavy-ball momentum (PyTorch's form) and L2 weight decay.

    ``g = grad + weight_decay * p``; ``buf = momentum * buf + g``;
    ``p -= lr * buf`` (or ``lr * (g + momentum * buf)`` with ``nesterov``).
    ``momentum=0`` is plain SGD and keeps no state. Weight decay here is
    coupled (added to the gradient), as in classic SGD.
    """

    def __init__(self, params, momentum=0.9, weight_decay=0.0, nesterov=False, order=None):
        super().__init__(params, order)
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        if weight_decay < 0:
            raise ValueError(f"weight_decay must be at least 0, got {weight_decay}")
        if nesterov and momentum == 0:
            raise ValueError("nesterov needs a momentum above 0")
        self.momentum, self.weight_decay, self.nesterov = float(momentum), float(weight_decay), nesterov
        if self.momentum:
            self._add_slot("momentum", params)

    def _update(self, p, g, tmp, state, lr, constants):
        xp, mu, wd, rate = self.xp, self.momentum, self.weight_decay, lr
        if wd:
            xp.multiply(p, wd, out=tmp)
            tmp += g
            g = tmp
        if mu:
            buf = state["momentum"]
            buf *= mu
            buf += g
            if self.nesterov:
                # p -= lr * (g + mu * buf), in two passes since tmp may hold g.
                xp.multiply(g, lr, out=tmp)
                p -= tmp
                g, rate = buf, lr * mu
            else:
                g = buf
        xp.multiply(g, rate, out=tmp)
        p -= tmp


class Adam(Optimizer):
    """Adam with decoupled weight decay (AdamW, Loshchilov and Hutter).

    ``p -= lr * weight_decay * p`` first, then the usual bias-corrected Adam
    step, in PyTorch's arithmetic: ``p -= (lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps)``.
    The step count is saved as ``"adam.step"``.
    """

    def __init__(self, params, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, order=None):
        super().__init__(params, order)
        b1, b2 = betas
        if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
            raise ValueError(f"betas must each be in [0, 1), got {tuple(betas)}")
        if eps <= 0:
            raise ValueError(f"eps must be above 0, got {eps}")
        if weight_decay < 0:
            raise ValueError(f"weight_decay must be at least 0, got {weight_decay}")
        self.betas, self.eps, self.weight_decay = (float(b1), float(b2)), float(eps), float(weight_decay)
        self._add_slot("adam.m", params)
        self._add_slot("adam.v", params)
        self._scalars["adam.step"] = 0

    def _begin(self, lr):
        b1, b2 = self.betas
        t = self._scalars["adam.step"] = self._scalars["adam.step"] + 1
        return lr / (1.0 - b1**t), 1.0 / math.sqrt(1.0 - b2**t)  # step size, 1 / sqrt(bias correction 2)

    def _update(self, p, g, tmp, state, lr, constants):
        xp, (b1, b2), eps, wd = self.xp, self.betas, self.eps, self.weight_decay
        step_size, inv_sqrt_bc2 = constants
        m, v = state["adam.m"], state["adam.v"]
        if wd:
            p *= 1.0 - lr * wd
        m *= b1
        xp.multiply(g, 1.0 - b1, out=tmp)
        m += tmp
        v *= b2
        xp.multiply(g, g, out=tmp)
        tmp *= 1.0 - b2
        v += tmp
        xp.sqrt(v, out=tmp)
        tmp *= inv_sqrt_bc2
        tmp += eps
        xp.divide(m, tmp, out=tmp)
        tmp *= step_size
        p -= tmp


def build_optimizer(name, params, lr, momentum=0.9, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8,
                    nesterov=False, order=None):
    """Build optimiser ``name`` ("sgd" or "adam") for ``params``.

    ``lr`` is checked here but passed to every :meth:`Optimizer.step`, since
    the schedule changes it; ``momentum`` and ``nesterov`` apply to SGD,
    ``betas`` and ``eps`` to Adam. ``order`` lays the state out flat in that
    order of names (see :class:`Optimizer`).

    Raises:
        ValueError: for an unknown name or an out-of-range setting.
    """
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; choose one of {', '.join(sorted(OPTIMIZERS))}")
    if not lr > 0:
        raise ValueError(f"learning rate must be above 0, got {lr}")
    if name == "sgd":
        return SGD(params, momentum=momentum, weight_decay=weight_decay, nesterov=nesterov, order=order)
    return Adam(params, betas=betas, eps=eps, weight_decay=weight_decay, order=order)


OPTIMIZERS = {"sgd": SGD, "adam": Adam}
SCHEDULES = ("constant", "cosine")


def learning_rate(step, base_lr, warmup_steps=0, total_steps=None, schedule="constant"):
    """The learning rate for 0-based ``step`` (the step about to be taken).

    Warmup is linear from ``base_lr / warmup_steps`` at step 0 up to
    ``base_lr`` at step ``warmup_steps - 1``: ``base_lr * (step + 1) / warmup_steps``
    (so no step runs at rate 0). Afterwards "constant" keeps ``base_lr``;
    "cosine" decays it to 0 at ``total_steps``:
    ``base_lr * 0.5 * (1 + cos(pi * (step - warmup_steps) / (total_steps - warmup_steps)))``,
    held at 0 past the end.

    Raises:
        ValueError: for an unknown schedule, negative counts, or "cosine"
            without ``total_steps`` greater than ``warmup_steps``.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")
    if step < 0:
        raise ValueError(f"step must be at least 0, got {step}")
    if warmup_steps < 0:
        raise ValueError(f"warmup_steps must be at least 0, got {warmup_steps}")
    if schedule == "cosine" and (total_steps is None or total_steps <= warmup_steps):
        raise ValueError(
            f"schedule 'cosine' needs total_steps above warmup_steps ({warmup_steps}), got {total_steps}"
        )
    if step < warmup_steps:
        return base_lr * (step + 1) / warmup_steps
    if schedule == "constant":
        return base_lr
    progress = min(1.0, (step - warmup_steps) / (total_steps - warmup_steps))
    return base_lr * 0.5 * (1.0 + math.cos(math.pi * progress))


def scaled_lr(base_lr, world_size, enabled=False):
    """``base_lr * world_size`` when ``enabled`` (Goyal et al.'s linear scaling rule), else ``base_lr``.

    Each rank's batch is per-rank, so N ranks step with an N-times larger
    global batch; scaling the rate keeps the per-sample update size. Pair it
    with warmup, as Goyal et al. do.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    return base_lr * world_size if enabled else base_lr
