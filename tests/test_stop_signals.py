"""A stop signal to the sweep is never lost, even when Python delivers it inside a finalizer that drops its
exception."""

import os
import signal
import sys

import pytest

from moe_vlm_sweep.launch.stop import Interrupted, raise_if_stopped, received, stoppable


class SignalsItselfWhenCollected:
    """Sends SIGTERM from its finalizer: ``os.kill`` runs the Python handler before it returns, so the handler's
    exception is raised inside ``__del__``, where Python drops it."""

    def __del__(self) -> None:
        os.kill(os.getpid(), signal.SIGTERM)


def test_a_stop_that_a_finalizer_swallowed_still_stops_the_sweep_and_is_not_printed(monkeypatch):
    printed = []
    monkeypatch.setattr(sys, "unraisablehook", printed.append)
    before = signal.getsignal(signal.SIGTERM)
    with stoppable():
        SignalsItselfWhenCollected()  # returns: the finalizer swallowed the handler's Interrupted
        assert received() == signal.SIGTERM
        with pytest.raises(Interrupted) as stop:
            raise_if_stopped()
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL, "a second signal must end the process at once"
    assert stop.value.signum == signal.SIGTERM
    assert printed == []
    assert signal.getsignal(signal.SIGTERM) is before and sys.unraisablehook == printed.append
    assert received() is None, "a stop belongs to its sweep alone"


def test_any_other_exception_a_finalizer_drops_is_still_printed(monkeypatch):
    class Faulty:
        def __del__(self) -> None:
            raise RuntimeError("a broken finalizer")

    printed = []
    monkeypatch.setattr(sys, "unraisablehook", printed.append)
    with stoppable():
        Faulty()
    assert [type(p.exc_value) for p in printed] == [RuntimeError]


def test_without_a_stop_the_check_passes_and_a_signal_that_gets_through_raises():
    with stoppable():
        raise_if_stopped()
        assert received() is None
        with pytest.raises(Interrupted):
            os.kill(os.getpid(), signal.SIGINT)
    with stoppable():
        assert received() is None
        raise_if_stopped()
