"""Confirmation re-runs (`best --confirm N`): the top trials really re-train on the CPU, the one whose median
holds is exported, a candidate with a failed re-run cannot win, and mixed data realism is refused up front."""

from __future__ import annotations

import datetime
import json
import statistics
from pathlib import Path

import optuna
import pytest
import yaml
from conftest import why_failed
from omegaconf import OmegaConf
from sweep_testing import FAST_TRAIN, cli, exported_experiment, private_conf

from moe_vlm_sweep.config import compose
from moe_vlm_sweep.export.best import ExportError, confirmed_export, export, ranked
from moe_vlm_sweep.export.confirm import CV_TARGET, confirm
from moe_vlm_sweep.metrics.schema import read_metrics
from moe_vlm_sweep.sweep.budget import TimeBudget
from moe_vlm_sweep.sweep.trial import metric_value

NAME = "confirm_test"
METRIC = "effective_tokens_per_s_per_gpu"
BASE = ["model=tiny", "hardware=cpu", *FAST_TRAIN]


def _study(storage: str | None, trials: list[tuple[list[str], float, str]], *, metrics=(METRIC,)) -> optuna.Study:
    """A study of completed trials as the sweeper records them: exact overrides, data realism, a value."""
    study = optuna.create_study(study_name=NAME, storage=storage, direction="maximize")
    if metrics:
        study.set_user_attr("objective_metrics", list(metrics))
    for overrides, value, realism in trials:
        study.add_trial(
            optuna.trial.create_trial(value=value, user_attrs={"overrides": overrides, "data_realism": realism})
        )
    return study


def _failed_repeats(cwd: Path, repeats: list[dict]) -> str:
    """Why a candidate's re-runs failed, for an assertion message: each one's status and its run's account."""
    return "\n".join(
        f"{r['status']}: {why_failed(cwd / r['run_dir'] if r['run_dir'] else None)}"
        for r in repeats
        if r["status"] != "ok"
    )


def test_mixed_realism_is_refused_before_anything_runs(tmp_path):
    study = _study(None, [(BASE, 1.0, "synthetic_images"), ([*BASE, "data=mock_text"], 2.0, "mock_text")])
    with pytest.raises(ExportError, match="mixes data realism"):
        confirm(study, sweep_dir=tmp_path, top_k=2, repeats=2)
    assert not (tmp_path / "confirm").exists()


def test_a_study_without_its_objective_cannot_be_confirmed(tmp_path):
    study = _study(None, [(BASE, 1.0, "synthetic_images")], metrics=())
    with pytest.raises(ExportError, match="no objective_metrics"):
        confirm(study, sweep_dir=tmp_path, top_k=1, repeats=2)


def test_export_puts_the_confirmed_trial_first(tmp_path):
    study = _study(None, [([*BASE, f"batch.mbs={m}"], float(m), "synthetic_images") for m in (1, 2, 4)])
    third = ranked(study)[2]
    exported = export(study, sweep_dir=tmp_path / "s", conf_dir=tmp_path, top_k=2, confirmed=third)
    assert [e.trial.number for e in exported] == [third.number, ranked(study)[0].number]
    assert exported[0].experiment == f"{NAME}_best" and exported[0].overrides == third.user_attrs["overrides"]
    assert yaml.safe_load((tmp_path / "s" / "best" / "overrides.yaml").read_text()) == exported[0].overrides
    assert [e["confirmed"] for e in yaml.safe_load((tmp_path / "s" / "best" / "top.yaml").read_text())] == [True, False]


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(lambda text: text[: len(text) // 2] + "\n  - [unclosed", id="truncated"),
        pytest.param(lambda text: "trial: 2\n", id="not_a_list"),
        pytest.param(lambda text: "\udcff".encode("utf-8", "surrogateescape").decode("latin-1"), id="binary"),
    ],
)
def test_an_unreadable_top_yaml_is_not_taken_for_no_confirmed_export(tmp_path, damage):
    """A best/top.yaml that names a confirmed best is what keeps an unconfirmed export from replacing it, so one
    that cannot be read refuses the export, naming the file, instead of reading as "nothing confirmed"."""
    study = _study(None, [([*BASE, f"batch.mbs={m}"], float(m), "synthetic_images") for m in (1, 2)])
    confirmed = ranked(study)[1]
    export(study, sweep_dir=tmp_path / "s", conf_dir=tmp_path, top_k=2, confirmed=confirmed)
    top = tmp_path / "s" / "best" / "top.yaml"
    assert confirmed_export(tmp_path / "s") == confirmed.number
    top.write_bytes(damage(top.read_text()).encode("latin-1"))
    with pytest.raises(ExportError, match=r"top\.yaml cannot be read .*confirmed best.*nothing is exported"):
        confirmed_export(tmp_path / "s")
    top.unlink()
    assert confirmed_export(tmp_path / "s") is None  # no earlier export: nothing to keep


