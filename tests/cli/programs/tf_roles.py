"""One rank's part in the TensorFlow face's failure and MPMD tests: ``tf_roles.py ROLE``.

Roles: ``shape N`` allreduces a tensor of N elements eagerly and in a
tf.function, printing ``mismatch`` for each FailedPrecondition/OpError;
``raise`` raises before its allreduce; ``wait`` allreduces (waiting for the
rank that raised). In TF1 graphs: ``graphs`` runs an alltoall every rank
refuses (rank 0 late), then collectives in a second graph, fetched several
times, printing ``graphs ok``; ``graph_wait`` fetches an allreduce its peer
never submits; ``idle`` sleeps for a minute without a collective. In a
tf.function: ``graph_raise`` allreduces, then raises inside a
``numpy_function``, before its second allreduce; ``graph_second`` runs both.
"""

import time

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


def graphs():
    tf.compat.v1.disable_eager_execution()
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
        refused = hvd.alltoall(tf.ones([n + 1]))  # n + 1 rows do not split evenly among n ranks
        if r == 0:
            time.sleep(3)  # the others' refusals stay in flight, unheard by rank 0, meanwhile
        try:
            sess.run(refused)
            raise SystemExit("an uneven alltoall ran")
        except tf.errors.OpError:
            pass
    with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
        swapped = hvd.alltoall(tf.fill([n], float(r)))  # the same kind as the refused op
        total = hvd.allreduce(tf.fill([4], float(r + 1)), op=hvd.Sum)
        for _ in range(3):
            assert (sess.run(swapped) == np.arange(n)).all()
            assert (sess.run(total) == n * (n + 1) / 2).all()
        rows = hvd.allgather(tf.fill([r + 1, 2], float(r)))
        want = np.concatenate([np.full([i + 1, 2], float(i)) for i in range(n)])
        assert (sess.run(rows) == want).all()
    print("graphs ok", flush=True)


def graph_wait():
    tf.compat.v1.disable_eager_execution()
    hvd.init()
    with tf.compat.v1.Session() as sess:
        sess.run(hvd.allreduce(tf.ones([4]), name="never.matched"))
    print("wait returned", flush=True)


def in_a_graph(raises):
    hvd.init()

    def give_up(x):
        raise RuntimeError("this rank gave up in a graph")

    @tf.function
    def step(x):
        x = hvd.allreduce(x, name="first")
        if raises:
            x = tf.numpy_function(give_up, [x], tf.float32)
        return hvd.allreduce(x, name="second")

    step(tf.ones([4]))
    print("graph returned", flush=True)


def main(role, *args):
    if role in ("graph_raise", "graph_second"):
        return in_a_graph(role == "graph_raise")
    if role == "shape":
        return shape(int(args[0]))
    if role == "graphs":
        return graphs()
    if role == "graph_wait":
        return graph_wait()
    if role == "idle":
        hvd.init()
        return time.sleep(60)
    hvd.init()
    if role == "raise":
        raise RuntimeError("this rank gave up")
    hvd.allreduce(tf.ones([4]))
    print("wait returned", flush=True)


if __name__ == "__main__":
    np.seterr(all="ignore")
    main(*sys.argv[1:])
