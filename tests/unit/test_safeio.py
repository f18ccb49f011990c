"""Opening users' files safely, without MPI: safeio itself and the readers built on it.

Every refusal here must come back at once (a FIFO never blocks), as one line
naming the file and what it is.
"""

import errno
import os
import zipfile

import numpy as np
import pytest
from mpi4py import MPI

from ringtrain.io.checkpoint import CheckpointError, latest_valid_checkpoint, read_checkpoint, save_checkpoint
from ringtrain.training.config import TrainConfig, load_config_file, validate
from ringtrain.data.load import load_sharded
from ringtrain.data.sources import MAX_CLASSES
from ringtrain.errors import UsageError
from ringtrain.models.registry import MAX_PARAMETERS, build_model
from ringtrain.io.safeio import (GiB, MiB, file_kind, human_bytes, one_line, open_regular, os_reason, read_regular)

SELF = MPI.COMM_SELF
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (mount)")


def refused(call, *needles, kind=UsageError):
    with pytest.raises(kind) as info:
        call()
    message = str(info.value)
    assert "\n" not in message and len(message) < 400, message
    for needle in needles:
        assert needle in message, message
    return message


@pytest.fixture
def fifo(tmp_path):
    path = tmp_path / "pipe.toml"
    os.mkfifo(path)
    return path


# ---------------------------------------------------------------- safeio


def test_a_regular_file_opens_and_reads(tmp_path):
    path = tmp_path / "a.toml"
    path.write_bytes(b"epochs = 1\n")
    with open_regular(path, "--config", 100) as fh:
        assert fh.read() == b"epochs = 1\n"
    assert read_regular(path, max_bytes=11) == b"epochs = 1\n"


def test_a_fifo_is_refused_without_blocking(fifo):
    refused(lambda: open_regular(fifo, "--config"), f"--config {fifo}: is a FIFO, not a regular file")


def test_a_directory_and_a_device_are_named(tmp_path):
    refused(lambda: open_regular(tmp_path, "--config"), f"--config {tmp_path}: is a directory, not a regular file")
    refused(lambda: open_regular("/dev/null"), "/dev/null: is a character device, not a regular file")


def test_a_link_to_dev_zero_is_refused_not_read(tmp_path):
    link = tmp_path / "zero.npz"
    os.symlink("/dev/zero", link)
    refused(lambda: read_regular(link), f"{link}: is a character device")