@pytest.mark.slow
def test_confirm_reruns_the_top_trials_and_exports_the_median_winner(tmp_path, monkeypatch):
    """Two healthy tiny configs and one whose 2 s timeout is shorter than worker start-up: it ranks first by its
    (recorded) value, so only the re-runs can keep it from winning."""
    conf = private_conf(tmp_path)
    sweep_dir = tmp_path / "outputs" / "sweeps" / NAME
    sweep_dir.mkdir(parents=True)
    _study(
        f"sqlite:///{sweep_dir / 'optuna.db'}",
        [
            ([*BASE, "batch.mbs=1"], 100.0, "synthetic_images"),
            ([*BASE, "batch.mbs=2"], 50.0, "synthetic_images"),
            ([*BASE, "train.timeout_s=2"], 1000.0, "synthetic_images"),
        ],
    )
    out = cli(["best", NAME, "--confirm", "2", "--top", "3"], cwd=tmp_path, conf=conf).stdout

    record = json.loads((sweep_dir / "best" / "confirm.json").read_text())
    assert record["repeats"] == 2 and record["cv_target"] == CV_TARGET == 0.02
    by_trial = {c["trial"]: c for c in record["candidates"]}
    assert sorted(by_trial) == [0, 1, 2] and all(len(c["repeats"]) == 2 for c in by_trial.values())
    healthy = [by_trial[0], by_trial[1]]
    for candidate in healthy:
        assert candidate["ok"], _failed_repeats(tmp_path, candidate["repeats"])
        for repeat in candidate["repeats"]:
            run_dir = tmp_path / repeat["run_dir"]
            assert run_dir.parent == sweep_dir / "confirm" / "runs" and repeat["status"] == "ok"
            metrics = read_metrics(run_dir)
            assert repeat["values"] == [metric_value(metrics, METRIC)] and repeat["values"][0] > 0
            assert repeat["step_time_median_s"] == metrics.step_time_s.median > 0
            assert repeat["step_time_cv"] == metrics.step_time_s.cv >= 0
        values = [r["values"][0] for r in candidate["repeats"]]
        times = [r["step_time_median_s"] for r in candidate["repeats"]]
        cv = statistics.pstdev(times) / statistics.fmean(times)
        assert candidate["median_values"] == [statistics.median(values)]
        assert candidate["step_time_cv_across_repeats"] == pytest.approx(cv)
        assert candidate["meets_cv_target"] == (cv <= CV_TARGET)
        assert candidate["original_values"] == [{0: 100.0, 1: 50.0}[candidate["trial"]]]

    failing = by_trial[2]
    assert failing["rank"] == 1 and not failing["ok"] and not failing["holds"] and failing["median_values"] is None
    assert [r["status"] for r in failing["repeats"]] == ["timeout", "timeout"]

    winner = max(healthy, key=lambda c: c["median_values"][0])
    assert record["winner"] == winner["trial"] and winner["holds"]
    assert [c["trial"] for c in record["candidates"] if c["holds"]] == [winner["trial"]]
    assert "<- holds" in out and f"best: trial #{winner['trial']} " in out

    best = sweep_dir / "best"
    assert yaml.safe_load((best / "overrides.yaml").read_text()) == winner["overrides"]
    assert yaml.safe_load((best / "top.yaml").read_text())[0]["trial"] == winner["trial"]
    monkeypatch.setattr(compose, "CONF_DIR", conf)
    monkeypatch.chdir(tmp_path)
    exported = OmegaConf.to_yaml(compose.compose_config([f"+experiment={NAME}_best"]))
    assert exported == OmegaConf.to_yaml(compose.compose_config(winner["overrides"]))
    assert exported_experiment(tmp_path, f"{NAME}_best").read_text().count("confirm.json") == 1


