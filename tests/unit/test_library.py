"""What a user of the library meets: the lazy torch adapter, batches torch can take, checked configs, exact flags."""

import importlib.util
import subprocess
import sys

import numpy as np
import pytest

import ringtrain
from ringtrain.cli import build_parser
from ringtrain.errors import UsageError


def test_interop_is_an_attribute_loaded_on_first_use():
    # `import ringtrain` stays light (no torch); the torch wing loads when first named, and
    # where torch is missing, naming it is one line that says how to install torch.
    code = ("import sys, ringtrain; assert 'ringtrain.torch' not in sys.modules and 'torch' not in sys.modules; "
            "assert callable(ringtrain.interop.average_gradients_)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    if importlib.util.find_spec("torch") is not None:
        assert result.returncode == 0, result.stderr
    else:
        last = result.stderr.strip().splitlines()[-1]
        assert last == ("ModuleNotFoundError: ringtrain.torch needs torch, which is not installed: "
                        "pip install torch==2.13.0 (or the [torch] extra)"), result.stderr
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        _ = ringtrain.nope


def test_batches_are_writeable_copies():
    plan = ringtrain.EpochPlan(100, 2, 0, batch_size=8, seed=1)
    batches = [rows for _, rows in plan.batches(0)]
    assert all(rows.flags.writeable and rows.dtype == np.int64 for rows in batches)
    batches[0][:] = -1  # the plan's own order is untouched
    assert np.array_equal(plan.batch_indices(0, 0), plan.epoch_order(0)[:8]) and plan.batch_indices(0, 0).min() >= 0


@pytest.mark.parametrize("change, message", [
    ({"epochs": "3"}, "--epochs: must be an integer, got '3' (str)"),
    ({"lr": "0.1"}, "--lr: must be a number, got '0.1' (str)"),
    ({"hidden": (128, "64")}, "--hidden: must be a tuple of integers like (128, 64)"),
    ({"drop_last": "yes"}, "--drop-last: must be True or False, got 'yes' (str)"),
])
def test_config_of_the_wrong_type_is_a_one_line_error(change, message):
    with pytest.raises(UsageError) as info:
        ringtrain.TrainConfig(**change)
    assert str(info.value).startswith(message) and "\n" not in str(info.value)


def test_config_takes_lists_ints_and_paths_for_what_they_mean(tmp_path):
    cfg = ringtrain.TrainConfig(hidden=[64, 32], lr=1, run_dir=tmp_path, epochs=np.int64(3))
    assert (cfg.hidden, cfg.lr, cfg.run_dir, cfg.epochs) == ((64, 32), 1.0, str(tmp_path), 3)
    assert type(cfg.lr) is float and type(cfg.epochs) is int


@pytest.mark.parametrize("argv", [["train", "--epoch", "3"], ["train", "--batch", "8"], ["plot", "r", "--step", "2"]])
def test_abbreviated_flags_are_refused(argv):
    with pytest.raises(UsageError, match="unrecognized arguments"):
        build_parser().parse_args(argv)

