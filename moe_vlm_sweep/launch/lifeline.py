"""The worker dies with its launcher: a sweep killed by ``kill -9`` (or a lost Slurm job's task) must not leave a
worker training on the GPU under the next trial, whose numbers it would quietly corrupt.

The launcher hands its identity (pid and kernel start time in clock ticks, so a reused pid does not count and a
wall-clock step cannot fake a death) to the worker in the environment; every rank watches it from a daemon thread
and exits when it is gone. A kernel parent-death signal would reach only the launcher's direct child, not
torchrun's ranks, and needs ``preexec_fn``, unsafe with the sweep's heartbeat thread. Linux only (``/proc``):
elsewhere the worker runs unwatched.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

logger = logging.getLogger(__name__)

LAUNCHER_ENV = "MOE_VLM_SWEEP_LAUNCHER"
WATCH_S = 1.0
"""How often a rank checks; one syscall a second costs nothing measurable next to a training step."""


def start_ticks(pid: int) -> str | None:
    """Field 22 of ``/proc/PID/stat`` (start time since boot, in ticks: fixed for the process's life), or None
    for a process that is gone or a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) ": field 3 (state) onward
    return None if fields[0] in ("Z", "X") else fields[19]


def launcher_identity() -> str | None:
    """``pid:start_ticks`` of this process, for the worker's environment (None without ``/proc``)."""
    ticks = start_ticks(os.getpid())
    return None if ticks is None else f"{os.getpid()}:{ticks}"


def is_alive(identity: str) -> bool:
    pid, ticks = identity.split(":")
    return start_ticks(int(pid)) == ticks


def watch_launcher() -> None:
    """Start the watch when the launcher set ``LAUNCHER_ENV`` (a worker started by hand runs unwatched)."""
    identity = os.environ.get(LAUNCHER_ENV)
    if not identity:
        return

    def watch() -> None:
        while is_alive(identity):
            time.sleep(WATCH_S)
        logger.warning("its launcher (%s) is gone; exiting so no orphan holds the device", identity)
        os._exit(1)

    threading.Thread(target=watch, name="launcher-watch", daemon=True).start()
