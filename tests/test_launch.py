"""Failure classification from real runs: a killed worker, a hang past its timeout, a machine preflight."""

from __future__ import annotations

import os
import signal
import threading
import time

import psutil
import pytest

from conftest import read_json
from moe_vlm_sweep.config.compose import compose_run_config
from moe_vlm_sweep.launch.local import launch
from moe_vlm_sweep.launch.result import RunResult
from moe_vlm_sweep.launch.run_dir import new_run_dir, prepare
from moe_vlm_sweep.plan.plan import make_plan

LONG = ["model=tiny", "train.warmup_steps=1", "train.steps=100000", "train.profile_steps=0"]


def _prepared(tmp_path, overrides):
    plan = make_plan(compose_run_config([*overrides, f"outputs_dir={tmp_path}"]), overrides)
    run_dir = new_run_dir(tmp_path)
    prepare(run_dir, plan, "")
    return plan, run_dir


def _worker_pids(run_dir) -> list[int]:
    return [p.pid for p in psutil.process_iter(["cmdline"])
            if "moe_vlm_sweep.train.worker" in " ".join(p.info["cmdline"] or []) and str(run_dir) in
            " ".join(p.info["cmdline"] or [])]


def test_killed_worker_is_a_crash(tmp_path):
    plan, run_dir = _prepared(tmp_path, LONG)
    box: dict[str, RunResult] = {}
    thread = threading.Thread(target=lambda: box.setdefault("r", launch(plan, run_dir)))
    thread.start()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not _worker_pids(run_dir):
        time.sleep(0.2)
    time.sleep(3)  # let it get into imports/building: a kill at any moment must read as a crash
    pids = _worker_pids(run_dir)
    assert pids, "the worker never started"
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    thread.join(timeout=120)
    result = box["r"]
    assert result.status == "crash"
    assert "SIGKILL" in result.reason
    assert not (run_dir / "metrics.json").exists()
    assert RunResult.read(run_dir).status == "crash"


def test_hang_past_timeout_is_a_timeout(tmp_path, run_cli):
    code, run_dir = run_cli(*LONG, "train.timeout_s=15")
    assert code == 1
    result = read_json(run_dir / "result.json")
    assert result["status"] == "timeout"
    assert "train.timeout_s=15" in result["reason"]
    assert not (run_dir / "metrics.json").exists()
    assert _worker_pids(run_dir) == []


def test_gpu_plan_on_a_cpu_machine_fails_preflight_as_invalid(run_cli):
    code, run_dir = run_cli("model=tiny", "hardware=h200")
    assert code == 1
    result = read_json(run_dir / "result.json")
    assert result["status"] == "invalid"
    assert "hardware" in result["reason"] or "cuda" in result["reason"].lower()


@pytest.mark.parametrize("name", ["crash", "timeout"])
def test_result_files_are_whole(name, tmp_path):
    """result.json is written atomically: no temp files are left behind, and it always parses."""
    result = RunResult(status=name, reason="x", run_dir=str(tmp_path))
    result.write(tmp_path)
    assert RunResult.read(tmp_path).status == name
    assert [p.name for p in tmp_path.iterdir()] == ["result.json"]
