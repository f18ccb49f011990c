"""ringtrain.keras: a Keras 3 model trained on N ranks equals one process on the whole batch.

Run at 1, 2, 3 and 4 ranks by tests/test_mpi_suite.py. Each rank trains on
its shard of every global batch through ``model.fit`` (so the reduction runs
inside Keras's ``tf.function``); the reference is the same model trained by
one process on the whole batches with the plain optimizer, computed on every
rank. Skipped where tensorflow is not installed.
"""

import numpy as np
import pytest
from mpi4py import MPI

tf = pytest.importorskip("tensorflow", reason="tensorflow is not installed (pip install tensorflow-cpu==2.21.0)")
hvd = pytest.importorskip("ringtrain.keras")

import ringtrain.comm  # noqa: E402 - after the importorskip above
from ringtrain.tensorflow.collectives import communicator_of  # noqa: E402

COMM = MPI.COMM_WORLD
keras = tf.keras


@pytest.fixture(autouse=True)
def runtime():
    hvd.init()
    ringtrain.comm.set_timeout(120, comm=communicator_of(None))
    yield
    hvd.barrier()


def _model(seed):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(2)])
    return model


def _data(batches, per_rank, n):
    rng = np.random.default_rng(7)
    x = rng.normal(size=(batches, per_rank * n, 4)).astype(np.float32)
    y = rng.normal(size=(batches, per_rank * n, 2)).astype(np.float32)
    return x, y


@pytest.mark.mpi
@pytest.mark.parametrize("name", ["SGD", "Adam"])
def test_fit_on_n_ranks_equals_one_process_on_the_whole_batch(name):
    n, r = COMM.Get_size(), COMM.Get_rank()
    per_rank, batches = 3, 4
    x, y = _data(batches, per_rank, n)
    model = _model(seed=100 + r)  # different starts: the callback must make them rank 0's
    optimizer = hvd.DistributedOptimizer(getattr(keras.optimizers, name)(learning_rate=0.05))
    model.compile(optimizer=optimizer, loss="mse")
    mine = slice(r * per_rank, (r + 1) * per_rank)
    model.fit(x[:, mine].reshape(-1, 4), y[:, mine].reshape(-1, 2), batch_size=per_rank, shuffle=False,
              epochs=1, verbose=0, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    got = model.get_weights()

    # The callback broadcast rank 0's start when training began: the reference starts there too.
    reference = _model(seed=100)
    reference.compile(optimizer=getattr(keras.optimizers, name)(learning_rate=0.05), loss="mse")
    reference.fit(x.reshape(-1, 4), y.reshape(-1, 2), batch_size=per_rank * n, shuffle=False, epochs=1, verbose=0)
    for a, b in zip(got, reference.get_weights()):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)


@pytest.mark.mpi
def test_metric_average_and_learning_rate_callbacks():
    n, r = COMM.Get_size(), COMM.Get_rank()
    x, y = _data(2, 2, n)
    model = _model(seed=1)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(learning_rate=0.1)), loss="mse")
    seen = []
    record = keras.callbacks.LambdaCallback(on_epoch_end=lambda epoch, logs: seen.append(dict(logs)))
    mine = slice(r * 2, (r + 1) * 2)
    model.fit(x[:, mine].reshape(-1, 4), y[:, mine].reshape(-1, 2), batch_size=2, epochs=2, verbose=0,
              callbacks=[hvd.callbacks.MetricAverageCallback(),
                         hvd.callbacks.LearningRateScheduleCallback(initial_lr=0.1, multiplier=0.5), record])
    losses = COMM.allgather([logs["loss"] for logs in seen])
    assert all(np.allclose(losses[0], mine_) for mine_ in losses)  # averaged: the same on every rank
    assert np.isclose(float(np.asarray(model.optimizer.learning_rate)), 0.1 * 0.5)


def _gradients(model, x, y):
    """The gradients of the mean squared error of ``model`` on (x, y), one process, no collectives."""
    with tf.GradientTape() as tape:
        loss = keras.losses.MeanSquaredError()(y, model(x, training=True))
    return tape.gradient(loss, model.trainable_variables)


def _train(loop, model, optimizer, xs, ys):
    """Train on the batches (xs[b], ys[b]) by ``model.fit``, or by a custom loop eagerly or in a tf.function."""
    if loop == "fit":
        model.compile(optimizer=optimizer, loss="mse")
        model.fit(np.concatenate(xs), np.concatenate(ys), batch_size=len(xs[0]), shuffle=False, epochs=1, verbose=0)
        return

    def step(x, y):
        optimizer.apply_gradients(zip(_gradients(model, x, y), model.trainable_variables))

    step = tf.function(step) if loop == "function" else step
    for x, y in zip(xs, ys):
        step(tf.constant(x), tf.constant(y))


