"""Horovod's ``horovod.tensorflow.util`` helpers that scripts and Horovod's tests import."""

import tensorflow as tf

__all__ = ["_executing_eagerly"]


def _executing_eagerly():
    """True when TensorFlow runs eagerly here (not while tracing a ``tf.function`` or building a TF1 graph)."""
    return tf.executing_eagerly()
