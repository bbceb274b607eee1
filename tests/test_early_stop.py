"""Stopping a loser early: the rule on per-step values, and a real sweep that stops a clearly slower trial."""

from __future__ import annotations

import json

import optuna
import pytest
from optuna.trial import TrialState
from sweep_testing import children_by_trial, cli, mlflow_runs, only_study, private_conf

from moe_vlm_sweep.launch.run_dir import PROGRESS_FILE
from moe_vlm_sweep.sweep.early_stop import EarlyStop, read_progress
from moe_vlm_sweep.sweep.spec import SweepSpecError, load_spec


def _rule(maximize=True, best=100.0):
    trial = optuna.create_study(direction="maximize" if maximize else "minimize").ask()
    return EarlyStop(trial=trial, metric="mfu", maximize=maximize, best=(0, best), min_steps=3, margin=0.1)


@pytest.mark.parametrize(
    "values, maximize, stops",
    [
        ([80, 81], True, False),  # too few steps, however slow
        ([80, 81, 82], True, True),  # every step more than 10% below the best's 100
        ([50, 50, 95], True, False),  # two noisy slow steps, one step near the best: goes on
        ([89, 89.9, 89.5], True, True),
        ([91, 85, 80], True, False),  # its best step is within the margin
        ([120, 115, 112], False, True),  # minimize: every step more than 10% above the best's 100
        ([120, 115, 109], False, False),
    ],
)
def test_the_rule_needs_every_step_clearly_worse(values, maximize, stops):
    reason = _rule(maximize).verdict(values)
    assert bool(reason) == stops
    if stops:
        assert "sweep.early_stop" in reason and "best trial #0" in reason


def test_no_best_yet_never_stops():
    rule = _rule()
    rule.best = None
    assert rule.verdict([1.0, 1.0, 1.0, 1.0]) is None


def test_each_measured_step_is_reported_as_the_running_median(tmp_path):
    rule = _rule()
    lines = [{"measured_step": i + 1, "mfu": v} for i, v in enumerate([95.0, 105.0, 99.0])]
    (tmp_path / PROGRESS_FILE).write_text("".join(json.dumps(line) + "\n" for line in lines) + '{"measured')
    assert len(read_progress(tmp_path)) == 3  # the half-written line is left for the next read
    assert rule(tmp_path) is None
    assert rule.trial.study.trials[0].intermediate_values == {1: 95.0, 2: 100.0, 3: 99.0}


@pytest.mark.parametrize(
    "node, knob",
    [
        ({"early_stop": {"min_steps": 1}}, "sweep.early_stop.min_steps=1"),
        ({"early_stop": {"margin": 0.0}}, "sweep.early_stop.margin=0.0"),
    ],
)
def test_bad_settings_name_the_knob(node, knob):
    with pytest.raises(SweepSpecError, match=knob.replace(".", r"\.")):
        load_spec(node)


SPACE = """defaults:
  - sweep_schema
  - _self_
  - override /hydra/sweeper@_global_.hydra.sweeper: moe_vlm_sweep
n_trials: 2
sampler: random
objective: {metric: effective_tokens_per_s_per_gpu, direction: maximize}
fixed: {model: tiny, train.warmup_steps: 1, train.steps: 40, train.profile_steps: 0}
allow_recipe_changes: [batch.gbs]
first_trials:
  - {batch.mbs: 8, batch.gbs: 8}
  - {batch.mbs: 1, batch.gbs: 1}
params:
  batch.mbs: [1, 8]
  batch.gbs: [1, 8]
"""


@pytest.mark.slow
def test_a_clearly_slower_trial_is_stopped_and_told_as_pruned(tmp_path):
    """MBS 1 runs the tiny model at well under half MBS 8's tokens/s on the CPU: it stops after a few of its
    40 measured steps, PRUNED in Optuna with its intermediate values, the reason in the study and in MLflow."""
    conf = private_conf(tmp_path, {"early": SPACE})
    out = cli(["run", "-m", "sweep=early"], cwd=tmp_path, conf=conf).stdout
    study = only_study(tmp_path)
    first, second = study.get_trials()
    assert first.state == TrialState.COMPLETE, out
    assert second.state == TrialState.PRUNED and second.user_attrs["failure_class"] == "pruned", out
    assert "stopped early after" in second.user_attrs["reason"]
    assert 3 <= len(second.intermediate_values) < 40
    progress = read_progress(tmp_path / second.user_attrs["run_dir"])
    assert 3 <= len(progress) < 40
    run = children_by_trial(mlflow_runs(tmp_path))[second.number]
    assert run.data.tags["moe_vlm_sweep.failure_class"] == "pruned"
    assert "stopped early after" in run.data.tags["moe_vlm_sweep.reason"]
