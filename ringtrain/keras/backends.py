"""Which array path ``ringtrain.keras`` takes: Keras 3's backend, read from Keras itself.

Keras picks its backend once, when it is first imported (``KERAS_BACKEND``,
else ``~/.keras/keras.json``, else TensorFlow). On ``tensorflow`` (Keras 3,
or Keras 2 under ``TF_USE_LEGACY_KERAS=1``) :mod:`ringtrain.keras` is
:mod:`~ringtrain.keras.tf_face`, over :mod:`ringtrain.tensorflow`; on
``torch`` and ``jax`` it is :mod:`~ringtrain.keras.native`, over the engine's
NumPy ops, and TensorFlow is never imported.
"""

from ..errors import UsageError

__all__ = ["NATIVE", "SERVED", "name", "face", "check"]

NATIVE = ("torch", "jax")
SERVED = ("tensorflow",) + NATIVE


def name():
    """The running Keras's backend (``keras.backend.backend()``): importing Keras here fixes it for the process."""
    try:
        import keras
    except ModuleNotFoundError as exc:  # one line that names the fix
        raise ModuleNotFoundError("ringtrain.keras needs Keras, which is not installed: pip install keras (Keras 3, "
                                  "for the torch and jax backends) or the [tensorflow] extra", name="keras") from exc
    return keras.backend.backend()


def check(backend):
    """``backend`` if ringtrain.keras serves it; else a UsageError that names the ones it does."""
    if backend not in SERVED:
        raise UsageError(f"ringtrain.keras does not serve Keras's {backend!r} backend; set KERAS_BACKEND to one of "
                         f"{', '.join(SERVED)} before Keras is first imported")
    return backend


def face():
    """The module that serves ringtrain.keras on the running backend (``tf_face`` or ``native``)."""
    if check(name()) == "tensorflow":
        from . import tf_face

        return tf_face
    from . import native

    return native
