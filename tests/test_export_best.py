"""Export: the experiment config is exactly the trial's overrides; mixed data realism is refused."""

from __future__ import annotations

import optuna
import pytest
from omegaconf import OmegaConf
from sweep_testing import private_conf

from moe_vlm_sweep.config import compose
from moe_vlm_sweep.export.best import ExportError, experiment_yaml, export, ranked, realism_of

OVERRIDES = [
    "model=tiny",
    "recompute=selective",
    "recompute.modules=[core_attn,layernorm]",
    "batch.mbs=1",
    "train.lr=0.0003",
    "vision=frozen",
    "data.fixed_batch=true",
    "train.precision=fp32",
]


def test_experiment_config_reproduces_the_overrides(tmp_path, monkeypatch):
    conf = private_conf(tmp_path)
    (conf / "experiment").mkdir()
    (conf / "experiment" / "t.yaml").write_text(experiment_yaml(OVERRIDES, conf))
    monkeypatch.setattr(compose, "CONF_DIR", conf)
    direct = OmegaConf.to_yaml(compose.compose_config(OVERRIDES))
    assert OmegaConf.to_yaml(compose.compose_config(["+experiment=t"])) == direct


def test_sweep_overrides_cannot_be_exported(tmp_path):
    with pytest.raises(ExportError, match="cannot go into an experiment config"):
        experiment_yaml(["batch.mbs=1,2"], tmp_path)


def _study(realisms, directions=("maximize",), values=None):
    study = optuna.create_study(directions=list(directions))
    for i, realism in enumerate(realisms):
        trial = study.ask()
        trial.suggest_int("batch.mbs", 1, 8)
        trial.set_user_attr("overrides", [f"batch.mbs={trial.params['batch.mbs']}"])
        trial.set_user_attr("data_realism", realism)
        study.tell(trial, values[i] if values else [float(i)] * len(directions))
    return study


def test_mixed_realism_is_refused(tmp_path):
    with pytest.raises(ExportError, match=r"mixes data realism \(1 trial\(s\) mock_text, 1 trial\(s\) synthetic"):
        export(_study(["synthetic_images", "mock_text"]), sweep_dir=tmp_path, conf_dir=tmp_path, top_k=2)


def test_export_writes_top_k_best_first(tmp_path):
    exported = export(_study(["synthetic_images"] * 3), sweep_dir=tmp_path / "s", conf_dir=tmp_path, top_k=2)
    assert [e.trial.number for e in exported] == [2, 1]
    assert exported[0].experiment.endswith("_best")
    assert (tmp_path / "experiment" / f"{exported[0].experiment}.yaml").exists()
    assert (tmp_path / "s" / "best" / "command.sh").read_text().count("+experiment=") == 1
    assert realism_of([e.trial for e in exported]) == "synthetic_images"


def test_two_objectives_rank_the_pareto_front():
    """Trial #0 is dominated by #2 (no faster, no smaller): the front is #2 and #1, by the first objective."""
    values = [(0.0, 2.0), (1.0, 1.0), (2.0, 2.0)]
    study = _study(["synthetic_images"] * 3, directions=("maximize", "minimize"), values=values)
    assert [t.number for t in ranked(study)] == [2, 1]


def test_an_export_removes_the_runner_ups_it_no_longer_ranks(tmp_path):
    study = _study(["synthetic_images"] * 3)
    export(study, sweep_dir=tmp_path / "s", conf_dir=tmp_path, top_k=2)
    assert (tmp_path / "experiment" / f"{study.study_name}_t1.yaml").exists()
    trial = study.ask()
    trial.suggest_int("batch.mbs", 1, 8)
    trial.set_user_attr("overrides", [f"batch.mbs={trial.params['batch.mbs']}"])
    trial.set_user_attr("data_realism", "synthetic_images")
    study.tell(trial, 9.0)
    export(study, sweep_dir=tmp_path / "s", conf_dir=tmp_path, top_k=2)
    names = sorted(p.name for p in (tmp_path / "experiment").glob(f"{study.study_name}_*.yaml"))
    assert names == [f"{study.study_name}_best.yaml", f"{study.study_name}_t2.yaml"]
