import io
import threading

from ringtrain.watchdog import Watchdog, left_neighbour


class FakeComm:
    """Only rank and size: the watchdog never communicates, it only aborts."""

    def __init__(self, rank=2, size=4):
        self.rank, self.size = rank, size

    def Get_rank(self):
        return self.rank

    def Get_size(self):
        return self.size


def test_left_neighbour_wraps():
    assert [left_neighbour(r, 4) for r in range(4)] == [3, 0, 1, 2]


def test_fires_with_operation_step_and_awaited_rank():
    fired = threading.Event()
    out = io.StringIO()
    dog = Watchdog(FakeComm(), timeout=0.2, stream=out, abort=fired.set)
    with dog.watch("gradient allreduce", step=7, waiting_on=1):
        assert fired.wait(5)
    dog.close()
    assert out.getvalue().strip() == ("rank 2: gradient allreduce at step 7 did not finish within 0.2s; "
                                      "waiting on rank 1 (raise --timeout if this is expected)")


def test_quiet_when_operations_finish_in_time():
    fired = threading.Event()
    dog = Watchdog(FakeComm(), timeout=0.3, abort=fired.set)
    for step in range(5):
        with dog.watch("allreduce", step=step):
            pass
    assert not fired.wait(0.8)
    dog.close()


def test_single_rank_needs_no_thread():
    dog = Watchdog(FakeComm(0, 1), timeout=0.1, abort=lambda: 1 / 0)
    with dog.watch("allreduce"):
        pass
    assert dog._thread is None


# --- the start-up watchdog: a watcher process, since MPI_Init holds the GIL -------------------

STARTUP = ("import sys, time; from ringtrain.watchdog import StartupWatchdog\n"
           "with StartupWatchdog(float(sys.argv[1]), 'start-up: test', env={'PMI_RANK': '1', 'PMI_SIZE': '2'},"
           " grace=0.1):\n"
           "    time.sleep(float(sys.argv[2]))\n"
           "print('ended in time')\n")


def test_the_startup_watchdog_kills_a_rank_stuck_past_its_bound():
    import signal
    import subprocess
    import sys
    import time

    began = time.monotonic()
    result = subprocess.run([sys.executable, "-c", STARTUP, "0.5", "60"], capture_output=True, text=True, timeout=30)
    assert result.returncode == -signal.SIGKILL, result
    assert time.monotonic() - began < 10
    assert result.stderr == "rank 1: start-up: test did not finish within 0.5s (raise --timeout if this is expected)\n"


def test_the_startup_watchdog_is_quiet_and_gone_when_start_up_ends_in_time():
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-c", STARTUP, "5", "0.1"], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0 and result.stdout == "ended in time\n" and result.stderr == "", result


def test_describe_is_one_line_that_keeps_the_cause_of_a_message_of_several():
    from ringtrain.errors import UsageError
    from ringtrain.failure import describe

    class UnknownError(Exception):
        pass

    graph = ("Graph execution error:\n\nDetected at node PyFunc defined at (most recent call last):\n"
             "  File \"train.py\", line 9, in step\n\nRuntimeError: the user's own words\n\n\n"
             "\t [[{{node PyFunc}}]] [Op:__inference_step_18]")
    want = "UnknownError: Graph execution error: ... RuntimeError: the user's own words"
    assert describe(UnknownError(graph)) == want
    assert describe(ValueError("first\nsecond\n")) == "ValueError: first ... second"
    tail = ValueError("a\nKeyError: the cause\nErrorHandler gave up")  # a name must end in "Error:" to count
    assert describe(tail) == "ValueError: a ... KeyError: the cause"
    assert describe(ValueError("one line")) == "ValueError: one line"
    assert describe(KeyError()) == "KeyError"
    assert describe(UsageError("--epochs must be positive")) == "--epochs must be positive"
