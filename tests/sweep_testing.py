"""Helpers of the sweep tests: a private copy of conf/ (to add spaces), the CLI in a subprocess, where an export
lands, and readers of the two stores the sweep writes (Optuna, MLflow)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import optuna
import psutil

from moe_vlm_sweep.config.compose import CONF_DIR
from moe_vlm_sweep.launch.local import SERVE_FLAG

FAST_TRAIN = ["train.warmup_steps=1", "train.steps=2", "train.profile_steps=0"]
SPACE_HEADER = (
    "defaults:\n  - sweep_schema\n  - _self_\n  - override /hydra/sweeper@_global_.hydra.sweeper: moe_vlm_sweep\n"
)
"""The head of every space file: the sweep's schema and this project's sweeper."""
TINY_FIXED = "fixed: {model: tiny, train.warmup_steps: 1, train.steps: 2, train.profile_steps: 0}\n"


def tiny_space(n_trials: int, rest: str) -> str:
    """A space file of ``n_trials`` on the tiny model at the fewest steps, maximizing throughput; ``rest`` holds
    its ``params`` (and whatever else it sets)."""
    objective = "objective: {metric: effective_tokens_per_s_per_gpu, direction: maximize}\n"
    return f"{SPACE_HEADER}n_trials: {n_trials}\n{objective}{TINY_FIXED}{rest}"


def private_conf(tmp_path: Path, spaces: dict[str, str] | None = None) -> Path:
    """The packaged conf/ copied, plus extra space files ``name -> yaml``."""
    conf = tmp_path / "conf"
    shutil.copytree(CONF_DIR, conf)
    for name, text in (spaces or {}).items():
        (conf / "sweep" / f"{name}.yaml").write_text(text)
    return conf


def exported_experiment(cwd: Path, name: str) -> Path:
    """The experiment config ``best`` writes for ``name`` when run in ``cwd`` (under the outputs folder)."""
    return cwd / "outputs" / "conf" / "experiment" / f"{name}.yaml"


def cli(
    args: list[str], *, cwd: Path, conf: Path, timeout: float = 600, check: bool = True, **popen
) -> subprocess.CompletedProcess:
    env = {**os.environ, "MOE_VLM_SWEEP_CONF": str(conf), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "moe_vlm_sweep.cli", *args],
        cwd=cwd,
        env=env,
        text=True,
        capture_output=True,
        timeout=timeout,
        **popen,
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}\nstdout:\n{proc.stdout[-6000:]}\nstderr:\n{proc.stderr[-6000:]}")
    return proc


def start_cli(args: list[str], *, cwd: Path, conf: Path, log: Path) -> subprocess.Popen:
    env = {**os.environ, "MOE_VLM_SWEEP_CONF": str(conf), "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "moe_vlm_sweep.cli", *args],
        cwd=cwd,
        env=env,
        stdout=open(log, "w"),
        stderr=subprocess.STDOUT,
    )


def only_study(cwd: Path) -> optuna.Study:
    dbs = list((cwd / "outputs" / "sweeps").glob("*/optuna.db"))
    assert len(dbs) == 1, dbs
    return optuna.load_study(study_name=dbs[0].parent.name, storage=f"sqlite:///{dbs[0]}")


def mlflow_runs(cwd: Path, experiment: str = "moe-vlm-sweep") -> list:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{cwd / 'outputs' / 'mlflow.db'}")
    exp = client.get_experiment_by_name(experiment)
    return list(client.search_runs([exp.experiment_id], max_results=1000))


def children_by_trial(runs: list) -> dict[int, object]:
    return {
        int(r.data.tags["moe_vlm_sweep.trial"]): r for r in runs if r.data.tags.get("moe_vlm_sweep.role") == "trial"
    }


WORKER = "moe_vlm_sweep.train.worker"


def processes_under(root: Path, command: str = "") -> list[psutil.Process]:
    """Processes running in ``root`` or naming it in their command line, whose command line holds ``command``:
    with ``WORKER``, a run's worker, torchrun and its ranks (a sweep's run directories are relative to its cwd)."""
    found = []
    for proc in psutil.process_iter(["cmdline", "cwd"]):
        cmdline, cwd = proc.info["cmdline"] or [], Path(proc.info["cwd"] or "/")
        under = cwd == root or root in cwd.parents or any(str(root) in arg for arg in cmdline)
        if under and command in " ".join(cmdline) and proc.pid != os.getpid():
            found.append(proc)
    return found


def trial_processes(root: Path) -> list[psutil.Process]:
    """A run's worker processes under ``root`` without the warm trial host (``--serve``), which serves every trial
    of the sweep and ends with it: a fresh worker, or a trial forked from the host, with its ranks."""
    found = []
    for proc in processes_under(root, WORKER):
        with contextlib.suppress(psutil.Error):
            parent = proc.parent()
            if SERVE_FLAG not in proc.cmdline() or (parent is not None and SERVE_FLAG in parent.cmdline()):
                found.append(proc)
    return found


def end_orphans(root: Path) -> None:
    """End what a killed process left running under ``root``."""
    for proc in processes_under(root):
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
