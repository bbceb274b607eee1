"""A measurement shared with another process says so: a real tiny training beside a process spinning on the same
cores is flagged ``contended`` with that process named; the trial's own processes never are."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator

import optuna
import psutil
import pytest
import yaml
from conftest import ok_run
from contract_samples import sample_metrics
from sweep_testing import children_by_trial, cli, mlflow_runs, only_study, private_conf
from test_sweep_e2e import SMALL_SPACE

from moe_vlm_sweep.export.best import export, ranked
from moe_vlm_sweep.export.report import write_report
from moe_vlm_sweep.launch.result import RunResult
from moe_vlm_sweep.metrics.schema import Contention, OtherProcess, read_metrics
from moe_vlm_sweep.sweep.progress import table
from moe_vlm_sweep.sweep.spec import ObjectiveConf
from moe_vlm_sweep.sweep.trial import CONTENDED_ATTR, outcome_of_result
from moe_vlm_sweep.train.contention import CONTENDING_CPU_PERCENT

_TRAIN = ("model=tiny", "train.steps=6", "train.warmup_steps=1", "train.profile_steps=0")


@contextlib.contextmanager
def _spinning() -> Iterator[tuple[int, dict]]:
    """A process spinning on this host's cores; after the block, ``share``: its percent of a core meanwhile."""
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    seen: dict = {}
    try:
        began, cpu = time.time(), psutil.Process(spinner.pid).cpu_times()
        yield spinner.pid, seen
        after = psutil.Process(spinner.pid).cpu_times()
        seen["share"] = 100 * (after.user + after.system - cpu.user - cpu.system) / (time.time() - began)
    finally:
        spinner.kill()
        spinner.wait()


def _unless_starved(found: bool, spinner: dict) -> None:
    """Fail plainly when the spinning process went unseen because it barely ran (a host so loaded that it got under
    three times the threshold), so the cause is named rather than a bare missing pid."""
    assert found or spinner["share"] >= 3 * CONTENDING_CPU_PERCENT, (
        f"the spinning process got only {spinner['share']:.0f}% of a core: the host is too busy to tell"
    )


def test_a_process_spinning_on_the_trials_cores_marks_it_contended(run_cli):
    with _spinning() as (pid, spinner):
        result = run_cli(*_TRAIN)
    run_dir, metrics = ok_run(result)
    seen = {p["pid"]: p for p in metrics["contention"]["processes"]}
    _unless_starved(pid in seen, spinner)
    assert metrics["contended"] is True
    assert pid in seen, metrics["contention"]
    assert seen[pid]["where"] == "cpu" and seen[pid]["cpu_percent"] >= CONTENDING_CPU_PERCENT
    assert metrics["contention"]["gpu_source"] == "not a GPU run"
    assert set(metrics["contention"]["cores"]) == os.sched_getaffinity(0)
    assert read_metrics(run_dir).contention.processes  # the typed reader keeps the evidence
    assert "contended measurement: pid" in (run_dir / "worker.log").read_text()


def test_without_another_busy_process_the_trial_is_not_contended_by_itself(run_cli):
    _, metrics = ok_run(run_cli(*_TRAIN))
    seen = {p["pid"] for p in metrics["contention"]["processes"]}
    # This test's process (the worker's ancestor) and everything it started are the trial's, never "other"; on a
    # quiet host nothing else is busy, so the run is clean (a shared host's own busy jobs are listed, and then
    # each one named was using CPU of its own, not of this tree).
    mine = {os.getpid(), *(p.pid for p in psutil.Process().children(recursive=True))}
    ranks = set(metrics["contention"]["rank_pids"])
    assert len(ranks) == 1 and not seen & (mine | ranks), metrics["contention"]
    assert metrics["contended"] is bool(seen)
    if os.environ.get("CI", "").lower() == "true":
        assert metrics["contended"] is False, metrics["contention"]


