"""Checkpoints: bitwise round trip, keep-K, atomic saves, damaged files caught."""

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ringtrain
from ringtrain.io import checkpoint as ck
from ringtrain.io.checkpoint import (
    CheckpointError,
    latest_valid_checkpoint,
    list_checkpoints,
    load_checkpoint,
    read_checkpoint,
    save_checkpoint,
)
from ringtrain.errors import UsageError


def sample_arrays():
    rng = np.random.default_rng(0)
    return {
        "params/fc2.weight": rng.standard_normal((3, 4)).astype(np.float32),
        "params/fc2.bias": rng.standard_normal(4).astype(np.float16),
        "params/fc10.weight": rng.standard_normal((2, 2)),  # float64
        "optim/momentum/fc2.weight": np.asfortranarray(rng.standard_normal((3, 4))),
        "optim/step": np.array(7, dtype=np.int64),  # 0-d
        "data/order": rng.permutation(10).astype(np.int64),
        "data/empty": np.zeros((0, 3), dtype=np.float32),
        "mask": np.array([True, False, True]),
        "big_endian": np.arange(3, dtype=">i4"),
        "labels": np.array(["cat", "dog"]),
        "z": np.array([1 + 2j], dtype=np.complex64),
    }


def sample_meta():
    return {
        "epoch": 2,
        "config": {"model": "mlp", "hidden": [64, 32], "lr": 0.1, "opt": {"betas": [0.9, 0.999]}},
        "rng": {"seed": 42, "state": 2**100 + 3, "position": {"epoch": 2, "batch": 5}},
        "note": "ünïcode ✓",
    }


def assert_same_arrays(got, want):
    assert list(got) == list(want)  # the order saved, not sorted
    for name in want:
        expected = np.asarray(want[name])
        assert got[name].dtype == expected.dtype, name
        assert got[name].shape == expected.shape, name
        assert got[name].tobytes(order="C") == expected.tobytes(order="C"), name


def assert_one_line_error(excinfo, *fragments):
    message = str(excinfo.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, (fragment, message)
    return message


@pytest.fixture
def ckdir(tmp_path):
    return tmp_path / "checkpoints"


# ---------------------------------------------------------------- round trip


def test_round_trip_is_bitwise(ckdir):
    arrays, meta = sample_arrays(), sample_meta()
    path = save_checkpoint(ckdir, 120, arrays, meta)
    assert os.path.basename(path) == "ckpt-00000120.npz"
    got, got_meta = read_checkpoint(path)
    assert_same_arrays(got, arrays)
    assert {k: got_meta[k] for k in meta} == meta
    assert got_meta["step"] == 120
    assert got_meta["format"] == "ringtrain-checkpoint" and got_meta["format_version"] == 1
    assert len(got_meta["sha256"]) == 64


def test_plain_numpy_reads_it_without_pickle(ckdir):
    arrays = sample_arrays()
    path = save_checkpoint(ckdir, 3, arrays, {"epoch": 0})
    with np.load(path, allow_pickle=False) as npz:
        assert set(npz.files) == set(arrays) | {"__meta__"}
        np.testing.assert_array_equal(npz["params/fc2.weight"], arrays["params/fc2.weight"])
        meta = json.loads(npz["__meta__"].tobytes())
    assert meta["step"] == 3 and meta["epoch"] == 0


def test_numpy_scalars_and_tuples_in_metadata_become_json(ckdir):
    path = save_checkpoint(ckdir, np.int64(4), {}, {"lr": np.float32(0.5), "shape": (2, 3)})
    _, meta = read_checkpoint(path)
    assert meta["lr"] == 0.5 and meta["shape"] == [2, 3] and meta["step"] == 4


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"arrays": {"x": np.array([object()])}}, "dtype object"),
        ({"arrays": {"__meta__": np.zeros(1)}}, "reserved"),
        ({"metadata": {"sha256": "x"}}, "reserved"),
        ({"metadata": {"step": 9}}, "reserved"),
        ({"metadata": {"loss": float("nan")}}, "JSON"),
        ({"metadata": {"f": print}}, "JSON"),
        ({"step": -1}, "step"),
        ({"step": 1.5}, "step"),
        ({"keep": 0}, "keep"),
    ],
)
def test_bad_arguments_are_programming_errors(ckdir, kwargs, fragment):
    call = {"step": 1, "arrays": {"x": np.zeros(2)}, "metadata": {}, "keep": 3, **kwargs}
    with pytest.raises((ValueError, TypeError), match=fragment):
        save_checkpoint(ckdir, call["step"], call["arrays"], call["metadata"], keep=call["keep"])
    assert list_checkpoints(ckdir) == []


