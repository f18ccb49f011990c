"""Horovod's ``DistributedOptimizer``: any ``torch.optim`` optimizer, its gradients averaged as backward makes them.

::

    opt = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size())
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    for x, y in batches:
        opt.zero_grad()
        loss_fn(model(x), y).backward()   # buckets are reduced while backward goes on
        opt.step()                        # waits for the last bucket, then the wrapped optimizer's update

The wrapper is an instance of a subclass of the optimizer's own class (so
``isinstance(opt, torch.optim.SGD)`` holds and its ``step`` is the original
update), sharing the original's parameter groups, options and state.

A hook after each parameter's gradient accumulation
(``register_post_accumulate_grad_hook``) counts backward passes; on the
``backward_passes_per_step``-th it hands the gradient to a
:class:`~ringtrain.torch.exchange.GradientExchange`, whose reducer starts a
bucket's reduction on its communication thread as soon as the bucket is full.
:meth:`synchronize` (called by ``step``) finishes every bucket, after giving
the reducer zeros for every parameter that got no gradient on this rank
(another rank may have one).

Contract (every rank of the process set): building the optimizer is
collective (its reducers duplicate the communicator, and each keeps the
duplicate for the optimizer's lifetime), and so is every ``step()`` and
``synchronize()``: every rank must make them in the same order, for
optimizers over parameters of the same shapes and dtypes.
"""

import contextlib
import os
import warnings

import torch

from . import process_sets as scope
from .compression import Compression, reducer_compression
from .exchange import GradientExchange, wire_dtype
from .reduce_ops import Average, Max, Min, Sum

__all__ = ["DistributedOptimizer"]

_ZERO_GRAD_RACE = ("optimizer.zero_grad() was called after loss.backward() but before optimizer.step() or "
                   "optimizer.synchronize(). This is prohibited as it can cause a race condition.")
_TOO_MANY_PASSES = ("Gradients were computed more than backward_passes_per_step times before call to step(). "
                    "Increase backward_passes_per_step to accumulate gradients locally.")
_STEP_AFTER_SYNC = ("optimizer.step() called without optimizer.skip_synchronize() context after "
                    "optimizer.synchronize(). This can cause training slowdown. You may want to consider using "
                    "optimizer.skip_synchronize() context if you use optimizer.synchronize() in your code.")


class _DistributedOptimizer:
    """The methods a wrapped optimizer gains (mixed in before its own class; see the module docstring)."""

    def _setup(self, original, named, backward_passes_per_step, plan, process_set):
        self.defaults = dict(original.defaults)
        self.state.update(original.state)
        self._parameter_names = {p: name for name, p in named}
        self.backward_passes_per_step = backward_passes_per_step
        self.process_set = process_set
        self._delay = {p: backward_passes_per_step for _, p in named}
        self._pending = set()  # parameters whose hook ran since the last synchronize
        self._synchronized = False
        self._should_synchronize = True
        self._exchange = None
        self._hooks = []
        if plan is None:  # one rank, or not in the process set: nothing to reduce
            return
        comm, op, compression, prescale, postscale = plan
        trained = [(name, p) for name, p in named if p.requires_grad]
        # Backward makes the last layer's gradients first: lay the buckets out in that order.
        self._exchange = GradientExchange(comm, trained[::-1], op, compression, prescale, postscale,
                                          bucket_bytes=_bucket_bytes())
        for _, p in trained:
            self._hooks.append(p.register_post_accumulate_grad_hook(self._hook))

    def _hook(self, p):
        # Runs inside backward, once p.grad holds this pass's gradient added in.
        if self._exchange.pushed(p):
            raise AssertionError(_TOO_MANY_PASSES)
        self._pending.add(p)
        self._delay[p] -= 1
        if self._delay[p] == 0:
            self._exchange.push(p)

    def set_backward_passes_per_step(self, passes):
        """Accumulate ``passes`` backward passes locally before each reduction."""
        self.backward_passes_per_step = passes
        for p in self._delay:
            self._delay[p] = passes

    def synchronize(self):
        """Finish reducing every gradient (collective); ``.grad`` then holds the result on every rank."""
        if self._exchange is not None:
            self._exchange.finish()
        for p in self._delay:
            self._delay[p] = self.backward_passes_per_step
        self._pending.clear()
        self._synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self):
        """Make ``step()`` skip its :meth:`synchronize`: for after an explicit one (gradient clipping)."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure=None):
        """Synchronize (unless inside :meth:`skip_synchronize`), then the wrapped optimizer's update."""
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn(_STEP_AFTER_SYNC, stacklevel=2)
            self.synchronize()
        self._synchronized = False
        return super().step(closure)

    def zero_grad(self, set_to_none=True):
        """The wrapped optimizer's ``zero_grad``, refused between backward and step (the reduction may be running)."""
        if self._pending:
            raise AssertionError(_ZERO_GRAD_RACE)
        return super().zero_grad(set_to_none=set_to_none)

    def load_state_dict(self, state_dict):
        """Load the wrapped optimizer's state, forgetting any backward pass not yet reduced."""
        if self._pending and self._exchange is not None:
            self._exchange.finish()  # collective: every rank had the same passes in flight
        self._pending.clear()
        self._synchronized = False
        self._should_synchronize = True
        for p in self._delay:
            self._delay[p] = self.backward_passes_per_step
        return super().load_state_dict(state_dict)


