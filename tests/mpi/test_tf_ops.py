"""ringtrain.tensorflow's Horovod ops against NumPy references, eagerly and inside tf.function.

Run at 1, 2, 3 and 4 ranks by tests/test_mpi_suite.py. Every rank makes its
own seeded data; the reference is MPI's allgather of everyone's data reduced
with NumPy. Values are small integers, so every result is exact in every
dtype and compared for equality. Many checks share one test (TensorFlow's
import and tracing cost seconds per rank). Gradients are compared with
TensorFlow's own gradient of the same computation written without
collectives (every rank's data as constants), scaled by Horovod's convention
for each op. Skipped where tensorflow is not installed.
"""

import threading
import time

import numpy as np
import pytest
from mpi4py import MPI

tf = pytest.importorskip("tensorflow", reason="tensorflow is not installed (pip install tensorflow-cpu==2.21.0)")
hvd = pytest.importorskip("ringtrain.tensorflow")

import ringtrain.comm  # noqa: E402 - after the importorskip above
import ringtrain.failure  # noqa: E402
from ringtrain.tensorflow.collectives import communicator_of, scatter_rows  # noqa: E402

COMM = MPI.COMM_WORLD
DTYPES = [np.uint8, np.int8, np.int32, np.int64, np.float16, np.float32, np.float64]
MODES = ["eager", "function"]


@pytest.fixture(autouse=True)
def runtime():
    hvd.init()
    # A rank whose assertion fails leaves its peers in the next op: the bound ends the job instead of a hang.
    ringtrain.comm.set_timeout(120, comm=communicator_of(None))
    yield
    hvd.barrier()


def _run(mode, fn, *args):
    """``fn(*args)`` eagerly, or traced once into a tf.function and run there; NumPy results."""
    if mode == "function":
        fn = tf.function(fn)
    out = fn(*args)
    return tf.nest.map_structure(lambda t: t.numpy(), out)


def _data(shape, dtype, seed):
    rng = np.random.default_rng(seed)
    low = 0 if dtype == np.uint8 else -3
    return rng.integers(low, 4, size=shape).astype(dtype)


def _everyone(array):
    return np.stack(COMM.allgather(array))


@pytest.mark.mpi
@pytest.mark.parametrize("mode", MODES)
def test_allreduce_every_op_and_dtype_matches_numpy(mode):
    n, r = COMM.Get_size(), COMM.Get_rank()
    ops = {hvd.Sum: lambda a: a.sum(0), hvd.Min: lambda a: a.min(0), hvd.Max: lambda a: a.max(0)}
    for i, dtype in enumerate(DTYPES):
        x = _data((3, 4), dtype, 100 * r + i)
        everyone = _everyone(x).astype(np.float64)
        for op, reduce in ops.items():
            got = _run(mode, lambda t, op=op: hvd.allreduce(t, op=op), tf.constant(x))
            np.testing.assert_array_equal(got, reduce(everyone).astype(dtype), err_msg=f"{dtype} op {op}")
        product = _run(mode, lambda t: hvd.allreduce(t, op=hvd.Product), tf.constant(np.ones_like(x) * 2))
        np.testing.assert_array_equal(product, np.full_like(x, 2 ** n), err_msg=f"{dtype} product")
        if dtype in (np.float32, np.float64):
            average = _run(mode, lambda t: hvd.allreduce(t, op=hvd.Average, prescale_factor=2.0,
                                                         postscale_factor=0.5), tf.constant(x))
            np.testing.assert_allclose(average, everyone.mean(0).astype(dtype), rtol=1e-6)
    grouped = _run(mode, lambda a, b: hvd.grouped_allreduce([a, b], op=hvd.Sum),
                   tf.constant(np.full(5, r, np.float32)), tf.constant(np.full((2, 2), 1, np.int32)))
    np.testing.assert_array_equal(grouped[0], np.full(5, sum(range(n)), np.float32))
    np.testing.assert_array_equal(grouped[1], np.full((2, 2), n, np.int32))
    # fp16 compression: float32 travels as float16 (small integers: exact) and comes back float32; int32 as it is.
    for x in (_data((3, 4), np.float32, r), _data((3, 4), np.int32, r)):
        got = _run(mode, lambda t: hvd.allreduce(t, op=hvd.Sum, compression=hvd.Compression.fp16), tf.constant(x))
        assert got.dtype == x.dtype
        np.testing.assert_array_equal(got, _everyone(x).sum(0).astype(x.dtype), err_msg=f"fp16 {x.dtype}")


