"""The TensorFlow face's small op: ``hvd.allreduce`` of a 4 KiB tensor, eagerly, against ``ringtrain.allreduce_``.

One launch (under mpirun) times three ways of the same 4 KiB float32 sum,
interleaved: the face's ``hvd.allreduce`` of a tensor, the engine's own op
on the NumPy array (``ringtrain.engine.allreduce``, the blocking call the
face makes: the difference is the face's), and the library's
``ringtrain.allreduce_``; and, beside them, one eager TensorFlow op on the
same tensor (``tf.identity``, no communication: what dispatching any eager
op costs, and so what an op written as a TensorFlow kernel would pay). Rounds of CALLS calls of each, each batch started
after a barrier; the per-call time of a round is the slowest rank's, and
the launch prints the medians over rounds, the ratios to the library's and
the load average (before and after) as one JSON line::

    mpirun -np 2 python scripts/bench_tf.py --bytes 4096 --calls 500 --rounds 11

Figures depend on the machine and its load: quote them with both.
"""

import argparse
import json
import os
import statistics
import time


def _timed(comm, fn, calls):
    comm.Barrier()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    mine = (time.perf_counter() - start) / calls
    return max(comm.allgather(mine))


def one_launch(nbytes, calls, rounds):
    import numpy as np
    import tensorflow as tf
    from mpi4py import MPI

    import ringtrain
    import ringtrain.tensorflow as hvd
    from ringtrain import engine

    hvd.init()
    comm = MPI.COMM_WORLD
    x = np.zeros(nbytes // 4, np.float32)  # zeros: a sum of zeros stays zero
    t = tf.constant(x)
    face = lambda: hvd.allreduce(t, op=hvd.Sum)  # noqa: E731 - the call timed, as a user writes it
    y = x.copy()
    under = lambda: engine.allreduce(y, op=hvd.Sum, out=y)  # noqa: E731
    library = lambda: ringtrain.allreduce_(x, op="sum")  # noqa: E731
    one_op = lambda: tf.identity(t)  # noqa: E731 - what any eager TensorFlow op costs, collective or not
    ways = {"hvd.allreduce": face, "engine": under, "ringtrain.allreduce_": library, "tf.identity": one_op}
    for fn in ways.values():  # warm every path
        fn()
    load = os.getloadavg()[0]
    times = {k: [] for k in ways}
    for _ in range(rounds):
        for k, fn in ways.items():
            times[k].append(_timed(comm, fn, calls))
    medians = {k: statistics.median(v) * 1e6 for k, v in times.items()}
    if comm.Get_rank() == 0:
        library_us = medians["ringtrain.allreduce_"]
        print(json.dumps({"ranks": comm.Get_size(), "bytes": nbytes, "calls": calls, "rounds": rounds,
                          "median_us": {k: round(v, 2) for k, v in medians.items()},
                          "ratio": round(medians["hvd.allreduce"] / library_us, 2),
                          "engine_ratio": round(medians["engine"] / library_us, 2),
                          "tf_op_ratio": round(medians["tf.identity"] / library_us, 2),
                          "load": [round(load, 2), round(os.getloadavg()[0], 2)]}), flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bytes", type=int, default=4096, help="tensor size in bytes (default 4096)")
    parser.add_argument("--calls", type=int, default=500, help="calls per timed batch (default 500)")
    parser.add_argument("--rounds", type=int, default=11, help="interleaved rounds (default 11)")
    args = parser.parse_args()
    one_launch(args.bytes, args.calls, args.rounds)


if __name__ == "__main__":
    main()
