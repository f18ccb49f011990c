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
import pickle

import numpy as np
import torch

from ..comm import allreduce_, broadcast_
from . import process_sets as scope
from .interop import broadcast_tensors_

__all__ = ["broadcast_parameters", "broadcast_optimizer_state", "broadcast_object", "allgather_object"]


def _comm(process_set):
    return scope.communicator_of(process_set)


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
    comm = _comm(process_set)
    root_rank = scope.set_rank(process_set, root_rank)
    mine = comm.Get_rank() == root_rank
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL) if mine else b""
    length = np.array([len(data)], np.int64)
    broadcast_(length, root=root_rank, comm=comm)
    words = np.zeros(-(-int(length[0]) // 8), np.int64)
    if mine:
        words.view(np.uint8)[: len(data)] = np.frombuffer(data, np.uint8)
    broadcast_(words, root=root_rank, comm=comm)
    if mine:
        return obj
    return pickle.loads(words.view(np.uint8)[: int(length[0])].tobytes())


def allgather_object(obj, name=None, process_set=None):
    """Return every rank's ``obj``, in rank order, pickled (collective; ``name`` is accepted for Horovod)."""
    comm = _comm(process_set)
    rank, size = comm.Get_rank(), comm.Get_size()
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    lengths = np.zeros(size, np.int64)
    lengths[rank] = len(data)
    allreduce_(lengths, op="sum", comm=comm)
    # Each rank's bytes in its own 8-byte-aligned slot, zeros elsewhere: a sum of the slots is
    # an exact gather, through the same header-checked allreduce as everything else.
    slots = -(-lengths // 8)
    starts = np.concatenate([[0], np.cumsum(slots)])
    words = np.zeros(int(starts[-1]), np.int64)
    words[starts[rank]: starts[rank + 1]].view(np.uint8)[: len(data)] = np.frombuffer(data, np.uint8)
    allreduce_(words, op="sum", comm=comm)
    return [pickle.loads(words[starts[r]: starts[r + 1]].view(np.uint8)[: int(lengths[r])].tobytes())
            for r in range(size)]


def broadcast_optimizer_state(optimizer, root_rank=0, model=None, process_set=None):
    """Give every rank ``root_rank``'s optimizer state and options (``lr``, ``betas``...), in place (collective).

    Works for every ``torch.optim`` optimizer but L-BFGS. A rank whose
    optimizer has no state yet (never stepped) first makes it with one step
    on zero gradients, as Horovod does, so that every rank has the same
    tensors to receive; the parameters are put back after that step, so the
    step moves nothing. Tensors (moment estimates, step counts) are broadcast
    in place; plain values (options and scalar state) are broadcast pickled.

    Args:
        optimizer: a ``torch.optim`` optimizer, wrapped by
            :func:`~ringtrain.torch.DistributedOptimizer` or not.
        root_rank: the rank whose state everyone gets.
        model: optional; its sparse ``Embedding`` parameters get sparse zero
            gradients for the first step (what SGD needs for them).
        process_set: within this process set (default: every rank).

    Raises:
        ValueError: for ``torch.optim.LBFGS``, whose state holds closures' history.
    """
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("cannot broadcast torch.optim.LBFGS state")
    state_dict = optimizer.state_dict()
    if not state_dict["state"]:
        _initialise_state(optimizer, model)
        state_dict = optimizer.state_dict()
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
        if key in setters:
            target, name = setters[key]
            target[name] = value


def _initialise_state(optimizer, model):
    """One update on zero gradients, so that the optimizer's state exists; parameters are restored after it."""
    from .optimizer import DistributedOptimizer

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
    distributed = getattr(type(optimizer), "__module__", None) == DistributedOptimizer.__module__
    # A wrapped optimizer's own step would reduce the zeros across ranks: step the original class.
    step = super(type(optimizer).__mro__[1], optimizer).step if distributed else optimizer.step
    step()
    with torch.no_grad():
        for p, value in saved:
            p.copy_(value)