@pytest.mark.mpi
@pytest.mark.parametrize("average", [False, True], ids=["summed", "averaged"])
@pytest.mark.parametrize("loop", ["fit", "eager", "function", "fit-legacy"])
def test_backward_passes_per_step_equals_one_process_applying_every_nth_pass(loop, average):
    # Horovod's backward_passes_per_step: N passes summed locally, reduced and applied on the N-th;
    # the 4th pass here is accumulated and not applied. Momentum makes a skipped apply visible.
    n, r = COMM.Get_size(), COMM.Get_rank()
    passes, per_rank, batches = 3, 2, 4
    x, y = _data(batches, per_rank, n)
    mine = slice(r * per_rank, (r + 1) * per_rank)
    model = _model(seed=5)
    sgd = keras.optimizers.SGD
    if loop == "fit-legacy":  # Keras 2's OptimizerV2 (Horovod's examples use them)
        if hasattr(keras, "version") and keras.version().startswith("3"):
            pytest.skip("Keras 2's legacy optimizers (tf-keras, TF_USE_LEGACY_KERAS=1) only")
        sgd, loop = keras.optimizers.legacy.SGD, "fit"
    optimizer = hvd.DistributedOptimizer(sgd(learning_rate=0.05, momentum=0.5),
                                         backward_passes_per_step=passes, average_aggregated_gradients=average)
    _train(loop, model, optimizer, list(x[:, mine]), list(y[:, mine]))
    got, iterations = model.get_weights(), int(optimizer.iterations.numpy())
    counter = int(optimizer._agg_helper.counter.numpy())

    reference = _model(seed=5)
    plain = keras.optimizers.SGD(learning_rate=0.05, momentum=0.5)
    total = None
    for b in range(batches):  # every rank's shard of a batch is one pass over the whole batch here
        grads = _gradients(reference, x[b], y[b])
        total = grads if total is None else [t + g for t, g in zip(total, grads)]
        if (b + 1) % passes == 0:
            plain.apply_gradients(zip([t / passes if average else t for t in total], reference.trainable_variables))
            total = None
    for a, b in zip(got, reference.get_weights()):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)
    assert iterations == batches  # as in Horovod, a pass that does not apply still counts
    assert counter == batches % passes


@pytest.mark.mpi
def test_backward_passes_per_step_below_one_is_refused():
    with pytest.raises(ValueError, match="backward_passes_per_step must be > 0"):
        hvd.DistributedOptimizer(keras.optimizers.SGD(), backward_passes_per_step=0)


@pytest.mark.mpi
def test_partial_distributed_optimizer_keeps_local_layers_gradients_local_and_scaled():
    # Horovod's rule: a local layer's gradient is this rank's own, divided by the set's size; the rest averaged.
    n, r = COMM.Get_size(), COMM.Get_rank()
    x, y = _data(1, 2, n)
    mine = slice(r * 2, (r + 1) * 2)
    model = _model(seed=3)
    before = model.get_weights()
    optimizer = hvd.PartialDistributedOptimizer(keras.optimizers.SGD(learning_rate=0.5),
                                                local_layers=[model.layers[0]])
    _train("eager", model, optimizer, [x[0, mine]], [y[0, mine]])
    got = model.get_weights()

    reference = _model(seed=3)
    own = [g.numpy() for g in _gradients(reference, x[0, mine], y[0, mine])]
    whole = [g.numpy() for g in _gradients(reference, x[0], y[0])]
    local = {id(v) for v in reference.layers[0].trainable_weights}
    for w0, w, v, g_own, g_all in zip(before, got, reference.trainable_variables, own, whole):
        expected = w0 - 0.5 * (g_own / n if id(v) in local else g_all)
        np.testing.assert_allclose(w, expected, rtol=2e-5, atol=2e-6)


@pytest.mark.mpi
def test_broadcast_callback_leaves_local_variables_as_each_rank_made_them():
    n, r = COMM.Get_size(), COMM.Get_rank()
    x, y = _data(1, 2, n)
    model = _model(seed=200 + r)
    own = model.get_weights()
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(learning_rate=0.0)), loss="mse")
    root = n - 1
    local = list(model.layers[0].variables)
    model.fit(x[0], y[0], batch_size=2 * n, epochs=1, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(root, local_variables=local)])
    roots = _model(seed=200 + root).get_weights()
    local_ids = {id(v) for v in local}
    for v, mine_, theirs in zip(model.variables, own, roots):
        np.testing.assert_array_equal(v.numpy(), mine_ if id(v) in local_ids else theirs)
