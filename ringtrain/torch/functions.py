"""Horovod's helpers: broadcast parameters, optimizer state and objects; gather objects.

Every function here is collective over its process set (default: every
rank): every rank must call the same functions in the same order. Each goes
through ringtrain's header-checked collectives, so ranks that disagree (a
different number of tensors, another root) raise on every rank instead of
hanging.

The typical start of a Horovod script::

    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
"""

import collections
import functools

import torch

from ..engine import ops
from ..engine import process_sets as scope
from ..engine import runtime
from ..engine.errors import CollectiveMismatchError
from .interop import broadcast_tensors_

__all__ = ["broadcast_parameters", "broadcast_optimizer_state", "broadcast_object", "allgather_object",
           "group_layout", "groups_problem"]


def _comm(process_set):
    return scope.communicator_of(process_set)


def _helper(function):
    """Run ``function`` as a helper the engine watches: it fails, or the job ends, when a peer has gone.

    These collectives run on the caller's communicator, not through the
    engine; without this, one called after a peer's ``shutdown`` (or
    ``sys.exit``) would wait for that peer for ever (engine.py's contract).
    """
    @functools.wraps(function)
    def run(*args, **kwargs):
        scope.communicator_of(None)  # ValueError before init, as Horovod's
        with runtime.current().engine.helper(function.__name__):
            return function(*args, **kwargs)
    return run


@_helper
def broadcast_parameters(params, root_rank=0, process_set=None):
    """Overwrite ``params`` with ``root_rank``'s, in place (collective).

    Args:
        params: a ``state_dict()`` (broadcast in the order of its sorted
            names), or a list of tensors or ``(name, tensor)`` pairs such as
            ``list(model.named_parameters())``. Any dtype: bool and uint8
            buffers included.
        root_rank: the rank whose values everyone gets (a rank of the whole
            job, as in Horovod, also with a process set).
        process_set: broadcast within this process set (default: every rank).

    Raises:
        ValueError: for ``params`` of another type.
    """
    if isinstance(params, dict):
        tensors = [t for _, t in sorted(params.items(), key=lambda item: str(item[0]))]
    elif isinstance(params, (list, tuple)) or hasattr(params, "__next__"):
        tensors = [p[1] if isinstance(p, tuple) else p for p in params]
    else:
        raise ValueError(f"invalid params of type: {type(params)}")
    broadcast_tensors_(tensors, root=scope.set_rank(process_set, root_rank), comm=_comm(process_set))


def broadcast_object(obj, root_rank=0, name=None, process_set=None):
    """Return ``root_rank``'s ``obj`` on every rank, pickled (collective; ``name`` is accepted for Horovod)."""
    return ops.broadcast_object(obj, root_rank, process_set)


def allgather_object(obj, name=None, process_set=None):
    """Return every rank's ``obj``, in rank order, pickled (collective; ``name`` is accepted for Horovod)."""
    return ops.allgather_object(obj, process_set)


@_helper
def broadcast_optimizer_state(optimizer, root_rank=0, model=None, process_set=None):
    """Give every rank ``root_rank``'s optimizer state and options (``lr``, ``momentum``...), in place (collective).

    Works for every ``torch.optim`` optimizer but L-BFGS. A rank whose
    optimizer has no state yet (never stepped) first makes it with one step
    on zero gradients, as Horovod does, so that every rank has the same
    tensors to receive; the parameters are put back after that step, so the
    step moves nothing.

    Parameter groups are matched by position: group ``i`` takes the root's
    group ``i``'s options, and its ``j``-th parameter the state of the root's.
    So first the ranks compare their optimizers (one small allgather): the
    same number of groups, of parameters in each, of the same shapes, with
    the same option names and the same state tensors. If any rank's differ
    from the root's, every rank raises the same one-line
    :class:`~ringtrain.torch.errors.CollectiveMismatchError` and nothing is
    changed (a learning rate left different on one rank would be a silent
    loss). Then tensors (moment estimates, step counts) are broadcast in
    place; plain values (options and scalar state) are broadcast pickled.

    Args:
        optimizer: a ``torch.optim`` optimizer, wrapped by
            :func:`~ringtrain.torch.DistributedOptimizer` or not.
        root_rank: the rank whose state everyone gets.
        model: optional; its sparse ``Embedding`` parameters get sparse zero
            gradients for the first step (what SGD needs for them).
        process_set: within this process set (default: every rank).

    Raises:
        ValueError: for ``torch.optim.LBFGS``, whose state holds closures' history.
        CollectiveMismatchError: on every rank, when the groups cannot be matched.
    """
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("cannot broadcast torch.optim.LBFGS state")
    state_dict = optimizer.state_dict()
    if not state_dict["state"]:
        _initialise_state(optimizer, model)
        state_dict = optimizer.state_dict()
    root = scope.set_rank(process_set, root_rank)
    layouts = allgather_object((runtime.rank(), group_layout(optimizer, state_dict)), process_set=process_set)
    problem = groups_problem([layout for _, layout in layouts], [r for r, _ in layouts], root)
    if problem is not None:
        raise CollectiveMismatchError(f"broadcast_optimizer_state: {problem}")
    tensors, values, setters = [], {}, {}
    occurrences = collections.Counter()
    for index, group in enumerate(state_dict["param_groups"]):
        for key, value in group.items():
            if key != "params":
                values[f"{key}.{index}"] = value
                setters[f"{key}.{index}"] = (optimizer.param_groups[index], key)
        for pid in group["params"]:
            for key, value in state_dict["state"].get(pid, {}).items():
                occurrences[key] += 1
                if torch.is_tensor(value):
                    tensors.append(value)
                else:
                    setters[f"{key}.{occurrences[key]}"] = (state_dict["state"][pid], key)
                    values[f"{key}.{occurrences[key]}"] = value
    broadcast_parameters(tensors, root_rank, process_set)
    for key, value in broadcast_object(values, root_rank, process_set=process_set).items():
        target, name = setters[key]  # the layouts matched: the root's keys are this rank's
        target[name] = value