def test_a_file_over_the_bound_is_refused_before_reading(tmp_path):
    path = tmp_path / "big.toml"
    with open(path, "wb") as fh:
        fh.truncate(3 * GiB + GiB // 10)  # sparse: no disk used
    refused(lambda: open_regular(path, "--config", MiB, "config files"),
            f"--config {path}: is 3.1 GiB; ringtrain reads config files of at most 1 MiB")


def test_errno_is_reported_as_what_happened(tmp_path, monkeypatch):
    refused(lambda: open_regular(tmp_path / "nope"), "nope: no such file")
    loop = tmp_path / "loop"
    os.symlink(loop, loop)
    refused(lambda: open_regular(loop), "loop: symbolic link loop")
    refused(lambda: open_regular(tmp_path / "afile" / "x"), "no such file")

    def denied(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(os, "open", denied)
    refused(lambda: open_regular(tmp_path / "x.npz"), "x.npz: permission denied")


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_permission_denied_for_real(tmp_path):
    path = tmp_path / "secret.npz"
    path.write_bytes(b"PK")
    path.chmod(0)
    refused(lambda: open_regular(path), "secret.npz: permission denied")


def test_the_error_class_is_the_callers():
    refused(lambda: open_regular("/dev/null", "checkpoint", error=CheckpointError), "checkpoint /dev/null: is a",
            kind=CheckpointError)


def test_pure_helpers():
    assert human_bytes(MiB) == "1 MiB" and human_bytes(3 * GiB + GiB // 10) == "3.1 GiB"
    assert human_bytes(1) == "1 byte" and human_bytes(512) == "512 bytes"
    assert one_line("a\n  b\tc") == "a b c"
    long = one_line("x" * 1000)
    assert len(long) == 300 and long.endswith("...")
    assert os_reason(OSError(errno.ELOOP, "Too many levels of symbolic links")) == "symbolic link loop"
    assert os_reason(OSError(errno.ENOSPC, "No space left on device")) == "no space left on device"
    assert file_kind(os.stat("/dev/null").st_mode) == "a character device"
    assert file_kind(os.stat(__file__).st_mode) is None


# ---------------------------------------------------------------- --config


def test_config_fifo_device_and_size(tmp_path, fifo):
    refused(lambda: load_config_file(str(fifo)), "is a FIFO, not a regular file")
    link = tmp_path / "zero.yaml"
    os.symlink("/dev/zero", link)
    refused(lambda: load_config_file(str(link)), "is a character device")
    big = tmp_path / "big.toml"
    big.write_bytes(b"#" * (MiB + 1))
    refused(lambda: load_config_file(str(big)), "ringtrain reads config files of at most 1 MiB")


def test_yaml_aliases_are_refused_at_once(tmp_path):
    # A 370-byte "billion laughs": nine levels of nine aliases each.
    lines = ['a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    lines += [f"a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 9)]
    path = tmp_path / "laughs.yaml"
    path.write_text("\n".join(lines) + "\n")
    message = refused(lambda: load_config_file(str(path)), "YAML aliases (*name)", "write the values out")
    assert message.startswith(f"--config {path}: ")
    alias_only = tmp_path / "alias.yml"
    alias_only.write_text("epochs: &e 3\nmax_steps: *e\n")
    refused(lambda: load_config_file(str(alias_only)), "YAML aliases (*name)")


def test_yaml_without_aliases_still_loads(tmp_path):
    path = tmp_path / "ok.yaml"
    path.write_text("epochs: 3\nhidden: [8, 4]\nlr: 0.05\n")
    assert load_config_file(str(path)) == {"epochs": 3, "hidden": (8, 4), "lr": 0.05}


def test_config_that_is_not_utf8_is_one_line(tmp_path):
    path = tmp_path / "latin.toml"
    path.write_bytes(b"# caf\xe9\n")
    refused(lambda: load_config_file(str(path)), "not UTF-8 text (byte 0xe9 at offset 5)")


@pytest.mark.parametrize("change, needle", [
    ({"hidden": (10 ** 11,)}, "--hidden: 100,000,000,000 is too large; ringtrain allows at most 1,048,576"),
    ({"features": 10 ** 10}, "--features: 10,000,000,000 is too large"),
    ({"samples": 10 ** 20}, "--samples: 100,000,000,000,000,000,000 is too large"),
    ({"classes": 10 ** 9}, "--classes: 1,000,000,000 is too large; ringtrain allows at most 100,000"),
    ({"bucket_mb": 1e303}, "--bucket-mb: 1e+303 is too large"),
    ({"dataset": "synthetic", "samples": 10 ** 9, "features": 10 ** 5}, "ringtrain generates synthetic datasets of "
                                                                         "at most 1 TiB"),
])
def test_sizes_beyond_any_real_run_are_refused_with_the_limit(change, needle):
    refused(lambda: validate(TrainConfig(**change)), needle)


def test_model_of_more_than_2_to_the_31_parameters_is_refused_before_allocating():
    with pytest.raises(ValueError, match=r"at most 2\^31") as info:
        build_model("mlp", 100_000, 10, hidden=(1_000_000, 100_000))
    assert "200,002,100,010 parameters" in str(info.value)
    build_model("mlp", 4, 3, hidden=(8,))  # small ones still build
    assert MAX_PARAMETERS == 2 ** 31


# ---------------------------------------------------------------- datasets


def _xy(n=20):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 3)).astype(np.float32), np.arange(n) % 2


def test_dataset_fifo_and_dev_zero_are_refused(tmp_path):
    os.mkfifo(tmp_path / "pipe.npz")
    refused(lambda: load_sharded(str(tmp_path / "pipe.npz"), SELF), "pipe.npz: is a FIFO, not a regular file")
    os.symlink("/dev/zero", tmp_path / "zero.npz")
    refused(lambda: load_sharded(str(tmp_path / "zero.npz"), SELF), "zero.npz: is a character device")
    os.symlink(tmp_path / "loop.npz", tmp_path / "loop.npz")
    refused(lambda: load_sharded(str(tmp_path / "loop.npz"), SELF), "loop.npz: symbolic link loop")
    data = tmp_path / "dir"
    data.mkdir()
    x, _ = _xy()
    np.save(data / "x.npy", x)
    os.mkfifo(data / "y.npy")
    refused(lambda: load_sharded(str(data), SELF), "y.npy: is a FIFO, not a regular file")


def test_npz_members_that_are_not_npy_are_one_line(tmp_path):
    path = tmp_path / "raw.npz"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("x", "not an array")
        zf.writestr("y", "nor this")
    refused(lambda: load_sharded(str(path), SELF), "raw.npz: member 'x' is not a .npy array")


def test_a_label_of_a_billion_is_refused_naming_the_bound(tmp_path):
    x, y = _xy()
    np.savez(tmp_path / "big.npz", x=x, y=np.where(np.arange(len(y)) == 6, 10 ** 9, y))
    refused(lambda: load_sharded(str(tmp_path / "big.npz"), SELF, test_fraction=0.0),
            "y has label 1,000,000,000 in row 6", f"at most {MAX_CLASSES:,} classes")
    np.savez(tmp_path / "float.npz", x=x, y=np.where(np.arange(len(y)) == 3, 1e300, y))
    refused(lambda: load_sharded(str(tmp_path / "float.npz"), SELF, test_fraction=0.0), "y has label 1e+300 in row 3")


def test_an_npz_whose_arrays_exceed_memory_is_refused_from_its_headers(tmp_path):
    path = tmp_path / "bomb.npz"
    header = np.lib.format.header_data_from_array_1_0(np.zeros(1, np.float32))
    header["shape"] = (1 << 45, 1)  # 128 TiB of float32, in a file of a few hundred bytes
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for name in ("x.npy", "y.npy"):
            with zf.open(name, "w") as member:
                np.lib.format.write_array_header_1_0(member, header)
    refused(lambda: load_sharded(str(path), SELF), "bomb.npz: its arrays take", "of memory")


# ---------------------------------------------------------------- checkpoints


def test_checkpoint_fifo_is_skipped_and_an_older_one_used(tmp_path):
    ckdir = tmp_path / "checkpoints"
    save_checkpoint(ckdir, 5, {"params/w": np.ones(3, np.float32)}, {"epoch": 0})
    os.mkfifo(ckdir / "ckpt-00000009.npz")
    os.symlink("/dev/zero", ckdir / "ckpt-00000008.npz")
    warnings = []
    path, arrays, meta = latest_valid_checkpoint(ckdir, warn=warnings.append)
    assert path.endswith("ckpt-00000005.npz") and meta["step"] == 5
    assert "is a FIFO, not a regular file" in warnings[0] and "is a character device" in warnings[1]
    refused(lambda: read_checkpoint(ckdir / "ckpt-00000009.npz"), "is a FIFO", kind=CheckpointError)