def DistributedOptimizer(optimizer, named_parameters=None, compression=Compression.none,  # noqa: N802 - Horovod's name
                         backward_passes_per_step=1, op=Average, gradient_predivide_factor=1.0, num_groups=0,
                         groups=None, sparse_as_dense=False, process_set=None):
    """Wrap ``optimizer`` so that ``step()`` applies gradients reduced across ranks (Horovod's signature).

    Args:
        optimizer: any ``torch.optim.Optimizer``.
        named_parameters: ``(name, parameter)`` pairs covering every
            parameter of ``optimizer`` (usually ``model.named_parameters()``);
            default: names made from the parameter groups.
        compression: ``Compression.none`` or ``Compression.fp16`` (a bucket
            travels as float16); another compressor class is refused.
        backward_passes_per_step: backward passes accumulated locally before
            each reduction (scale the loss by its inverse for a mean).
        op: ``Average`` (default), ``Sum``, ``Min`` or ``Max``.
        gradient_predivide_factor: with ``Average``, scale by ``1 / f``
            before the sum and by ``f / size`` after it.
        num_groups, groups: Horovod's explicit fusion groups; checked and
            accepted, since ringtrain's buckets fuse every gradient anyway.
        sparse_as_dense: accepted; sparse gradients are always reduced dense
            and handed back sparse.
        process_set: reduce over this process set (default: every rank).

    Raises:
        ValueError: for Horovod's argument errors (unnamed or duplicate
            parameters, bad groups, ``backward_passes_per_step < 1``).
        NotImplementedError: for ``Adasum`` or ``Product``, or a compressor
            other than ``Compression.none`` and ``Compression.fp16``, on more
            than one rank (on every rank alike: it depends on the arguments only).
    """
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if num_groups != 0:
        warnings.warn("Parameter `num_groups` has been replaced by `groups` and will be removed in v0.23.0.",
                      DeprecationWarning, stacklevel=2)
        groups = num_groups if groups is None else groups
    if backward_passes_per_step <= 0:
        raise ValueError("backward_passes_per_step must be > 0")
    named = _named(optimizer, named_parameters)
    _check_groups(groups)
    plan = _plan(process_set, op, compression, gradient_predivide_factor, named)
    cls = type(type(optimizer).__name__, (_DistributedOptimizer, type(optimizer)), {"__module__": __name__})
    wrapped = cls(optimizer.param_groups)
    wrapped._setup(optimizer, named, backward_passes_per_step, plan, process_set)
    return wrapped


def _named(optimizer, named_parameters):
    """Horovod's checks: ``(name, parameter)`` tuples, unique names, every parameter named."""
    if named_parameters is None:
        return [(f"allreduce.noname.{i}.{j}", p) for i, group in enumerate(optimizer.param_groups)
                for j, p in enumerate(group["params"])]
    named = list(named_parameters)
    if any(not isinstance(item, tuple) for item in named):
        raise ValueError("named_parameters should be a sequence of tuples (name, parameter), usually produced by "
                         "model.named_parameters().")
    seen, dups = set(), set()
    for name, _ in named:
        (dups if name in seen else seen).add(name)
    if dups:
        raise ValueError(f"Parameter names in named_parameters must be unique. Found duplicates: "
                         f"{', '.join(sorted(dups))}")
    named_ids = {id(p) for _, p in named}
    unnamed = [id(p) for group in optimizer.param_groups for p in group["params"] if id(p) not in named_ids]
    if unnamed:
        raise ValueError(f"named_parameters was specified, but one or more model parameters were not named. "
                         f"Python object ids: {', '.join(map(str, unnamed))}")
    # Reduce in the optimizer's order (the same on every rank), not the order names were given.
    names = {id(p): name for name, p in named}
    return [(names[id(p)], p) for group in optimizer.param_groups for p in group["params"]]


def _bucket_bytes():
    """Horovod's fusion threshold (``HOROVOD_FUSION_THRESHOLD``, bytes), if set, sizes the buckets."""
    value = os.environ.get("HOROVOD_FUSION_THRESHOLD")
    if value is None:
        return None
    try:
        return max(1, int(value))  # Horovod's 0 (no fusion): every gradient a bucket of its own
    except ValueError:
        raise ValueError(f"HOROVOD_FUSION_THRESHOLD must be a number of bytes, got {value!r}") from None


def _check_groups(groups):
    if groups is None:
        return
    if not (isinstance(groups, list) or groups > 0):
        raise ValueError("groups should be a non-negative integer or a list of list of torch.Tensor.")
    if isinstance(groups, list):
        seen = set()
        for group in groups:
            for p in group:
                if not isinstance(p, torch.Tensor):
                    raise ValueError("groups must consist of torch.Tensor.")
                if id(p) in seen:
                    raise ValueError("A parameter can only appear once in groups.")
                seen.add(id(p))


def _plan(process_set, op, compression, predivide, named):
    """``(comm, op, compression, prescale, postscale)`` for the exchange, or None when there is nothing to reduce."""
    if not scope.included(process_set):
        return None
    comm = scope.communicator_of(process_set)
    size = comm.Get_size()
    if size == 1:
        return None
    names = {Average: "mean", Sum: "sum", Min: "min", Max: "max"}
    if op not in names:
        raise NotImplementedError(f"DistributedOptimizer: op {op!r} is not implemented by ringtrain on more than "
                                  f"one rank; use Average, Sum, Min or Max")
    for name, p in named:
        if p.requires_grad and wire_dtype(p.dtype) is None:
            raise ValueError(f"DistributedOptimizer: parameter {name!r} has dtype {p.dtype}; ringtrain reduces "
                             "floating-point and complex gradients")
    wire = reducer_compression(compression)
    if wire is False:
        raise NotImplementedError("DistributedOptimizer: only Compression.none and Compression.fp16 are supported")
    op_name = names[op]
    if op_name == "mean" and predivide != 1.0:
        # Horovod's split average: 1/f before the sum, f/size after it.
        return comm, "sum", wire, 1.0 / predivide, predivide / size
    return comm, op_name, wire, 1.0, 1.0
