"""``ringtrain train --model cnn`` under real mpirun, against references it can compute.

The references are the ones the MLP is held to: one process taking the
full-batch step that several ranks take together (tests/mpi/test_trainer.py),
and a straight run that a run resumed after a killed rank must equal bit for
bit (tests/cli/test_faults.py, whose fault-injecting program is reused).
Every job runs under a time bound.
"""

import os
import sys

import numpy as np

import ringtrain
from mpirun import ROOT, mpirun, ringtrain as rt, show

FAULTY = os.path.join(ROOT, "tests", "cli", "programs", "faulty_train.py")
# A small network, so that a job is mostly start-up: one 3x3 block of 4 channels, then 8 units.
NET = ["--model", "cnn", "--channels", "4", "--kernel", "3", "--hidden", "8", "--no-progress"]


def write_images(path, n_train, n_test, classes=3, seed=5):
    """N x 8 x 8 images: a fixed random pattern per class plus noise."""
    rng = np.random.default_rng(seed)
    patterns = rng.normal(size=(classes, 8, 8))
    y = rng.integers(0, classes, n_train + n_test)
    x = (patterns[y] + rng.normal(size=(len(y), 8, 8))).astype(np.float32)
    np.savez(path, x=x[:n_train], y=y[:n_train], x_test=x[n_train:], y_test=y[n_train:])
    return str(path)


def final_params(run_dir):
    params, meta = ringtrain.load_checkpoint(str(run_dir))
    assert meta["final"], meta
    return params


def initial_params(data):
    """The parameters the runs started from (built here as the trainer builds them)."""
    from mpi4py import MPI

    from ringtrain.data.load import load_sharded

    shard = load_sharded(data, MPI.COMM_SELF)
    model = ringtrain.build_model("cnn", shard.num_features, shard.num_classes, hidden=(8,), seed=0,
                                  input_shape=shard.image_shape, channels=(4,), kernel=3)
    return model.params


def test_full_batch_on_3_ranks_equals_one_process(tmp_path):
    # With the shard as the batch, 3 ranks averaging their shard gradients
    # take exactly the step one process takes on the whole set.
    n = 48  # divisible by 3
    data = write_images(tmp_path / "images.npz", n, 12)
    flags = [*NET, "--dataset", data, "--optimizer", "sgd", "--momentum", "0", "--lr", "0.1", "--epochs", "10",
             "--eval-every", "0", "--resume", "none"]
    many = mpirun(3, rt("train", *flags, "--batch-size", str(n // 3), "--run-dir", str(tmp_path / "many")),
                  timeout=120)
    assert many.returncode == 0, show(many)
    assert "ringtrain: sharded optimizer step" in many.stdout, show(many)  # the CNN is on the flat-buffer tier
    one = mpirun(1, rt("train", *flags, "--batch-size", str(n), "--run-dir", str(tmp_path / "one")), timeout=120)
    assert one.returncode == 0, show(one)
    got, want = final_params(tmp_path / "many"), final_params(tmp_path / "one")
    assert list(got) == ["conv1.weight", "conv1.bias", "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    assert got["conv1.weight"].shape == (3, 3, 1, 4) and got["fc1.weight"].shape == (4 * 4 * 4, 8)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6, err_msg=name)
    assert not np.array_equal(want["conv1.weight"], initial_params(data)["conv1.weight"])  # it trained


def test_killed_rank_then_resume_matches_an_uninterrupted_run(tmp_path):
    # 320 training rows: 20 steps per epoch at 2 ranks, as in test_faults.py.
    data = write_images(tmp_path / "images.npz", 320, 80)
    flags = [*NET, "--dataset", data, "--batch-size", "8", "--epochs", "3", "--checkpoint-every", "5",
             "--keep", "3"]
    straight = mpirun(2, rt("train", *flags, "--run-dir", str(tmp_path / "straight")), timeout=120)
    assert straight.returncode == 0, show(straight)

    run_dir = tmp_path / "run"
    killed = mpirun(2, [sys.executable, FAULTY, "kill", "1", "23", *flags, "--run-dir", str(run_dir)], timeout=60)
    assert killed.returncode != 0, show(killed)
    # Rank 1 died in step 23: the newest whole checkpoint is step 20's.
    assert sorted(os.listdir(run_dir / "checkpoints"))[-1] == "ckpt-00000020.npz"

    resumed = mpirun(2, rt("train", *flags, "--run-dir", str(run_dir), "--resume", "auto"), timeout=120)
    assert resumed.returncode == 0, show(resumed)
    assert "ckpt-00000020.npz at step 20" in resumed.stdout, show(resumed)
    a, b = final_params(run_dir), final_params(tmp_path / "straight")
    assert list(a) == list(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and np.array_equal(a[name], b[name]), name


def test_cnn_on_flat_data_is_one_line_and_exit_2(tmp_path):
    run_dir = tmp_path / "run"
    result = mpirun(2, rt("train", "--model", "cnn", "--dataset", "synthetic", "--run-dir", str(run_dir)),
                    timeout=60)
    assert result.returncode == 2, show(result)
    lines = result.stderr.strip().splitlines()
    assert lines == ["ringtrain: error: model 'cnn' needs image data: digits, mnist5k, or an .npz whose x is "
                     "N x H x W or N x C x H x W"], show(result)
    assert not run_dir.exists()
