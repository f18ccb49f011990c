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