@pytest.mark.mpi
@pytest.mark.parametrize("mode", MODES)
def test_allgather_broadcast_alltoall_reducescatter_match_numpy(mode):
    n, r = COMM.Get_size(), COMM.Get_rank()
    for i, dtype in enumerate(DTYPES):
        x = _data((r + 1, 2), dtype, 10 * r + i)
        got = _run(mode, hvd.allgather, tf.constant(x))
        np.testing.assert_array_equal(got, np.concatenate(COMM.allgather(x)), err_msg=f"allgather {dtype}")
        y = _data((3,), dtype, 7 * r + i)
        for root in range(n):
            got = _run(mode, lambda t, root=root: hvd.broadcast(t, root), tf.constant(y))
            np.testing.assert_array_equal(got, COMM.bcast(y, root=root), err_msg=f"broadcast {dtype} root {root}")
    splits = np.array([(r + d) % 3 for d in range(n)], np.int32)
    x = np.arange(int(splits.sum()) * 2, dtype=np.float32).reshape(-1, 2) + 100 * r
    out, received = _run(mode, lambda t, s: hvd.alltoall(t, splits=s), tf.constant(x), tf.constant(splits))
    sent = np.split(x, np.cumsum(splits)[:-1])
    expected = COMM.alltoall(sent)
    np.testing.assert_array_equal(out, np.concatenate(expected))
    np.testing.assert_array_equal(received, [len(e) for e in expected])
    for op in (hvd.Sum, hvd.Average):
        z = _data((2 * n + 1, 3), np.float64, 3 * r)
        got = _run(mode, lambda t, op=op: hvd.reducescatter(t, op=op), tf.constant(z))
        total = _everyone(z).sum(0) / (n if op == hvd.Average else 1)
        start, stop = scatter_rows(2 * n + 1, n)[r]
        np.testing.assert_allclose(got, total[start:stop], err_msg=f"reducescatter op {op}")


@pytest.mark.mpi
def test_indexed_slices_are_gathered_as_horovod_does():
    n, r = COMM.Get_size(), COMM.Get_rank()
    slices = tf.IndexedSlices(tf.constant(np.full((2, 3), r + 1, np.float32)), tf.constant([r, r + 1]),
                              dense_shape=tf.constant([n + 1, 3]))
    got = hvd.allreduce(slices, op=hvd.Sum)
    dense = tf.math.unsorted_segment_sum(got.values, got.indices, n + 1).numpy()
    expected = np.zeros((n + 1, 3), np.float32)
    for k in range(n):
        expected[k:k + 2] += k + 1
    np.testing.assert_array_equal(dense, expected)
    with pytest.raises(NotImplementedError):
        hvd.allreduce(slices, op=hvd.Max)


def _global_loss(op, n, r, xs, ws, x_me):
    """The sum over ranks of each rank's ``sum(w_rank * op(x))`` written without collectives (TF's own graph)."""
    xs = [x_me if k == r else tf.constant(x) for k, x in enumerate(xs)]
    if op == "allreduce":
        outs = [tf.add_n(xs)] * n
    elif op == "allgather":
        outs = [tf.concat(xs, 0)] * n
    elif op == "broadcast":
        outs = [xs[0]] * n
    else:  # reducescatter (sum)
        total = tf.add_n(xs)
        outs = [total[a:b] for a, b in scatter_rows(total.shape[0], n)]
    return tf.add_n([tf.reduce_sum(tf.constant(w) * o) for w, o in zip(ws, outs)])


