"""Gradient compression for :class:`~ringtrain.torch.DistributedOptimizer`, with Horovod's names.

A compressor is a class with two static methods: ``compress(tensor) ->
(tensor, ctx)`` before the wire and ``decompress(tensor, ctx) -> tensor``
after it. :class:`Compression` names the two that ship::

    opt = DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=Compression.fp16)

The optimizer hands these two to ringtrain's bucketed reducer as its own
``compression`` (``None`` or ``"fp16"``), so a bucket is cast once instead of
once per tensor (for an average, divided by the rank count first, so the
float16 sum cannot overflow where the mean would not). The optimizer refuses
other compressors; the classes' ``compress``/``decompress`` serve any code
that calls them directly.
"""

import torch

__all__ = ["Compression", "Compressor", "NoneCompressor", "FP16Compressor"]


class Compressor:
    """The interface: compress before the reduction, decompress after it."""

    @staticmethod
    def compress(tensor):
        """Return ``(compressed tensor, context for decompress)``."""
        raise NotImplementedError

    @staticmethod
    def decompress(tensor, ctx):
        """Return the tensor ``compress`` was given, as well as the wire allows."""
        raise NotImplementedError


class NoneCompressor(Compressor):
    """No compression: the tensor travels as it is."""

    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


class FP16Compressor(Compressor):
    """Floating-point tensors travel as float16 (half the bytes); other dtypes as they are."""

    @staticmethod
    def compress(tensor):
        dtype = tensor.dtype
        if dtype.is_floating_point:
            tensor = tensor.type(torch.float16)
        return tensor, dtype

    @staticmethod
    def decompress(tensor, ctx):
        dtype = ctx
        if dtype.is_floating_point and tensor.dtype != dtype:
            tensor = tensor.type(dtype)
        return tensor


class Compression:
    """The compressors by name: ``Compression.none`` and ``Compression.fp16``."""

    none = NoneCompressor
    fp16 = FP16Compressor


def reducer_compression(compression):
    """The reducer's own name for a known compressor (``None`` or ``"fp16"``), or False for any other."""
    if compression is NoneCompressor or compression is None:
        return None
    if compression is FP16Compressor:
        return "fp16"
    return False
