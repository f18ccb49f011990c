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
