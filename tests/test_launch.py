"""Failure classification from real runs: a killed worker, a hang past its timeout, a machine preflight."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
import yaml
from conftest import LONG, prepared, read_json
from sweep_testing import WORKER, processes_under

from moe_vlm_sweep.launch.lifeline import is_alive, start_ticks
from moe_vlm_sweep.launch.local import cuda_alloc_conf, launch
from moe_vlm_sweep.launch.result import RunResult
from moe_vlm_sweep.launch.run_dir import overrides_yaml
from moe_vlm_sweep.launch.stop import Interrupted, stoppable


def _worker_pids(run_dir) -> list[int]:
    return [p.pid for p in processes_under(run_dir, WORKER)]


def test_killed_worker_is_a_crash(tmp_path):
    plan, run_dir = prepared(tmp_path, LONG)
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
    assert not list(run_dir.glob("native_crash.*"))  # a kill is no native crash: the rank's empty file is gone
    assert RunResult.read(run_dir).status == "crash"


@pytest.mark.flaky(reruns=0)  # the crash is this test's own doing: never rerun as the chance one would be
def test_a_native_crash_leaves_the_workers_python_stacks_beside_its_log(tmp_path):
    """A worker killed by a fatal signal (a segfault in a native library) is a crash, and its rank's crash file
    says what each thread was running: faulthandler's stacks, as failure.json cannot be written."""
    run_dir, ranks, ended = _training(tmp_path, LONG)
    os.kill(ranks[0], signal.SIGSEGV)
    result = ended()
    assert result.status == "crash"
    assert result.reason.startswith("rank 0: Fatal Python error: Segmentation fault"), result.reason
    stacks = (run_dir / "native_crash.rank0.txt").read_text()
    assert stacks.startswith("Fatal Python error: Segmentation fault")
    assert "moe_vlm_sweep/train/" in stacks  # the stack reaches the training code
    assert RunResult.read(run_dir).reason == result.reason


@pytest.mark.slow
@pytest.mark.flaky(reruns=0)
def test_a_rank_that_aborts_is_the_cause_not_the_peer_that_lost_it(tmp_path):
    """Two ranks: rank 0 aborts in native code (SIGABRT, as glibc does on a corrupted heap), rank 1 then fails on
    the closed connection. The run's reason names rank 0 and its stacks, not rank 1's broken pipe."""
    run_dir, ranks, ended = _training(
        tmp_path, [*LONG, "launcher=torchrun", "launcher.nproc_per_node=2", "parallel.ep=2"]
    )
    assert set(ranks) == {0, 1}, f"the two ranks never trained: {ranks}"
    os.kill(ranks[0], signal.SIGABRT)
    result = ended()
    assert result.status == "crash"
    assert result.reason.startswith("rank 0: Fatal Python error: Aborted"), result.reason
    assert result.failure is None or result.failure.rank == 1  # rank 1's broken pipe, if it wrote one, is kept
    assert "moe_vlm_sweep/train/" in (run_dir / "native_crash.rank0.txt").read_text()
    assert not (run_dir / "native_crash.rank1.txt").exists()  # rank 1 ended by a Python exception or a signal


def _training(tmp_path, overrides: list[str]) -> tuple[Path, dict[int, int], Callable[[], RunResult]]:
    """A run launched in a thread, once its ranks train: (run dir, pid of each rank, wait for its result)."""
    plan, run_dir = prepared(tmp_path, overrides)
    box: dict[str, RunResult] = {}
    thread = threading.Thread(target=lambda: box.setdefault("r", launch(plan, run_dir)))
    thread.start()
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and "measured]" not in _text(run_dir / "worker.log"):
        time.sleep(0.2)
    workers = [p for p in processes_under(run_dir, WORKER) if "torch.distributed.run" not in " ".join(p.cmdline())]
    ranks = {int(p.environ().get("RANK", 0)): p.pid for p in workers}  # a world of one runs without torchrun
    assert 0 in ranks, f"the worker never trained: {ranks}"

    def ended() -> RunResult:
        thread.join(timeout=120)
        return box["r"]

    return run_dir, ranks, ended


def _text(path) -> str:
    return path.read_text() if path.exists() else ""


