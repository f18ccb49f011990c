"""Horovod's gradient compressors for TensorFlow: ``Compression.none`` and ``Compression.fp16``."""

import tensorflow as tf

__all__ = ["Compressor", "NoneCompressor", "FP16Compressor", "Compression"]


class Compressor:
    """Turns a tensor into what travels (``compress``) and back (``decompress``)."""

    @staticmethod
    def compress(tensor):
        """``(tensor to send, context for decompress)``."""
        raise NotImplementedError

    @staticmethod
    def decompress(tensor, ctx):
        """The received tensor, as the caller's dtype."""
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Tensors travel as they are."""

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
        if dtype.is_floating:
            tensor = tf.cast(tensor, tf.float16)
        return tensor, dtype

    @staticmethod
    def decompress(tensor, ctx):
        if ctx is not None and ctx.is_floating and tensor.dtype != ctx:
            tensor = tf.cast(tensor, ctx)
        return tensor


class Compression:
    """The compressors by name: ``Compression.none`` and ``Compression.fp16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