# ---------------------------------------------------------------- keep-K and listing


def test_keep_k_deletes_the_oldest(ckdir):
    for step in (10, 20, 30, 40, 50):
        save_checkpoint(ckdir, step, {"w": np.full(2, step)}, {}, keep=3)
    assert [os.path.basename(p) for p in list_checkpoints(ckdir)] == [
        "ckpt-00000050.npz",
        "ckpt-00000040.npz",
        "ckpt-00000030.npz",
    ]


def test_keep_none_keeps_everything(ckdir):
    for step in range(5):
        save_checkpoint(ckdir, step, {}, {}, keep=None)
    assert len(list_checkpoints(ckdir)) == 5


def test_checkpoints_from_a_later_step_are_not_pruned_and_the_new_one_survives(ckdir):
    # A run resumed from step 20 writes step 30 while an abandoned step 90 exists.
    for step in (10, 20, 90):
        save_checkpoint(ckdir, step, {}, {}, keep=None)
    path = save_checkpoint(ckdir, 30, {}, {}, keep=1)
    assert list_checkpoints(ckdir) == [str(ckdir / "ckpt-00000090.npz"), path]


def test_list_sorts_by_step_and_ignores_other_files(ckdir):
    ckdir.mkdir()
    for name in ("ckpt-00000009.npz", "ckpt-123456789.npz", "ckpt-00000010.npz", "notes.txt",
                 "ckpt-x.npz", ".ckpt-00000011.npz.tmp-1"):
        (ckdir / name).write_bytes(b"")
    assert [os.path.basename(p) for p in list_checkpoints(ckdir)] == [
        "ckpt-123456789.npz",
        "ckpt-00000010.npz",
        "ckpt-00000009.npz",
    ]
    assert list_checkpoints(ckdir / "missing") == []


def dead_pid():
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    return int(proc.stdout)


def test_save_removes_stale_temporaries(ckdir):
    ckdir.mkdir()
    stale = ckdir / f".ckpt-00000005.npz.tmp-{dead_pid()}"
    stale.write_bytes(b"PK\x03\x04half")
    save_checkpoint(ckdir, 6, {}, {})
    assert not stale.exists()


# ---------------------------------------------------------------- atomic saves


