"""One rank's part in the TensorFlow face's failure and MPMD tests: ``tf_roles.py ROLE``.

Roles: ``shape N`` allreduces a tensor of N elements eagerly and in a
tf.function, printing ``mismatch`` for each FailedPrecondition/OpError;
``raise`` raises before its allreduce; ``wait`` allreduces (waiting for the
rank that raised).
"""

import sys

import numpy as np
import tensorflow as tf

import ringtrain.tensorflow as hvd


def shape(n):
    hvd.init()
    for run in (lambda t: hvd.allreduce(t), tf.function(lambda t: hvd.allreduce(t))):
        try:
            run(tf.ones([n]))
            print("agreed", flush=True)
        except tf.errors.OpError as exc:
            print(f"mismatch: {exc.message.splitlines()[0][:200]}", flush=True)
    hvd.barrier()


def main(role, *args):
    if role == "shape":
        return shape(int(args[0]))
    hvd.init()
    if role == "raise":
        raise RuntimeError("this rank gave up")
    hvd.allreduce(tf.ones([4]))
    print("wait returned", flush=True)


if __name__ == "__main__":
    np.seterr(all="ignore")
    main(*sys.argv[1:])
