"""Handlers installed for a while and handed back exactly: the launcher's and the trainer's, one path."""

import signal
import threading

import pytest

from ringtrain.cluster.jobs import FORWARDED, Forwarder
from ringtrain.cluster.signals import restorable, swapped_handlers
from ringtrain.training.stopping import StopSignals


class FakeComm:
    def Get_size(self):
        return 1


def _mine(signum, frame):
    pass


@pytest.fixture
def usr1_restored():
    before = signal.getsignal(signal.SIGUSR1)
    yield
    signal.signal(signal.SIGUSR1, before)


def test_the_previous_handlers_come_back(usr1_restored):
    signal.signal(signal.SIGUSR1, _mine)
    with swapped_handlers([signal.SIGUSR1], signal.SIG_IGN) as previous:
        assert signal.getsignal(signal.SIGUSR1) is signal.SIG_IGN
        assert previous == {signal.SIGUSR1: _mine}
    assert signal.getsignal(signal.SIGUSR1) is _mine


def test_the_previous_handlers_come_back_after_an_exception(usr1_restored):
    signal.signal(signal.SIGUSR1, _mine)
    with pytest.raises(RuntimeError):
        with swapped_handlers([signal.SIGUSR1], signal.SIG_IGN):
            raise RuntimeError("boom")
    assert signal.getsignal(signal.SIGUSR1) is _mine


def test_off_the_main_thread_nothing_is_installed(usr1_restored):
    signal.signal(signal.SIGUSR1, _mine)
    seen = []

    def body():
        with swapped_handlers([signal.SIGUSR1], signal.SIG_IGN) as previous:
            seen.append((previous, signal.getsignal(signal.SIGUSR1)))

    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    assert seen == [({}, _mine)]


def test_a_handler_installed_from_c_is_restored_as_the_default():
    assert restorable(None) is signal.SIG_DFL
    assert restorable(_mine) is _mine


@pytest.mark.parametrize("make", [lambda: StopSignals(FakeComm()), Forwarder], ids=["StopSignals", "Forwarder"])
def test_leaving_never_hands_none_to_signal_signal(monkeypatch, make):
    # CPython's signal.signal returns None for a handler it did not install
    # (one set from C by an embedding program); handing that None back raises
    # TypeError. Both users of the swap must restore it as SIG_DFL instead.
    real = signal.signal
    calls = []

    def from_c_once(signum, handler):
        if handler is None:
            raise TypeError("signal handler must be signal.SIG_IGN, signal.SIG_DFL, or a callable object")
        calls.append((signum, handler))
        old = real(signum, handler)
        return None if len(calls) == 1 else old

    saved = {s: signal.getsignal(s) for s in FORWARDED}
    monkeypatch.setattr(signal, "signal", from_c_once)
    try:
        with make():
            pass
    finally:
        for s, h in saved.items():
            real(s, h)
    first = calls[0][0]
    assert (first, signal.SIG_DFL) in calls[-len(calls) // 2:]
