"""The one parser for numbers from the environment: what it takes, what it refuses, and how it says so."""

import pytest

from ringtrain.environment import EnvironmentValueError, env_flag, env_int, env_seconds, parse_int, parse_seconds
from ringtrain.errors import UsageError

GARBAGE = ["abc", "5s", "²", "1e3", "0x10", "1_000", "+3", "3.", " - 3", "nan", "inf", "1" * 400, "٣", "３"]


@pytest.mark.parametrize("text", GARBAGE)
def test_garbage_is_one_line_naming_the_variable(text):
    with pytest.raises(EnvironmentValueError) as caught:
        parse_int(text, "SOME_COUNT")
    line = str(caught.value)
    assert line.startswith("SOME_COUNT=") and "\n" not in line and len(line) < 200
    assert isinstance(caught.value, UsageError)


@pytest.mark.parametrize("text", GARBAGE + ["-1", "0"])
def test_seconds_that_must_be_positive_refuse_garbage_zero_and_negatives(text):
    with pytest.raises(EnvironmentValueError, match="RINGTRAIN_X="):
        parse_seconds(text, "RINGTRAIN_X", positive=True)


def test_values_in_range_are_taken_and_blank_is_the_default():
    env = {"A": " 7 ", "B": "2.5", "C": "", "D": "yes"}
    assert env_int(env, "A", lo=1, hi=8) == 7
    assert env_seconds(env, "B") == 2.5
    assert env_int(env, "C", default=3) == 3 and env_int(env, "missing", default=4) == 4
    assert env_flag(env, "D") is True and env_flag(env, "C", default=True) is True


def test_ranges_are_enforced_at_both_ends():
    assert parse_int("-2", "N", lo=-5) == -2
    for text in ("-6", "9"):
        with pytest.raises(EnvironmentValueError, match="from -5 to 8"):
            parse_int(text, "N", lo=-5, hi=8)


def test_a_flag_that_is_no_switch_is_refused():
    with pytest.raises(EnvironmentValueError, match="HOROVOD_STALL_CHECK_DISABLE='maybe'"):
        env_flag({"HOROVOD_STALL_CHECK_DISABLE": "maybe"}, "HOROVOD_STALL_CHECK_DISABLE")


def test_seconds_name_their_unit_and_whole_bounds_read_as_whole_numbers():
    with pytest.raises(EnvironmentValueError) as caught:
        parse_seconds("20000", "HOROVOD_CYCLE_TIME", hi=10_000, unit="milliseconds")
    assert str(caught.value) == ("HOROVOD_CYCLE_TIME='20000': must be a number of milliseconds >= 0 and <= 10000; "
                                 "unset it for the default")
    assert parse_seconds("0.5", "HOROVOD_CYCLE_TIME", hi=10_000, unit="milliseconds") == 0.5


@pytest.mark.parametrize("text", ["\u20035", "5\u00a0", "\u30005"])
def test_only_ascii_blanks_are_forgiven_around_a_number(text):
    assert parse_int(" 5\t", "N") == 5
    with pytest.raises(EnvironmentValueError):
        parse_int(text, "N")
    with pytest.raises(EnvironmentValueError):
        parse_seconds(text, "N")
