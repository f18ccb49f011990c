"""The engine's settings (ringtrain.engine.settings): every variable read once, validated, one line when bad."""

import pytest

from ringtrain.engine.settings import DEFAULT_FUSION_BYTES, Settings
from ringtrain.errors import UsageError


def test_unset_variables_give_the_documented_defaults():
    s = Settings.from_env({})
    assert (s.cycle_s, s.fusion_bytes, s.local_bytes) == (0.001, 64 << 20, 16 << 10) == \
        (0.001, DEFAULT_FUSION_BYTES, 16 << 10)
    assert s.stall_times == (60.0, 0.0) and s.timeout_s is None and s.notes == ()


def test_each_variable_sets_its_field():
    s = Settings.from_env({"HOROVOD_CYCLE_TIME": "0.5", "HOROVOD_FUSION_THRESHOLD": "1048576",
                           "RINGTRAIN_HVD_LOCAL_BYTES": "0", "RINGTRAIN_TIMEOUT": "30",
                           "HOROVOD_STALL_CHECK_TIME_SECONDS": "2", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "5"})
    assert (s.cycle_s, s.fusion_bytes, s.local_bytes, s.timeout_s) == (0.0005, 1 << 20, 0, 30.0)
    assert s.stall_times == (2.0, 5.0)


def test_stall_variables_behave_as_horovods():
    assert Settings.from_env({"HOROVOD_STALL_CHECK_DISABLE": "1"}).stall_times == (None, 0.0)
    moot = Settings.from_env({"HOROVOD_STALL_CHECK_TIME_SECONDS": "9", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "5"})
    assert moot.stall_times == (9.0, 0.0) and "will not shutdown" in moot.notes[0]


@pytest.mark.parametrize("name, value, words", [
    ("HOROVOD_CYCLE_TIME", "fast", "a number of milliseconds"),
    ("HOROVOD_CYCLE_TIME", "20000", "<= 10000"),
    ("HOROVOD_FUSION_THRESHOLD", "64MB", "a whole number of bytes"),
    ("HOROVOD_FUSION_THRESHOLD", "-1", "a whole number of bytes"),
    ("RINGTRAIN_HVD_LOCAL_BYTES", "1e4", "a whole number of bytes"),
    ("HOROVOD_STALL_CHECK_TIME_SECONDS", "soon", "a number of seconds"),
    ("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "-5", "a number of seconds"),
    ("HOROVOD_STALL_CHECK_DISABLE", "maybe", "0 or 1"),
    # A misspelt disable switch is refused even though the check times it would make moot are fine,
    # and a bound that is not a number is refused rather than taken as no bound.
    ("RINGTRAIN_TIMEOUT", "ten", "seconds > 0"),
    ("RINGTRAIN_TIMEOUT", "0", "seconds > 0"),
])
def test_a_bad_value_is_one_line_naming_the_variable_and_the_fix(name, value, words):
    with pytest.raises(UsageError) as caught:
        Settings.from_env({name: value})
    line = str(caught.value)
    assert "\n" not in line and line.startswith(f"{name}=") and words in line and "unset it" in line
    assert caught.value.everywhere


def test_a_bad_value_is_refused_even_where_another_variable_makes_it_moot():
    with pytest.raises(UsageError, match="HOROVOD_STALL_CHECK_TIME_SECONDS"):
        Settings.from_env({"HOROVOD_STALL_CHECK_DISABLE": "1", "HOROVOD_STALL_CHECK_TIME_SECONDS": "x"})
