"""Many sweep workers on one study as a job array, through submitit: how a cluster runs trials in parallel.

Each array task runs one ordinary sweep process, ``moe-vlm-sweep run -m <overrides> sweep.storage=<url>
sweep.seed=<seed + index>``, on its own node; the workers share the study through the storage, and its ledger
launches no config twice. Slurm needs PostgreSQL storage (SQLite over a shared file system does not lock safely);
``--cluster local`` runs the array as local processes. A preempted or requeued worker resumes the study
(``SweepWorker``). Each worker gets the
job's time limit, less a margin, as ``sweep.time_budget_s``: it stops between trials instead of being killed in one.

    python launchers/sweep_workers.py --workers 8 --storage postgresql+psycopg2://user@db/optuna \\
        --slurm partition=gpu gpus_per_node=8 timeout_min=720 \\
        -- sweep=cluster_3d launcher=torchrun launcher.nproc_per_node=8
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import NoReturn

import submitit

from moe_vlm_sweep.config.compose import CompositionError, compose_config
from moe_vlm_sweep.console import configure_logging, say
from moe_vlm_sweep.launch import slurm

logger = logging.getLogger(__name__)

GENERIC = {"timeout_min", "nodes", "tasks_per_node", "gpus_per_node", "cpus_per_task", "mem_gb", "name"}
"""submitit's executor-independent parameters (used by ``--cluster local`` too); any other ``--slurm key=value`` is
passed as ``slurm_<key>``."""
TIMEOUT_MIN = 24 * 60
"""The job's time limit unless ``--slurm timeout_min=...`` says otherwise (submitit's own default is 5 minutes)."""
STOP_GRACE_S = 30
"""How long a preempted worker's sweep gets to stop before it is killed (well inside submitit's signal delay)."""
MARGIN_S = 300
"""Of the job's time limit, kept back from the sweep's budget for start-up, the last export and MLflow."""


def refuse(message: str) -> NoReturn:
    """Invalid input: the message on stderr and exit 2, before anything is submitted."""
    say(f"error: {message}", err=True)
    raise SystemExit(2)


class SweepWorker(submitit.helpers.Checkpointable):
    """One array task: a sweep process, its output in the task's submitit log.

    Preemption, or the job's time limit coming (submitit's signal, ``signal_delay_s`` before it): ``checkpoint``
    stops the sweep (SIGTERM, then SIGKILL after STOP_GRACE_S) and submitit requeues this task with the same
    command, which resumes the study: finished trials stay, the one the sweep was running is marked interrupted
    (``sweep.resume.stale``). A job Slurm requeues itself (``scontrol requeue``, a node failure with
    ``--requeue``) runs the same command again from the start, with the same effect."""

    def __init__(self) -> None:
        self.process: subprocess.Popen | None = None

    def __call__(self, argv: list[str]) -> int:
        cli = shutil.which("moe-vlm-sweep")
        command = [cli] if cli else [sys.executable, "-m", "moe_vlm_sweep.cli"]
        # unbuffered: a sweep Slurm kills (requeue, preemption) leaves its last lines in the task's log
        self.process = subprocess.Popen([*command, "run", "-m", *argv], env={**os.environ, "PYTHONUNBUFFERED": "1"})
        code = self.process.wait()
        if code != 0:
            # Slurm may be ending the job (scancel, requeue, preemption, time limit: SIGTERM to every process,
            # SIGKILL after KillWait; submitit's own process ignores SIGTERM). Returning now would write a result
            # and end the job as if the sweep had finished; waiting lets it end as Slurm says (requeued, ...).
            # Killed by SIGTERM, or the sweep's own clean stop on it (exit 128 + SIGTERM).
            slurm.await_slurm_end(terminated=code in (-signal.SIGTERM, 128 + signal.SIGTERM))
        return code

    def checkpoint(self, argv: list[str]) -> submitit.helpers.DelayedSubmission:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return submitit.helpers.DelayedSubmission(SweepWorker(), argv)


def parameters(pairs: list[str], workers: int, cluster: str) -> dict:
    params: dict = {"nodes": 1, "tasks_per_node": 1, "timeout_min": TIMEOUT_MIN, "slurm_array_parallelism": workers}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            refuse(f"--slurm {pair!r}: expected key=value (e.g. partition=gpu)")
        if key == "timeout_min" and not value.isdigit():
            refuse(f"--slurm timeout_min={value}: expected whole minutes")
        if key in GENERIC or cluster == "slurm":
            params[key if key in GENERIC else f"slurm_{key}"] = int(value) if value.isdigit() else value
    return params


def _space_budget(overrides: list[str]) -> float | None:
    """``sweep.time_budget_s`` as the workers' sweep will compose it from the space's file and the overrides; a
    typo in them fails here, before any job is queued."""
    own = [o for o in overrides if not o.lstrip("+").startswith(("hydra.", "hydra/"))]
    try:
        return compose_config(own).sweep.time_budget_s
    except CompositionError as exc:
        refuse(f"the sweep's overrides do not compose: {exc}")


def time_budget(overrides: list[str], timeout_min: int) -> list[str]:
    """``sweep.time_budget_s`` within the job's limit: the job's limit less MARGIN_S, or a smaller budget from the
    command line or the space's file; a larger one from the command line is refused, from the file capped."""
    most = timeout_min * 60 - MARGIN_S
    if most <= 0:
        refuse(
            f"--slurm timeout_min={timeout_min}: a sweep job needs more than {MARGIN_S} s, "
            "the margin kept for start-up and the last export"
        )
    given = [o.lstrip("+") for o in overrides if o.lstrip("+").startswith("sweep.time_budget_s=")]
    value = given[-1].split("=", 1)[1] if given else ""
    if given and value.lower() in ("null", "none", ""):
        refuse(
            f"{given[-1]}: a worker needs a budget within the job's limit; leave it out to get "
            f"{most} s (timeout_min={timeout_min} less the {MARGIN_S} s margin)"
        )
    if given and float(value) > most:
        refuse(
            f"{given[-1]} does not fit the job: timeout_min={timeout_min} leaves at most {most} s "
            f"after the {MARGIN_S} s margin"
        )
    budget = _space_budget(overrides)
    if given or (budget is not None and budget <= most):
        return []
    if budget is not None:
        logger.warning(
            "the space's sweep.time_budget_s=%g is capped at %s s, the job's limit (timeout_min=%s) less the %s s "
            "margin",
            budget,
            most,
            timeout_min,
            MARGIN_S,
        )
    return [f"sweep.time_budget_s={most}"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, required=True)
    parser.add_argument("--storage", required=True, help="the shared Optuna storage URL")
    parser.add_argument("--seed", type=int, default=0, help="worker i samples with sweep.seed = seed + i")
    parser.add_argument("--cluster", choices=("slurm", "local"), default="slurm")
    parser.add_argument(
        "--slurm",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="job parameters: timeout_min, gpus_per_node, ... (also for --cluster local) or any "
        "sbatch option (partition=...)",
    )
    parser.add_argument("--folder", type=Path, default=Path("outputs/submitit"), help="submitit's logs and state")
    parser.add_argument("--wait", action="store_true", help="wait for every worker and report its exit status")
    parser.add_argument("overrides", nargs="+", help="the sweep command's overrides, after --")
    args = parser.parse_args(argv)
    configure_logging()
    if args.workers < 1:
        parser.error(f"--workers={args.workers} must be >= 1")
    if args.cluster == "slurm" and not args.storage.startswith("postgresql"):
        parser.error(
            f"--storage={args.storage}: workers on several nodes need PostgreSQL storage "
            "(postgresql://...), since SQLite does not lock safely over a shared file system"
        )
    params = parameters(args.slurm, args.workers, args.cluster)
    budget = time_budget(args.overrides, params["timeout_min"])
    executor = submitit.AutoExecutor(folder=args.folder, cluster=args.cluster)
    executor.update_parameters(**params)
    argvs = [
        [*args.overrides, *budget, f"sweep.storage={args.storage}", f"sweep.seed={args.seed + i}"]
        for i in range(args.workers)
    ]
    jobs = executor.map_array(SweepWorker(), argvs)
    for job, argv_i in zip(jobs, argvs):
        say(f"worker {job.job_id}: {shlex.join(['moe-vlm-sweep', 'run', '-m', *argv_i])}")
    if not args.wait:
        return 0
    failed = False
    for job in jobs:  # every worker's status, whatever the others' were
        try:
            code = job.result()
            status = f"exit {code}"
        except Exception as exc:
            code, status = None, f"failed: {type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"
        failed = failed or code != 0  # a signal's negative code is a failure too
        say(f"worker {job.job_id}: {status} (log: {job.paths.stdout})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
