"""A Slurm job per run or sweep trial, through Hydra's submitit launcher (``hydra/launcher=slurm``).

The job's one task starts the worker as on any machine (``launch/local.py``: one process, or torchrun spawning
the ranks on the node), so the job must hold what the run's layout needs; these checks run before anything is
submitted, because a job that cannot hold the run fails only after waiting in the queue.
"""

from __future__ import annotations

import logging
import os
import subprocess
import time
from collections.abc import Mapping
from typing import Any

SUBMITIT_TARGET = "hydra_plugins.hydra_submitit_launcher"
JOB_MARGIN_S = 120
"""What a job needs beyond ``train.timeout_s``: its Python start, the trial's composition, the worker's teardown.
submitit's signal (``signal_delay_s`` before the limit) comes on top: once it arrives, submitit ends or requeues
the job, so the worker's own timeout must have fired by then."""
END_WAIT_S = 600
"""How long a job's process waits for Slurm to kill it once Slurm is ending its job (KillWait, the time between
Slurm's SIGTERM and its SIGKILL, is seconds to a minute on real clusters)."""


def is_submitit(hydra_launcher: Mapping[str, Any]) -> bool:
    return str(hydra_launcher.get("_target_", "")).startswith(SUBMITIT_TARGET)


def job_problems(job: Mapping[str, Any], *, nproc_per_node: int, nnodes: int, timeout_s: float) -> list[str]:
    """What a submitit job (``hydra.launcher``) lacks for runs of ``launcher.nproc_per_node`` x
    ``launcher.nnodes`` processes and ``train.timeout_s``."""
    problems = []
    nodes, tasks, gpus = job.get("nodes", 1), job.get("tasks_per_node", 1), job.get("gpus_per_node")
    if nnodes != 1:
        problems.append(
            f"launcher.nnodes={nnodes}: a run under Slurm is one node's process group "
            "(one trial per job; more workers share a study through sweep.storage)"
        )
    if nodes != 1:
        problems.append(f"hydra.launcher.nodes={nodes} must be 1: the worker's process group runs on one node")
    if tasks != 1:
        problems.append(
            f"hydra.launcher.tasks_per_node={tasks} must be 1: the job's one task starts the worker, "
            "and torchrun spawns the ranks"
        )
    if gpus is not None and gpus < nproc_per_node:
        problems.append(
            f"hydra.launcher.gpus_per_node={gpus} is less than launcher.nproc_per_node="
            f"{nproc_per_node}: each rank needs its GPU"
        )
    timeout_min, signal_s = job.get("timeout_min"), job.get("signal_delay_s") or 0
    if timeout_min is not None and timeout_min * 60 < timeout_s + JOB_MARGIN_S + signal_s:
        why = f"{JOB_MARGIN_S} s" + (f" + hydra.launcher.signal_delay_s={signal_s}" if signal_s else "")
        problems.append(
            f"hydra.launcher.timeout_min={timeout_min} must exceed train.timeout_s={timeout_s:g} s by "
            f"at least {why}: a hung run must end as a timeout the sweep records, before submitit's "
            "time-limit signal or Slurm's kill"
        )
    return problems


def ending_job() -> str | None:
    """The state of the Slurm job this process runs in, if Slurm is ending it (past its time limit, cancelled,
    preempted or requeued: no longer RUNNING); None outside a job, while it runs on, or where squeue cannot tell."""
    job = os.environ.get("SLURM_JOB_ID")
    if not job:
        return None
    try:
        proc = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    state = proc.stdout.strip()
    return state if proc.returncode == 0 and state and state != "RUNNING" else None


def await_slurm_end(terminated: bool = False) -> None:
    """When Slurm ends a job it sends SIGTERM to each of its processes and SIGKILL after KillWait. A run that the
    SIGTERM ended must not be reported: a trial job's result would be read as a crash in place of the state Slurm
    gives the job (TIMEOUT, CANCELLED), and a sweep worker's return would end a job that Slurm means to requeue
    as if it had finished. So the process waits for the SIGKILL (at most END_WAIT_S), then goes on as before.
    ``terminated``: the run ended on SIGTERM; inside a job that comes from Slurm even while the job still shows
    RUNNING (a preempted job's GraceTime), so the wait holds whatever squeue says."""
    if "SLURM_JOB_ID" not in os.environ:
        return
    state = ending_job()
    if state is None and not terminated:
        return
    logging.getLogger(__name__).warning("Slurm is ending this job (%s); waiting for it", state or "SIGTERM")
    deadline = time.monotonic() + END_WAIT_S
    while time.monotonic() < deadline and (terminated or ending_job() is not None):
        time.sleep(5)
