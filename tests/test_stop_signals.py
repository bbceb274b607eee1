"""A stop signal to the sweep is never lost, even when Python delivers it inside a finalizer that drops its
exception."""

import os
import signal
import sys

import pytest

from hydra_plugins.moe_vlm_sweep_sweeper._stop import Interrupted, raise_if_stopped, received, stoppable


class _SignalsItselfWhenCollected:
    def __del__(self) -> None:
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(10_000):  # the handler runs at the next bytecode check, still inside this finalizer
            pass


def test_a_stop_that_a_finalizer_swallowed_still_stops_the_sweep(monkeypatch):
    dropped = []
    monkeypatch.setattr(sys, "unraisablehook", dropped.append)
    before = signal.getsignal(signal.SIGTERM)
    with stoppable():
        _SignalsItselfWhenCollected()
        assert [type(d.exc_value) for d in dropped] == [Interrupted], "the finalizer did not swallow the stop"
        assert received() == signal.SIGTERM
        with pytest.raises(Interrupted) as stop:
            raise_if_stopped()
    assert stop.value.signum == signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is before


def test_no_stop_raises_nothing_and_the_next_sweep_starts_clean():
    with stoppable():
        raise_if_stopped()
        assert received() is None
        with pytest.raises(Interrupted):
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(10_000):
                pass
    with stoppable():
        assert received() is None
        raise_if_stopped()
