"""SIGINT and SIGTERM to a running sweep: the first stops it cleanly, a second ends the process at once.

Python runs a signal handler between any two bytecodes of the main thread, finalizers included. An exception it
raises inside a weakref callback or a ``__del__`` (SQLAlchemy and MLflow run both while a trial is set up) is
printed as "Exception ignored" and dropped, and the sweep would then run on as if nothing had come. So the handler
also records the signal, and :func:`raise_if_stopped` raises a recorded stop wherever stopping is safe: the
sweep's loop before it asks, claims and launches a trial, and ``launch`` about once a second while a worker runs
(a sweep's trials, its confirmation re-runs and its verification), whose process group then ends on the way out.
The dropped exception is not printed either: the stop it carried takes effect, so it is no error. Outside a sweep
nothing is recorded and the check does nothing.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

_received: list[int] = []
logger = logging.getLogger(__name__)


class Interrupted(BaseException):
    """SIGINT or SIGTERM reached the sweep. A BaseException, like KeyboardInterrupt, so it passes through
    Hydra's launcher (which keeps a task's Exception as its result) and the local launcher (which ends the
    worker's process group on the way)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _interrupt(signum: int, frame: Any) -> None:
    _received.append(signum)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    raise Interrupted(signum)


def raise_if_stopped() -> None:
    """Raise the stop that came, whether its own exception got through or a finalizer dropped it."""
    if _received:
        raise Interrupted(_received[0])


def received() -> int | None:
    """The signal that stopped the sweep, whether or not its exception got through; None if none came."""
    return _received[0] if _received else None


@contextmanager
def stoppable() -> Iterator[None]:
    """Install the handler for the sweep's duration (from the main thread only, where Python delivers signals);
    on the way out put back what was there before and forget the stop."""
    _received.clear()
    handlers = {}
    if threading.current_thread() is threading.main_thread():
        handlers = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    unraisable = sys.unraisablehook

    def quiet_about_stops(dropped: Any) -> None:
        if isinstance(dropped.exc_value, Interrupted):
            logger.debug("%s came inside %r; it takes effect at the next safe point", dropped.exc_value, dropped.object)
        else:
            unraisable(dropped)

    sys.unraisablehook = quiet_about_stops
    try:
        yield
    finally:
        sys.unraisablehook = unraisable
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        _received.clear()
