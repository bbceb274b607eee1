"""The typed contracts between stages: plan.json, metrics.json, failure.json and result.json are read through
their dataclasses (one codec), their status is one enum, and a config becomes a plan on one path."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import os
from pathlib import Path

import pytest
from contract_samples import sample_metrics

from moe_vlm_sweep.config import schema
from moe_vlm_sweep.config.codec import DecodeError, from_dict
from moe_vlm_sweep.config.compose import compose_config
from moe_vlm_sweep.config.schema import ConfigFieldError, RunConfig
from moe_vlm_sweep.launch.local import classify
from moe_vlm_sweep.launch.result import RunResult
from moe_vlm_sweep.launch.status import RunStatus
from moe_vlm_sweep.launch.summary import summarize
from moe_vlm_sweep.metrics.schema import (
    Failure,
    Metrics,
    native_crash_file,
    read_failure,
    read_metrics,
    write_failure,
    write_metrics,
)
from moe_vlm_sweep.plan.compose import INVALID_ERRORS, compose_plan, plan_of
from moe_vlm_sweep.plan.plan import RunPlan
from moe_vlm_sweep.sweep.trial import Outcome, metric_value, plan_trial

ROOT = Path(__file__).resolve().parents[1]
TINY = ["model=tiny", "train.steps=2", "train.warmup_steps=1"]


def _edit_metrics(run_dir: Path, edit) -> None:
    write_metrics(run_dir, sample_metrics())
    data = json.loads((run_dir / "metrics.json").read_text())
    edit(data)
    (run_dir / "metrics.json").write_text(json.dumps(data))


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d.update(schema_version=2), "schema_version 2 is not 1"),
        (lambda d: d.pop("mfu"), "missing required field(s): mfu"),
        (lambda d: d["step_time_s"].pop("median"), "missing required field(s): step_time_s.median"),
        (lambda d: d.update(mfu_percent=1.0), "unknown key(s) for Metrics: mfu_percent"),
        (lambda d: d["step_time_s"].update(median="fast"), "step_time_s.median='fast' must be int or float, not str"),
        (lambda d: d["flops_per_step"]["total"].pop("model"), "flops_per_step.total.model"),
        (lambda d: d.update(status="great"), "status='great' must be one of ok, oom"),
    ],
    ids=["version", "missing", "missing-nested", "unknown", "wrong-type", "missing-in-dict", "status"],
)
def test_a_metrics_file_that_does_not_fit_is_a_clear_error(tmp_path, edit, message):
    _edit_metrics(tmp_path, edit)
    with pytest.raises(DecodeError) as raised:
        read_metrics(tmp_path)
    assert message in str(raised.value) and str(tmp_path / "metrics.json") in str(raised.value)


def test_the_reader_gives_typed_parts(tmp_path):
    write_metrics(tmp_path, sample_metrics())
    metrics = read_metrics(tmp_path)
    assert metrics == sample_metrics() and metrics.status is RunStatus.OK
    assert metrics.step_time_s.median == 0.1 and metrics.flops_per_step["total"].model == 2.0
    assert metric_value(metrics, "step_time_s.median") == 0.1
    assert metric_value(metrics, "flops_per_step.total.hardware") == 3.0
    assert metric_value(metrics, "step_time_s.fastest") is None


def test_the_launcher_reads_the_worker_files_through_the_types(tmp_path):
    """A metrics.json the reader refuses is no result: the run is a crash that says why, not an ``ok`` whose
    consumers fail later on a missing key."""
    _edit_metrics(tmp_path, lambda d: d.update(schema_version=7))
    result = classify(tmp_path, 0, False, 60.0)
    assert result.status == RunStatus.CRASH and result.metrics is None
    assert "schema_version 7 is not 1" in result.reason

    write_metrics(tmp_path, sample_metrics())
    result = classify(tmp_path, 0, False, 60.0)
    assert result.ok and isinstance(result.metrics, Metrics) and result.metrics.mfu == 0.01


def test_a_failure_file_of_an_unknown_class_is_a_crash_that_says_so(tmp_path):
    write_failure(tmp_path, Failure(failure_class="oom", exception_type="E", message="m", rank=0, step=1, traceback=""))
    assert classify(tmp_path, 1, False, 60.0).status == RunStatus.OOM
    data = json.loads((tmp_path / "failure.json").read_text())
    (tmp_path / "failure.json").write_text(json.dumps({**data, "failure_class": "segfault"}))
    with pytest.raises(DecodeError, match="failure_class='segfault'"):
        read_failure(tmp_path)
    result = classify(tmp_path, 1, False, 60.0)
    assert result.status == RunStatus.CRASH and "segfault" in result.reason


def test_the_first_failure_is_the_cause_whether_native_or_python(tmp_path):
    """A rank that dies in native code writes no failure.json; its peer, losing the connection, does. The earlier
    of the two is the run's cause: a peer's broken pipe after a crash is not, an abort after a peer's OOM is not."""
    write_failure(
        tmp_path,
        Failure(
            failure_class="crash",
            exception_type="RuntimeError",
            message="Connection reset by peer",
            rank=1,
            step=4,
            traceback="",
        ),
    )
    crash = native_crash_file(tmp_path, 0)
    crash.write_text('Fatal Python error: Aborted\n\nThread 0x1 (most recent call first):\n  File "loop.py"\n')
    failed_at = (tmp_path / "failure.json").stat().st_mtime_ns
    os.utime(crash, ns=(failed_at - 1, failed_at - 1))
    result = classify(tmp_path, 1, False, 60.0)
    assert result.status == RunStatus.CRASH and result.failure is not None and result.failure.rank == 1
    assert result.reason == (
        "rank 0: Fatal Python error: Aborted (a native crash; every thread's stack is in native_crash.rank0.txt)"
    )

    for after in (failed_at + 1, failed_at):  # a tie too: a peer's abort follows a failure within the clock's tick
        os.utime(crash, ns=(after, after))
        assert classify(tmp_path, 1, False, 60.0).reason == "RuntimeError: Connection reset by peer"
    crash.write_text("")  # a rank that ended normally leaves no stacks: an empty file is no crash
    assert classify(tmp_path, 1, False, 60.0).reason == "RuntimeError: Connection reset by peer"


