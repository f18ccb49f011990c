"""Horovod's Keras API on Keras 3 (TensorFlow, torch and JAX backends) and Keras 2: ``import ringtrain.keras as hvd``.

Serves ``horovod.tensorflow.keras`` and ``horovod.keras``: init and the rank
family, a :func:`DistributedOptimizer` for Keras optimizers, :mod:`.callbacks`
(``BroadcastGlobalVariablesCallback``, ``MetricAverageCallback``,
``LearningRateScheduleCallback``, ``LearningRateWarmupCallback``),
``broadcast_variables``, ``broadcast_global_variables``, ``load_model`` and
``allreduce`` / ``allgather`` / ``broadcast`` / ``reducescatter`` of values.

The array path follows Keras's backend (:mod:`.backends`, read once at
import): on ``tensorflow`` the names are :mod:`.tf_face`'s, over
:mod:`ringtrain.tensorflow` (Keras 3's ``tf.keras``, or Keras 2's under
``TF_USE_LEGACY_KERAS=1``; :mod:`.elastic` too); on ``torch`` and ``jax``
(which Horovod never served) they are :mod:`.native`'s, over the engine's
NumPy ops, without TensorFlow. Set ``KERAS_BACKEND`` before Keras is first
imported.

The wrapped optimizer averages the gradients across the process set in
``apply`` (``apply_gradients`` on Keras 2), in one grouped allreduce per
step, before the wrapped update; ``model.fit`` and custom loops both go
through it. Collective: every rank must step the same optimizer at the same
steps.
"""

from . import backends

BACKEND = backends.check(backends.name())

if BACKEND == "tensorflow":
    from .tf_face import *  # noqa: F401,F403 - the face's __all__, the same names on every backend
    from .tf_face import __all__ as _names
    from . import elastic  # noqa: F401 - hvd.elastic, TensorFlow only
    _names = [*_names, "elastic"]
else:
    from .native import *  # noqa: F401,F403
    from .native import __all__ as _names

from . import callbacks  # noqa: E402 - after the face, which the callbacks use

__all__ = [*_names, "callbacks", "BACKEND"]
