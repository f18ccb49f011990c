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

Which gradient is which across ranks. With ``named_parameters`` gradients
are matched by name, as Horovod matches its ops: ranks may list the
parameters in different orders. Without names they are matched by position
in the optimizer's parameter groups. Building the optimizer checks, in one
collective, that every rank trains the same parameters (by name, or the same
shapes and dtypes in order) and reduces them the same way (op, compression,
predivide factor); otherwise every rank raises the same one-line
:class:`~ringtrain.torch.errors.CollectiveMismatchError` (a ``RuntimeError``).

A hook after each parameter's gradient accumulation
(``register_post_accumulate_grad_hook``) counts backward passes; on the
``backward_passes_per_step``-th it hands the gradient to the
:class:`~ringtrain.torch.buckets.GradientBuckets`, whose reducer starts a
bucket's reduction on its communication thread as soon as the bucket is
full. :meth:`synchronize` (called by ``step``) finishes every bucket, after
giving the reducer zeros for every parameter that got no gradient on this
rank (another rank may have one).

Contract (every rank of the process set): building the optimizer is
collective (it agrees on the parameters, and its reducers duplicate the
communicator, each keeping the duplicate for the optimizer's lifetime), and
so is every ``step()`` and ``synchronize()``: every rank must make them in
the same order.

.. warning::
    After the first ``step()`` or ``synchronize()`` on more than one rank,
    each gradient of a float16, float32 or float64 parameter is a view of
    its slot in the optimizer's bucket, as in Horovod (``grad.set_(output)``)
    and DDP's ``gradient_as_bucket_view``. With
    ``zero_grad(set_to_none=False)`` the next backward accumulates straight
    into the bucket, and the reduction overwrites it in place: keep a
    ``p.grad.clone()``, not ``p.grad``, to hold a gradient across a step.
    With ``zero_grad()`` (``set_to_none=True``, the default) backward makes
    fresh gradients, which are copied into the bucket.

Compression: :class:`Compression` names Horovod's two compressors. The
optimizer hands them to the reducer as its own ``compression`` (``None`` or
``"fp16"``), so a bucket is cast once instead of once per tensor (for an
average, divided by the rank count first, so the float16 sum cannot overflow
where the mean would not); other compressors are refused. Their
``compress``/``decompress`` serve :func:`ringtrain.torch.allreduce` and any
code that calls them directly.
"""

import contextlib
import dataclasses
import os
import warnings

import torch

from ..environment import env_int
from ..engine import process_sets as scope
from ..engine import runtime
from .buckets import GradientBuckets, match_problem, wire_dtype
from ..engine.compression import Compressor, NoneCompressor, compression_namespace, fp16_compressor
from ..engine.errors import CollectiveMismatchError
from .functions import allgather_object
from ..engine.reduce_ops import Average, Max, Min, Sum, op_name

__all__ = ["DistributedOptimizer", "Compression", "Compressor", "NoneCompressor", "FP16Compressor"]

_ZERO_GRAD_RACE = ("optimizer.zero_grad() was called after loss.backward() but before optimizer.step() or "
                   "optimizer.synchronize(). This is prohibited as it can cause a race condition.")
_TOO_MANY_PASSES = ("Gradients were computed more than backward_passes_per_step times before call to step(). "
                    "Increase backward_passes_per_step to accumulate gradients locally.")
# How the engine's watch names the optimizer's reductions (engine.py: helpers that run around the engine).
_IN_BACKWARD = "DistributedOptimizer: a gradient bucket's reduction in backward()"
_IN_STEP = "DistributedOptimizer: the gradient reduction in step() or synchronize()"
_STEP_AFTER_SYNC = ("optimizer.step() called without optimizer.skip_synchronize() context after "
                    "optimizer.synchronize(). This can cause training slowdown. You may want to consider using "
                    "optimizer.skip_synchronize() context if you use optimizer.synchronize() in your code.")


FP16Compressor = fp16_compressor(lambda dtype: dtype.is_floating_point, lambda tensor, dtype: tensor.type(dtype),
                                 torch.float16, __name__)
Compression = compression_namespace(FP16Compressor, __name__)


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
        self._buckets = None
        self._hooks = []
        if plan is None:  # one rank, or not in the process set: nothing to reduce
            return
        # Backward makes the last layer's gradients first: lay the buckets out in the reverse of the agreed order.
        self._buckets = GradientBuckets(plan.comm, plan.layout[::-1], plan.op, plan.compression, plan.prescale,
                                        plan.postscale, bucket_bytes=_bucket_bytes())
        for _, p in plan.layout:
            self._hooks.append(p.register_post_accumulate_grad_hook(self._hook))

    def _hook(self, p):
        # Runs inside backward, once p.grad holds this pass's gradient added in.
        if self._buckets.pushed(p):
            raise AssertionError(_TOO_MANY_PASSES)
        self._pending.add(p)
        self._delay[p] -= 1
        if self._delay[p] == 0:
            with runtime.current().engine.helper(_IN_BACKWARD):  # may reduce a bucket on this thread
                self._buckets.push(p)

    def set_backward_passes_per_step(self, passes):
        """Accumulate ``passes`` backward passes locally before each reduction."""
        self.backward_passes_per_step = passes
        for p in self._delay:
            self._delay[p] = passes

    def synchronize(self):
        """Finish reducing every gradient (collective); ``.grad`` then holds the result on every rank.

        On more than one rank, ``.grad`` is then a view of the optimizer's
        bucket (see the module's warning).
        """
        if self._buckets is not None:
            with runtime.current().engine.helper(_IN_STEP):
                self._buckets.finish()
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
        if self._pending and self._buckets is not None:
            with runtime.current().engine.helper(_IN_STEP):
                self._buckets.finish()  # collective: every rank had the same passes in flight
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

    Collective over the process set: every member must build it, for the
    same parameters (see the module docstring for how they are matched).

    Args:
        optimizer: any ``torch.optim.Optimizer``.
        named_parameters: ``(name, parameter)`` pairs covering every
            parameter of ``optimizer`` (usually ``model.named_parameters()``):
            gradients are then matched across ranks by name. Default:
            matched by position in the optimizer's parameter groups.
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
            than one rank.
        CollectiveMismatchError: on every rank of the process set, when the
            ranks' parameters cannot be matched, when they would reduce them
            differently, or when another rank raised one of the above.
    """
    if num_groups != 0:
        warnings.warn("Parameter `num_groups` has been replaced by `groups` and will be removed in v0.23.0.",
                      DeprecationWarning, stacklevel=2)
        groups = num_groups if groups is None else groups
    comm = scope.communicator_of(process_set) if scope.included(process_set) else None
    if comm is not None and comm.Get_size() == 1:
        comm = None  # one rank: nothing to reduce, nobody to agree with
    named, plan, refusal = [], None, None
    try:  # Horovod's argument errors; on more than one rank, only once every member has heard of them
        if gradient_predivide_factor != 1.0 and op != Average:
            raise ValueError("gradient_predivide_factor not supported with op != Average")
        if backward_passes_per_step <= 0:
            raise ValueError("backward_passes_per_step must be > 0")
        named = _named(optimizer, named_parameters)
        _check_groups(groups)
        if comm is not None:
            plan = _plan(comm, op, compression, gradient_predivide_factor, named)
    except (ValueError, NotImplementedError) as exc:
        refusal = exc
    if comm is not None:
        with runtime.current().engine.helper("DistributedOptimizer"):
            _agree(plan, refusal, named, (op, compression, gradient_predivide_factor), named_parameters is not None,
                   process_set)
    if refusal is not None:
        raise refusal
    cls = type(type(optimizer).__name__, (_DistributedOptimizer, type(optimizer)), {"__module__": __name__})
    wrapped = cls(optimizer.param_groups)
    wrapped._setup(optimizer, named, backward_passes_per_step, plan, process_set)
    return wrapped


def _named(optimizer, named_parameters):
    """Horovod's checks: ``(name, parameter)`` tuples, unique names, every parameter named; in the optimizer's order."""
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
    names = {id(p): name for name, p in named}
    return [(names[id(p)], p) for group in optimizer.param_groups for p in group["params"]]


def _bucket_bytes():
    """Horovod's fusion threshold (``HOROVOD_FUSION_THRESHOLD``, bytes), if set, sizes the buckets.

    ``init`` has already refused a bad value on every rank, so this read cannot fail on one rank alone.
    """
    value = env_int(os.environ, "HOROVOD_FUSION_THRESHOLD", None, unit=" of bytes", everywhere=True)
    return None if value is None else max(1, value)  # Horovod's 0 (no fusion): every gradient a bucket of its own


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


@dataclasses.dataclass
class _Plan:
    """How this rank reduces its gradients."""

    comm: object             # the buckets' communicator (each reducer duplicates it)
    op: str                  # the reducer's op: "mean", "sum", "min" or "max"
    compression: str         # the reducer's compression: None or "fp16"
    prescale: float          # applied to each gradient before the sum (Horovod's 1 / predivide factor)
    postscale: float         # and after it
    layout: list = dataclasses.field(default_factory=list)  # [(name, parameter)] trained, in the agreed order


# The reducer's names for the ops and compressions it takes.
_OPS = {Average: "mean", Sum: "sum", Min: "min", Max: "max"}
_COMPRESSIONS = {None: None, NoneCompressor: None, FP16Compressor: "fp16"}


def _plan(comm, op, compression, predivide, named):
    """This rank's :class:`_Plan` from its arguments (ValueError, NotImplementedError for the ones refused)."""
    size = comm.Get_size()
    if op not in _OPS:
        # By name (op_name raises ValueError for a value that is no op at all): Adasum, not "op 2".
        raise NotImplementedError(f"DistributedOptimizer: op=hvd.{op_name(op).capitalize()} is not implemented by "
                                  "ringtrain on more than one rank; use hvd.Average, hvd.Sum, hvd.Min or hvd.Max")
    for name, p in named:
        if p.requires_grad and wire_dtype(p.dtype) is None:
            raise ValueError(f"DistributedOptimizer: parameter {name!r} has dtype {p.dtype}; ringtrain reduces "
                             "floating-point and complex gradients")
    if compression not in _COMPRESSIONS:
        raise NotImplementedError("DistributedOptimizer: only Compression.none and Compression.fp16 are supported")
    wire = _COMPRESSIONS[compression]
    if _OPS[op] == "mean" and predivide != 1.0:
        # Horovod's split average: 1/f before the sum, f/size after it.
        return _Plan(comm, "sum", wire, 1.0 / predivide, predivide / size)
    return _Plan(comm, _OPS[op], wire, 1.0, 1.0)


def _agree(plan, refusal, named, reduction, by_name, process_set):
    """Check with every member that all can reduce alike; set ``plan.layout`` to the agreed order (collective).

    One allgather of every member's trained parameters, reduction arguments
    and argument error (``refusal``); every member then reaches the same
    verdict from the same records, so a mismatch is raised on every member,
    and a member's own argument error is named on the others instead of
    leaving them waiting in a later collective. Returns with ``refusal``
    for the caller to raise.
    """
    op, compression, predivide = reduction
    trained = [(name, p) for name, p in named if p.requires_grad]
    record = {"rank": runtime.rank(),
              "refused": None if refusal is None else str(refusal).removeprefix("DistributedOptimizer: "),
              "reduction": (_OPS.get(op, repr(op)), _COMPRESSIONS.get(compression, repr(compression)),
                            repr(float(predivide)) if isinstance(predivide, (int, float)) else repr(predivide)),
              "params": [(name, tuple(p.shape), str(p.dtype), p.device.type) for name, p in trained]}
    records = allgather_object(record, process_set=process_set)
    if refusal is not None:
        return  # this rank's own error, raised by the caller, keeps Horovod's type
    problem = match_problem(records, [r["rank"] for r in records], by_name)
    if problem is not None:
        raise CollectiveMismatchError(f"DistributedOptimizer: {problem}")
    if by_name:  # the root's order, so that every rank's buckets hold the same gradients
        mine = dict(trained)
        plan.layout = [(name, mine[name]) for name, *_ in records[0]["params"]]
    else:
        plan.layout = trained