def _study_with_a_contended_fastest_trial():
    study = optuna.create_study(direction="maximize", study_name="shared")
    for speed in (100.0, 300.0, 200.0):
        trial = study.ask()
        trial.suggest_int("batch.mbs", 1, 8)
        trial.set_user_attr("overrides", [f"batch.mbs={trial.params['batch.mbs']}"])
        trial.set_user_attr("data_realism", "synthetic_images")
        if speed == 300.0:  # the fastest measured beside a busy process
            metrics = sample_metrics()
            metrics.tokens_per_s, metrics.contended = speed, True
            metrics.contention = Contention(
                processes=[OtherProcess(pid=4242, name="spin", where="cpu", cpu_percent=97.0)],
                gpu_source="not a GPU run",
                cores=[0],
                cpu_threshold_percent=10.0,
                window_s=1.0,
            )
            outcome = outcome_of_result(
                RunResult(status="ok", metrics=metrics), ObjectiveConf(metric="tokens_per_s", direction="maximize")
            )
            trial.set_user_attr(CONTENDED_ATTR, outcome.contention)
        study.tell(trial, speed)
    return study


def test_a_contended_faster_trial_ranks_after_the_uncontended_ones_and_says_so(tmp_path):
    study = _study_with_a_contended_fastest_trial()
    assert [t.number for t in ranked(study)] == [2, 0, 1]
    assert study.trials[1].user_attrs[CONTENDED_ATTR] == "pid 4242 spin (cpu, 97.0% CPU)"
    printed = table(ranked(study), ["tokens_per_s"], realism="synthetic_images")
    assert "3*" in printed and "#1: pid 4242 spin (cpu, 97.0% CPU)" in printed, printed
    exported = export(study, sweep_dir=tmp_path / "s", conf_dir=tmp_path, top_k=3)
    assert [e.trial.number for e in exported] == [2, 0, 1]
    top = yaml.safe_load((tmp_path / "s" / "best" / "top.yaml").read_text())
    assert [row["contended"] for row in top] == [None, None, "pid 4242 spin (cpu, 97.0% CPU)"]
    assert "# Contended: measured beside pid 4242" in (tmp_path / "experiment" / "shared_t1.yaml").read_text()
    page = write_report(study, tmp_path / "report").read_text()
    assert "yes: pid 4242 spin (cpu, 97.0% CPU)" in page


@pytest.mark.slow
def test_a_sweep_trial_measured_beside_a_busy_process_carries_the_flag(tmp_path):
    """A real one-trial sweep beside a spinning process: the Optuna trial and its MLflow child name the process,
    the console's trial line says CONTENDED, and ``best`` marks the row."""
    space = SMALL_SPACE.replace("n_trials: 3", "n_trials: 1").replace("train.steps: 2", "train.steps: 6")
    conf = private_conf(tmp_path, {"small": space})
    with _spinning() as (pid, spinner):
        proc = cli(["run", "-m", "sweep=small"], cwd=tmp_path, conf=conf, timeout=900)
    study = only_study(tmp_path)
    (trial,) = study.get_trials(states=(optuna.trial.TrialState.COMPLETE,))
    _unless_starved(f"pid {pid} " in trial.user_attrs.get(CONTENDED_ATTR, ""), spinner)
    assert f"pid {pid} " in trial.user_attrs.get(CONTENDED_ATTR, ""), trial.user_attrs
    assert "CONTENDED (measured beside pid" in proc.stdout, proc.stdout[-3000:]
    child = children_by_trial(mlflow_runs(tmp_path))[trial.number]
    assert child.data.tags[f"moe_vlm_sweep.{CONTENDED_ATTR}"] == trial.user_attrs[CONTENDED_ATTR]
    best = cli(["best", "--outputs", "outputs"], cwd=tmp_path, conf=conf)
    assert "1*" in best.stdout and f"#{trial.number}: pid {pid}" in best.stdout, best.stdout
