"""A Slurm job per run or sweep trial, through Hydra's submitit launcher (``hydra/launcher=slurm``).

The job's one task starts the worker as on any machine (``launch/local.py``: one process, or torchrun spawning
the ranks on the node), so the job must hold what the run's layout needs; these checks run before anything is
submitted, because a job that cannot hold the run fails only after waiting in the queue.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

SUBMITIT_TARGET = "hydra_plugins.hydra_submitit_launcher"
JOB_MARGIN_S = 120
"""What a job needs beyond ``train.timeout_s``: its Python start, the trial's composition, the worker's teardown.
submitit's signal (``signal_delay_s`` before the limit) comes on top: once it arrives, submitit ends or requeues
the job, so the worker's own timeout must have fired by then."""


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