def test_a_timeout_names_the_rank_that_died_in_native_code_while_its_peers_hung(tmp_path):
    native_crash_file(tmp_path, 2).write_text("Fatal Python error: Segmentation fault\n")
    native_crash_file(tmp_path, 1).write_text("")
    (tmp_path / "native_crash.rank1.txt.orig").write_text("Fatal Python error: Aborted\n")  # a copy: no rank's
    (tmp_path / "native_crash.rankX.txt").write_text("Fatal Python error: Aborted\n")
    result = classify(tmp_path, None, True, 60.0)
    assert result.status == RunStatus.TIMEOUT
    assert result.reason == (
        "no result within train.timeout_s=60 s; rank 2: Fatal Python error: Segmentation fault "
        "(a native crash; every thread's stack is in native_crash.rank2.txt)"
    )
    native_crash_file(tmp_path, 2).unlink()
    assert classify(tmp_path, None, True, 60.0).reason == "no result within train.timeout_s=60 s"


def test_result_json_round_trips_typed_and_reads_earlier_empty_parts(tmp_path):
    RunResult(status="ok", run_dir=str(tmp_path), metrics=sample_metrics()).write(tmp_path)
    result = RunResult.read(tmp_path)
    assert result.metrics == sample_metrics() and result.status is RunStatus.OK
    assert "MFU 1.00%" in summarize(result)
    on_disk = json.loads((tmp_path / "result.json").read_text())
    assert on_disk["status"] == "ok" and on_disk["metrics"]["step_time_s"]["median"] == 0.1

    (tmp_path / "result.json").write_text(json.dumps({**on_disk, "status": "crash", "metrics": {}, "failure": {}}))
    old = RunResult.read(tmp_path)
    assert old.status == RunStatus.CRASH and old.metrics is None and old.failure is None


def test_a_status_outside_the_enum_is_refused(tmp_path):
    with pytest.raises(ValueError, match="status='segfault'"):
        RunResult(status="segfault")
    with pytest.raises(ValueError, match="'duplicate'"):
        RunResult(status="duplicate")  # a sweep's status, never a run's
    with pytest.raises(ValueError, match="needs the run's metrics"):
        RunResult(status="ok")
    with pytest.raises(ValueError, match="'segfault'"):
        Outcome(state="fail", failure_class="segfault")
    (tmp_path / "result.json").write_text(json.dumps({"status": "segfault"}))
    with pytest.raises(DecodeError, match="status='segfault'"):
        RunResult.read(tmp_path)


def test_statuses_are_the_strings_the_stores_hold():
    """Optuna user attrs, MLflow tags and JSON files written before the enum still compare equal."""
    assert RunStatus.OOM == "oom" and RunStatus("interrupted") is RunStatus.INTERRUPTED
    assert json.dumps({"s": RunStatus.NAN}) == '{"s": "nan"}' and f"{RunStatus.CRASH}" == "crash"
    assert Outcome(state="fail", failure_class="timeout").failure_class is RunStatus.TIMEOUT


def test_tracking_reads_result_metrics_typed(tmp_path):
    from moe_vlm_sweep.tracking.mlflow_sink import _result_metrics

    RunResult(status="ok", run_dir=str(tmp_path), metrics=sample_metrics()).write(tmp_path)
    assert _result_metrics(str(tmp_path)) == sample_metrics()
    (tmp_path / "result.json").write_text(json.dumps({"status": "ok", "metrics": {"mfu": 0.5}}))
    assert _result_metrics(str(tmp_path)) is None  # not a metrics.json: the trial is closed as unreadable


