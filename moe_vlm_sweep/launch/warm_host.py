"""A warm trial host: a sweep pays the worker's imports (torch, megatron-core, Transformer Engine) once, not per
trial, and every trial still runs in a fresh process of its own.

The host is ``python -m moe_vlm_sweep.train.worker --serve MODULE...``: it imports the modules, then forks one
child per trial, before any CUDA context exists (it checks, and a host that finds one refuses to fork: a CUDA
context does not survive a fork). The child calls setsid (its own process group), takes the trial's environment, working
directory and log, and runs the worker's ``main`` as a fresh process would; on exit it is reaped by the host,
which reports the exit status. So a trial's crash, hang or OOM ends only that child, the launcher's timeout kills
the child's whole process group as before, and the worker's files classify the run as before.

A torchrun group on one node (``launcher.nnodes=1``) is forked the same way: the child is a small leader (as
torchrun ``--standalone``) that forks one process per rank with torchrun's rank variables, all in the leader's
process group, ends the group as soon as a rank fails, and exits 1 if any did. Several nodes need torchrun's
rendezvous: they start fresh processes through torchrun as before.

No orphan: the host watches its launcher (``lifeline``) and exits when it, or the pipe to it, is gone; each trial
watches the launcher too, so a ``kill -9`` of the sweep ends the host and the trial in about a second. The host
ignores SIGINT and SIGTERM: a signal to the sweep (Ctrl-C, ``kill``, Slurm's SIGTERM to every process of a job)
stops the sweep, which ends the running trial's group and then the host; the trial itself keeps the default
handlers. A sweep interrupted while its host starts or forks kills what it started.

Protocol: one JSON object a line, requests on the host's stdin, replies on its stdout (the host moves its own
stdout to stderr first, so an import's print cannot corrupt it).
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path

from moe_vlm_sweep.launch.lifeline import LAUNCHER_ENV, WATCH_S, is_alive

log = logging.getLogger(__name__)

HOST_LOG = "warm_host.log"
READY_TIMEOUT_S = 600.0
"""How long the host may import before the launcher gives up on it (torch + TE + megatron: 15 s on an H200)."""
KILL_UNREPORTED_S = 5.0
"""How long a launcher interrupted while the host forks a trial waits for the trial's pid, to end it."""
CUDA_SAFE_ENV = {"PYTORCH_NVML_BASED_CUDA_CHECK": "1"}
"""``torch.cuda.is_available()`` asks NVML instead of initialising the CUDA driver, so an import that checks
for a GPU leaves the host forkable (PyTorch's documented switch for fork-based launchers)."""


# --- the host's side (runs inside the worker's interpreter) ---------------------------------------------------


def _send(fd: int, message: dict) -> None:
    os.write(fd, (json.dumps(message) + "\n").encode())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_group(nproc: int, run_one: Callable[[], int]) -> int:
    """torchrun ``--standalone`` in miniature: one forked process per rank, the group ended on a rank's failure."""
    port, ranks = _free_port(), {}
    for rank in range(nproc):
        pid = os.fork()
        if pid == 0:
            os.environ.update(
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE=str(nproc),
                LOCAL_WORLD_SIZE=str(nproc),
                GROUP_RANK="0",
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
            )
            os._exit(_guarded(run_one))
        ranks[pid] = rank
    failed = False
    while ranks:
        pid, status = os.wait()
        ranks.pop(pid, None)
        if os.waitstatus_to_exitcode(status) != 0 and not failed:
            failed = True
            for other in ranks:  # as torchrun: one failed rank ends the group (the others would hang in a collective)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(other, signal.SIGTERM)
    return 1 if failed else 0


def _guarded(body: Callable[[], int]) -> int:
    try:
        return body()
    except BaseException:
        import traceback

        traceback.print_exc()
        return 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


