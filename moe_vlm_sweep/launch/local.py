"""Run the worker in its own process (world 1) or torchrun group, with a timeout, and classify the outcome.

The classification reads what the worker wrote (``metrics.json`` or ``failure.json``) and falls back to the
exit status only when the worker could not write: a signal is a ``crash``, a run past ``train.timeout_s`` is a
``timeout``. The worker runs in its own process group (``setsid``), so a timeout kills the whole group (torchrun and every
rank), never leaving an orphan holding a GPU; if this process itself is killed, the ranks see it gone and exit
(``launch/lifeline.py``).

``warm=True`` (a sweep's trials) forks the worker from a warm trial host (``launch/warm_host.py``) instead of
starting a fresh interpreter: the same isolation, timeout, classification and lifeline, without paying the
imports again. Every run gets the shared compile caches (``launch/compile_cache.py``).

``watch`` (a sweep's early stop) is called about once a second with the run directory while the worker runs; a
reason it returns ends the run's process group, and the run is ``pruned`` with that reason. A stop signal to the
sweep that a finalizer swallowed is raised at the same pace (``launch/stop.py``), ending the group too.

Inside a Slurm job that Slurm is ending (time limit, scancel, preemption), a crashed run is not reported: the
process waits for Slurm's kill, so the job ends with Slurm's state (``launch/slurm.py``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from moe_vlm_sweep.config.codec import DecodeError
from moe_vlm_sweep.launch import slurm, warm_host
from moe_vlm_sweep.launch.compile_cache import cache_env
from moe_vlm_sweep.launch.lifeline import LAUNCHER_ENV, launcher_identity
from moe_vlm_sweep.launch.result import RunResult
from moe_vlm_sweep.launch.run_dir import WORKER_LOG
from moe_vlm_sweep.launch.status import RunStatus
from moe_vlm_sweep.launch.stop import raise_if_stopped
from moe_vlm_sweep.metrics.schema import (
    FAILURE_FILE,
    drop_empty_native_crash_files,
    first_native_crash,
    read_failure,
    read_metrics,
)
from moe_vlm_sweep.plan.plan import RunPlan

WORKER_MODULE = "moe_vlm_sweep.train.worker"
SERVE_FLAG = "--serve"
"""``python -m WORKER_MODULE --serve MODULE...``: the worker as a warm trial host (``launch/warm_host.py``)."""
KILL_GRACE_S = 10.0
WATCH_EVERY_S = 1.0
ALLOC_CONF_ENVS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
"""Where PyTorch's CUDA allocator reads its settings, in its order (``c10/cuda/CUDAAllocatorConfig.h``): the
CUDA name, then the generic one (2.9+). The launcher sets both to one value, so neither shadows the config."""


def cuda_alloc_conf(inherited: str | None, expandable_segments: bool) -> str:
    """The allocator settings the worker gets: the caller's own (a ``garbage_collection_threshold``, say) with
    ``expandable_segments`` always as ``train.expandable_segments`` says, so a run never depends on the shell's
    value of the one setting the config owns."""
    items = (item.strip() for item in (inherited or "").split(","))
    kept = [item for item in items if item and not item.startswith("expandable_segments")]
    return ",".join([*kept, f"expandable_segments:{expandable_segments}"])


def worker_command(plan: RunPlan, run_dir: Path) -> list[str]:
    launcher = plan.run_config.launcher
    if launcher.name == "local":
        return [sys.executable, "-m", WORKER_MODULE, str(run_dir)]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={launcher.nproc_per_node}",
        f"--nnodes={launcher.nnodes}",
    ]
    if launcher.nnodes == 1:
        cmd.append("--standalone")
    return [*cmd, "-m", WORKER_MODULE, str(run_dir)]


class _Trial(Protocol):
    pid: int
    """The worker's (or torchrun's) pid: also its process group (setsid)."""

    def wait(self, timeout: float | None) -> int | None:
        """The exit status (negative: the signal), or None if still running after ``timeout`` s."""


class _FreshTrial:
    """The worker in a new interpreter (``moe-vlm-sweep run``, several nodes, or where no host can start)."""

    def __init__(self, command: list[str], env: dict[str, str], log_path: Path):
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True
            )
        self.pid = self.proc.pid

    def wait(self, timeout: float | None) -> int | None:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None


class _HostedTrial:
    """The worker forked by a warm trial host; if the host dies, the trial's group is ended and it is a crash."""

    def __init__(self, host: warm_host.WarmHost, run_dir: Path, env: dict[str, str], nproc: int):
        self.host = host
        self.gone: str | None = None
        self.returncode: int | None = None
        self.pid = host.start(argv=[WORKER_MODULE, str(run_dir)], env=env, log_path=run_dir / WORKER_LOG, nproc=nproc)

    def wait(self, timeout: float | None) -> int | None:
        if self.gone or self.returncode is not None:
            return self.returncode  # as Popen.wait: the status once known, however often asked
        try:
            self.returncode = self.host.wait(self.pid, timeout)
            return self.returncode
        except warm_host.HostGone as exc:
            self.gone = str(exc)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, signal.SIGKILL)
            return None


def _kill_group(trial: _Trial) -> int | None:
    """End the worker's whole process group; also reaps ranks a finished torchrun left behind."""
    returncode = None
    for sig, wait in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, None)):
        try:
            os.killpg(trial.pid, sig)
        except ProcessLookupError:
            break
        returncode = trial.wait(wait)
        if returncode is not None or getattr(trial, "gone", None):
            break
    return returncode


def _read[T](reader: Callable[[Path], T], run_dir: Path) -> tuple[T | None, str]:
    """What ``reader`` makes of the worker's file, or None and why not (no file: an empty reason)."""
    try:
        return reader(run_dir), ""
    except FileNotFoundError:
        return None, ""
    except (OSError, DecodeError) as exc:
        return None, str(exc)