def test_hang_past_timeout_is_a_timeout(tmp_path, run_cli):
    code, run_dir = run_cli(*LONG, "train.timeout_s=15")
    assert code == 1
    result = read_json(run_dir / "result.json")
    assert result["status"] == "timeout"
    assert "train.timeout_s=15" in result["reason"]
    assert not (run_dir / "metrics.json").exists()
    assert _worker_pids(run_dir) == []


def test_a_stop_a_finalizer_swallowed_ends_the_running_worker_within_seconds(tmp_path):
    """The sweep's stop is recorded but its exception never reached the launcher's wait (``launch/stop.py``):
    the launcher raises it at its next check and ends the worker's whole group on the way out."""
    from moe_vlm_sweep.launch import stop

    plan, run_dir = prepared(tmp_path, LONG)
    swallowed = threading.Timer(3, stop._received.append, [signal.SIGTERM])  # the record a dropped stop leaves
    began = time.monotonic()
    with stoppable(), pytest.raises(Interrupted):
        swallowed.start()
        launch(plan, run_dir)
    assert time.monotonic() - began < 3 + 10, "the launcher checks for a stop about once a second"
    assert _worker_pids(run_dir) == []
    assert not (run_dir / "result.json").exists(), "a stopped run has no verdict: the sweep marks it interrupted"


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


@pytest.mark.parametrize(
    ("layout", "processes"),
    [
        ([], 1),  # the worker
        (["launcher=torchrun", "launcher.nproc_per_node=2"], 3),  # torchrun and 2 ranks
        (["data.loader_workers=1"], 2),  # the worker and the DataLoader worker it forked
    ],
    ids=["local", "torchrun", "loader_worker"],
)
def test_a_killed_launcher_leaves_no_worker_behind(layout, processes, tmp_path):
    """kill -9 of `moe-vlm-sweep run` (or of a sweep) skips every cleanup; the ranks, and the processes that build
    their batches, must still end on their own, or they would keep running beside the next trial."""
    cmd = [sys.executable, "-m", "moe_vlm_sweep.cli", "run", *LONG, *layout, f"outputs_dir={tmp_path}"]
    cli = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while len(processes_under(tmp_path, WORKER)) < processes:
            assert cli.poll() is None and time.monotonic() < deadline, "the run never started"
            time.sleep(0.2)
        cli.kill()
        cli.wait()
        _gone, alive = psutil.wait_procs(processes_under(tmp_path, WORKER), timeout=30)
        assert not alive, [p.info["cmdline"] for p in alive]
        assert "its launcher" in next((tmp_path / "runs").glob("*/worker.log")).read_text()
    finally:
        for process in processes_under(tmp_path, WORKER):
            process.kill()


def test_a_zombie_or_a_reused_pid_is_not_the_launcher():
    """The identity is pid + kernel start ticks: a pid recycled by a new process, or a zombie, reads as gone."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1)"])
    identity = f"{child.pid}:{start_ticks(child.pid)}"
    assert is_alive(identity)
    assert not is_alive(f"{child.pid}:{int(start_ticks(child.pid)) + 1}")  # same pid, another process
    deadline = time.monotonic() + 30
    while start_ticks(child.pid) is not None:  # exited, not reaped yet: a zombie
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert not is_alive(identity) and psutil.Process(child.pid).status() == psutil.STATUS_ZOMBIE
    child.wait()


@pytest.mark.parametrize(
    "inherited, expandable, expected",
    [
        (None, True, "expandable_segments:True"),
        ("expandable_segments:True", False, "expandable_segments:False"),
        (
            "garbage_collection_threshold:0.8, expandable_segments:False",
            True,
            "garbage_collection_threshold:0.8,expandable_segments:True",
        ),
    ],
)
def test_the_config_owns_the_allocators_expandable_segments(inherited, expandable, expected):
    """The shell's other allocator settings pass through; its expandable_segments never decides a run's memory."""
    assert cuda_alloc_conf(inherited, expandable) == expected


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        ["model=tiny", "train.steps=6"],
        ["+tag='a b'", "x=[a, b]", 'name="it\'s"', "sweep.params.k=choice(1,2)", "k=" + "v" * 100 + " w"],
    ],
)
def test_overrides_yaml_loads_back_to_the_overrides(overrides):
    """Quotes, spaces and brackets inside an override survive (shell quoting is not YAML: ``'"'"'`` breaks it)."""
    text = overrides_yaml(overrides)
    assert yaml.safe_load(text) == overrides
    assert len(text.splitlines()) == max(len(overrides), 1), "one override per line"
