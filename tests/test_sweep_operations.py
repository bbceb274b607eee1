"""What a user meets around a sweep: signals, storage problems, a killed sweep's finished work, a full disk.

Real sweeps in subprocesses (Hydra, Optuna on SQLite or PostgreSQL, MLflow on SQLite, tiny CPU training), real
signals, a real read-only mount and a real full file system (tmpfs, where this machine lets root mount one)."""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import optuna
import psutil
import pytest
from optuna.trial import TrialState
from sweep_testing import (
    WORKER,
    children_by_trial,
    cli,
    end_orphans,
    mlflow_runs,
    only_study,
    private_conf,
    processes_under,
    start_cli,
    trial_processes,
)
from test_sweep_e2e import SMALL_SPACE, _assert_consistent, _postgres_url

from moe_vlm_sweep.sweep import ledger

ONE = SMALL_SPACE.replace("n_trials: 3", "n_trials: 1")


def _wait_in_trial(tmp_path: Path, sweep: subprocess.Popen, log: Path, number: int = 0) -> list[psutil.Process]:
    """Wait until trial ``number`` runs its worker; return the worker's processes."""
    deadline = time.monotonic() + 300
    while True:
        opened = "sweep: study" in log.read_text()
        trials = only_study(tmp_path).get_trials() if opened else []
        workers = trial_processes(tmp_path)
        if workers and any(
            t.number == number and t.user_attrs.get("claim") == "launch" and t.state == TrialState.RUNNING
            for t in trials
        ):
            return workers
        assert sweep.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
        time.sleep(0.2)


SMALL = ["run", "-m", "sweep=small"]


def _sweep_in_first_trial(tmp_path: Path, n_trials: int) -> tuple[Path, Path, subprocess.Popen, list[psutil.Process]]:
    """Start the small space's sweep of ``n_trials`` (its console in ``first.log``) and wait until trial #0 runs
    its worker: (conf, log, sweep, the worker's processes). Ends what it started if the wait fails."""
    conf = private_conf(tmp_path, {"small": SMALL_SPACE.replace("n_trials: 3", f"n_trials: {n_trials}")})
    log = tmp_path / "first.log"
    sweep = start_cli(SMALL, cwd=tmp_path, conf=conf, log=log)
    try:
        return conf, log, sweep, _wait_in_trial(tmp_path, sweep, log)
    except BaseException:
        end_orphans(tmp_path)
        raise


def _freeze_until_the_worker_finished(sweep: subprocess.Popen, workers: list[psutil.Process]) -> None:
    """Freeze the sweep (SIGSTOP) so that its worker writes metrics.json and no launcher reads it."""
    sweep.send_signal(signal.SIGSTOP)
    psutil.wait_procs(workers, timeout=300)


def _described(procs: list[psutil.Process]) -> list[str]:
    out = []
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            out.append(f"{proc.pid} (parent {proc.ppid()}, {proc.status()}): {' '.join(proc.cmdline())}")
    return out


