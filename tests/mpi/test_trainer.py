"""The trainer against references it can compute: one process, and itself straight through.

Runs at 1, 2, 3 and 4 ranks. Each test ends its collectives before asserting.
"""

import dataclasses
import os
import tempfile

import numpy as np
import pytest
from mpi4py import MPI

from ringtrain.training.config import TrainConfig
from ringtrain.models.registry import build_model
from ringtrain.training.loop import train
from ringtrain.training.replicas import params_digest

QUIET = dict(progress=False, log_every=1000, eval_every=0)


def shared_tmpdir(comm):
    """A temporary directory that every rank agrees on (made by rank 0)."""
    path = tempfile.mkdtemp(prefix="ringtrain-test-") if comm.Get_rank() == 0 else None
    return comm.bcast(path, root=0)


def write_dataset(comm, directory, n_train, n_test=24, features=7, classes=3, seed=5):
    path = os.path.join(directory, "data.npz")
    if comm.Get_rank() == 0:
        rng = np.random.default_rng(seed)
        centers = rng.normal(size=(classes, features)) * 2
        y = rng.integers(0, classes, n_train + n_test)
        x = (centers[y] + rng.normal(size=(len(y), features))).astype(np.float32)
        np.savez(path, x=x[:n_train], y=y[:n_train], x_test=x[n_train:], y_test=y[n_train:])
    comm.Barrier()
    return path


