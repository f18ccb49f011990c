"""Batch normalisation over the global batch: every rank's statistics averaged in forward, on CPU and CUDA.

:class:`SyncBatchNorm` is a drop-in for ``BatchNorm1d/2d/3d`` in a
data-parallel model: in training it normalises with the mean and variance of
the batch of every rank together, so the replicas compute what one process
would on the whole batch, and their running statistics stay equal.

How: the per-channel sums (and element counts) go through an allreduce that
autograd sees (:class:`_AllreduceSum`, whose backward is the allreduce of the
gradients, since every rank's sum feeds every rank's output). The variance is
a second pass over ``x - mean``, which stays accurate where
``E[x^2] - E[x]^2`` would cancel. Backward is then plain autograd through
these few operations: nothing is written by hand.

Collective (every rank of the process set): each training-mode forward, and
the backward through it, in the same order on every rank.
"""

import torch
from torch.nn.modules.batchnorm import _BatchNorm

from ..comm import allreduce
from ..engine import process_sets as scope
from ..engine import runtime
from .tensors import as_array, as_tensor, sync

__all__ = ["SyncBatchNorm"]


def _reduce(tensor, comm):
    """The sum of ``tensor`` over the ranks of ``comm``, as a new tensor (collective)."""
    tensor = tensor.detach().contiguous()
    sync([tensor])  # ringtrain reads the memory next, through CuPy: torch's kernels must be done
    with runtime.current().engine.helper("SyncBatchNorm: the statistics' allreduce"):
        return as_tensor(allreduce(as_array(tensor), op="sum", comm=comm)).to(tensor.device)


class _AllreduceSum(torch.autograd.Function):
    """A sum over ranks that autograd differentiates: its backward is the sum of the gradients over ranks."""

    @staticmethod
    def forward(ctx, tensor, comm):
        ctx.comm = comm
        return _reduce(tensor, comm)

    @staticmethod
    def backward(ctx, grad):
        return _reduce(grad, ctx.comm), None


class SyncBatchNorm(_BatchNorm):
    """Batch normalisation with statistics over every rank's batch (Horovod's signature).

    Args:
        num_features: channels ``C`` of an input ``(N, C, ...)``.
        eps, momentum, affine, track_running_stats: as ``torch.nn.BatchNorm2d``
            (``momentum=None``: a cumulative average).
        process_set: the ranks whose batches are normalised together (default: every rank).
    """

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True, track_running_stats=True,
                 process_set=None):
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.process_set = process_set

    def _check_input_dim(self, input):
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input):
        self._check_input_dim(input)
        comm = self._communicator()
        if not self.training or comm is None:
            return super().forward(input)
        factor = self.momentum
        if self.track_running_stats:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:
                factor = 1.0 / float(self.num_batches_tracked)
        dims = [0] + list(range(2, input.dim()))
        # Sums in float32 at least: float16 activations summed over a global batch overflow.
        wide = input.float() if input.dtype in (torch.float16, torch.bfloat16) else input
        count = torch.full((1,), input.numel() // input.size(1), dtype=wide.dtype, device=input.device)
        sums = _AllreduceSum.apply(torch.cat([wide.sum(dims), count]), comm)
        total = sums[-1].detach()
        mean = sums[:-1] / total
        shape = [1, -1] + [1] * (input.dim() - 2)
        centred = wide - mean.view(shape)
        var = _AllreduceSum.apply(centred.square().sum(dims), comm) / total
        out = centred * torch.rsqrt(var + self.eps).view(shape)
        if self.affine:
            out = out * self.weight.view(shape) + self.bias.view(shape)
        if self.track_running_stats:
            with torch.no_grad():
                unbiased = var * (total / (total - 1)) if total > 1 else var
                self.running_mean.mul_(1 - factor).add_(mean.to(self.running_mean.dtype), alpha=factor)
                self.running_var.mul_(1 - factor).add_(unbiased.to(self.running_var.dtype), alpha=factor)
        return out.to(input.dtype)

    def _communicator(self):
        """The process set's communicator, or None where there is nothing to synchronise (one rank)."""
        if not scope.included(self.process_set):
            return None
        comm = scope.communicator_of(self.process_set)
        return comm if comm.Get_size() > 1 else None
