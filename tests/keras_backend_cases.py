"""ringtrain.keras on Keras 3's torch and JAX backends: the tests each backend's file runs (tests/mpi/test_keras_*.py).

Keras fixes its backend at its first import, so each backend has a file of
its own that sets ``KERAS_BACKEND`` at its top, then imports :func:`use` and
the tests from here. Every rank trains on its shard of every global batch
through ``model.fit``; the reference is the same model trained by one process
on the whole batches with the plain optimizer, computed on every rank.
Multi-rank checks gather with mpi4py after the last collective.
"""

import os
import shutil
import sys
import tempfile

import numpy as np
import pytest
from mpi4py import MPI

COMM = MPI.COMM_WORLD


def use(backend, module):
    """Skip the calling test file, saying why, unless Keras runs on ``backend`` in this process.

    Keras picks its backend once per process, at its first import: a file
    collected after another backend's (``pytest tests/mpi`` in one process)
    gets the backend already fixed.
    """
    pytest.importorskip(module, reason=f"{module} is not installed: the {backend} backend's tests need it "
                                       f"(docs/tensorflow.md says how to install it)")
    keras = pytest.importorskip("keras", reason="keras is not installed (pip install keras, or the [tensorflow] "
                                                "extra)")
    if keras.backend.backend() != backend:
        pytest.skip(f"Keras was imported on its {keras.backend.backend()!r} backend earlier in this process; run "
                    f"this file alone (tests/test_mpi_suite.py does)", allow_module_level=True)
    return keras


@pytest.fixture(autouse=True)
def runtime():
    import ringtrain.comm
    import ringtrain.keras as hvd
    from ringtrain.engine import communicator_of

    hvd.init()
    ringtrain.comm.set_timeout(120, comm=communicator_of(None))
    yield hvd
    hvd.barrier()


def _model(seed):
    import keras

    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(2)])


def _data(batches, per_rank, n):
    rng = np.random.default_rng(7)
    x = rng.normal(size=(batches, per_rank * n, 4)).astype(np.float32)
    y = rng.normal(size=(batches, per_rank * n, 2)).astype(np.float32)
    return x, y


def _shard(x, y, per_rank):
    mine = slice(COMM.Get_rank() * per_rank, (COMM.Get_rank() + 1) * per_rank)
    return x[:, mine].reshape(-1, x.shape[-1]), y[:, mine].reshape(-1, y.shape[-1])


def fit_equals_one_process(runtime, name, compiled):
    """N ranks through DistributedOptimizer and the broadcast callback == one process on the whole batch."""
    import keras

    hvd, n, r = runtime, COMM.Get_size(), COMM.Get_rank()
    per_rank, batches = 3, 4
    x, y = _data(batches, per_rank, n)
    model = _model(seed=100 + r)  # different starts: the callback must make them rank 0's
    model.compile(optimizer=hvd.DistributedOptimizer(getattr(keras.optimizers, name)(learning_rate=0.05)),
                  loss="mse", jit_compile=compiled)
    mine_x, mine_y = _shard(x, y, per_rank)
    model.fit(mine_x, mine_y, batch_size=per_rank, shuffle=False, epochs=1, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    got = model.get_weights()

    # The callback broadcast rank 0's start when training began: the reference starts there too.
    reference = _model(seed=100)
    reference.compile(optimizer=getattr(keras.optimizers, name)(learning_rate=0.05), loss="mse")
    reference.fit(x.reshape(-1, 4), y.reshape(-1, 2), batch_size=per_rank * n, shuffle=False, epochs=1, verbose=0)
    for a, b in zip(got, reference.get_weights()):
        # float32 sums in another order: Adam divides by the gradients' size, so tiny ones differ relatively most.
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-5)


