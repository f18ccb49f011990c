"""Horovod's gradient compressors for TensorFlow: ``Compression.none`` and ``Compression.fp16``.

The compressors are the engine's (:mod:`ringtrain.engine.compression`); this
module gives ``fp16`` TensorFlow's casts.
"""

import tensorflow as tf

from ..engine.compression import Compressor, NoneCompressor, compression_namespace, fp16_compressor

__all__ = ["Compressor", "NoneCompressor", "FP16Compressor", "Compression"]

FP16Compressor = fp16_compressor(lambda dtype: dtype.is_floating, tf.cast, tf.float16, __name__)
Compression = compression_namespace(FP16Compressor, __name__)