def _start_trial(request: dict, protocol_fds: tuple[int, int], main: Callable[[list[str]], int]) -> int:
    """Fork the trial's process: setsid, the trial's environment, cwd and log; never returns in the child. Returns
    once the child leads its own process group, so the launcher's ``killpg`` of the pid never misses it."""
    sys.stdout.flush()
    sys.stderr.flush()
    grouped, said = os.pipe()
    pid = os.fork()
    if pid:
        os.close(said)
        os.read(grouped, 1)  # the child's word after setsid (or EOF, had it died first)
        os.close(grouped)
        return pid
    code = 1
    try:
        os.setsid()
        os.close(grouped)
        os.write(said, b"1")
        os.close(said)
        for fd in protocol_fds:
            os.close(fd)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        out = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.close(out)
        os.close(null)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the host ignores both; the trial must not
        signal.signal(signal.SIGINT, signal.default_int_handler)
        argv = request["argv"]
        nproc = request.get("nproc", 1)
        code = _guarded(lambda: main(argv)) if nproc == 1 else _guarded(lambda: _run_group(nproc, lambda: main(argv)))
    finally:
        os._exit(code)


def _exit_if_gone(identity: str, done: threading.Event) -> None:
    while not done.wait(WATCH_S):
        if not is_alive(identity):
            os._exit(1)


def serve(preload: list[str], main: Callable[[list[str]], int]) -> int:
    """The host's loop: import ``preload``, say ready, then fork a child per request and report its exit."""
    proto_in, proto_out = os.dup(0), os.dup(1)
    os.dup2(2, 1)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    # Python warns at every fork of a process with a thread; torch's import starts a native one that holds no
    # lock the child needs (multiprocessing's forkserver forks the same way after its preload).
    warnings.filterwarnings("ignore", message=r".*use of fork\(\) may lead to deadlocks", category=DeprecationWarning)
    # The host ends with its launcher (the pipe, the lifeline), never by a signal meant for the sweep: Slurm's
    # SIGTERM to every process of a job must stop the sweep and its trial, not the host under a running trial.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    identity = os.environ.get(LAUNCHER_ENV)
    imported = threading.Event()
    watcher = threading.Thread(target=_exit_if_gone, args=(identity, imported), name="launcher-watch", daemon=True)
    if identity:  # imports take seconds: a launcher killed meanwhile must not leave the host importing
        watcher.start()
    began, failed = time.perf_counter(), {}
    for name in preload:
        try:
            importlib.import_module(name)
        except Exception as exc:
            failed[name] = f"{type(exc).__name__}: {exc}"
    imported.set()
    if watcher.is_alive():
        watcher.join()  # no thread of ours runs at a fork
    torch = sys.modules.get("torch")
    cuda_initialized = bool(torch is not None and torch.cuda.is_initialized())
    threads = len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else None
    _send(
        proto_out,
        {
            "ready": not cuda_initialized,
            "imports_s": time.perf_counter() - began,
            "failed_imports": failed,
            "cuda_initialized": cuda_initialized,
            "threads": threads,
        },
    )
    if cuda_initialized:
        return 1
    buffer, children = b"", set[int]()
    while True:
        readable, _, _ = select.select([proto_in], [], [], 0.05 if children else WATCH_S)
        for pid in list(children):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                children.discard(pid)
                _send(proto_out, {"exit": pid, "returncode": os.waitstatus_to_exitcode(status)})
        if identity and not is_alive(identity):
            return 1  # the trials watch the launcher themselves
        if not readable:
            continue
        chunk = os.read(proto_in, 65536)
        if not chunk:
            return 0  # the launcher closed the pipe (or died): its trials end by their own watch
        buffer += chunk
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            pid = _start_trial(json.loads(line), (proto_in, proto_out), main)
            children.add(pid)
            _send(proto_out, {"started": pid})


# --- the launcher's side ------------------------------------------------------------------------------------


class HostGone(RuntimeError):
    """The host exited or broke its protocol; the trial it ran (if any) has been ended."""