@pytest.mark.mpi
def test_the_broadcast_callback_makes_every_rank_start_from_rank_0(runtime):
    import keras

    hvd, r = runtime, COMM.Get_rank()
    x, y = _data(2, 2, COMM.Get_size())
    model = _model(seed=200 + r)
    before = [w.copy() for w in model.get_weights()]
    # A learning rate of 0: what the ranks end with is what the callback gave them.
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(learning_rate=0.0)), loss="mse")
    model.fit(*_shard(x, y, 2), batch_size=2, epochs=1, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    slots = [np.array(keras.ops.convert_to_numpy(v)) for v in model.optimizer.variables]
    everyone = COMM.allgather((before, model.get_weights(), slots))
    for _, after, rank_slots in everyone:
        for a, b in zip(after, everyone[0][0]):
            np.testing.assert_array_equal(a, b)  # rank 0's start, on every rank
        for a, b in zip(rank_slots, everyone[0][2]):
            np.testing.assert_array_equal(a, b)
    if COMM.Get_size() > 1:  # the starts did differ: the equality above is the broadcast's doing
        assert not np.array_equal(everyone[1][0][0], everyone[0][0][0])


@pytest.mark.mpi
def test_metric_average_and_learning_rate_callbacks(runtime):
    import keras

    hvd = runtime
    x, y = _data(2, 2, COMM.Get_size())
    model = _model(seed=1)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(learning_rate=0.1, momentum=0.9)),
                  loss="mse")
    seen = []
    record = keras.callbacks.LambdaCallback(on_epoch_end=lambda epoch, logs: seen.append(dict(logs)))
    model.fit(*_shard(x, y, 2), batch_size=2, epochs=3, verbose=0,
              callbacks=[hvd.callbacks.MetricAverageCallback(),
                         hvd.callbacks.LearningRateWarmupCallback(initial_lr=0.1, warmup_epochs=1),
                         hvd.callbacks.LearningRateScheduleCallback(initial_lr=0.1, multiplier=0.5, start_epoch=1),
                         record])
    losses = COMM.allgather([logs["loss"] for logs in seen])
    assert all(np.allclose(losses[0], mine) for mine in losses)  # averaged: the same on every rank
    # The warmup reached 0.1 at epoch 0's last batch; the schedule set 0.1 * 0.5 ** (epoch - 1) from epoch 1;
    # each change's momentum correction was undone after its step.
    assert [round(logs["lr"], 6) for logs in seen] == [0.1, 0.1, 0.05]
    assert np.isclose(float(np.asarray(model.optimizer.learning_rate)), 0.05)
    assert np.isclose(float(np.asarray(model.optimizer.momentum)), 0.9)


@pytest.mark.mpi
def test_values_reduce_gather_and_broadcast_as_numpy_says(runtime):
    hvd, n, r = runtime, COMM.Get_size(), COMM.Get_rank()
    mine = np.arange(6, dtype=np.float32).reshape(3, 2) * (r + 1)
    total = np.arange(6, dtype=np.float32).reshape(3, 2) * (n * (n + 1) / 2)
    summed = hvd.allreduce(mine, op=hvd.Sum)
    averaged = hvd.allreduce(mine)
    gathered = hvd.allgather(mine[: r + 1])
    root = hvd.broadcast(mine, root_rank=n - 1)
    np.testing.assert_allclose(summed, total)
    np.testing.assert_allclose(averaged, total / n)
    np.testing.assert_array_equal(gathered, np.concatenate([np.arange(6, dtype=np.float32).reshape(3, 2)[: k + 1]
                                                            * (k + 1) for k in range(n)]))
    np.testing.assert_array_equal(root, np.arange(6, dtype=np.float32).reshape(3, 2) * n)


@pytest.mark.mpi
def test_load_model_keeps_the_state_and_averages_again(runtime):
    import keras

    hvd, r = runtime, COMM.Get_rank()
    x, y = _data(2, 2, COMM.Get_size())
    model = _model(seed=3)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(learning_rate=0.05)), loss="mse")
    model.fit(*_shard(x, y, 2), batch_size=2, epochs=1, verbose=0)
    folder = tempfile.mkdtemp(prefix=f"keras-{r}-")  # a folder per rank: no rank reads another's file
    try:
        path = os.path.join(folder, "model.keras")
        model.save(path)
        loaded = hvd.load_model(path)
    finally:
        shutil.rmtree(folder)
    assert isinstance(loaded.optimizer, sys.modules["ringtrain.keras.native"].DistributedKerasOptimizer)
    assert int(np.asarray(loaded.optimizer.iterations)) == 2
    # Each rank trains on its own shard; the averaging keeps the weights equal everywhere.
    loaded.fit(*_shard(x, y, 2), batch_size=2, epochs=1, verbose=0)
    everyone = COMM.allgather(loaded.get_weights())
    for weights in everyone:
        for a, b in zip(weights, everyone[0]):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
