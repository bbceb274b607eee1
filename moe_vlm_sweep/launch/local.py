"""Run the worker in its own process (world 1) or torchrun group, with a timeout, and classify the outcome.

The classification reads what the worker wrote (``metrics.json`` or ``failure.json``) and falls back to the
exit status only when the worker could not write: a signal is a ``crash``, a run past ``train.timeout_s`` is a
``timeout``. The worker runs in its own process group (``setsid``), so a timeout kills the whole group (torchrun and every
rank), never leaving an orphan holding a GPU; if this process itself is killed, the ranks see it gone and exit
(``launch/lifeline.py``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from moe_vlm_sweep.launch.lifeline import LAUNCHER_ENV, launcher_identity
from moe_vlm_sweep.launch.result import STATUSES, RunResult
from moe_vlm_sweep.launch.run_dir import WORKER_LOG
from moe_vlm_sweep.plan.plan import RunPlan

WORKER_MODULE = "moe_vlm_sweep.train.worker"
KILL_GRACE_S = 10.0
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
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={launcher.nproc_per_node}",
           f"--nnodes={launcher.nnodes}"]
    if launcher.nnodes == 1:
        cmd.append("--standalone")
    return [*cmd, "-m", WORKER_MODULE, str(run_dir)]


def _kill_group(proc: subprocess.Popen) -> None:
    """End the worker's whole process group; also reaps ranks a finished torchrun left behind."""
    for sig, wait in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def classify(run_dir: Path, returncode: int | None, timed_out: bool, timeout_s: float) -> RunResult:
    metrics, failure = _read_json(run_dir / "metrics.json"), _read_json(run_dir / "failure.json")
    if timed_out:
        return RunResult(status="timeout", reason=f"no result within train.timeout_s={timeout_s:g} s",
                         returncode=returncode, failure=failure or {})
    if failure is not None:
        status = failure.get("failure_class", "crash")
        return RunResult(status=status if status in STATUSES else "crash",
                         reason=f"{failure.get('exception_type', '')}: {failure.get('message', '')}".strip(": "),
                         returncode=returncode, failure=failure)
    if returncode == 0 and metrics is not None:
        return RunResult(status="ok", returncode=0, metrics=metrics)
    if returncode is not None and returncode < 0:
        reason = f"worker killed by signal {signal.Signals(-returncode).name}"
    elif returncode == 0:
        reason = "worker exited 0 without writing metrics.json"
    else:
        reason = f"worker exited with status {returncode} without writing failure.json"
    return RunResult(status="crash", reason=reason, returncode=returncode)


def launch(plan: RunPlan, run_dir: Path) -> RunResult:
    """Run the worker for ``plan`` in ``run_dir`` (prepared by ``run_dir.prepare``) and write result.json."""
    timeout_s = plan.run_config.train.timeout_s
    inherited = next(filter(None, map(os.environ.get, ALLOC_CONF_ENVS)), None)
    alloc_conf = cuda_alloc_conf(inherited, plan.run_config.train.expandable_segments)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **dict.fromkeys(ALLOC_CONF_ENVS, alloc_conf)}
    if identity := launcher_identity():
        env[LAUNCHER_ENV] = identity
    start = time.monotonic()
    with open(run_dir / WORKER_LOG, "wb") as log:
        proc = subprocess.Popen(worker_command(plan, run_dir), stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        timed_out = False
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
        except BaseException:
            _kill_group(proc)
            raise
        finally:
            _kill_group(proc)
    result = classify(run_dir, proc.returncode, timed_out, timeout_s)
    result.run_dir, result.wall_s = str(run_dir), time.monotonic() - start
    result.write(run_dir)
    return result
