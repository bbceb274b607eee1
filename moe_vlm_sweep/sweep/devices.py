"""Trials on one host measure on devices no other trial uses at the same time.

Three sweep workers on one 2-core machine measured the same config at 1239 tok/s against 3393 tok/s with two:
enough to change the winner. So a trial launched on this host first takes its devices: a lock file per GPU (as
many as ``launcher.nproc_per_node``; ``CUDA_VISIBLE_DEVICES`` then names the ones it holds), or on the CPU one
lock over the cores this process may use (the worker's threads use them all). A trial that cannot have its
devices waits for them, saying so once; it never runs beside another. The locks are ``flock`` locks, so a killed
sweep's are released by the kernel, and they are host-wide (``MOE_VLM_SWEEP_LOCK_DIR``, default under the
system's temporary folder), so workers of different studies share them too.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

LOCK_DIR_ENV = "MOE_VLM_SWEEP_LOCK_DIR"
POLL_S = 0.5


def lock_dir() -> Path:
    path = Path(os.environ.get(LOCK_DIR_ENV) or Path(tempfile.gettempdir()) / "moe-vlm-sweep-locks")
    path.mkdir(parents=True, exist_ok=True)
    return path


def _try_lock(name: str) -> int | None:
    fd = os.open(lock_dir() / name, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd


def visible_gpus() -> list[str]:
    """The GPUs this process may hand out: ``CUDA_VISIBLE_DEVICES`` as the sweep was started with, else all."""
    given = os.environ.get("CUDA_VISIBLE_DEVICES")
    if given is not None:
        return [d.strip() for d in given.split(",") if d.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]


@contextlib.contextmanager
def held(*, gpus: int, say: Callable[[str], None]) -> Iterator[str]:
    """Hold ``gpus`` GPUs (0: this host's cores) for one trial; yields what it holds, for the progress line. While
    held, ``CUDA_VISIBLE_DEVICES`` names the held GPUs (the local launcher passes its environment on)."""
    cores = sorted(os.sched_getaffinity(0))
    pool = [f"gpu-{d}" for d in visible_gpus()] if gpus else [f"cpu-{cores[0]}-{cores[-1]}-{len(cores)}"]
    wanted = gpus or 1
    if wanted > len(pool):
        raise RuntimeError(f"a trial needs {wanted} GPUs and this host shows {len(pool)}")
    fds: dict[str, int] = {}
    waited = False
    try:
        while True:
            for name in pool:
                if name not in fds and len(fds) < wanted and (fd := _try_lock(name)) is not None:
                    fds[name] = fd
            if len(fds) == wanted:
                break
            if not waited:
                say(
                    f"waiting for {'GPUs' if gpus else 'the CPU cores'} another trial on this host measures on "
                    f"(locks in {lock_dir()})"
                )
                waited = True
            for name in list(fds):  # never sit on part of a set while waiting: two waiters could deadlock
                os.close(fds.pop(name))
            time.sleep(POLL_S)
        saved = os.environ.get("CUDA_VISIBLE_DEVICES")
        if gpus:
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(n.removeprefix("gpu-") for n in fds)
        try:
            yield ", ".join(fds)
        finally:
            if gpus:
                if saved is None:
                    os.environ.pop("CUDA_VISIBLE_DEVICES", None)
                else:
                    os.environ["CUDA_VISIBLE_DEVICES"] = saved
    finally:
        for fd in fds.values():
            os.close(fd)
