"""The worker dies with its launcher: a sweep killed by ``kill -9`` (or a lost Slurm job's task) must not leave a
worker training on the GPU under the next trial, whose numbers it would quietly corrupt.

The launcher hands its identity (pid and start time, so a reused pid does not count) to the worker in the
environment; every rank watches it from a daemon thread and exits when it is gone. A kernel parent-death signal
would reach only the launcher's direct child, not torchrun's ranks, and needs ``preexec_fn``, unsafe with the
sweep's heartbeat thread.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Optional

import psutil

LAUNCHER_ENV = "MOE_VLM_SWEEP_LAUNCHER"
WATCH_S = 1.0
"""How often a rank checks; one syscall a second costs nothing measurable next to a training step."""


def launcher_identity(pid: Optional[int] = None) -> str:
    """``pid:start_time`` of the launching process, for the worker's environment."""
    process = psutil.Process(pid)
    return f"{process.pid}:{process.create_time():.2f}"


def _alive(identity: str) -> bool:
    pid, started = identity.split(":")
    try:
        return f"{psutil.Process(int(pid)).create_time():.2f}" == started
    except psutil.NoSuchProcess:
        return False


def watch_launcher() -> None:
    """Start the watch when the launcher set ``LAUNCHER_ENV`` (a worker started by hand runs unwatched)."""
    identity = os.environ.get(LAUNCHER_ENV)
    if not identity:
        return

    def watch() -> None:
        while _alive(identity):
            time.sleep(WATCH_S)
        print(f"worker: its launcher ({identity}) is gone; exiting so no orphan holds the device",
              file=sys.stderr, flush=True)
        os._exit(1)

    threading.Thread(target=watch, name="launcher-watch", daemon=True).start()