def classify(
    run_dir: Path,
    returncode: int | None,
    timed_out: bool,
    timeout_s: float,
    stopped: str | None = None,
    host_gone: str | None = None,
) -> RunResult:
    failure, unreadable_failure = _read(read_failure, run_dir)
    native = first_native_crash(run_dir)
    if stopped is not None:
        return RunResult(status=RunStatus.PRUNED, reason=stopped, returncode=returncode, failure=failure)
    if timed_out:  # the peers of a rank that died in native code may hang until the timeout: it says which
        return RunResult(
            status=RunStatus.TIMEOUT,
            reason=f"no result within train.timeout_s={timeout_s:g} s" + (f"; {native.reason}" if native else ""),
            returncode=returncode,
            failure=failure,
        )
    # A tie goes to failure.json: a peer's abort follows a Python failure within the clock's tick, while a Python
    # failure caused by a crash needs a timed-out or reset connection, a traceback and a file written.
    if failure is not None and (native is None or native.at_ns >= (run_dir / FAILURE_FILE).stat().st_mtime_ns):
        return RunResult(
            status=failure.failure_class,
            reason=f"{failure.exception_type}: {failure.message}".strip(": "),
            returncode=returncode,
            failure=failure,
        )
    metrics, unreadable_metrics = _read(read_metrics, run_dir) if returncode == 0 else (None, "")
    if metrics is not None:
        return RunResult(status=RunStatus.OK, returncode=0, metrics=metrics)
    if native is not None:  # before any peer's failure: a rank died in native code, its peers lost it
        return RunResult(status=RunStatus.CRASH, reason=native.reason, returncode=returncode, failure=failure)
    if unreadable_failure or unreadable_metrics:
        reason = f"the worker's result does not read: {unreadable_failure or unreadable_metrics}"
    elif host_gone is not None:
        reason = host_gone
    elif returncode is not None and returncode < 0:
        reason = f"worker killed by signal {signal.Signals(-returncode).name}"
    elif returncode == 0:
        reason = "worker exited 0 without writing metrics.json"
    else:
        reason = f"worker exited with status {returncode} without writing failure.json"
    return RunResult(status=RunStatus.CRASH, reason=reason, returncode=returncode)


def trial_env(plan: RunPlan) -> dict[str, str]:
    """The worker's environment: the caller's, with the allocator settings, the compile caches and the lifeline."""
    inherited = next(filter(None, map(os.environ.get, ALLOC_CONF_ENVS)), None)
    alloc_conf = cuda_alloc_conf(inherited, plan.run_config.train.expandable_segments)
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        **dict.fromkeys(ALLOC_CONF_ENVS, alloc_conf),
        **cache_env(plan.run_config.outputs_dir, plan.run_config.hardware.name, os.environ),
    }
    if identity := launcher_identity():
        env[LAUNCHER_ENV] = identity
    return env


def host_preload(plan: RunPlan) -> list[str]:
    """What a host imports beyond the worker's own modules: Transformer Engine where the plan uses it."""
    return ["transformer_engine.pytorch"] if plan.transformer_impl == "transformer_engine" else []


def _hosted(plan: RunPlan, run_dir: Path, env: dict[str, str]) -> _HostedTrial | None:
    """The run forked by this process's warm host, or None where it cannot be (several nodes, a host that fails
    to start or to fork: the run then starts fresh, so a broken host costs time, never a trial)."""
    launcher = plan.run_config.launcher
    if launcher.nnodes != 1:
        return None
    nproc = 1 if launcher.name == "local" else launcher.nproc_per_node
    command = [sys.executable, "-m", WORKER_MODULE, SERVE_FLAG, *host_preload(plan)]
    host_env = {**env, **warm_host.CUDA_SAFE_ENV}
    try:
        host = warm_host.shared_host(command, host_env, Path(plan.run_config.outputs_dir) / warm_host.HOST_LOG)
        return _HostedTrial(host, run_dir, env, nproc)
    except warm_host.HostGone as exc:
        logging.getLogger(__name__).warning("%s; this run starts a fresh worker", exc)
        return None


def launch(
    plan: RunPlan, run_dir: Path, *, warm: bool = False, watch: Callable[[Path], str | None] | None = None
) -> RunResult:
    """Run the worker for ``plan`` in ``run_dir`` (prepared by ``run_dir.prepare``) and write result.json."""
    timeout_s = plan.run_config.train.timeout_s
    env = trial_env(plan)
    start = time.monotonic()
    hosted = _hosted(plan, run_dir, env) if warm else None
    trial = hosted or _FreshTrial(worker_command(plan, run_dir), env, run_dir / WORKER_LOG)
    returncode, timed_out, stopped = None, False, None
    try:
        while True:
            left = timeout_s - (time.monotonic() - start)
            if left <= 0:
                timed_out = True
                break
            returncode = trial.wait(min(left, WATCH_EVERY_S))
            if returncode is not None or getattr(trial, "gone", None):
                break
            raise_if_stopped()
            if watch and (stopped := watch(run_dir)):
                break
    finally:
        ended = _kill_group(trial)
        returncode = returncode if returncode is not None else ended
    drop_empty_native_crash_files(run_dir)
    result = classify(run_dir, returncode, timed_out, timeout_s, stopped, getattr(trial, "gone", None))
    if (
        result.status == RunStatus.CRASH
    ):  # Slurm's SIGTERM may have ended the worker: the job's state tells, not this run
        slurm.await_slurm_end(terminated=returncode == -signal.SIGTERM)
    result.run_dir, result.wall_s = str(run_dir), time.monotonic() - start
    result.write(run_dir)
    return result
