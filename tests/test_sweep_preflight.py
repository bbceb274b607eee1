"""A space is checked before any trial: each value composes, each param's fields are known, the objective is a
field of metrics.json. Each bad space exits 2 with the knob named, no traceback, and no study is created."""

from __future__ import annotations

import re

import pytest
from sweep_testing import SPACE_HEADER, TINY_FIXED, cli, private_conf

from moe_vlm_sweep.cli import main
from moe_vlm_sweep.sweep.preflight import check_objective, metric_fields
from moe_vlm_sweep.sweep.spec import ObjectiveConf, SweepSpecError


@pytest.mark.parametrize(
    "body,message",
    [
        (
            TINY_FIXED + "params:\n  batch.mbss: [1, 2]\n",
            "sweep.params.batch.mbss=1 does not compose: Could not override 'batch.mbss'. Key 'mbss' not in 'BatchConf'",
        ),
        (
            TINY_FIXED + "params:\n  batch.mbs: [1, two]\n",
            "sweep.params.batch.mbs=two does not compose: Error merging override batch.mbs=two Value 'two' of type "
            "'str' could not be converted to Integer",
        ),
        (
            TINY_FIXED + "params:\n  batch.mbs: {type: categorical, choises: [1, 2]}\n",
            "sweep.params.batch.mbs: unknown field(s) choises for type categorical",
        ),
        (
            TINY_FIXED + "params:\n  dispatcher.token_dispatcher: [alltoall, alltoal]\n",
            "sweep.params.dispatcher.token_dispatcher=alltoal does not compose: "
            "dispatcher.token_dispatcher='alltoal' must be one of allgather, alltoall, flex",
        ),
        (
            TINY_FIXED + "params:\n  recompute: [none, selectiv]\n",
            "sweep.params.recompute=selectiv does not compose: In 'config': Could not find 'recompute/selectiv'",
        ),
        (
            "fixed: {model: tiny, train.stepz: 2}\nparams:\n  batch.mbs: [1, 2]\n",
            "sweep.fixed with the command line's overrides does not compose: Could not override 'train.stepz'",
        ),
        (
            TINY_FIXED
            + "params:\n  batch.mbs: {type: int, low: 1, high: 2}\n  train.lr: {type: float, low: 0.001, high: 0.01}"
            "\nallow_recipe_changes: [train.lr]\nfirst_trials:\n  - {batch.mbs: 1}\nobjective: {metric: tokens_per_sec}\n",
            "sweep.objective.metric='tokens_per_sec' is not a numeric field of metrics.json",
        ),
    ],
)
def test_a_bad_space_exits_2_before_any_trial(tmp_path, body, message):
    conf = private_conf(tmp_path, {"bad": SPACE_HEADER + "n_trials: 2\n" + body})
    proc = cli(["run", "-m", "sweep=bad"], cwd=tmp_path, conf=conf, check=False, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"error: {message}" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    assert not (tmp_path / "outputs" / "sweeps").exists() and not (tmp_path / "outputs" / "runs").exists()


def test_metric_fields_follow_the_metrics_dataclass():
    fields = set(metric_fields())
    assert {
        "mfu",
        "effective_tokens_per_s_per_gpu",
        "step_time_s.median",
        "peak_memory_gib",
        "flops_per_step.KEY.model",
        "predicted_peak_memory_gib",
    } <= fields
    assert "step_time_s.steps" not in fields and "hardware" not in fields  # a list, a string
    check_objective(ObjectiveConf(metric="step_time_s.median", direction="minimize", peak_memory=True))
    check_objective(ObjectiveConf(metric="flops_per_step.decoder.model"))
    with pytest.raises(SweepSpecError, match=re.escape("sweep.objective.metric='step_time_s.medain'")):
        check_objective(ObjectiveConf(metric="step_time_s.medain"))


@pytest.mark.parametrize("command", ["check", "run", "best", "report", "ui", "verify"])
def test_every_command_has_help(command, capsys):
    with pytest.raises(SystemExit) as exited:  # argparse's --help exits 0 itself
        code = main([command, "--help"])
        raise SystemExit(code)
    assert exited.value.code == 0
    out = capsys.readouterr().out
    assert f"moe-vlm-sweep {command}" in out
    if command == "verify":  # a first sentence over two docstring lines reads whole
        assert "does the candidate train the same model as its reference?" in " ".join(out.split())