@pytest.mark.mpi
@pytest.mark.parametrize("mode", MODES)
def test_gradients_match_tensorflow_with_horovods_scaling(mode):
    n, r = COMM.Get_size(), COMM.Get_rank()
    # Horovod's registered gradients relative to the gradient of the sum of every rank's loss.
    cases = {"allreduce": (lambda t: hvd.allreduce(t, op=hvd.Sum), 1.0),
             "allgather": (hvd.allgather, 1.0 / n),
             "broadcast": (lambda t: hvd.broadcast(t, 0), (1.0 / n) if r == 0 else 0.0),
             "reducescatter": (lambda t: hvd.reducescatter(t, op=hvd.Sum), float(n))}
    for name, (op, scale) in cases.items():
        x = np.random.default_rng(r).normal(size=(n + 1, 2))
        xs = COMM.allgather(x)
        out_shape = {"allgather": (sum(len(a) for a in xs), 2),
                     "reducescatter": (np.subtract(*scatter_rows(n + 1, n)[r][::-1]), 2)}.get(name, x.shape)
        w = np.random.default_rng(50 + r).normal(size=out_shape)
        ws = COMM.allgather(w)

        def grad(v, w=w, op=op):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(tf.convert_to_tensor(w) * op(v))
            return tape.gradient(loss, v)
        v = tf.Variable(x)
        got = _run(mode, grad, v)
        with tf.GradientTape() as tape:
            reference = tape.gradient(_global_loss(name, n, r, xs, ws, v), v,
                                      unconnected_gradients=tf.UnconnectedGradients.ZERO)
        np.testing.assert_allclose(got, scale * reference.numpy(), atol=1e-12, err_msg=name)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("mode", MODES)
def test_disagreement_is_an_error_on_every_rank(mode):
    # Horovod's types, eagerly and inside a graph (where a Python function's own error would be an
    # UnknownError): a disagreement is a FailedPreconditionError, a refusal an InvalidArgumentError.
    r = COMM.Get_rank()
    mismatch = tf.errors.FailedPreconditionError
    with pytest.raises(mismatch, match="shape"):
        _run(mode, hvd.allreduce, tf.ones([3 + r]))
    with pytest.raises(mismatch, match="dtype"):
        _run(mode, hvd.allgather, tf.ones([2], tf.float32 if r else tf.int32))
    if r == 0:
        with pytest.raises(tf.errors.InvalidArgumentError, match="splits"):
            _run(mode, lambda t: hvd.alltoall(t, splits=[5] * COMM.Get_size()), tf.ones([2]))
    else:
        with pytest.raises(mismatch, match="rank 0 refused"):
            _run(mode, hvd.alltoall, tf.ones([COMM.Get_size()]))


@pytest.mark.mpi(min_size=2)
def test_a_failed_collective_whose_result_a_tf_function_drops_still_raises():
    r = COMM.Get_rank()

    @tf.function
    def dropped(t):
        hvd.allreduce(t, name="dropped")
        return t + 1

    with pytest.raises(tf.errors.FailedPreconditionError, match="shape") as failed:
        dropped(tf.ones([3 + r]))
    assert "/dev/null" not in ringtrain.failure.describe(failed.value)


@pytest.mark.mpi(min_size=2)
def test_a_tf1_fetch_raises_the_failure_of_a_collective_built_before_it():
    r = COMM.Get_rank()
    with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
        failed = hvd.allreduce(tf.ones([3 + r]))  # never fetched: the next collective runs after it
        later = hvd.allreduce(tf.ones([2]), op=hvd.Sum)
        with pytest.raises(tf.errors.FailedPreconditionError, match="shape"):
            sess.run(later)
        del failed


@pytest.mark.mpi
def test_tape_optimizer_and_objects():
    n, r = COMM.Get_size(), COMM.Get_rank()
    v = tf.Variable(np.full(3, float(r)))
    hvd.broadcast_variables([v], root_rank=n - 1)
    np.testing.assert_array_equal(v.numpy(), np.full(3, float(n - 1)))
    w = tf.Variable(np.arange(3.0))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(w * float(r + 1))
    grads = hvd.DistributedGradientTape(tape).gradient(loss, [w])
    np.testing.assert_allclose(grads[0].numpy(), np.full(3, (n + 1) / 2))
    assert hvd.broadcast_object({"r": r}, root_rank=0) == {"r": 0}
    if n > 1:  # ranks that name different roots: Horovod's error on every rank
        with pytest.raises(tf.errors.FailedPreconditionError, match="root"):
            hvd.broadcast_object(r, root_rank=r % 2)
    assert hvd.allgather_object(r * 2) == [2 * k for k in range(n)]
    assert int(hvd.size_op().numpy()) == n and int(hvd.rank_op().numpy()) == r


