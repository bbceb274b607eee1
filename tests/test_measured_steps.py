"""An adaptive number of measured steps (``train/steps.py``): a floor, a CV target, ``train.steps`` the ceiling."""

from __future__ import annotations

import pytest
from conftest import read_json, run_in, why_failed

from moe_vlm_sweep.config.schema import TrainConf
from moe_vlm_sweep.train.steps import MeasuredSteps, StopReason, cv

SCHEDULE = ["warmup", "census"] + ["measured"] * 10 + ["profile"]


def _run(train: TrainConf, times: list[float]) -> tuple[list[str], MeasuredSteps]:
    """Walk the schedule as ``Trainer.run`` does, feeding ``times`` to the measured steps in order."""
    measuring, ran, fed = MeasuredSteps(train, "cpu"), [], iter(times)
    for phase in measuring.schedule(SCHEDULE):
        ran.append(phase)
        if phase == "measured":
            measuring.record(next(fed))
    return ran, measuring


def test_steady_steps_stop_at_the_floor():
    ran, measuring = _run(TrainConf(steps=10, min_steps=3, target_cv=0.02), [1.0, 1.01, 0.99] + [1.0] * 7)
    assert ran == ["warmup", "census"] + ["measured"] * 3 + ["profile"]  # the profile step still runs
    assert measuring.stop is StopReason.TARGET_CV and len(measuring.times) == 3


def test_noise_measures_on_until_the_cv_is_reached():
    times = [1.0, 1.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    ran, measuring = _run(TrainConf(steps=10, min_steps=3, target_cv=0.15), times)
    n = ran.count("measured")
    assert cv(times[:n]) <= 0.15 < cv(times[: n - 1])  # the first step at which the CV is within target
    assert 3 < n < 10 and measuring.stop is StopReason.TARGET_CV


def test_the_ceiling_is_train_steps():
    ran, measuring = _run(TrainConf(steps=10, min_steps=3, target_cv=0.01), [1.0, 2.0] * 5)
    assert ran.count("measured") == 10 and measuring.stop is StopReason.STEPS


def test_without_a_target_every_step_is_measured():
    ran, measuring = _run(TrainConf(steps=10), [1.0] * 10)
    assert ran.count("measured") == 10 and measuring.stop is StopReason.STEPS


@pytest.mark.parametrize(("override", "rule"), [("train.target_cv=1.5", "< 1"), ("train.min_steps=1", ">= 2")])
def test_invalid_values_exit_2(tmp_path, capsys, override, rule):
    code, _ = run_in(tmp_path, "model=tiny", override)
    err = capsys.readouterr().err
    assert code == 2 and override in err and rule in err and "Traceback" not in err


def test_metrics_say_how_many_steps_and_why(run_cli):
    # Two CPU steps have a CV under 0.9 unless one took 19x the other: the target stops at the floor.
    code, run_dir = run_cli("model=tiny", "train.steps=12", "train.target_cv=0.9", "train.min_steps=2")
    assert code == 0, why_failed(run_dir)
    steps = read_json(run_dir / "metrics.json")["step_time_s"]
    assert steps["measured"] == len(steps["steps"]) == 2
    assert steps["stopped_by"] == "target_cv" and steps["target_cv"] == 0.9
    phases = read_json(run_dir / "metrics.json")["loss"]["phases"]
    assert phases.count("measured") == 2 and phases[-1] == "profile"


def test_fixed_steps_say_so(run_cli):
    code, run_dir = run_cli("model=tiny", "train.steps=3")
    assert code == 0, why_failed(run_dir)
    steps = read_json(run_dir / "metrics.json")["step_time_s"]
    assert steps["measured"] == 3 and steps["stopped_by"] == "steps" and steps["target_cv"] is None


@pytest.mark.slow
def test_ranks_stop_at_the_same_step(run_cli):
    """Each rank's step time differs; the slowest rank's decides for all, so no rank waits alone in a collective."""
    code, run_dir = run_cli(
        "model=tiny",
        "launcher=torchrun",
        "launcher.nproc_per_node=2",
        "parallel.ep=2",
        "train.steps=12",
        "train.target_cv=0.9",
        "train.min_steps=2",
    )
    assert code == 0, why_failed(run_dir)
    steps = read_json(run_dir / "metrics.json")["step_time_s"]
    assert steps["measured"] == 2 and steps["stopped_by"] == "target_cv"