def enospc(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def snapshot(directory):
    return {name: (directory / name).read_bytes() for name in sorted(os.listdir(directory))}


def _fail_on_second_member(monkeypatch):
    real = np.lib.format.write_array
    calls = []

    def write_array(fp, array, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            fp.write(b"\0" * 10)  # some bytes of the member are already out
            enospc()
        return real(fp, array, *args, **kwargs)

    monkeypatch.setattr(np.lib.format, "write_array", write_array)


@pytest.mark.parametrize(
    "inject",
    [
        lambda mp: mp.setattr(os, "fsync", enospc),
        lambda mp: _fail_on_second_member(mp),
        lambda mp: mp.setattr(os, "replace", enospc),
        lambda mp: mp.setattr(ck.zipfile.ZipFile, "_write_end_record", enospc),
    ],
    ids=["fsync", "mid-write", "rename", "zip-directory"],
)
def test_failed_write_leaves_earlier_checkpoints_intact(ckdir, monkeypatch, inject):
    arrays = sample_arrays()
    save_checkpoint(ckdir, 10, arrays, {"epoch": 0}, keep=2)
    save_checkpoint(ckdir, 20, arrays, {"epoch": 1}, keep=2)
    before = snapshot(ckdir)
    with monkeypatch.context() as mp:
        inject(mp)
        with pytest.raises(CheckpointError) as excinfo:
            save_checkpoint(ckdir, 30, arrays, {"epoch": 2}, keep=2)
    assert_one_line_error(excinfo, "ckpt-00000030.npz", "No space left on device",
                          "earlier checkpoints are untouched")
    assert excinfo.value.__cause__.errno == errno.ENOSPC
    assert snapshot(ckdir) == before  # nothing new, nothing pruned, no temporary
    assert read_checkpoint(list_checkpoints(ckdir)[0])[1]["epoch"] == 1


def test_interrupted_write_removes_the_temporary_and_reraises(ckdir, monkeypatch):
    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(np.lib.format, "write_array", interrupt)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(ckdir, 1, {"w": np.zeros(3)}, {})
    assert os.listdir(ckdir) == []


def test_checkpoint_error_is_a_usage_error():
    assert issubclass(CheckpointError, UsageError)
    assert ringtrain.load_checkpoint is load_checkpoint
    assert ringtrain.CheckpointError is CheckpointError


# ---------------------------------------------------------------- damaged files


@pytest.fixture
def good(ckdir):
    arrays = {"params/w": np.arange(64, dtype=np.float32).reshape(8, 8) + 0.5,
              "params/b": np.arange(8, dtype=np.int64)}
    path = save_checkpoint(ckdir, 5, arrays, {"epoch": 1, "config": {"lr": 0.25}})
    return path, arrays


def read_error(path, *fragments):
    with pytest.raises(CheckpointError) as excinfo:
        read_checkpoint(path)
    return assert_one_line_error(excinfo, str(path), *fragments)


@pytest.mark.parametrize("fraction", [0.0001, 0.1, 0.35, 0.5, 0.8, 0.99])
def test_truncated_file_is_detected(good, fraction):
    path, _ = good
    data = Path(path).read_bytes()
    with open(path, "wb") as f:
        f.write(data[: max(1, int(len(data) * fraction))])
    read_error(path)


def test_last_byte_missing_is_detected(good):
    path, _ = good
    data = Path(path).read_bytes()
    Path(path).write_bytes(data[:-1])
    read_error(path, "damaged")


def flip(path, offset, mask=0x01):
    data = bytearray(Path(path).read_bytes())
    data[offset] ^= mask
    Path(path).write_bytes(bytes(data))


def test_flipped_byte_in_array_data_is_detected(good):
    path, arrays = good
    offset = Path(path).read_bytes().find(arrays["params/w"].tobytes())
    assert offset > 0
    flip(path, offset + 100)
    read_error(path)


def test_flipped_byte_in_array_data_with_zip_crc_patched_is_caught_by_sha256(good):
    # Someone (or a buggy tool) rewrote the member and fixed up the zip CRCs:
    # only the checksum can tell.
    path, arrays = good
    tampered = dict(arrays)
    tampered["params/w"] = arrays["params/w"].copy()
    tampered["params/w"][0, 0] += 1
    _, meta = read_checkpoint(path)
    blob = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    np.savez(path, **tampered, __meta__=blob)
    read_error(path, "checksum mismatch")


def test_flipped_byte_in_metadata_is_detected(good):
    path, _ = good
    data = Path(path).read_bytes()
    flip(path, data.find(b'"lr":0.25') + len('"lr":0.'))  # 0.25 -> 0.35
    read_error(path)


def test_edited_metadata_with_valid_json_fails_the_checksum(good):
    path, arrays = good
    _, meta = read_checkpoint(path)
    meta["epoch"] = 2
    blob = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    np.savez(path, **arrays, __meta__=blob)
    read_error(path, "checksum mismatch")


def test_zero_length_file(good):
    path, _ = good
    os.truncate(path, 0)
    read_error(path, "empty file")


def test_not_a_zip_file(tmp_path):
    path = tmp_path / "ckpt-00000001.npz"
    path.write_text("hello\n")
    read_error(path, "not a ringtrain checkpoint")


def test_npz_that_is_not_a_ringtrain_checkpoint(tmp_path):
    path = tmp_path / "weights.npz"
    np.savez(path, w=np.zeros(3))
    read_error(path, "not a ringtrain checkpoint", "__meta__")


def test_npz_with_foreign_metadata(tmp_path):
    path = tmp_path / "weights.npz"
    np.savez(path, __meta__=np.frombuffer(b'{"format": "other"}', dtype=np.uint8))
    read_error(path, "not a ringtrain checkpoint")


def test_pickle_containing_npz_is_never_loaded(tmp_path, monkeypatch):
    import pickle

    unpickled = []
    monkeypatch.setattr(pickle, "loads", lambda *a, **k: unpickled.append(1))
    path = tmp_path / "evil.npz"
    np.savez(path, w=np.array([{"a": 1}], dtype=object), allow_pickle=True)
    read_error(path, "pickled")
    assert unpickled == []


def test_newer_format_version_asks_for_an_upgrade(tmp_path):
    path = tmp_path / "future.npz"
    meta = {"format": "ringtrain-checkpoint", "format_version": 99, "step": 1, "sha256": "0"}
    np.savez(path, __meta__=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8))
    read_error(path, "format version 99", "upgrade")


def test_renamed_checkpoint_with_the_wrong_step_is_rejected(good):
    path, _ = good
    wrong = os.path.join(os.path.dirname(path), "ckpt-00000006.npz")
    os.rename(path, wrong)
    read_error(wrong, "does not match its file name")
    # A copy under another kind of name is fine (say, best.npz).
    best = os.path.join(os.path.dirname(path), "best.npz")
    os.rename(wrong, best)
    assert read_checkpoint(best)[1]["step"] == 5


def test_missing_file_and_directory(tmp_path):
    read_error(tmp_path / "nope.npz", "no such file")
    read_error(tmp_path, "directory")


# ---------------------------------------------------------------- fallback


def test_latest_valid_falls_back_to_the_newest_good_one_and_warns(ckdir):
    for step in (10, 20, 30, 40):
        save_checkpoint(ckdir, step, {"params/w": np.full(3, step)}, {"epoch": step}, keep=None)
    paths = list_checkpoints(ckdir)
    flip(paths[0], os.path.getsize(paths[0]) // 2)  # step 40: flipped byte
    os.truncate(paths[1], 100)  # step 30: half written
    stale = ckdir / f".ckpt-00000050.npz.tmp-{dead_pid()}"
    stale.write_bytes(b"PK\x03\x04")
    warnings = []
    path, arrays, meta = latest_valid_checkpoint(ckdir, warn=warnings.append)
    assert path == paths[2] and meta["step"] == 20
    np.testing.assert_array_equal(arrays["params/w"], np.full(3, 20))
    assert len(warnings) == 3 and all("\n" not in w for w in warnings)
    assert "interrupted save" in warnings[0] and str(stale) in warnings[0]
    assert paths[0] in warnings[1] and "falling back" in warnings[1]
    assert paths[1] in warnings[2]


def test_latest_valid_is_none_when_nothing_verifies(ckdir):
    assert latest_valid_checkpoint(ckdir, warn=pytest.fail) is None
    save_checkpoint(ckdir, 1, {}, {})
    os.truncate(list_checkpoints(ckdir)[0], 0)
    warnings = []
    assert latest_valid_checkpoint(ckdir, warn=warnings.append) is None
    assert len(warnings) == 1 and "no older checkpoint" in warnings[0]


def test_latest_valid_warns_through_the_warnings_module_by_default(ckdir):
    save_checkpoint(ckdir, 1, {}, {})
    save_checkpoint(ckdir, 2, {}, {})
    os.truncate(list_checkpoints(ckdir)[0], 0)
    with pytest.warns(ck.CheckpointWarning, match="empty file"):
        assert latest_valid_checkpoint(ckdir)[2]["step"] == 1


# ---------------------------------------------------------------- load_checkpoint


@pytest.fixture
def run_dir(tmp_path):
    run = tmp_path / "run"
    arrays = {"params/fc1.weight": np.ones((2, 2), np.float32),
              "params/fc1.bias": np.zeros(2, np.float32),
              "optim/momentum/fc1.weight": np.full((2, 2), 3.0)}
    save_checkpoint(run / "checkpoints", 10, arrays, {"epoch": 1})
    arrays["params/fc1.bias"] = np.ones(2, np.float32)
    save_checkpoint(run / "checkpoints", 20, arrays, {"epoch": 2})
    return run


@pytest.mark.parametrize("where", ["run", "checkpoints", "file"])
def test_load_checkpoint_from_run_dir_checkpoints_dir_or_file(run_dir, where):
    target = {"run": run_dir, "checkpoints": run_dir / "checkpoints",
              "file": run_dir / "checkpoints" / "ckpt-00000020.npz"}[where]
    params, meta = load_checkpoint(target)
    assert list(params) == ["fc1.weight", "fc1.bias"]
    np.testing.assert_array_equal(params["fc1.bias"], np.ones(2, np.float32))
    assert meta["step"] == 20 and meta["epoch"] == 2


def test_load_checkpoint_skips_a_damaged_newest(run_dir):
    newest = list_checkpoints(run_dir / "checkpoints")[0]
    os.truncate(newest, 50)
    warnings = []
    params, meta = load_checkpoint(run_dir, warn=warnings.append)
    assert meta["step"] == 10 and len(warnings) == 1
    np.testing.assert_array_equal(params["fc1.bias"], np.zeros(2, np.float32))


def test_load_checkpoint_with_nothing_valid_names_the_directory(run_dir, tmp_path):
    for path in list_checkpoints(run_dir / "checkpoints"):
        os.truncate(path, 0)
    with pytest.raises(CheckpointError) as excinfo:
        load_checkpoint(run_dir, warn=lambda line: None)
    assert_one_line_error(excinfo, str(run_dir / "checkpoints"), "all 2 are damaged")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointError, match="there are none"):
        load_checkpoint(empty)
    with pytest.raises(CheckpointError, match="no such checkpoint file or run directory"):
        load_checkpoint(tmp_path / "missing")


# ---------------------------------------------------------------- fuzz


@pytest.fixture(scope="module")
def fuzz_case(tmp_path_factory):
    directory = tmp_path_factory.mktemp("fuzz")
    arrays = {"params/w": np.linspace(-1, 1, 24, dtype=np.float32).reshape(4, 6),
              "params/b": np.arange(3, dtype=np.float16),
              "optim/t": np.array(9, dtype=np.int64)}
    path = save_checkpoint(directory, 7, arrays, {"epoch": 3, "config": {"lr": 0.125}})
    original = Path(path).read_bytes()
    return directory, original, arrays, read_checkpoint(path)[1]


def exact_or_detected(directory, data, arrays, meta):
    path = os.path.join(directory, "ckpt-00000007.npz")
    with open(path, "wb") as f:
        f.write(data)
    try:
        got, got_meta = read_checkpoint(path)
    except CheckpointError as exc:
        assert "\n" not in str(exc)
        return False
    assert_same_arrays(got, arrays)  # never silently wrong
    assert got_meta == meta
    return True


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzz_flipped_bytes_are_detected_or_harmless(fuzz_case, data):
    directory, original, arrays, meta = fuzz_case
    damaged = bytearray(original)
    for _ in range(data.draw(st.integers(1, 3))):
        offset = data.draw(st.integers(0, len(original) - 1))
        damaged[offset] ^= data.draw(st.integers(1, 255))
    exact_or_detected(directory, bytes(damaged), arrays, meta)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzz_truncations_are_always_detected(fuzz_case, data):
    directory, original, arrays, meta = fuzz_case
    length = data.draw(st.integers(0, len(original) - 1))
    assert not exact_or_detected(directory, original[:length], arrays, meta)