def _mount_tmpfs(path: Path, options: str) -> None:
    path.mkdir(parents=True, exist_ok=True)
    # CI runs as root and must exercise the full disk and the read-only path: there a missing mount fails
    unavailable = pytest.fail if os.environ.get("CI") == "true" else pytest.skip
    if os.geteuid() != 0:
        unavailable("mounting a tmpfs needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True, text=True)
    if done.returncode:
        unavailable(f"this machine does not let root mount a tmpfs: {done.stderr.strip()}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- storage problems: exit 2 within seconds, in plain words -----------------------------------------------


def _fails_fast(proc: subprocess.CompletedProcess, began: float, *words: str) -> None:
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr
    for word in words:
        assert word in proc.stderr, proc.stderr
    assert time.monotonic() - began < 30, f"took {time.monotonic() - began:.0f} s"  # start-up included


def test_best_of_a_missing_study_says_which_exist(tmp_path):
    conf = private_conf(tmp_path)
    (tmp_path / "outputs" / "sweeps" / "cpu_demo-1234").mkdir(parents=True)
    (tmp_path / "outputs" / "sweeps" / "cpu_demo-1234" / "optuna.db").write_bytes(b"")
    began = time.monotonic()
    proc = cli(["best", "no_such_study"], cwd=tmp_path, conf=conf, check=False, timeout=60)
    _fails_fast(proc, began, "no study 'no_such_study' under outputs/sweeps (studies there: cpu_demo-1234)")


def test_an_unreachable_postgresql_server_is_named_at_once(tmp_path):
    """A bare postgresql:// URL (the README's form) reaches psycopg2, and a server that is not there is said so."""
    conf = private_conf(tmp_path, {"one": ONE})
    url = f"postgresql://postgres@127.0.0.1:{_free_port()}/postgres"
    began = time.monotonic()
    proc = cli(["run", "-m", "sweep=one", f"sweep.storage={url}"], cwd=tmp_path, conf=conf, check=False, timeout=120)
    _fails_fast(
        proc,
        began,
        "cannot reach the study's database server at postgresql+psycopg2://postgres@127.0.0.1",
        "start the server",
    )


def test_a_read_only_storage_path_is_named(tmp_path):
    conf = private_conf(tmp_path, {"one": ONE})
    read_only = tmp_path / "ro"
    if os.geteuid() == 0:
        _mount_tmpfs(read_only, "ro,size=1m")
    else:
        read_only.mkdir()
        read_only.chmod(0o555)
    try:
        began = time.monotonic()
        proc = cli(
            ["run", "-m", "sweep=one", f"sweep.storage=sqlite:///{read_only}/optuna.db"],
            cwd=tmp_path,
            conf=conf,
            check=False,
            timeout=120,
        )
        _fails_fast(proc, began, f"sweep.storage=sqlite:///{read_only}/optuna.db:", "writable")
    finally:
        if os.geteuid() == 0:
            subprocess.run(["umount", str(read_only)], check=False)


@pytest.mark.slow
def test_an_emptied_or_damaged_database_never_starts_the_study_over(tmp_path):
    conf = private_conf(tmp_path, {"one": ONE})
    cli(["run", "-m", "sweep=one"], cwd=tmp_path, conf=conf, timeout=600)
    db = next((tmp_path / "outputs" / "sweeps").glob("*/optuna.db"))
    whole = db.read_bytes()
    db.write_bytes(whole[: len(whole) // 2])
    began = time.monotonic()
    proc = cli(["run", "-m", "sweep=one"], cwd=tmp_path, conf=conf, check=False, timeout=120)
    _fails_fast(proc, began, f"the Optuna database sqlite:///{db} is damaged")
    db.write_bytes(b"")
    began = time.monotonic()
    proc = cli(["run", "-m", "sweep=one"], cwd=tmp_path, conf=conf, check=False, timeout=120)
    _fails_fast(
        proc,
        began,
        f"study {db.parent.name} is not in sqlite:///{db}, but MLflow",
        "holds 1 trial run(s) of it",
        "sweep.study_name=NEW",
    )
    children = children_by_trial(mlflow_runs(tmp_path))
    assert len(children) == 1, "no second child run beside the first study's"


@pytest.mark.slow
def test_a_full_disk_fails_the_trials_mlflow_run_and_keeps_its_result(tmp_path):
    """The MLflow artifact store on a 16 KiB file system: the trial's files do not fit. The study keeps the
    measured value; the child run is FAILED with the reason, never FINISHED without what it should hold."""
    conf = private_conf(tmp_path, {"one": ONE})
    artifacts = tmp_path / "outputs" / "mlartifacts"
    _mount_tmpfs(artifacts, "size=16k")
    try:
        out = cli(["run", "-m", "sweep=one"], cwd=tmp_path, conf=conf, timeout=600).stdout
    finally:
        subprocess.run(["umount", str(artifacts)], check=False)
    assert "trial #0's MLflow run could not be logged whole" in out, out[-3000:]
    trial = only_study(tmp_path).trials[0]
    assert trial.state == TrialState.COMPLETE and trial.values
    child = children_by_trial(mlflow_runs(tmp_path))[0]
    assert child.info.status == "FAILED"
    assert "No space left on device" in child.data.tags["moe_vlm_sweep.tracking_error"]


@pytest.mark.slow
def test_a_postgresql_server_stopped_mid_sweep_is_said_plainly(tmp_path):
    conf = private_conf(tmp_path, {"small": SMALL_SPACE})
    storage, stop = _postgres_url(tmp_path)
    log = tmp_path / "sweep.log"
    try:
        sweep = start_cli(
            ["run", "-m", "sweep=small", f"sweep.storage={storage}", "sweep.study_name=pg"],
            cwd=tmp_path,
            conf=conf,
            log=log,
        )
        deadline = time.monotonic() + 300
        while not processes_under(tmp_path, WORKER):
            assert sweep.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(0.2)
    finally:
        stop()
    try:
        assert sweep.wait(timeout=300) == 2, log.read_text()[-4000:]
    finally:
        end_orphans(tmp_path)
    text = log.read_text()
    assert "error: cannot reach the study's database server at postgresql+psycopg2://" in text, text[-3000:]
    assert "Traceback" not in text


# --- finished work is kept -----------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_killed_sweep_whose_worker_finished_keeps_the_result(tmp_path):
    """The sweep is frozen (SIGSTOP) while its worker trains, so the worker writes metrics.json and no launcher
    reads it; then the sweep is killed. The same command adopts that measurement: the trial is COMPLETE with its
    value, its MLflow child FINISHED with the metrics, and the config is not measured again."""
    conf, _, sweep, workers = _sweep_in_first_trial(tmp_path, 2)
    try:
        _freeze_until_the_worker_finished(sweep, workers)
        sweep.send_signal(signal.SIGKILL)
        sweep.wait()
    finally:
        end_orphans(tmp_path)
    run_dir = next((tmp_path / "outputs" / "runs").glob("*-job0-*"))
    assert (run_dir / "metrics.json").exists() and not (run_dir / "result.json").exists()
    out = cli(SMALL, cwd=tmp_path, conf=conf).stdout
    assert "resume: trial #0 was left RUNNING by a sweep that is gone, but its run finished (ok" in out, out
    study = only_study(tmp_path)
    first = study.trials[0]
    assert first.state == TrialState.COMPLETE and first.user_attrs["run_dir"].endswith(run_dir.name)
    assert len(list((tmp_path / "outputs" / "runs").glob("*-job0-*"))) == 1
    runs = mlflow_runs(tmp_path)
    _assert_consistent(study, runs, 2)
    child = children_by_trial(runs)[0]
    assert child.info.status == "FINISHED" and "effective_tokens_per_s_per_gpu" in child.data.metrics
    assert not [t for t in study.trials if t.user_attrs.get("retry_of") == 0]


# --- signals -------------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_stops_the_sweep_cleanly_and_the_same_command_resumes(tmp_path, sig, code):
    conf, log, sweep, workers = _sweep_in_first_trial(tmp_path, 2)
    try:
        began = time.monotonic()
        sweep.send_signal(sig)
        assert sweep.wait(timeout=60) == code, log.read_text()[-4000:]
        assert time.monotonic() - began < 20
        left = psutil.wait_procs(workers, timeout=5)[1]
        assert not left, f"the trial's worker must be stopped with the sweep: {_described(left)}"
        left = psutil.wait_procs(processes_under(tmp_path, WORKER), timeout=10)[1]
        assert not left, f"nothing of the sweep may outlive it (a warm trial host included): {_described(left)}"
    finally:
        end_orphans(tmp_path)
    text = log.read_text()
    assert "Traceback" not in text, text[-4000:]
    lines = [line for line in text.splitlines() if line.startswith("sweep: stopped by")]
    assert lines == [
        f"sweep: stopped by {sig.name}; trial #0 marked interrupted and queued to run again. "
        "Resume with: moe-vlm-sweep run -m sweep=small"
    ], text[-3000:]
    study = only_study(tmp_path)
    assert study.trials[0].state == TrialState.FAIL and study.trials[0].user_attrs["failure_class"] == "interrupted"
    runs = mlflow_runs(tmp_path)
    assert not [r.info.run_name for r in runs if r.info.status == "RUNNING"]
    assert children_by_trial(runs)[0].info.status == "KILLED"
    cli(SMALL, cwd=tmp_path, conf=conf)
    study = only_study(tmp_path)
    _assert_consistent(study, mlflow_runs(tmp_path), 2)
    retry = [t for t in study.trials if t.user_attrs.get("retry_of") == 0]
    assert len(retry) == 1 and retry[0].state == TrialState.COMPLETE and retry[0].params == study.trials[0].params


_SWALLOWED_STOP = """
import os, signal, sys

from hydra_plugins.moe_vlm_sweep_sweeper._impl import SweeperImpl
from moe_vlm_sweep import cli
from moe_vlm_sweep.export.finish import SweepEnd


class SignalsItselfWhenCollected:
    def __del__(self):
        os.kill(os.getpid(), signal.SIGTERM)  # the handler runs here, and Python drops what it raises


owner, name = {"validate": (SweeperImpl, "_validate"), "finish": (SweepEnd, "finish")}[sys.argv[1]]
original = getattr(owner, name)


def then_a_swallowed_stop(*args, **kwargs):
    result = original(*args, **kwargs)
    SignalsItselfWhenCollected()
    return result


setattr(owner, name, then_a_swallowed_stop)
sys.exit(cli.main(sys.argv[2:]))
"""


def _sweep_with_a_swallowed_stop(tmp_path: Path, after: str) -> tuple[str, optuna.Study]:
    """The one-trial small sweep, where SIGTERM comes inside a finalizer right after ``after`` returns: (its
    console, its study), once it exited as stopped with nothing of the dropped exception printed."""
    conf = private_conf(tmp_path, {"small": ONE})
    driver = tmp_path / "swallowed_stop.py"
    driver.write_text(_SWALLOWED_STOP)
    env = {**os.environ, "MOE_VLM_SWEEP_CONF": str(conf), "PYTHONUNBUFFERED": "1"}
    try:
        done = subprocess.run(
            [sys.executable, str(driver), after, *SMALL],
            cwd=tmp_path,
            env=env,
            text=True,
            capture_output=True,
            timeout=300,
        )
    finally:
        end_orphans(tmp_path)
    out = done.stdout + done.stderr
    assert done.returncode == 143, out[-4000:]
    assert "Traceback" not in out and "Exception ignored" not in out, out[-3000:]
    return out, only_study(tmp_path)


@pytest.mark.slow
def test_a_stop_a_finalizer_swallowed_before_the_claim_still_stops_the_sweep(tmp_path):
    out, study = _sweep_with_a_swallowed_stop(tmp_path, "validate")
    assert "sweep: stopped by SIGTERM; trial #0 marked interrupted. Resume with" in out, out[-3000:]
    (first,) = study.trials
    assert first.state == TrialState.FAIL and first.user_attrs["failure_class"] == "interrupted"
    assert "claim" not in first.user_attrs and not (tmp_path / "outputs" / "runs").exists()
    runs = mlflow_runs(tmp_path)
    assert {r.info.status for r in runs} == {"KILLED"} and list(children_by_trial(runs)) == [0]


@pytest.mark.slow
def test_a_stop_a_finalizer_swallowed_as_the_sweep_ends_still_exits_as_stopped(tmp_path):
    out, study = _sweep_with_a_swallowed_stop(tmp_path, "finish")
    assert "sweep: SIGTERM came as the sweep ended; every result is kept" in out, out[-3000:]
    assert [t.state for t in study.trials] == [TrialState.COMPLETE]


# --- uncontended measurements --------------------------------------------------------------------------------


@pytest.mark.slow
def test_two_sweep_workers_on_one_host_never_measure_at_once(tmp_path, monkeypatch):
    """Two workers of one study on this machine's cores: every launched trial's run (from its first file to its
    result.json) ends before the next one starts, whichever worker runs it."""
    monkeypatch.setenv("MOE_VLM_SWEEP_LOCK_DIR", str(tmp_path / "locks"))
    conf = private_conf(tmp_path, {"small": SMALL_SPACE.replace("n_trials: 3", "n_trials: 4")})
    storage = f"sqlite:///{tmp_path / 'shared.db'}"
    command = ["run", "-m", "sweep=small", f"sweep.storage={storage}", "sweep.study_name=shared"]
    workers = [
        start_cli([*command, f"sweep.seed={seed}"], cwd=tmp_path, conf=conf, log=tmp_path / f"w{seed}.log")
        for seed in (1, 2)
    ]
    try:
        for worker, seed in zip(workers, (1, 2)):
            assert worker.wait(timeout=900) == 0, (tmp_path / f"w{seed}.log").read_text()[-4000:]
    finally:
        end_orphans(tmp_path)
    study = optuna.load_study(study_name="shared", storage=storage)
    launched = [t for t in study.trials if t.user_attrs.get("claim") == "launch"]
    assert len({t.user_attrs["worker"] for t in launched}) == 2, "both workers should have run trials"
    spans = sorted(
        (
            (tmp_path / t.user_attrs["run_dir"] / "config.yaml").stat().st_mtime,
            (tmp_path / t.user_attrs["run_dir"] / "result.json").stat().st_mtime,
            t.number,
        )
        for t in launched
    )
    for (_, end, before), (start, _, after) in itertools.pairwise(spans):
        assert start >= end, f"trial #{after} started {end - start:.1f} s before trial #{before} ended"
    assert all(t.user_attrs["devices"].startswith("cpu-") for t in launched)
    # Live progress: the worker logs each step; the console echoes the running trial's steps and the time left.
    log = (tmp_path / launched[0].user_attrs["run_dir"] / "worker.log").read_text()
    assert re.search(r"\[step 1/\d warmup\] [\d.]+ ms, \d+ real tok/s, loss [\d.]+\n", log), log[-2000:]
    assert len(re.findall(r"\[step \d/\d measured\]", log)) == 2, log[-2000:]
    console = (tmp_path / "w1.log").read_text() + (tmp_path / "w2.log").read_text()
    assert re.search(r"  trial #\d+ \[step \d/\d (warmup|measured)\] [\d.]+ ms", console), console[-3000:]
    assert re.search(r"\[trial \d/4\] .* about \d+ (s|min) left", console), console[-3000:]
    from mlflow.tracking import MlflowClient

    experiment = MlflowClient(f"sqlite:///{tmp_path / 'outputs' / 'mlflow.db'}").get_experiment_by_name("moe-vlm-sweep")
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"  # the UI's training view


@pytest.mark.slow
def test_a_signal_just_after_the_worker_finished_keeps_its_result(tmp_path):
    """SIGTERM reaches a frozen sweep whose worker then finishes; the sweep wakes into the signal with the
    result on disk: it tells that result (not interrupted, not queued again) and exits 143."""
    _, log, sweep, workers = _sweep_in_first_trial(tmp_path, 2)
    try:
        _freeze_until_the_worker_finished(sweep, workers)
        sweep.send_signal(signal.SIGTERM)
        sweep.send_signal(signal.SIGCONT)
        assert sweep.wait(timeout=60) == 143, log.read_text()[-4000:]
    finally:
        end_orphans(tmp_path)
    assert "sweep: stopped by SIGTERM; trial #0 had finished and is kept. Resume with:" in log.read_text()
    study = only_study(tmp_path)
    assert study.trials[0].state == TrialState.COMPLETE
    assert not [t for t in study.trials if t.user_attrs.get("retry_of") == 0]
    assert children_by_trial(mlflow_runs(tmp_path))[0].info.status == "FINISHED"


@pytest.mark.slow
def test_a_second_ctrl_c_ends_the_sweep_at_once_and_it_still_resumes(tmp_path):
    conf, log, sweep, workers = _sweep_in_first_trial(tmp_path, 1)
    try:
        sweep.send_signal(signal.SIGINT)
        time.sleep(0.05)
        sweep.send_signal(signal.SIGINT)
        assert sweep.wait(timeout=10) == -signal.SIGINT, log.read_text()[-3000:]
        assert not psutil.wait_procs(workers, timeout=30)[1], "the worker must not outlive the sweep"
    finally:
        end_orphans(tmp_path)
    out = cli(SMALL, cwd=tmp_path, conf=conf).stdout
    # Wherever the second signal landed (before the trial was marked, or between marking and queuing it again),
    # the resumed study re-runs the interrupted config once and MLflow matches it.
    study = only_study(tmp_path)
    _assert_consistent(study, mlflow_runs(tmp_path), 1)
    retry = [t for t in study.trials if t.user_attrs.get("retry_of") == 0]
    assert len(retry) == 1 and retry[0].state == TrialState.COMPLETE, out[-3000:]


def _first_trial_unclaimed(tmp_path: Path) -> bool:
    """Trial 0 is asked and not yet claimed (its config is being composed), read straight from the database so the
    poll is quick enough to land in that window."""
    dbs = list((tmp_path / "outputs" / "sweeps").glob("*/optuna.db"))
    if not dbs:
        return False
    # suppress: the tables may not be created yet
    with contextlib.closing(sqlite3.connect(dbs[0], timeout=5)) as db, contextlib.suppress(sqlite3.OperationalError):
        keys = db.execute(
            "SELECT a.key FROM trials t JOIN trial_user_attributes a ON a.trial_id = t.trial_id "
            "WHERE t.number = 0 AND t.state = 'RUNNING'"
        ).fetchall()
        return ("worker",) in keys and ("claim",) not in keys
    return False


@pytest.mark.slow
def test_a_signal_before_the_trial_claims_its_config_spends_no_trial(tmp_path):
    conf = private_conf(tmp_path, {"small": ONE})
    log = tmp_path / "first.log"
    command = ["run", "-m", "sweep=small"]
    sweep = start_cli(command, cwd=tmp_path, conf=conf, log=log)
    try:
        deadline = time.monotonic() + 300
        while not _first_trial_unclaimed(tmp_path):
            assert sweep.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(0.01)
        sweep.send_signal(signal.SIGTERM)
        assert sweep.wait(timeout=180) == 143, log.read_text()[-4000:]
    finally:
        end_orphans(tmp_path)
    first = only_study(tmp_path).trials[0]
    assert first.state == TrialState.FAIL and first.user_attrs["failure_class"] == "interrupted"
    assert "claim" not in first.user_attrs, "the signal came after the claim: this test needs it before"
    assert "trial #0 marked interrupted. Resume with" in log.read_text()
    cli(command, cwd=tmp_path, conf=conf)
    study = only_study(tmp_path)
    _assert_consistent(study, mlflow_runs(tmp_path), 1)
    (measured,) = ledger.counted(study.trials)
    assert measured.number > 0 and measured.state == TrialState.COMPLETE
    assert [t.number for t in study.trials if t.user_attrs.get("claim") == "launch"] == [measured.number]
