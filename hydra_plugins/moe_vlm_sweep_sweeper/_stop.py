"""SIGINT and SIGTERM to a running sweep: the first stops it cleanly, a second ends the process at once.

Python runs a signal handler between any two bytecodes of the main thread, finalizers included. An exception it
raises inside a weakref callback or a ``__del__`` (SQLAlchemy and MLflow run both while a trial is set up) is
printed as "Exception ignored" and dropped, and the sweep would then run on as if nothing had come. So the handler
also records the signal, and the sweep's loop calls :func:`raise_if_stopped` at each point where stopping is
safe: a dropped stop takes effect there.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

_received: list[int] = []


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
    """Raise the stop a finalizer swallowed, if one came."""
    if _received:
        raise Interrupted(_received[0])


def received() -> int | None:
    """The signal that stopped the sweep, whether or not its exception got through; None if none came."""
    return _received[0] if _received else None


@contextmanager
def stoppable() -> Iterator[None]:
    """Install the handler for the sweep's duration (from the main thread only, where Python delivers signals)
    and put back what was there before."""
    _received.clear()
    handlers = {}
    if threading.current_thread() is threading.main_thread():
        handlers = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
