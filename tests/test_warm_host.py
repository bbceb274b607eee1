"""The warm trial host: each trial a fresh forked process, classified, timed out and cleaned up as a fresh
worker is, with the imports paid once. Real tiny CPU training; the host is shared by this module's tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest
from conftest import LONG, prepared, read_json
from sweep_testing import WORKER, processes_under

from moe_vlm_sweep.launch import warm_host
from moe_vlm_sweep.launch.local import launch

FAST = ["model=tiny", "train.warmup_steps=1", "train.steps=2", "train.profile_steps=0"]


def _host() -> psutil.Process | None:
    """This process's warm host, once a launch has started it."""
    hosts = [h for h in list(warm_host._hosts.values()) if h.alive]
    assert len(hosts) <= 1
    return psutil.Process(hosts[0].proc.pid) if hosts else None


def _trial_pids(host: psutil.Process | None) -> list[int]:
    return [child.pid for child in host.children()] if host else []


def test_trials_after_the_first_start_training_within_a_second_of_imports(tmp_path):
    """The CPU target: a forked trial's ``startup.imports`` (from its creation to its last import) is under 1 s,
    where a fresh worker's is several seconds; its result is a whole run."""
    results = [launch(*prepared(tmp_path, FAST), warm=True) for _ in range(2)]
    assert [r.status for r in results] == ["ok", "ok"], [r.reason for r in results]
    for result in results:
        imports = result.metrics.wall_s["startup.imports"]
        assert imports < 1.0, result.metrics.wall_s
    assert all(read_json(Path(r.run_dir) / "result.json")["status"] == "ok" for r in results)


def test_a_crashing_trial_is_a_crash_and_the_host_runs_the_next(tmp_path):
    crashed = launch(*prepared(tmp_path, [*FAST, "model.decoder.vocab_size=1"]), warm=True)
    assert crashed.status == "crash" and crashed.failure is not None and crashed.failure.rank == 0, crashed.reason
    host = _host()
    plan, run_dir = prepared(tmp_path, LONG)
    box = {}
    thread = threading.Thread(target=lambda: box.setdefault("r", launch(plan, run_dir, warm=True)))
    thread.start()
    deadline = time.monotonic() + 60
    while not _trial_pids(_host()):
        assert time.monotonic() < deadline, "the host never forked the trial"
        time.sleep(0.1)
    time.sleep(2)
    os.kill(_trial_pids(_host())[0], signal.SIGKILL)  # an OOM kill, say
    thread.join(timeout=60)
    assert box["r"].status == "crash" and "SIGKILL" in box["r"].reason, box["r"].reason
    assert _host().pid == host.pid and launch(*prepared(tmp_path, FAST), warm=True).ok


def test_a_hanging_trial_times_out_and_its_whole_group_is_killed(tmp_path):
    plan, run_dir = prepared(tmp_path, [*LONG, "train.timeout_s=8"])
    box = {}
    thread = threading.Thread(target=lambda: box.setdefault("r", launch(plan, run_dir, warm=True)))
    thread.start()
    deadline = time.monotonic() + 60
    # the forked child is the host's child before it calls setsid: wait for it to lead its own group
    while not (pids := _trial_pids(_host())) or _pgid(pids[0]) != pids[0]:
        assert time.monotonic() < deadline, "the trial never led its own process group"
        time.sleep(0.1)
    group = pids[0]
    thread.join(timeout=60)
    assert box["r"].status == "timeout" and "train.timeout_s=8" in box["r"].reason
    assert not [p for p in psutil.process_iter() if _pgid(p.pid) == group]
    assert not (run_dir / "metrics.json").exists()


def _pgid(pid: int):
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


@pytest.mark.slow
def test_a_torchrun_group_on_one_node_is_forked_per_rank(tmp_path):
    result = launch(*prepared(tmp_path, [*FAST, "launcher=torchrun", "launcher.nproc_per_node=2"]), warm=True)
    assert result.ok, result.reason
    assert result.metrics.layout["dp"] == 2
    assert result.metrics.wall_s["startup.imports"] < 1.0


def test_a_killed_launcher_leaves_neither_host_nor_trial(tmp_path):
    """kill -9 of a process that launched through a warm host: the host and its running trial both end."""
    script = textwrap.dedent(f"""
        from moe_vlm_sweep.config.compose import compose_run_config
        from moe_vlm_sweep.launch.local import launch
        from moe_vlm_sweep.launch.run_dir import new_run_dir, prepare
        from moe_vlm_sweep.plan.plan import make_plan
        overrides = {LONG!r} + ["outputs_dir={tmp_path}"]
        plan = make_plan(compose_run_config(overrides), overrides)
        run_dir = new_run_dir("{tmp_path}")
        prepare(run_dir, plan, "")
        launch(plan, run_dir, warm=True)
    """)
    launcher = subprocess.Popen(
        [sys.executable, "-c", script], cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        deadline = time.monotonic() + 120
        while len(processes_under(tmp_path, WORKER)) < 2:  # the host and its forked trial
            assert launcher.poll() is None and time.monotonic() < deadline, "the trial never started"
            time.sleep(0.2)
        time.sleep(1)
        survivors = processes_under(tmp_path, WORKER)
        launcher.kill()
        launcher.wait()
        _gone, alive = psutil.wait_procs(survivors, timeout=30)
        assert not alive, [p.info["cmdline"] for p in alive]
        assert "its launcher" in next((tmp_path / "runs").glob("*/worker.log")).read_text()
    finally:
        for process in processes_under(tmp_path, WORKER):
            process.kill()


def test_a_host_that_cannot_start_is_not_tried_again(tmp_path):
    """A host that fails to start (here it exits at once) costs one try; the runs then start fresh workers."""
    command = [sys.executable, "-c", "import sys; sys.exit(3)"]
    with pytest.raises(warm_host.HostGone, match="did not start"):
        warm_host.shared_host(command, dict(os.environ), tmp_path / "host.log")
    began = time.monotonic()
    with pytest.raises(warm_host.HostGone, match="did not start"):
        warm_host.shared_host(command, dict(os.environ), tmp_path / "host.log")
    assert time.monotonic() - began < 0.5
