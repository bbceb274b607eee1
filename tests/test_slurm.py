"""Slurm through submitit: Hydra's submitit launcher (the preset composes; a job that cannot hold the runs is
refused before anything is submitted; a sweep's trials run as submitit jobs) and launchers/sweep_workers.py
(sweep workers as a job array on one study). End to end on submitit's local executor: no Slurm here."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import optuna
import pytest
from hydra import compose, initialize_config_dir

from moe_vlm_sweep.config.compose import CONF_DIR, register
from moe_vlm_sweep.launch.slurm import is_submitit, job_problems
from moe_vlm_sweep.sweep import ledger
from sweep_testing import cli, only_study, private_conf

ROOT = Path(__file__).resolve().parents[1]

JOB = {"nodes": 1, "tasks_per_node": 1, "gpus_per_node": 8, "timeout_min": 60}


def test_the_slurm_preset_composes_on_hydras_submitit_launcher():
    register()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3", job_name="t"):
        cfg = compose(config_name="config", overrides=["hydra/launcher=slurm", "hydra.launcher.partition=gpu"],
                      return_hydra_config=True)
    job = cfg.hydra.launcher
    assert is_submitit(job) and job._target_.endswith("SlurmLauncher")
    assert (job.nodes, job.tasks_per_node, job.gpus_per_node, job.partition) == (1, 1, 8, "gpu")
    assert job_problems(job, nproc_per_node=8, nnodes=1, timeout_s=600) == []


@pytest.mark.parametrize("change, launcher, message", [
    ({"tasks_per_node": 8}, {}, "hydra.launcher.tasks_per_node=8 must be 1: the job's one task starts the worker"),
    ({"gpus_per_node": 4}, {}, "hydra.launcher.gpus_per_node=4 is less than launcher.nproc_per_node=8"),
    ({"nodes": 2}, {}, "hydra.launcher.nodes=2 must be 1"),
    ({}, {"nnodes": 2}, "launcher.nnodes=2: a run under Slurm is one node's process group"),
    ({"timeout_min": 10}, {}, "hydra.launcher.timeout_min=10 must exceed train.timeout_s=600 s"),
])
def test_a_job_that_cannot_hold_the_run_is_named(change, launcher, message):
    problems = job_problems({**JOB, **change}, **{"nproc_per_node": 8, "nnodes": 1, **launcher}, timeout_s=600)
    assert len(problems) == 1 and message in problems[0], problems


SPACE = """defaults:
  - sweep_schema
  - _self_
  - override /hydra/sweeper@_global_.hydra.sweeper: moe_vlm_sweep
n_trials: 2
objective: {metric: effective_tokens_per_s_per_gpu, direction: maximize}
fixed: [model=tiny, train.warmup_steps=1, train.steps=2, train.profile_steps=0]
params:
  batch.mbs: [1, 2, 4]
"""


@pytest.mark.slow
def test_sweep_trials_run_as_submitit_jobs(tmp_path):
    conf = private_conf(tmp_path, {"tiny2": SPACE})
    refused = cli(["run", "-m", "sweep=tiny2", "hydra/launcher=submitit_local", "hydra.launcher.tasks_per_node=2"],
                  cwd=tmp_path, conf=conf, check=False)
    assert refused.returncode != 0
    assert "the Slurm job (hydra.launcher) cannot hold this sweep's runs: hydra.launcher.tasks_per_node=2" in (
        refused.stdout + refused.stderr)
    assert not (tmp_path / "outputs").exists(), "nothing may be created before the job is known to fit"
    cli(["run", "-m", "sweep=tiny2", "hydra/launcher=submitit_local"], cwd=tmp_path, conf=conf)
    trials = only_study(tmp_path).get_trials()
    assert [t.user_attrs["failure_class"] for t in trials] == ["ok", "ok"]
    logs = sorted((tmp_path / "outputs" / "multirun").glob("*/.submitit/*/*_0_log.out"))
    assert len(logs) == 2 and all("Job completed successfully" in p.read_text() for p in logs)


@pytest.mark.slow
def test_sweep_workers_share_one_study_as_a_submitit_array(tmp_path):
    """launchers/sweep_workers.py with submitit's local executor: two array tasks, one study, no config twice."""
    space = SPACE.replace("n_trials: 2", "n_trials: 4") + "  vision: [trainable, frozen]\n"  # 6 configs
    conf = private_conf(tmp_path, {"tiny4": space})
    storage = f"sqlite:///{tmp_path / 'shared.db'}"
    env = {**os.environ, "MOE_VLM_SWEEP_CONF": str(conf), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "launchers" / "sweep_workers.py"), "--workers", "2",
                           "--storage", storage, "--seed", "7", "--cluster", "local", "--wait",
                           "--folder", str(tmp_path / "submitit"), "--", "sweep=tiny4", "sweep.study_name=shared"],
                          cwd=tmp_path, env=env, text=True, capture_output=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("exit 0") == 2 and "sweep.seed=7" in proc.stdout and "sweep.seed=8" in proc.stdout
    study = optuna.load_study(study_name="shared", storage=storage)
    launched = [t for t in study.get_trials() if t.user_attrs.get("claim") == "launch"]
    assert len(ledger.counted(study.get_trials())) == 4
    assert len({tuple(sorted(t.params.items())) for t in launched}) == len(launched)
    assert len({t.user_attrs["worker"] for t in launched}) == 2, "both array tasks should have run trials"


def test_sweep_workers_refuse_sqlite_on_slurm():
    proc = subprocess.run([sys.executable, str(ROOT / "launchers" / "sweep_workers.py"), "--workers", "2",
                           "--storage", "sqlite:///x.db", "--", "sweep=cpu_demo"], capture_output=True, text=True)
    assert proc.returncode == 2 and "workers on several nodes need PostgreSQL storage" in proc.stderr