def test_plan_json_round_trips_through_the_codec(tmp_path):
    plan = compose_plan(TINY)[0]
    plan.write(tmp_path / "plan.json")
    assert RunPlan.read(tmp_path / "plan.json") == plan
    data = plan.to_dict()
    with pytest.raises(DecodeError, match="unknown key"):
        RunPlan.from_dict({**data, "layoutt": data["layout"]})
    with pytest.raises(DecodeError, match=r"layout\.tp"):
        RunPlan.from_dict({**data, "layout": {k: v for k, v in data["layout"].items() if k != "tp"}})
    with pytest.raises(ConfigFieldError, match=r"unknown key\(s\) for BatchConf: batch\.bogus"):
        _ = RunPlan.from_dict({**data, "config": {**data["config"], "batch": {"bogus": 1}}}).run_config


@dataclasses.dataclass(kw_only=True)
class _Inner:
    n: int


@dataclasses.dataclass(kw_only=True)
class _Outer:
    inner: _Inner
    many: list[_Inner] = dataclasses.field(default_factory=list)
    by_name: dict[str, _Inner | None] = dataclasses.field(default_factory=dict)


def test_the_codec_refuses_what_a_dataclass_cannot_hold():
    data = {"inner": {"n": 1}, "many": [{"n": 2}], "by_name": {"a": {"n": 3}, "b": None}}
    decoded = from_dict(_Outer, data)
    assert decoded == _Outer(inner=_Inner(n=1), many=[_Inner(n=2)], by_name={"a": _Inner(n=3), "b": None})
    with pytest.raises(DecodeError, match=r"many\[0\]\.n=True must be int, not bool"):
        from_dict(_Outer, {"inner": {"n": 1}, "many": [{"n": True}]})
    with pytest.raises(DecodeError, match="inner=3 must be Mapping, not int"):
        from_dict(_Outer, {"inner": 3})
    with pytest.raises(DecodeError, match=r"by_name\.a\.n='3' must be int"):
        from_dict(_Outer, {"inner": {"n": 1}, "by_name": {"a": {"n": "3"}}})


def test_run_sweep_trial_and_confirmation_plan_the_same_way():
    """``run``/``check``, a sweep's trial, a confirmation re-run and a verification compose -> plan on one path."""
    overrides = [*TINY, "batch.mbs=2", "batch.gbs=4"]
    plan, resolved = compose_plan(overrides)
    assert plan_of(compose_config(overrides), overrides) == (plan, resolved)
    swept = [*overrides, "sweep=cpu_demo", "sweep.n_trials=3"]  # the sweep's own nodes never reach the plan
    assert plan_trial(compose_config(swept), swept) == (plan, resolved)
    from moe_vlm_sweep.export import confirm, verify

    assert inspect.signature(confirm.confirm).parameters["plan"].default is compose_plan
    assert inspect.signature(verify.verify).parameters["plan"].default is compose_plan
    with pytest.raises(INVALID_ERRORS):
        compose_plan([*TINY, "batch.mbs=3", "batch.gbs=4"])


def _sources() -> list[Path]:
    return [
        *ROOT.glob("moe_vlm_sweep/**/*.py"),
        *ROOT.glob("hydra_plugins/**/*.py"),
        *ROOT.glob("launchers/*.py"),
        *ROOT.glob("benchmarks/*.py"),
    ]


def test_no_consumer_reads_metrics_by_string_keys_or_writes_a_status_literal():
    """``metrics["mfu"]``, ``metrics.get("mfu")`` or ``status="oom"`` would bypass the types: every consumer goes through the fields and
    ``RunStatus``."""
    statuses = {s.value for s in RunStatus}
    found = []
    for path in _sources():
        package = not path.is_relative_to(ROOT / "benchmarks")  # the scripts' own tables have their own words
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
                target = node.value
                name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")
                if name in ("metrics", "failure") and isinstance(node.slice.value, str):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} {name}[{node.slice.value!r}]")
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
                target = node.func.value
                name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")
                if name in ("metrics", "failure"):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} {name}.get(...)")
            if (
                package
                and isinstance(node, ast.keyword)
                and node.arg in ("status", "failure_class")
                and isinstance(node.value, ast.Constant)
                and node.value.value in statuses
            ):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.arg}={node.value.value!r}")
    assert not found, found


def test_run_config_decodes_with_its_own_error():
    """The worker classifies a config it cannot rebuild as ``invalid`` (ConfigFieldError), not as a crash."""
    with pytest.raises(ConfigFieldError, match=r"unknown key\(s\) for RunConfig: nope"):
        schema.from_dict(RunConfig, {"nope": 1})
    with pytest.raises(ConfigFieldError, match=r"batch\.mbs='2' must be int"):
        schema.from_dict(RunConfig, {"batch": {"mbs": "2"}})
