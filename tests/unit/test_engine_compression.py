"""ringtrain.engine.compression: Horovod's compressors, made for a framework by its dtype test and cast.

NumPy stands in for a framework here; the torch and TensorFlow faces' own
compressors are exercised by their optimizer tests under mpirun.
"""

import numpy as np

from ringtrain.engine.compression import Compressor, NoneCompressor, compression_namespace, fp16_compressor

FP16 = fp16_compressor(lambda dtype: dtype.kind == "f", lambda a, dtype: a.astype(dtype), np.dtype(np.float16),
                       "numpy_face")
Compression = compression_namespace(FP16, "numpy_face")


def test_fp16_sends_floating_point_as_float16_and_gives_back_the_callers_dtype():
    values = np.random.default_rng(0).standard_normal(8)
    sent, ctx = Compression.fp16.compress(values)
    assert sent.dtype == np.float16 and ctx == np.float64
    back = Compression.fp16.decompress(sent, ctx)
    assert back.dtype == np.float64
    np.testing.assert_array_equal(back, values.astype(np.float16).astype(np.float64))


def test_fp16_leaves_other_dtypes_and_none_leaves_everything_as_it_is():
    counts = np.arange(5, dtype=np.int32)
    sent, ctx = Compression.fp16.compress(counts)
    assert sent is counts and Compression.fp16.decompress(sent, ctx) is counts
    sent, ctx = Compression.none.compress(counts)
    assert sent is counts and ctx is None and Compression.none.decompress(sent, ctx) is counts
    assert Compression.none is NoneCompressor and issubclass(Compression.fp16, Compressor)


def test_a_faces_compressors_are_named_as_its_own():
    assert (FP16.__module__, FP16.__qualname__) == ("numpy_face", "FP16Compressor")
    assert (Compression.__module__, Compression.__name__) == ("numpy_face", "Compression")