def group_layout(optimizer, state_dict=None):
    """What must match the root's for a broadcast of ``optimizer``'s state, as plain comparable values (pure).

    Per parameter group: its option names, and per parameter its shape and
    its state's entries (name, shape and dtype of a tensor, or type of a
    plain value).
    """
    state_dict = optimizer.state_dict() if state_dict is None else state_dict
    layout = []
    for group, saved in zip(optimizer.param_groups, state_dict["param_groups"]):
        params = []
        for p, pid in zip(group["params"], saved["params"]):
            state = state_dict["state"].get(pid, {})
            params.append((tuple(p.shape), tuple(sorted(
                (key, tuple(v.shape), str(v.dtype).replace("torch.", "")) if torch.is_tensor(v)
                else (key, type(v).__name__) for key, v in state.items()))))
        layout.append((tuple(sorted(k for k in saved if k != "params")), params))
    return layout


def groups_problem(layouts, ranks, root):
    """Why the ranks' optimizers cannot take the root's state group by group, as one line, or None (pure).

    Args:
        layouts: one :func:`group_layout` per member, in the set's rank order.
        ranks: the members' ranks, for the message.
        root: the root's index in ``layouts``.
    """
    want, at = layouts[root], f"the root (rank {ranks[root]})"
    fix = "; build the optimizer with the same parameter groups on every rank"
    for rank, mine in zip(ranks, layouts):
        if len(mine) != len(want):
            return f"rank {rank} has {len(mine)} parameter groups and {at} has {len(want)}{fix}"
        for i, ((options, params), (root_options, root_params)) in enumerate(zip(mine, want)):
            if options != root_options:
                odd = sorted(set(options) ^ set(root_options))
                return f"parameter group {i} has other options on rank {rank} than on {at} ({', '.join(odd)}){fix}"
            if len(params) != len(root_params):
                return (f"parameter group {i} holds {len(params)} parameters on rank {rank} and {len(root_params)} "
                        f"on {at}{fix}")
            for j, ((shape, state), (root_shape, root_state)) in enumerate(zip(params, root_params)):
                if shape != root_shape:
                    return (f"parameter {j} of group {i} has shape {shape} on rank {rank} and {root_shape} on "
                            f"{at}{fix}")
                if state != root_state:
                    return (f"parameter {j} of group {i} has state {_names(state)} on rank {rank} and "
                            f"{_names(root_state)} on {at}; step every rank's optimizer alike, or none before "
                            "the broadcast")
    return None


def _names(state):
    """``(exp_avg (3, 4) float32, step () float32)`` for a parameter's state from :func:`group_layout`."""
    return "(" + (", ".join(" ".join(map(str, entry)) for entry in state) or "none") + ")"


def _initialise_state(optimizer, model):
    """One update on zero gradients, so that the optimizer's state exists; parameters are restored after it."""
    sparse = set()
    if model is not None:
        sparse = {id(p) for m in model.modules()
                  if isinstance(m, torch.nn.Embedding) and m.sparse for p in m.parameters()}
    saved = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad:
                saved.append((p, p.detach().clone()))
                p.grad = torch.zeros_like(p)
                if isinstance(optimizer, torch.optim.SparseAdam) or id(p) in sparse:
                    p.grad = p.grad.to_sparse()
    if hasattr(optimizer, "skip_synchronize"):
        # A DistributedOptimizer's step would reduce the zeros across ranks: the wrapped update alone.
        with optimizer.skip_synchronize():
            optimizer.step()
    else:
        optimizer.step()
    with torch.no_grad():
        for p, value in saved:
            p.copy_(value)