@pytest.mark.mpi
def test_named_tf_function_collectives_of_two_threads_are_matched_by_name():
    # Each thread runs a tf.function of its own, its collective named, at moments of its own on each rank:
    # a run must meet the same collective's run on the other ranks, whichever thread came first.
    n, r = COMM.Get_size(), COMM.Get_rank()
    ones = tf.function(lambda t: hvd.allreduce(t, op=hvd.Sum, name="ones"))
    hundreds = tf.function(lambda t: hvd.allreduce(t, op=hvd.Sum, name="hundreds"))
    got = {}

    def loop(fn, value, seed):
        rng = np.random.default_rng(seed)
        try:
            for _ in range(20):
                time.sleep(rng.random() * 0.004)
                got.setdefault(value, []).append(float(fn(tf.constant([value]))[0]))
        except Exception as exc:  # noqa: BLE001 - reported by the assertion below
            got[value] = repr(exc)
    threads = [threading.Thread(target=loop, args=(ones, 1.0, 2 * r)),
               threading.Thread(target=loop, args=(hundreds, 100.0, 2 * r + 1))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(100)
    assert got == {1.0: [float(n)] * 20, 100.0: [100.0 * n] * 20}


@pytest.mark.mpi(min_size=2)
def test_an_unnamed_tf_function_collective_run_by_some_ranks_leaves_everyones_next_one_matched():
    # Rank 0 alone runs a tf.function's unnamed collective on a set of its own; then every rank runs another
    # tf.function's: its name must not depend on how many collectives a rank ran before.
    n, r = COMM.Get_size(), COMM.Get_rank()
    mine = hvd.add_process_set([0])
    try:
        alone = tf.function(lambda: hvd.allreduce(tf.constant([5.0]), op=hvd.Sum, process_set=mine))() \
            if r == 0 else None
        everyone = tf.function(lambda: hvd.allreduce(tf.constant([float(r + 1)]), op=hvd.Sum))()
    finally:
        hvd.remove_process_set(mine)
    assert float(everyone[0]) == n * (n + 1) / 2
    assert r != 0 or float(alone[0]) == 5.0


KINDS = (tf.int8, tf.int16, tf.int32, tf.int64, tf.uint8, tf.float16, tf.float64)  # besides float32 and bool


@pytest.mark.mpi
def test_a_loop_of_eager_allreduces_keeps_every_promise():
    # The eager loop's op goes straight to the engine (its cached record, its path for a lone op): each
    # result is a tensor of its own (the engine's output memory, handed to TensorFlow: its kernels must
    # take it, as they take only aligned memory), scalars and bools reduce, a tape still records the
    # gradient, and a tf.function over an eager tensor still builds a graph op.
    n, r = COMM.Get_size(), COMM.Get_rank()
    x = tf.constant(np.full(1024, r, np.float32))
    results = [hvd.allreduce(x * float(i), op=hvd.Sum) for i in range(20)]
    kinds = [hvd.allreduce(tf.constant(np.full((3, 5), r + 1), dtype), op=hvd.Sum)
             for dtype in KINDS]
    kernel_sums = [float(tf.reduce_sum(tf.cast(got, tf.float64))) for got in results + kinds]
    scalar = hvd.allreduce(tf.constant(float(r)))
    flags = hvd.allreduce(tf.constant([r == 0, True]), op=hvd.Min)
    flags_all = bool(tf.reduce_all(flags))  # (a kernel on the bool result)
    watched = tf.constant([1.0, 2.0])
    with tf.GradientTape() as tape:
        tape.watch(watched)
        total = tf.reduce_sum(hvd.allreduce(watched * float(r + 1), op=hvd.Sum))
    grad = tape.gradient(total, watched)
    traced = tf.function(lambda: hvd.allreduce(x, op=hvd.Max))()
    for i, got in enumerate(results):
        np.testing.assert_array_equal(got.numpy(), np.full(1024, i * n * (n - 1) / 2, np.float32))
    assert kernel_sums == [1024 * i * n * (n - 1) / 2 for i in range(20)] + [15 * n * (n + 1) / 2] * len(kinds)
    assert all(got.dtype == dtype for got, dtype in zip(kinds, KINDS))
    assert float(scalar) == (n - 1) / 2 and scalar.shape == ()
    np.testing.assert_array_equal(flags.numpy(), [n == 1, True])
    assert flags_all == (n == 1)
    np.testing.assert_allclose(grad.numpy(), np.full(2, n * (r + 1.0)))  # the Sum of dy (n), times r + 1
    np.testing.assert_array_equal(traced.numpy(), np.full(1024, n - 1, np.float32))


@pytest.mark.mpi(min_size=2)
def test_an_eager_loop_whose_ranks_part_ways_fails_on_every_rank():
    # The same small op repeated (matched by its cached record on the engine's path for a lone op) until
    # one rank changes the op: every rank gets the error, and the next op works again.
    r = COMM.Get_rank()
    x = tf.ones([256])
    for _ in range(5):
        hvd.allreduce(x, op=hvd.Sum)
    with pytest.raises(tf.errors.FailedPreconditionError, match="op"):
        hvd.allreduce(x, op=hvd.Sum if r == 0 else hvd.Max)
    np.testing.assert_array_equal(hvd.allreduce(x, op=hvd.Sum).numpy(), np.full(256, COMM.Get_size()))


@pytest.mark.mpi
@pytest.mark.parametrize("average", [False, True], ids=["summed", "averaged"])
@pytest.mark.parametrize("mode", MODES + ["graph"])
def test_tf1_optimizer_with_backward_passes_per_step_applies_every_nth_sum(mode, average):
    # The reference: one process, the plain optimizer, every rank's data; it applies the sum of each
    # N passes' averaged gradients (divided by N when averaged). The 5th pass is accumulated, not applied.
    n, r = COMM.Get_size(), COMM.Get_rank()
    passes, steps = 2, 5
    data = np.random.default_rng(11).normal(size=(steps, n, 3))
    run = _tf1_graph_passes if mode == "graph" else _tf2_passes
    w, global_step, counter = run(mode == "function", data[:, r], passes, average)

    w_ref, plain, total = tf.Variable(np.ones(3)), tf.compat.v1.train.MomentumOptimizer(0.1, 0.5), 0.0
    for b in range(steps):
        total = total + 2.0 * w_ref.numpy() * data[b].mean(axis=0)
        if (b + 1) % passes == 0:
            plain.apply_gradients([(tf.constant(total / passes if average else total), w_ref)])
            total = 0.0
    np.testing.assert_allclose(w, w_ref.numpy(), rtol=1e-12)
    assert global_step == steps  # as in Horovod, a pass that does not apply still counts
    assert counter == steps % passes


def _tf1_optimizer(passes, average):
    return hvd.DistributedOptimizer(tf.compat.v1.train.MomentumOptimizer(0.1, 0.5), backward_passes_per_step=passes,
                                    average_aggregated_gradients=average)


def _tf2_passes(function, mine, passes, average):
    """Eager or tf.function: ``minimize`` of sum(w * w * x) for each of this rank's rows x; (w, step, counter)."""
    w, global_step = tf.Variable(np.ones(3)), tf.Variable(0, dtype=tf.int64)
    opt = _tf1_optimizer(passes, average)

    def step(x):
        opt.minimize(lambda: tf.reduce_sum(w * w * x), var_list=[w], global_step=global_step)

    step = tf.function(step) if function else step
    for x in mine:
        step(tf.constant(x))
    return w.numpy(), int(global_step.numpy()), int(opt._agg_helper.counter.numpy())


def _tf1_graph_passes(function, mine, passes, average):
    """The same passes in a TF1 graph run by a Session (where Horovod serves backward_passes_per_step)."""
    del function
    with tf.Graph().as_default():
        w, x = tf.Variable(np.ones(3)), tf.compat.v1.placeholder(tf.float64, [3])
        global_step = tf.compat.v1.train.get_or_create_global_step()
        opt = _tf1_optimizer(passes, average)
        train = opt.minimize(tf.reduce_sum(w * w * x), global_step=global_step)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            for row in mine:
                sess.run(train, {x: row})
            got, step, counter = sess.run([w, global_step, opt._agg_helper.counter])
    return got, int(step), int(counter)
