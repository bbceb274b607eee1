"""Config roots beyond the package: a team's own folder (``--config-dir`` / ``hydra.searchpath``) and the outputs
folder's exported experiments, for ``check``/``run`` (compose) and ``run -m`` (Hydra's app) alike."""

from __future__ import annotations

from pathlib import Path

import pytest

from moe_vlm_sweep import cli
from moe_vlm_sweep.config.compose import (
    CompositionError,
    add_searchpath,
    compose_run_config,
    config_dir_overrides,
    exports_dir,
    with_searchpath,
)

TEAM_MODEL = "defaults:\n  - tiny\n  - _self_\nname: team_moe\ntext_tokens: 97\n"


def _team_dir(tmp_path: Path) -> Path:
    team = tmp_path / "team_conf"
    (team / "model").mkdir(parents=True)
    (team / "model" / "team_moe.yaml").write_text(TEAM_MODEL)
    return team


def test_a_team_model_composes_from_its_own_folder(tmp_path):
    team = _team_dir(tmp_path)
    with pytest.raises(CompositionError, match="team_moe"):
        compose_run_config(["model=team_moe"])
    for args in (["--config-dir", str(team)], [f"--config-dir={team}"], [f"hydra.searchpath=[file://{team}]"]):
        cfg = compose_run_config(config_dir_overrides([*args, "model=team_moe"]))
        assert (cfg.model.name, cfg.model.text_tokens) == ("team_moe", 97)


def test_check_takes_a_config_dir_and_records_it_for_the_rerun(tmp_path, capsys):
    team = _team_dir(tmp_path)
    assert cli.main(["check", "--config-dir", str(team), "model=team_moe"]) == 0
    assert "valid" in capsys.readouterr().out
    assert config_dir_overrides(["--config-dir", str(team), "model=team_moe"]) == [
        "model=team_moe",
        f"hydra.searchpath=['file://{team}']",
    ]


def test_a_missing_config_dir_exits_2_naming_it(tmp_path, capsys):
    assert cli.main(["check", "--config-dir", str(tmp_path / "nope"), "model=tiny"]) == 2
    assert f"--config-dir '{tmp_path / 'nope'}': no such directory" in capsys.readouterr().err


def test_the_users_searchpath_entries_are_kept_and_extended():
    assert add_searchpath(["a=1", "hydra.searchpath=[file:///x]"], ["file:///y", "file:///x"]) == [
        "a=1",
        "hydra.searchpath=['file:///x','file:///y']",
    ]
    assert add_searchpath(["a=1"], []) == ["a=1"]


def test_exported_experiments_compose_from_the_outputs_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert with_searchpath(["-m", "batch.mbs=2"]) == ["-m", "batch.mbs=2"]  # nothing exported yet
    for outputs in ("outputs", str(tmp_path / "elsewhere")):
        experiment = exports_dir(outputs) / "experiment" / "mine_best.yaml"
        experiment.parent.mkdir(parents=True)
        experiment.write_text("# @package _global_\nbatch:\n  mbs: 3\n")
        given = [] if outputs == "outputs" else [f"outputs_dir={outputs}"]
        assert compose_run_config([*given, "+experiment=mine_best"]).batch.mbs == 3
    assert with_searchpath(["-m", "x=1", "--cfg", "job"]) == [
        "-m",
        "x=1",
        f"hydra.searchpath=['file://{tmp_path / 'outputs' / 'conf'}']",
        "--cfg",
        "job",
    ]


def test_a_multirun_searches_the_team_folder_too(tmp_path, capsys):
    """Hydra's app (what ``run -m`` starts) gets the same search path: ``--cfg job`` prints its job config."""
    from moe_vlm_sweep.sweep.app import multirun

    team = _team_dir(tmp_path)
    assert multirun(config_dir_overrides(["--config-dir", str(team), "model=team_moe", "--cfg", "job"])) == 0
    assert "name: team_moe" in capsys.readouterr().out