class WarmHost:
    """One host process, one trial at a time (the sweeper runs one trial at a time per process; its pipe is not
    shared between threads)."""

    def __init__(self, command: list[str], env: dict[str, str], log_path: Path):
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_path = log_path
        with open(log_path, "ab") as host_log:
            self.proc = subprocess.Popen(
                command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=host_log, env=env, start_new_session=True
            )
        assert self.proc.stdin is not None and self.proc.stdout is not None  # both are pipes (above)
        self._requests, self._replies = self.proc.stdin, self.proc.stdout
        self._buffer = b""
        try:
            ready = self._next(READY_TIMEOUT_S)
        except HostGone as exc:
            ready = {"exited": str(exc)}
        except BaseException:  # a signal to the sweep while the host imports: no host is left behind
            self.kill()
            raise
        if ready is None or not ready.get("ready"):
            self.close()
            raise HostGone(f"the warm trial host did not start ({ready}); see {log_path}")
        self.imports_s = float(ready["imports_s"])
        if ready.get("failed_imports"):
            log.warning("warm trial host: could not preload %s", ready["failed_imports"])

    def _next(self, timeout: float) -> dict | None:
        """The host's next message within ``timeout`` s, or None; raises HostGone at the pipe's end."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            readable, _, _ = select.select([self._replies], [], [], left)
            if not readable:
                return None
            chunk = os.read(self._replies.fileno(), 65536)
            if not chunk:
                raise HostGone(f"the warm trial host exited (status {self.proc.poll()}); see {self.log_path}")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def start(self, *, argv: list[str], env: dict[str, str], log_path: Path, nproc: int) -> int:
        """Fork a trial; returns its pid (also its process group, made by setsid)."""
        request = {"argv": argv, "env": env, "cwd": os.getcwd(), "log": str(log_path.resolve()), "nproc": nproc}
        try:
            self._requests.write((json.dumps(request) + "\n").encode())
            self._requests.flush()
        except (BrokenPipeError, OSError) as exc:
            raise HostGone(f"the warm trial host is gone ({exc}); see {self.log_path}") from exc
        try:
            message = self._next(READY_TIMEOUT_S)
        except BaseException:  # a signal to the sweep before the host said which pid it forked: end that trial
            with contextlib.suppress(Exception):
                late = self._next(KILL_UNREPORTED_S) or {}
                if "started" in late:
                    os.killpg(int(late["started"]), signal.SIGKILL)
            raise
        if message is None or "started" not in message:
            raise HostGone(f"the warm trial host did not fork the trial ({message}); see {self.log_path}")
        return int(message["started"])

    def wait(self, pid: int, timeout: float | None) -> int | None:
        """The trial's exit status (negative: the signal), or None if it is still running after ``timeout`` s."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = 3600.0 if deadline is None else deadline - time.monotonic()
            if left <= 0:
                return None
            message = self._next(left)
            if message is None:
                return None
            if message.get("exit") == pid:
                return int(message["returncode"])

    def close(self) -> None:
        """Close the pipe (the host exits on its own), then make sure."""
        with contextlib.suppress(OSError):
            self._requests.close()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


_hosts: dict[tuple, WarmHost] = {}
_failed_starts: dict[tuple, str] = {}
"""Hosts that could not start (a CUDA context after the imports, say): not tried again by this process, so a
sweep pays for the failed start once and then runs fresh workers."""


def shared_host(command: list[str], env: dict[str, str], log_path: Path) -> WarmHost:
    """This process's host for ``command`` (started on first use, restarted if it died), closed at exit."""
    key = tuple(command)
    if key in _failed_starts:
        raise HostGone(_failed_starts[key])
    host = _hosts.get(key)
    if host is None or not host.alive:
        try:
            host = _hosts[key] = WarmHost(command, env, log_path)
        except HostGone as exc:
            _failed_starts[key] = str(exc)
            raise
        if len(_hosts) == 1:
            atexit.register(close_hosts)
    return host


def close_hosts() -> None:
    while _hosts:
        _hosts.popitem()[1].close()
