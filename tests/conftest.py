from __future__ import annotations

import importlib.util
import json
import os
import re
from pathlib import Path

import pytest
import torch

from moe_vlm_sweep.cli import main
from moe_vlm_sweep.config.compose import compose_run_config
from moe_vlm_sweep.launch.run_dir import new_run_dir, prepare
from moe_vlm_sweep.metrics.schema import NATIVE_CRASH_MARK
from moe_vlm_sweep.plan.plan import RunPlan, make_plan

needs_cuda_te = pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("transformer_engine") is None,
    reason="needs a CUDA GPU with Transformer Engine; CI has neither",
)
"""The GPU tests' mark: they run on a GPU machine with ``python -m pytest tests/test_gpu_*.py``."""

GPU_TINY = ("model=tiny", "model.text_tokens=113", "hardware=h200", "parallel=3d", "batch.mbs=2", "batch.gbs=4")
"""``model=tiny`` on a GPU: TE specs and bf16, 128 decoder tokens (a multiple of 128, which graphed attention
needs on cuDNN <= 9.15), two micro-batches a step."""


def pytest_configure(config: pytest.Config) -> None:
    """A test whose run died in native code (a crash inside torch or gloo on the CPU, which the run's reason names
    and ``why_failed`` puts in the assertion message) is run once more; any other failure is final, and the
    summary line counts the reruns. Only where pytest-rerunfailures is installed (``.[test]``): the GPU tests
    also run where it is not."""
    if config.pluginmanager.hasplugin("rerunfailures") and not config.getoption("reruns"):
        config.option.reruns = 1
        config.option.only_rerun = [re.escape(NATIVE_CRASH_MARK)]


def why_failed(run_dir: Path | None) -> str:
    """A failed run's account for an assertion message: the launcher's reason, the stacks of any rank that died in
    native code, and the end of the worker's log (a peer's broken pipe comes last there, rarely the cause)."""
    if run_dir is None:
        return "no run directory"
    result = run_dir / "result.json"
    parts = [json.loads(result.read_text())["reason"] if result.exists() else "no result.json"]
    parts += [f"{crash.name}:\n{crash.read_text()[-3000:]}" for crash in sorted(run_dir.glob("native_crash.rank*"))]
    log = run_dir / "worker.log"
    parts.append(log.read_text()[-4000:] if log.exists() else "no worker.log")
    return "\n".join(parts)


def run_in(outputs: Path, *overrides: str) -> tuple[int, Path | None]:
    """Run `moe-vlm-sweep run OVERRIDES` in-process with outputs under ``outputs``; return (exit code, run dir)."""
    code = main(["run", *overrides, f"outputs_dir={outputs}"])
    runs = sorted((outputs / "runs").glob("*")) if (outputs / "runs").exists() else []
    return code, (runs[-1] if runs else None)


def ok_run(result: tuple[int, Path | None]) -> tuple[Path, dict]:
    """(run dir, metrics.json) of a ``run_in`` or ``run_cli`` result that must have succeeded; otherwise the
    failure's account is the assertion message."""
    code, run_dir = result
    assert code == 0 and run_dir is not None, why_failed(run_dir)
    return run_dir, read_json(run_dir / "metrics.json")


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