@pytest.mark.mpi
def test_full_batch_equals_single_process():
    # With a dataset that divides evenly and the whole shard as the batch,
    # N ranks averaging shard gradients take exactly the single-process step.
    comm = MPI.COMM_WORLD
    size, rank = comm.Get_size(), comm.Get_rank()
    tmp = shared_tmpdir(comm)
    n = 120  # divisible by 1, 2, 3 and 4
    data = write_dataset(comm, tmp, n)
    base = TrainConfig(dataset=data, model="mlp", hidden=(16,), optimizer="sgd", momentum=0.0, lr=0.3,
                       epochs=15, resume="none", **QUIET)
    many = train(dataclasses.replace(base, batch_size=n // size, run_dir=os.path.join(tmp, "many")), comm)
    one = train(dataclasses.replace(base, batch_size=n, run_dir=os.path.join(tmp, f"one-{rank}")), MPI.COMM_SELF)
    comm.Barrier()
    assert many.step == one.step == 15
    for name in one.params:
        np.testing.assert_allclose(many.params[name], one.params[name], rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.mpi
@pytest.mark.parametrize("stop_at", [5, 9])  # mid-epoch, and at an epoch boundary (9 steps per epoch)
def test_resume_is_bitwise_exact(stop_at):
    comm = MPI.COMM_WORLD
    size = comm.Get_size()
    tmp = shared_tmpdir(comm)
    n = 9 * 4 * size  # 9 steps per epoch at batch 4
    data = write_dataset(comm, tmp, n)
    base = TrainConfig(dataset=data, model="mlp", hidden=(8,), optimizer="adam", lr=0.01, epochs=3,
                       batch_size=4, checkpoint_every=4, resume="auto", **QUIET)
    straight = train(dataclasses.replace(base, run_dir=os.path.join(tmp, "straight")), comm)
    stopped = train(dataclasses.replace(base, run_dir=os.path.join(tmp, "resumed"), max_steps=stop_at), comm)
    resumed = train(dataclasses.replace(base, run_dir=os.path.join(tmp, "resumed")), comm)
    digests = comm.allgather({k: v.tobytes() for k, v in resumed.params.items()})
    assert stopped.step == stop_at and stopped.stopped == "max_steps"
    assert resumed.step == straight.step == 27
    for name in straight.params:
        assert np.array_equal(straight.params[name], resumed.params[name]), name
    assert all(d == digests[0] for d in digests)


@pytest.mark.mpi
def test_every_rank_ends_with_identical_parameters():
    comm = MPI.COMM_WORLD
    tmp = shared_tmpdir(comm)
    result = train(TrainConfig(dataset="synthetic", samples=503, features=5, classes=3, hidden=(8,), epochs=2,
                               batch_size=8, run_dir=os.path.join(tmp, "r"), resume="none", **QUIET), comm)
    everyone = comm.allgather({k: v.tobytes() for k, v in result.params.items()})
    assert all(e == everyone[0] for e in everyone)


def _overlap_run(comm, tmp, name, **settings):
    # Small buckets (1 KiB), so the MLP's gradients form four buckets and
    # overlapping really starts reductions during backward. Unsharded, so
    # that --no-overlap reduces the same buckets with the same calls.
    cfg = TrainConfig(dataset="synthetic", samples=400, features=40, classes=4, hidden=(48, 24), epochs=2,
                      batch_size=16, bucket_mb=1 / 1024, run_dir=os.path.join(tmp, name), resume="none",
                      eval_every=1, progress=False, log_every=1000, shard_optimizer=False)
    return train(dataclasses.replace(cfg, **settings), comm)


@pytest.mark.mpi
def test_overlap_on_and_off_give_bitwise_equal_parameters_and_fp16_comes_close():
    comm = MPI.COMM_WORLD
    tmp = shared_tmpdir(comm)
    on = _overlap_run(comm, tmp, "on", overlap=True)
    off = _overlap_run(comm, tmp, "off", overlap=False)
    half_on = _overlap_run(comm, tmp, "fp16-on", overlap=True, fp16_allreduce=True)
    half_off = _overlap_run(comm, tmp, "fp16-off", overlap=False, fp16_allreduce=True)
    digests = comm.allgather([params_digest(r.params) for r in (on, off, half_on, half_off)])
    assert all(d == digests[0] for d in digests)  # every rank identical, in every mode
    assert params_digest(on.params) == params_digest(off.params)
    assert params_digest(half_on.params) == params_digest(half_off.params)
    for name in on.params:
        np.testing.assert_allclose(half_on.params[name], on.params[name], rtol=0.05, atol=0.02, err_msg=name)
    assert abs(half_on.eval["accuracy"] - on.eval["accuracy"]) <= 0.05


@pytest.mark.mpi
def test_resume_with_overlap_and_fp16_is_bitwise_exact():
    comm = MPI.COMM_WORLD
    tmp = shared_tmpdir(comm)
    straight = _overlap_run(comm, tmp, "straight", fp16_allreduce=True)
    _overlap_run(comm, tmp, "resumed", fp16_allreduce=True, max_steps=7, checkpoint_every=3, resume="auto")
    resumed = _overlap_run(comm, tmp, "resumed", fp16_allreduce=True, resume="auto")
    comm.Barrier()
    assert resumed.step == straight.step
    assert params_digest(resumed.params) == params_digest(straight.params)


@pytest.mark.mpi
@pytest.mark.parametrize("algorithm", ["shm", "ring"])
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_sharded_optimizer_step_gives_bitwise_the_unsharded_run(algorithm, optimizer):
    # Same transport both ways, so every chunk is summed in the same order.
    comm = MPI.COMM_WORLD
    tmp = shared_tmpdir(comm)
    base = TrainConfig(dataset="synthetic", samples=301, features=24, classes=5, hidden=(32, 16), epochs=2,
                       batch_size=8, optimizer=optimizer, lr=0.05, weight_decay=0.01, allreduce=algorithm,
                       resume="none", **QUIET)
    # The caller's own model: the sharded step moves its buffers into shared
    # memory for the run and must hand them back before freeing the window.
    model = build_model("mlp", 24, 5, hidden=(32, 16), seed=base.seed)
    sharded = train(dataclasses.replace(base, run_dir=os.path.join(tmp, "sharded")), comm, model=model)
    whole = train(dataclasses.replace(base, run_dir=os.path.join(tmp, "whole"), shard_optimizer=False), comm)
    digests = comm.allgather((params_digest(sharded.params), params_digest(whole.params)))
    after = model.evaluate(np.ones((3, 24), np.float32), np.array([0, 1, 2]))  # usable after the run
    assert all(d == digests[0] for d in digests)
    assert digests[0][0] == digests[0][1]
    assert sharded.eval == whole.eval
    assert params_digest(model.params) == digests[0][0] and np.isfinite(after[0])


@pytest.mark.mpi
def test_a_sharded_checkpoint_resumes_unsharded_bitwise():
    # The checkpoint holds the whole optimizer state only if every rank's
    # shard of it was gathered first: an unsharded run resumed from it must
    # end where the sharded run going straight through ends.
    comm = MPI.COMM_WORLD
    tmp = shared_tmpdir(comm)
    n = 9 * 4 * comm.Get_size()
    data = write_dataset(comm, tmp, n)
    base = TrainConfig(dataset=data, model="mlp", hidden=(8,), optimizer="adam", lr=0.01, epochs=3, batch_size=4,
                       checkpoint_every=4, allreduce="shm", resume="auto", **QUIET)
    straight = train(dataclasses.replace(base, run_dir=os.path.join(tmp, "straight")), comm)
    train(dataclasses.replace(base, run_dir=os.path.join(tmp, "resumed"), max_steps=5), comm)
    resumed = train(dataclasses.replace(base, run_dir=os.path.join(tmp, "resumed"), shard_optimizer=False), comm)
    comm.Barrier()
    assert resumed.step == straight.step == 27
    assert params_digest(resumed.params) == params_digest(straight.params)
