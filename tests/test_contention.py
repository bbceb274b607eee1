"""A measurement shared with another process says so: a real tiny training beside a process spinning on the same
cores is flagged ``contended`` with that process named; the trial's own processes never are."""

from __future__ import annotations

import os
import subprocess
import sys

import psutil
from conftest import read_json

from moe_vlm_sweep.metrics.schema import read_metrics
from moe_vlm_sweep.train.contention import CONTENDING_CPU_PERCENT

_TRAIN = ("model=tiny", "train.steps=6", "train.warmup_steps=1", "train.profile_steps=0")


def test_a_process_spinning_on_the_trials_cores_marks_it_contended(run_cli):
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        code, run_dir = run_cli(*_TRAIN)
    finally:
        spinner.kill()
        spinner.wait()
    assert code == 0, (run_dir / "worker.log").read_text()
    metrics = read_json(run_dir / "metrics.json")
    assert metrics["contended"] is True
    seen = {p["pid"]: p for p in metrics["contention"]["processes"]}
    assert spinner.pid in seen, metrics["contention"]
    assert seen[spinner.pid]["where"] == "cpu" and seen[spinner.pid]["cpu_percent"] >= CONTENDING_CPU_PERCENT
    assert metrics["contention"]["gpu_source"] == "not a GPU run"
    assert set(metrics["contention"]["cores"]) == os.sched_getaffinity(0)
    assert read_metrics(run_dir).contention.processes  # the typed reader keeps the evidence
    assert "contended measurement: pid" in (run_dir / "worker.log").read_text()


def test_without_another_busy_process_the_trial_is_not_contended_by_itself(run_cli):
    code, run_dir = run_cli(*_TRAIN)
    assert code == 0, (run_dir / "worker.log").read_text()
    metrics = read_json(run_dir / "metrics.json")
    seen = {p["pid"] for p in metrics["contention"]["processes"]}
    # This test's process (the worker's ancestor) and everything it started are the trial's, never "other"; on a
    # quiet host nothing else is busy, so the run is clean (a shared host's own busy jobs are listed, and then
    # each one named was using CPU of its own, not of this tree).
    mine = {os.getpid(), *(p.pid for p in psutil.Process().children(recursive=True))}
    assert not seen & mine, metrics["contention"]
    assert metrics["contended"] is bool(seen)
    if os.environ.get("CI", "").lower() == "true":
        assert metrics["contended"] is False, metrics["contention"]
