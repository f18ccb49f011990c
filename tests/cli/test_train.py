"""``ringtrain train`` as users run it: under mpirun, reading and writing real files."""

import json
import os

import numpy as np
import pytest

import ringtrain
from mpirun import mpirun, ringtrain as rt, run, show
from ringtrain.cluster.launch import find_mpirun


def read_metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        return [json.loads(line) for line in fh]


@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_digits_reaches_97_percent(tmp_path, ranks):
    run_dir = tmp_path / "run"
    result = mpirun(ranks, rt("train", "--dataset", "digits", "--run-dir", str(run_dir)), timeout=180)
    assert result.returncode == 0, show(result)
    evals = [m for m in read_metrics(run_dir) if m["event"] == "eval"]
    assert evals[-1]["accuracy"] >= 0.97, show(result)
    # Exact global evaluation: every test sample counted once, whatever the ranks.
    from mpi4py import MPI

    from ringtrain.data.load import load_sharded

    assert {e["samples"] for e in evals} == {load_sharded("digits", MPI.COMM_SELF).num_test}
    # Only rank 0 prints: one header (and, on several ranks, how gradients
    # are averaged), one line per epoch, one summary.
    lines = result.stdout.strip().splitlines()
    assert sum(line.startswith("epoch ") for line in lines) == 30, show(result)
    assert sum(line.startswith("ringtrain: ") for line in lines) == (1 if ranks == 1 else 2), show(result)
    assert ranks == 1 or lines[1] == "ringtrain: sharded optimizer step (reduce-scatter, update, allgather) over shm"
    assert f"({32 * ranks} global)" in lines[0]


def test_run_directory_layout_and_checkpoint_loads(tmp_path):
    run_dir = tmp_path / "run"
    result = mpirun(2, rt("train", "--dataset", "digits", "--epochs", "3", "--keep", "2",
                          "--run-dir", str(run_dir)), timeout=120)
    assert result.returncode == 0, show(result)
    config = json.loads((run_dir / "config.json").read_text())
    assert config["epochs"] == 3 and config["run_dir"] == str(run_dir)
    metrics = read_metrics(run_dir)
    kinds = {m["event"] for m in metrics}
    assert {"train", "eval", "checkpoint", "done"} <= kinds
    train_events = [m for m in metrics if m["event"] == "train"]
    assert all({"step", "epoch", "loss", "accuracy", "samples_per_sec", "time"} <= set(m) for m in train_events)
    ckpts = sorted(os.listdir(run_dir / "checkpoints"))
    assert len(ckpts) == 2 and all(c.endswith(".npz") for c in ckpts)
    params, meta = ringtrain.load_checkpoint(str(run_dir))
    assert meta["step"] == metrics[-1]["step"] and meta["config"]["epochs"] == 3
    # The saved parameters are exactly the model the run built (reference: build it here).
    from mpi4py import MPI

    from ringtrain.data.load import load_sharded

    digits = load_sharded("digits", MPI.COMM_SELF)
    model = ringtrain.build_model("mlp", digits.num_features, digits.num_classes, hidden=tuple(config["hidden"]))
    assert {k: v.shape for k, v in params.items()} == {k: v.shape for k, v in model.params.items()}
    # A checkpoint is a plain npz that other tools read without ringtrain.
    with np.load(os.path.join(run_dir, "checkpoints", ckpts[-1]), allow_pickle=False) as z:
        assert any(k.startswith("params/") for k in z.files)


@pytest.mark.parametrize("flags,needle", [
    (["--epochs", "0"], "--epochs: must be > 0"),
    (["--model", "mlpp"], "unknown model 'mlpp'; choose one of cnn, mlp, softmax"),
    (["--dataset", "/no/such/data.npz"], "/no/such/data.npz"),
    (["--batch-size", "5000"], "batch"),
    (["--hidden", "a,b"], "--hidden: expected comma-separated integers"),
])
def test_bad_values_one_line_exit_2_no_run_dir(tmp_path, flags, needle):
    run_dir = tmp_path / "run"
    result = mpirun(2, rt("train", "--run-dir", str(run_dir), *flags), timeout=60)
    assert result.returncode == 2, show(result)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], show(result)
    assert "Traceback" not in result.stderr
    assert not run_dir.exists()


def test_ranks_given_different_batch_sizes_all_fail_cleanly(tmp_path):
    run_dir = str(tmp_path / "run")
    mpi = find_mpirun()
    args = [mpi, "-np", "1", *rt("train", "--run-dir", run_dir, "--batch-size", "32"), ":",
            "-np", "1", *rt("train", "--run-dir", run_dir, "--batch-size", "64")]
    result = run(args, timeout=60)
    assert result.returncode == 2, show(result)
    assert "ranks disagree on --batch-size: rank 0 has 32, rank 1 has 64" in result.stderr, show(result)
    assert not os.path.exists(run_dir)


def test_max_time_stops_with_a_final_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    result = mpirun(2, rt("train", "--dataset", "synthetic", "--samples", "20000", "--epochs", "1000",
                          "--max-time", "2", "--run-dir", str(run_dir)), timeout=120)
    assert result.returncode == 0, show(result)
    done = [m for m in read_metrics(run_dir) if m["event"] == "done"]
    assert done and done[0]["stopped"] == "max_time" and done[0]["epoch"] < 1000, show(result)
    params, meta = ringtrain.load_checkpoint(str(run_dir))
    assert meta["final"] and meta["step"] == done[0]["step"]
