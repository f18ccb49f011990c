"""The library collectives' guard, on one rank: the bound's settings, and one thread at a time."""

import threading

import numpy as np
import pytest

import ringtrain
import ringtrain.comm
from ringtrain.comm import guard
from ringtrain.errors import UsageError


@pytest.fixture(autouse=True)
def no_bound():
    ringtrain.comm.set_timeout(None)
    yield
    ringtrain.comm.set_timeout(None)


@pytest.mark.parametrize("value", [0, -1, float("nan"), float("inf"), "soon", True])
def test_a_bound_must_be_seconds_above_zero(value):
    with pytest.raises(UsageError, match="must be a number of seconds > 0, or None for no bound"):
        ringtrain.comm.set_timeout(value)


def test_set_returns_the_previous_bound_and_the_block_restores_it():
    assert ringtrain.comm.get_timeout() is None
    assert ringtrain.comm.set_timeout(30) is None
    with ringtrain.comm.timeout(5):
        assert ringtrain.comm.get_timeout() == 5
    assert ringtrain.comm.get_timeout() == 30


def test_the_environment_gives_the_default(monkeypatch):
    monkeypatch.setenv(guard.ENV, "12.5")
    assert guard.timeout_from_env() == 12.5
    monkeypatch.setenv(guard.ENV, "later")
    with pytest.raises(UsageError, match="^RINGTRAIN_TIMEOUT='later': must be a number of seconds > 0; unset it"):
        guard.timeout_from_env()
    monkeypatch.setenv(guard.ENV, "")
    assert guard.timeout_from_env() is None


def test_collectives_still_work_under_a_bound():
    ringtrain.comm.set_timeout(10)
    x = np.arange(4, dtype=np.float32)
    assert np.array_equal(ringtrain.allreduce(x, op="sum"), x)
    assert ringtrain.allreduce_many_([x.copy()])[0].tolist() == x.tolist()


def test_a_second_thread_in_a_collective_on_one_communicator_is_refused():
    held = guard.guard_of(None)
    assert held.enter("broadcast_")  # as if this thread were inside broadcast_
    try:
        errors = []

        def other():
            try:
                ringtrain.allreduce_(np.ones(3, np.float32))
            except UsageError as exc:
                errors.append(str(exc))

        thread = threading.Thread(target=other)
        thread.start()
        thread.join()
        assert errors == ["allreduce_: another thread is in broadcast_ on this communicator; call ringtrain's "
                          "collectives on one communicator from one thread at a time (use a lock, or give each "
                          "thread its own communicator with comm.Dup())"]
        # The same thread may nest (a collective made of collectives).
        ringtrain.allreduce_(np.ones(3, np.float32))
    finally:
        held.exit()
    ringtrain.allreduce_(np.ones(3, np.float32))  # released: anyone may call again


def test_threads_taking_turns_are_fine():
    def call():
        ringtrain.allreduce_(np.ones(3, np.float32))

    for _ in range(3):
        thread = threading.Thread(target=call)
        thread.start()
        thread.join()
        call()


def test_a_repeated_call_looks_the_communicators_state_up_no_more(monkeypatch):
    # The small-call path's cost: after the first call, neither the guard nor
    # the collective asks MPI's attribute cache for the communicator's state.
    from ringtrain.comm.state import CommState

    x = np.ones(4, np.float32)
    for call in (ringtrain.allreduce_, ringtrain.allreduce, ringtrain.broadcast_):
        call(x)
    lookups = []
    original = CommState.of.__func__
    monkeypatch.setattr(CommState, "of", classmethod(lambda cls, comm: lookups.append(comm) or original(cls, comm)))
    for _ in range(3):
        ringtrain.allreduce_(x)
        ringtrain.allreduce(x)
        ringtrain.broadcast_(x)
        ringtrain.allreduce_many_([x])
    assert lookups == []
