from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from moe_vlm_sweep.cli import main
from moe_vlm_sweep.config.compose import compose_run_config
from moe_vlm_sweep.launch.run_dir import new_run_dir, prepare
from moe_vlm_sweep.plan.plan import RunPlan, make_plan


def run_in(outputs: Path, *overrides: str) -> tuple[int, Path | None]:
    """Run `moe-vlm-sweep run OVERRIDES` in-process with outputs under ``outputs``; return (exit code, run dir)."""
    code = main(["run", *overrides, f"outputs_dir={outputs}"])
    runs = sorted((outputs / "runs").glob("*")) if (outputs / "runs").exists() else []
    return code, (runs[-1] if runs else None)


@pytest.fixture
def run_cli(tmp_path, capsys):
    """``run_in`` under tmp_path, echoing the CLI's output into the test's report."""

    def _run(*overrides: str) -> tuple[int, Path | None]:
        result = run_in(tmp_path, *overrides)
        print(capsys.readouterr().out)
        return result

    return _run


LONG = ["model=tiny", "train.warmup_steps=1", "train.steps=100000", "train.profile_steps=0"]
"""A run that trains until it is stopped (the launcher's timeouts and signals)."""


def prepared(tmp_path: Path, overrides: list[str]) -> tuple[RunPlan, Path]:
    """(plan, run directory) of ``overrides``, prepared for the launcher under ``tmp_path``."""
    plan = make_plan(compose_run_config([*overrides, f"outputs_dir={tmp_path}"]), overrides)
    run_dir = new_run_dir(tmp_path)
    prepare(run_dir, plan, "")
    return plan, run_dir


def read_json(path: Path) -> dict:
    return json.loads(path.read_text())


@pytest.fixture(scope="module")
def megatron_world():
    """Megatron's parallel state for a world of one, once for the module (torch.distributed on gloo)."""
    from megatron.core import parallel_state
    from megatron.core.num_microbatches_calculator import destroy_num_microbatches_calculator

    from moe_vlm_sweep.config.schema import ParallelConf, RunConfig
    from moe_vlm_sweep.plan.plan import make_plan
    from moe_vlm_sweep.train import cpu_compat
    from moe_vlm_sweep.train.worker import init_distributed

    env = dict(os.environ)
    cpu_compat.apply()
    init_distributed(make_plan(RunConfig(parallel=ParallelConf(strategy="3d"))))
    yield
    parallel_state.destroy_model_parallel()
    destroy_num_microbatches_calculator()
    torch.distributed.destroy_process_group()
    os.environ.clear()
    os.environ.update(env)


def slurm_required() -> bool:
    """Under CI (``CI=true``, as ``.ci/run`` runs) or ``MOE_VLM_SWEEP_REQUIRE_SLURM=1`` a cluster that cannot
    start fails the Slurm tests; elsewhere they skip with the reason."""
    return os.environ.get("CI", "").lower() == "true" or os.environ.get("MOE_VLM_SWEEP_REQUIRE_SLURM") == "1"


@pytest.fixture(scope="session")
def slurm():
    """A one-node Slurm cluster on localhost for the whole test run (``tests/slurm_cluster.py``); each test gets it with
    the node idle."""
    from slurm_cluster import ClusterUnavailable, start_cluster

    try:
        cluster = start_cluster()
    except ClusterUnavailable as exc:
        (pytest.fail if slurm_required() else pytest.skip)(f"no Slurm cluster: {exc}")
    yield cluster
    cluster.stop()
