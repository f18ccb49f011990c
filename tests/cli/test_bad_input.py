"""Bad input, table-driven: one line on stderr naming the problem, exit 2, no traceback, nothing written.

Each case is a real command in a subprocess (``python -m ringtrain ...``,
one rank: cheap, and argument and input checks run on every rank alike); a
few run again under ``mpirun -np 2`` to show that rank 0 alone prints the
one line. All inputs live in a fresh directory, and after each case that
directory holds exactly what it held before.
"""

import io
import json
import os
import zipfile

import numpy as np
import pytest

from mpirun import mpirun, run
from refusals import assert_refused
from ringtrain import backend
from ringtrain.io.checkpoint import FORMAT, FORMAT_VERSION, save_checkpoint

SMALL = ["--dataset", "synthetic", "--samples", "200", "--features", "4", "--classes", "3", "--hidden", "4",
         "--epochs", "1"]


def make_inputs(tmp):
    """Every bad input file the table refers to, under ``tmp``."""
    def text(name, content):
        path = tmp / name
        path.write_text(content)

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(10, 3)).astype(np.float32), np.arange(10) % 2
    x_nan = x.copy()
    x_nan[4, 1] = np.nan
    np.savez(tmp / "nan.npz", x=x_nan, y=y)
    np.savez(tmp / "label.npz", x=x, y=np.where(np.arange(10) == 6, -1, y))
    np.savez(tmp / "short.npz", x=x, y=y[:9])
    np.savez(tmp / "pickled.npz", x=x, y=np.array([1, "a"] * 5, dtype=object))
    np.savez(tmp / "fraction.npz", x=x, y=y + 0.5)
    np.savez(tmp / "flat.npz", x=x[:, 0], y=y)
    text("text.npz", "x,y\n1,2\n")
    os.makedirs(tmp / "noy")
    np.save(tmp / "noy" / "x.npy", x)
    text("ok.toml", "epochs = 1\n")
    text("bad.json", "{\"epochs\": \n")
    text("bad.ini", "epochs = 1\n")
    text("nested.json", "[" * 100_000 + "]" * 100_000)
    text("syntax.toml", "epochs = \n")
    text("unknown.toml", "epoch = 3\n")
    text("type.toml", 'epochs = "ten"\n')
    text("value.toml", "lr = -0.5\n")
    text("syntax.yaml", "epochs: [1,\n")
    text("list.yaml", "- 1\n- 2\n")
    text("bool.yaml", "scale_lr: maybe\n")
    text("null.yaml", "classes: null\n")
    text("slots.hosts", "node1 slots=x\n")
    text("zero.hosts", "node1:0\n")
    text("comments.hosts", "# nobody here\n\n")
    text("one.hosts", "localhost:1\n")
    text("afile", "not a directory\n")
    os.makedirs(tmp / "empty")
    good = save_checkpoint(tmp / "ckpts", 3, {"params/fc1.weight": np.zeros((4, 4), np.float32)},
                           {"epoch": 0, "step_in_epoch": 3})
    os.rename(good, tmp / "other-model.npz")
    damaged = save_checkpoint(tmp / "ckpts", 5, {"params/fc1.weight": np.ones((4, 4), np.float32)},
                              {"epoch": 0, "step_in_epoch": 5})
    data = bytearray(open(damaged, "rb").read())
    data[len(data) // 2] ^= 1
    (tmp / "damaged.npz").write_bytes(bytes(data))
    os.unlink(damaged)
    os.rmdir(tmp / "ckpts")
    text("fraction.toml", "hidden = [8.5]\n")
    np.savez(tmp / "huge-label.npz", x=x, y=np.where(np.arange(10) == 6, np.uint64(2 ** 63), y.astype(np.uint64)))
    # A run directory holding a checkpoint of a newer format, and a checkpoint whose step is a float.
    (tmp / "newer" / "checkpoints").mkdir(parents=True)
    crafted_checkpoint(tmp / "newer" / "checkpoints" / "ckpt-00000009.npz", format_version=FORMAT_VERSION + 1, step=9)
    crafted_checkpoint(tmp / "float-step.npz", step=3.0)


def crafted_checkpoint(path, **meta):
    """A checkpoint-shaped file whose metadata says what a newer or hostile writer chose."""
    meta = {"format": FORMAT, "format_version": FORMAT_VERSION, "sha256": "0" * 64, "epoch": 0, "step_in_epoch": 0,
            "config": {}, **meta}
    with zipfile.ZipFile(path, "w") as zf:
        for name, array in (("params/fc1.weight", np.zeros((4, 4), np.float32)),
                            ("__meta__", np.frombuffer(json.dumps(meta).encode(), np.uint8))):
            buf = io.BytesIO()
            np.lib.format.write_array(buf, array)
            zf.writestr(name + ".npy", buf.getvalue())


def train(*flags):
    return ["train", "--run-dir", "{tmp}/run", *flags]


def launch(hostfile, *flags, np_="2"):
    return ["launch", "-np", np_, "-o", "{tmp}/logs", *(["--hostfile", hostfile] if hostfile else []), *flags,
            "--", "ringtrain", "info"]


# (id, arguments with {tmp} for the inputs' directory, text the one line must contain)
CASES = [
    # flags
    ("epochs-zero", train("--epochs", "0"), "--epochs: must be > 0, got 0"),
    ("lr-negative", train("--lr", "-1"), "--lr: must be > 0, got -1"),
    ("lr-nan", train("--lr", "nan"), "--lr: must be a finite number, got nan"),
    ("momentum-one-and-a-half", train("--momentum", "1.5"), "--momentum: must be in [0, 1), got 1.5"),
    ("batch-size-not-int", train("--batch-size", "abc"), "argument --batch-size: invalid int value: 'abc'"),
    ("optimizer-unknown", train("--optimizer", "rmsprop"),
     "--optimizer: unknown value 'rmsprop'; choose one of sgd, adam"),
    ("nonfinite-unknown", train("--nonfinite", "ignore"),
     "--nonfinite: unknown value 'ignore'; choose one of skip, abort"),
    ("hidden-zero", train("--hidden", "0"), "--hidden: layer sizes must be > 0, got 0"),
    ("test-fraction", train("--test-fraction", "1.5"), "--test-fraction: must be between 0 and 1, got 1.5"),
    ("unknown-flag", train("--bogus"), "unrecognized arguments: --bogus"),
    ("timeout-zero", train("--timeout", "0"), "--timeout: must be > 0, got 0.0"),
    ("classes-one", train("--dataset", "synthetic", "--classes", "1"), "--classes: must be at least 2, got 1"),
    ("max-steps-zero", train("--max-steps", "0"), "--max-steps: must be > 0, got 0"),
    ("batch-bigger-than-shard", train(*SMALL, "--batch-size", "5000"), "batch"),
    ("device-gpu-without-one", train(*SMALL, "--device", "gpu"), "--device gpu needs a CUDA GPU"),
    # configuration files
    ("config-missing", train("--config", "{tmp}/nope.toml"), "--config {tmp}/nope.toml: no such file"),
    ("config-ini", train("--config", "{tmp}/bad.ini"), "expected a .toml, .yaml, .yml or .json file"),
    ("json-syntax", train("--config", "{tmp}/bad.json"), "bad.json: not valid JSON: "),
    ("json-nested", train("--config", "{tmp}/nested.json"), "nested.json: not valid JSON: "),
    ("toml-syntax", train("--config", "{tmp}/syntax.toml"), "syntax.toml: not valid TOML: "),
    ("toml-unknown-key", train("--config", "{tmp}/unknown.toml"),
     "unknown setting 'epoch'; did you mean 'epochs'?"),
    ("toml-wrong-type", train("--config", "{tmp}/type.toml"), "setting 'epochs' must be int, got 'ten'"),
    ("toml-bad-value", train("--config", "{tmp}/value.toml"), "--lr: must be > 0, got -0.5"),
    ("yaml-syntax", train("--config", "{tmp}/syntax.yaml"), "syntax.yaml: not valid YAML: "),
    ("yaml-not-a-table", train("--config", "{tmp}/list.yaml"), "expected a table of settings, got list"),
    ("yaml-not-a-bool", train("--config", "{tmp}/bool.yaml"), "setting 'scale_lr' must be bool, got 'maybe'"),
    ("yaml-null", train("--config", "{tmp}/null.yaml"), "setting 'classes' must be int, got None"),
    # hostfiles and the launcher
    ("hostfile-missing", launch("{tmp}/nope.hosts"), "cannot read hostfile"),
    ("hostfile-bad-slots", launch("{tmp}/slots.hosts"),
     "hostfile line 1: expected 'host slots=N' or 'host:N', got 'node1 slots=x'"),
    ("hostfile-zero-slots", launch("{tmp}/zero.hosts"), "hostfile line 1: slots must be at least 1"),
    ("hostfile-no-hosts", launch("{tmp}/comments.hosts"), "lists no hosts"),
    ("hostfile-too-few-slots", launch("{tmp}/one.hosts"), "-np 2 needs 2 slots but the hosts give 1"),
    ("launch-np-zero", launch(None, np_="0"), "number of processes must be at least 1, got 0"),
    ("launch-mpirun-missing", launch(None, "--mpirun", "{tmp}/no-mpirun"),
     "--mpirun {tmp}/no-mpirun: no such executable file"),
    # dataset files
    ("data-nan", train("--dataset", "{tmp}/nan.npz"), "nan.npz: x has a non-finite value"),
    ("data-label-out-of-range", train("--dataset", "{tmp}/label.npz"), "label.npz: y has label -1 in row 6"),
    ("data-length-mismatch", train("--dataset", "{tmp}/short.npz"), "short.npz: x has 10 rows but y has 9"),
    ("data-missing", train("--dataset", "{tmp}/missing.npz"), "missing.npz: no such file"),
    ("data-not-npz", train("--dataset", "{tmp}/text.npz"), "text.npz: not a .npz file"),
    ("data-pickled", train("--dataset", "{tmp}/pickled.npz"), "pickled.npz: cannot read"),
    ("data-fractional-labels", train("--dataset", "{tmp}/fraction.npz"), "y must hold integer class labels"),
    ("data-x-one-dimensional", train("--dataset", "{tmp}/flat.npz"), "x must be 2-D"),
    ("data-dir-without-y", train("--dataset", "{tmp}/noy"), "noy: no y.npy"),
    ("data-unknown-name", train("--dataset", "digitz"), "unknown dataset 'digitz'"),
    # the environment: the file system around the run
    ("run-dir-under-a-file", ["train", *SMALL, "--run-dir", "{tmp}/afile/run"],
     "--run-dir {tmp}/afile/run: cannot write there (Not a directory)"),
    ("run-dir-is-a-file", ["train", *SMALL, "--run-dir", "{tmp}/afile"], "exists and is not a directory"),
    ("run-dir-not-creatable", ["train", *SMALL, "--run-dir", "/proc/ringtrain-run"],
     "--run-dir /proc/ringtrain-run: cannot write there"),
    ("resume-damaged-file", train(*SMALL, "--resume", "{tmp}/damaged.npz"), "damaged.npz: damaged or truncated"),
    ("resume-missing", train(*SMALL, "--resume", "{tmp}/nope.npz"), "--resume: no checkpoint at"),
    ("resume-other-model", train(*SMALL, "--resume", "{tmp}/other-model.npz"), "does not fit this model"),
    ("resume-empty-dir", train(*SMALL, "--resume", "{tmp}/empty"), "no valid checkpoint there"),
    # files a newer ringtrain, or an attacker, wrote
    ("resume-newer-format", ["train", *SMALL, "--run-dir", "{tmp}/newer"],
     f"written in checkpoint format version {FORMAT_VERSION + 1}, and this ringtrain reads format version "
     f"{FORMAT_VERSION} at most"),
    ("resume-none-beside-a-newer-format", ["train", *SMALL, "--run-dir", "{tmp}/newer", "--resume", "none"],
     "upgrade ringtrain to read it (nothing was written)"),
    ("resume-float-step", train(*SMALL, "--resume", "{tmp}/float-step.npz"),
     "float-step.npz: damaged metadata (step is float 3.0, not a non-negative integer)"),
    # values that used to pass and go wrong later
    ("bucket-mb-below-a-byte", train(*SMALL, "--bucket-mb", "1e-7"), "--bucket-mb: must be at least 1 byte"),
    ("hidden-fraction-in-a-file", train(*SMALL, "--config", "{tmp}/fraction.toml"),
     "--hidden: expected comma-separated integers like 128,64, got [8.5]"),
    ("run-dir-not-utf8", ["train", *SMALL, "--run-dir", "{tmp}/run-\udcff"], "is not UTF-8 text"),
    ("dataset-not-utf8", train("--dataset", "{tmp}/d-\udcff.npz"), "--dataset: b'"),
    ("label-beyond-int64", train("--dataset", "{tmp}/huge-label.npz"),
     "huge-label.npz: y has label 9,223,372,036,854,775,808 in row 6"),
]

MPI_CASES = ["data-nan", "toml-syntax", "resume-damaged-file", "run-dir-under-a-file", "device-gpu-without-one",
             "batch-bigger-than-shard", "resume-newer-format", "resume-float-step", "bucket-mb-below-a-byte",
             "run-dir-not-utf8"]


def check(tmp_path, args, needle, start):
    assert_refused(tmp_path, args, needle, start, make_inputs)


def skip_where_valid(name):
    # On a machine with a GPU, --device gpu is good input: nothing to refuse.
    if name == "device-gpu-without-one" and backend.gpu_available():
        pytest.skip("a GPU is visible here, so --device gpu is valid input")


@pytest.mark.parametrize("name, args, needle", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_exit_2_nothing_written(tmp_path, name, args, needle):
    skip_where_valid(name)
    check(tmp_path, args, needle, lambda cmd: run(cmd, timeout=30))


@pytest.mark.parametrize("name, args, needle", [c for c in CASES if c[0] in MPI_CASES],
                         ids=[c[0] for c in CASES if c[0] in MPI_CASES])
def test_bad_input_under_mpirun_is_one_line_from_rank_0(tmp_path, name, args, needle):
    skip_where_valid(name)
    check(tmp_path, args, needle, lambda cmd: mpirun(2, cmd, timeout=30))


def test_there_are_at_least_30_cases():
    assert len(CASES) >= 30 and len({c[0] for c in CASES}) == len(CASES)