def _launched_trial_study(wall_s: float, storage: str | None = None) -> optuna.Study:
    """One completed trial as a sweep records a launched one: its run directory and how long it took."""
    study = _study(storage, [])
    trial = optuna.trial.create_trial(
        value=1.0, user_attrs={"overrides": BASE, "data_realism": "synthetic_images", "run_dir": "outputs/runs/trial"}
    )
    trial.datetime_start = trial.datetime_complete - datetime.timedelta(seconds=wall_s)
    study.add_trial(trial)
    return study


def test_an_interrupted_confirmation_goes_on_from_its_finished_reruns(tmp_path):
    """An allocation ends between re-runs: the budget starts none that the trial's own time says
    would overrun it, nothing is written or exported, and the next confirmation reuses what finished."""
    study, lines = _launched_trial_study(wall_s=60.0), []
    stopped = confirm(study, sweep_dir=tmp_path, top_k=1, repeats=2, budget=TimeBudget(30.0))
    assert (
        not stopped.complete
        and stopped.winner is None
        and "re-run 1 of trial #0 would need about 60 s" in stopped.stopped
    )
    assert not (tmp_path / "confirm").exists() and not (tmp_path / "best").exists()

    first = confirm(study, sweep_dir=tmp_path, top_k=1, repeats=1).candidates[0].repeats[0]
    assert first.ok, why_failed(Path(first.run_dir) if first.run_dir else None)
    partial = confirm(study, sweep_dir=tmp_path, top_k=1, repeats=2, budget=TimeBudget(30.0), progress=lines.append)
    assert not partial.complete and [r.run_dir for r in partial.candidates[0].repeats] == [first.run_dir]
    assert lines == [f"[confirm 1/2] trial #0 -> {first.values[0]:.4g} (finished by an earlier confirmation)"]

    done = confirm(study, sweep_dir=tmp_path, top_k=1, repeats=2)
    repeats = done.candidates[0].repeats
    assert done.complete and done.winner is done.candidates[0] and all(r.ok for r in repeats), [
        why_failed(Path(r.run_dir) if r.run_dir else None) for r in repeats if not r.ok
    ]
    assert repeats[0].run_dir == first.run_dir != repeats[1].run_dir and repeats[0].values == first.values
    record = json.loads((tmp_path / "best" / "confirm.json").read_text())
    assert [r["run_dir"] for r in record["candidates"][0]["repeats"]] == [r.run_dir for r in repeats]

    failed, other_plan = (Path(r.run_dir) for r in repeats)
    result = json.loads((failed / "result.json").read_text())
    (failed / "result.json").write_text(json.dumps({**result, "status": "oom"}))  # e.g. a run on a smaller GPU
    plan = json.loads((other_plan / "plan.json").read_text())
    (other_plan / "plan.json").write_text(json.dumps({**plan, "seq_length": plan["seq_length"] + 1}))
    again = confirm(study, sweep_dir=tmp_path, top_k=1, repeats=2, budget=TimeBudget(30.0))
    assert not again.complete and again.candidates[0].repeats == []  # neither is reused; none fits the budget


def test_best_confirm_past_its_time_budget_exits_3_and_exports_nothing(tmp_path):
    conf = private_conf(tmp_path)
    sweep_dir = tmp_path / "outputs" / "sweeps" / NAME
    sweep_dir.mkdir(parents=True)
    _launched_trial_study(wall_s=60.0, storage=f"sqlite:///{sweep_dir / 'optuna.db'}")
    proc = cli(["best", NAME, "--confirm", "2", "--time-budget-s", "30"], cwd=tmp_path, conf=conf, check=False)
    assert proc.returncode == 3, proc.stderr
    assert "confirmation: stopped: re-run 1 of trial #0 would need about 60 s" in proc.stdout
    assert "--time-budget-s are left; the same command resumes" in proc.stdout
    assert not (sweep_dir / "best").exists() and not exported_experiment(tmp_path, f"{NAME}_best").exists()


@pytest.mark.parametrize("args", [["--time-budget-s", "30"], ["--confirm", "2", "--time-budget-s", "0"]])
def test_a_time_budget_without_confirmation_or_time_is_refused(tmp_path, args):
    proc = cli(["best", NAME, *args], cwd=tmp_path, conf=private_conf(tmp_path), check=False)
    assert proc.returncode == 2 and "--time-budget-s" in proc.stderr and "needs --confirm N" in proc.stderr
