"""A torch module through the trainer against a single-process run (skipped where torch is not installed).

Runs at 1, 2, 3 and 4 ranks. Each test ends its collectives before asserting.
"""

import dataclasses
import io
import os
import tempfile

import numpy as np
import pytest
from mpi4py import MPI

from ringtrain.training.config import TrainConfig
from ringtrain.training.loop import train
from ringtrain.training.replicas import params_digest

try:
    import torch

    from ringtrain.torch import TorchModel
except ImportError:  # collected and skipped, so the suite still sees this file's tests
    torch = None

pytestmark = pytest.mark.skipif(torch is None, reason="torch is not installed")

SHAPE = (1, 8, 8)
QUIET = dict(progress=False, log_every=1000, eval_every=0)


def small_cnn(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 4, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Flatten(), torch.nn.Linear(4 * 4 * 4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3),
    )


def shared_tmpdir(comm):
    path = tempfile.mkdtemp(prefix="ringtrain-torch-") if comm.Get_rank() == 0 else None
    return comm.bcast(path, root=0)


def write_images(comm, directory, n_train, n_test=24, classes=3, seed=5):
    """An .npz of 8x8 one-channel images: the trainer hands them to the model as flat rows."""
    path = os.path.join(directory, "images.npz")
    if comm.Get_rank() == 0:
        rng = np.random.default_rng(seed)
        centres = rng.normal(size=(classes, *SHAPE[1:])) * 2
        y = rng.integers(0, classes, n_train + n_test)
        x = (centres[y] + rng.normal(size=(len(y), *SHAPE[1:]))).astype(np.float32)
        np.savez(path, x=x[:n_train], y=y[:n_train], x_test=x[n_train:], y_test=y[n_train:])
    comm.Barrier()
    return path


@pytest.mark.mpi
@pytest.mark.parametrize("settings, path", [
    ({}, "sharded optimizer step"),
    # Tiny buckets: several per step, so the hooks' on_grad really overlaps with backward.
    ({"bucket_mb": 1 / 1024}, "overlapped in"),
])
def test_full_batch_at_n_ranks_equals_a_single_process_run(settings, path):
    # An evenly divisible dataset with the whole shard as the batch: N ranks
    # averaging their shards' gradients take the single process's step.
    comm = MPI.COMM_WORLD
    size, rank = comm.Get_size(), comm.Get_rank()
    tmp = shared_tmpdir(comm)
    n = 120  # divisible by 1, 2, 3 and 4
    base = TrainConfig(dataset=write_images(comm, tmp, n), optimizer="sgd", momentum=0.9, lr=0.05, epochs=8,
                       resume="none", **QUIET, **settings)
    printed = io.StringIO()
    many = train(dataclasses.replace(base, batch_size=n // size, run_dir=os.path.join(tmp, "many")), comm,
                 model=TorchModel(small_cnn(), input_shape=SHAPE), stream=printed)
    one = train(dataclasses.replace(base, batch_size=n, run_dir=os.path.join(tmp, f"one-{rank}")), MPI.COMM_SELF,
                model=TorchModel(small_cnn(), input_shape=SHAPE), stream=io.StringIO())
    everyone = comm.allgather(params_digest(many.params))
    assert many.step == one.step == 8
    assert all(d == everyone[0] for d in everyone)  # replicas bitwise identical
    if size > 1 and rank == 0:
        assert path in printed.getvalue(), printed.getvalue()
    for name in one.params:
        np.testing.assert_allclose(many.params[name], one.params[name], rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.mpi
def test_the_trained_module_holds_the_trained_parameters():
    # After train() the sharded step has moved the buffers out of its window
    # again: the user's module must still be the trained network.
    comm = MPI.COMM_WORLD
    tmp = shared_tmpdir(comm)
    module = small_cnn()
    model = TorchModel(module, input_shape=SHAPE)
    result = train(TrainConfig(dataset=write_images(comm, tmp, 48), batch_size=4, epochs=2, resume="none",
                               run_dir=os.path.join(tmp, "r"), **QUIET), comm, model=model)
    comm.Barrier()
    for name, p in module.named_parameters():
        np.testing.assert_array_equal(p.detach().numpy(), result.params[name], err_msg=name)
