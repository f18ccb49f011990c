"""Crafted checkpoints: each is one line naming the file, never a traceback, a wrong step or a huge allocation."""

import io
import json
import subprocess
import sys
import zipfile

import numpy as np
import pytest

from ringtrain.io.checkpoint import (FORMAT, FORMAT_VERSION, CheckpointError, CheckpointTooNew, check_formats,
                                     latest_valid_checkpoint, read_checkpoint, save_checkpoint)


def npy(array):
    buf = io.BytesIO()
    np.lib.format.write_array(buf, array, allow_pickle=False)
    return buf.getvalue()


def crafted(path, meta, arrays=None, compression=zipfile.ZIP_STORED, raw_meta=None):
    """A checkpoint-shaped zip with whatever metadata and members a hostile writer chose."""
    arrays = {"params/w": np.zeros(4, np.float32)} if arrays is None else arrays
    with zipfile.ZipFile(path, "w", compression=compression) as zf:
        for name, value in arrays.items():
            zf.writestr(name + ".npy", value if isinstance(value, bytes) else npy(value))
        blob = raw_meta if raw_meta is not None else json.dumps(meta).encode()
        zf.writestr("__meta__.npy", npy(np.frombuffer(blob, np.uint8)))
    return str(path)


def meta(**overrides):
    return {"format": FORMAT, "format_version": FORMAT_VERSION, "step": 1, "sha256": "0" * 64, **overrides}


def one_line_error(path, needle, kind=CheckpointError):
    with pytest.raises(kind) as info:
        read_checkpoint(path)
    text = str(info.value)
    assert "\n" not in text and text.startswith(f"checkpoint {path}: ") and needle in text, text
    return text


# --- a newer format: refused, never skipped ------------------------------------------

def test_a_newer_format_is_refused_naming_both_versions(tmp_path):
    path = crafted(tmp_path / "ckpt-00000001.npz", meta(format_version=FORMAT_VERSION + 1))
    text = one_line_error(path, f"format version {FORMAT_VERSION + 1}", CheckpointTooNew)
    assert f"reads format version {FORMAT_VERSION} at most" in text and "upgrade ringtrain" in text


def test_a_newer_checkpoint_is_never_skipped_for_an_older_one(tmp_path):
    older = {"params/w": np.ones(4, np.float32)}
    save_checkpoint(tmp_path, 1, older, {})
    crafted(tmp_path / "ckpt-00000002.npz", meta(step=2, format_version=FORMAT_VERSION + 1))
    warned = []
    with pytest.raises(CheckpointTooNew):
        latest_valid_checkpoint(tmp_path, warn=warned.append)
    with pytest.raises(CheckpointTooNew):  # whatever lineage is wanted
        latest_valid_checkpoint(tmp_path, warn=warned.append, accept=lambda m: False)
    with pytest.raises(CheckpointTooNew):
        check_formats(tmp_path)
    assert warned == []


# --- metadata types --------------------------------------------------------------------

@pytest.mark.parametrize("step, shown", [(1.0, "float 1.0"), ("1", "str '1'"), (True, "bool True"), (-1, "int -1"),
                                         (None, "NoneType None")])
def test_a_step_that_is_not_a_non_negative_integer_is_refused(tmp_path, step, shown):
    path = crafted(tmp_path / "ckpt-00000001.npz", meta(step=step))
    one_line_error(path, f"damaged metadata (step is {shown}, not a non-negative integer)")


def test_deeply_nested_metadata_is_one_line(tmp_path):
    deep = b"[" * 200_000 + b"]" * 200_000
    path = crafted(tmp_path / "ckpt-00000001.npz", None, raw_meta=deep)
    one_line_error(path, "damaged metadata (not valid UTF-8 JSON)")


# --- sizes declared before anything is inflated ------------------------------------------

def test_a_deflate_bomb_is_refused_before_it_is_inflated(tmp_path):
    big = np.zeros(64 << 20, np.uint8)  # 64 MiB of zeros deflate to about 64 KiB
    path = crafted(tmp_path / "ckpt-00000001.npz", meta(), {"params/w": big, "params/v": big},
                   compression=zipfile.ZIP_DEFLATED)
    # Run in a child with its address space capped well below what inflating would take.
    code = ("import resource, sys; resource.setrlimit(resource.RLIMIT_AS, (400 << 20, 400 << 20));"
            "from ringtrain.io.checkpoint import read_checkpoint, CheckpointError\n"
            f"try:\n read_checkpoint({path!r})\nexcept CheckpointError as e:\n print(e)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    assert "would inflate to more than 64 times the file's size" in result.stdout, result.stdout


def test_a_header_that_claims_more_than_the_member_holds_is_refused(tmp_path):
    # A header claiming 10^10 elements over 16 bytes of data.
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": "<f4", "fortran_order": False, "shape": (10 ** 10,)})
    member = buf.getvalue() + bytes(16)
    path = crafted(tmp_path / "ckpt-00000001.npz", meta(), {"params/w": member})
    one_line_error(path, "declares shape (10000000000,) of float32")


def test_ringtrains_own_checkpoints_still_load(tmp_path):
    path = save_checkpoint(tmp_path, 3, {"params/w": np.arange(5, dtype=np.float32)}, {"epoch": 1})
    arrays, m = read_checkpoint(path)
    assert m["step"] == 3 and arrays["params/w"].tolist() == [0, 1, 2, 3, 4]
