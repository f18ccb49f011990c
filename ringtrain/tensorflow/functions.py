"""Horovod's TensorFlow helpers: broadcast variables and objects, gather objects.

Every function here is collective over its process set (default: every
rank): every member must call the same functions in the same order. The
object helpers are the engine's (shared with ``ringtrain.torch``): pickled
on the caller's thread, their bytes moved by ringtrain's header-checked
collectives, so members that disagree (another root, one call more) raise
instead of taking the wrong object; ``broadcast_variables`` goes through
the ops, so it works eagerly and inside ``tf.function``.
"""


import tensorflow as tf

from . import collectives as engine
from .mpi_ops import broadcast_, global_process_set, with_tf_errors

__all__ = ["broadcast_variables", "broadcast_object", "broadcast_object_fn", "allgather_object",
           "broadcast_global_variables"]


def broadcast_variables(variables, root_rank, process_set=global_process_set, inplace=False):
    """Overwrite each variable with ``root_rank``'s (collective); eagerly, or an op inside a graph.

    Args:
        variables: the variables, the same shapes and dtypes on every member, in the same order.
        root_rank: the rank whose values everyone gets (a rank of the whole job).
        process_set: broadcast within this process set (default: every rank).
        inplace: accepted for Horovod's signature (the variables are always assigned in place).

    Returns:
        None eagerly; in a graph, an op that runs the broadcasts.
    """
    variables = list(variables)
    if not variables:
        return None if tf.executing_eagerly() else tf.no_op()
    values = broadcast_(variables, root_rank, process_set=process_set)
    return None if tf.executing_eagerly() else tf.group(*values)


def broadcast_global_variables(root_rank):
    """Broadcast every TF1 global variable from ``root_rank`` (graph mode only, as in Horovod)."""
    if tf.executing_eagerly():
        raise RuntimeError("hvd.broadcast_global_variables() does not support eager execution. "
                           "Please use `hvd.broadcast_variables(<model/optimizer variables>)` instead.")
    return broadcast_variables(tf.compat.v1.global_variables(), root_rank)


def broadcast_object(obj, root_rank=0, session=None, name=None, process_set=global_process_set):
    """Return ``root_rank``'s ``obj`` on every member, pickled (collective; ``session``, ``name`` accepted)."""
    return with_tf_errors(lambda: engine.broadcast_object(obj, root_rank, process_set))


def broadcast_object_fn(root_rank=0, session=None, name=None, process_set=global_process_set):
    """A function that broadcasts its argument from ``root_rank`` (Horovod's TF1 helper)."""
    def fn(obj):
        return broadcast_object(obj, root_rank, session, name, process_set)
    return fn


def allgather_object(obj, session=None, name=None, process_set=global_process_set):
    """Every member's ``obj``, in rank order, pickled (collective; ``session``, ``name`` accepted)."""
    return with_tf_errors(lambda: engine.allgather_object(obj, process_set))
