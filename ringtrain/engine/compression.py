"""Horovod's gradient compressors, written once for every face: ``Compression.none`` and ``Compression.fp16``.

A compressor turns a tensor into what travels (``compress``, which also
returns what ``decompress`` needs) and the received tensor back into the
caller's dtype (``decompress``). ``none`` sends tensors as they are;
``fp16`` sends floating-point tensors as float16, half the bytes, and
everything else as it is. The only framework-specific part of ``fp16`` is
asking whether a dtype is floating point and casting, so each face makes
its own with :func:`fp16_compressor` and names both with
:func:`compression_namespace`. A user's own compressor subclasses :class:`Compressor`.
"""

__all__ = ["Compressor", "NoneCompressor", "fp16_compressor", "compression_namespace"]


class Compressor:
    """The interface: compress before the reduction, decompress after it."""

    @staticmethod
    def compress(tensor):
        """Return ``(tensor to send, context for decompress)``."""
        raise NotImplementedError

    @staticmethod
    def decompress(tensor, ctx):
        """Return the received tensor as the caller's dtype, as well as the wire allows."""
        raise NotImplementedError


class NoneCompressor(Compressor):
    """No compression: the tensor travels as it is."""

    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


def fp16_compressor(is_floating, cast, float16, module):
    """A face's ``FP16Compressor``: ``is_floating(dtype)``, ``cast(tensor, dtype)`` and its float16 dtype.

    ``module`` is the face module the class is reported as belonging to (its repr, pickling by name).
    """

    class FP16Compressor(Compressor):
        """Floating-point tensors travel as float16 (half the bytes); other dtypes as they are."""

        @staticmethod
        def compress(tensor):
            dtype = tensor.dtype
            if is_floating(dtype):
                tensor = cast(tensor, float16)
            return tensor, dtype

        @staticmethod
        def decompress(tensor, ctx):
            if ctx is not None and is_floating(ctx) and tensor.dtype != ctx:
                tensor = cast(tensor, ctx)
            return tensor

    FP16Compressor.__module__, FP16Compressor.__qualname__ = module, "FP16Compressor"
    return FP16Compressor


def compression_namespace(fp16, module):
    """The ``Compression`` namespace of a face: its compressors by name, ``none`` and ``fp16``."""
    names = type("Compression", (), {"__doc__": "The compressors by name: ``Compression.none`` and "
                                                "``Compression.fp16``.", "none": NoneCompressor, "fp16": fp16})
    names.__module__ = module
    return names
