"""The report's page and plots from a real Optuna study (its numbers here are the test's, not a measurement):
every plot is drawn and non-blank, the Pareto front is drawn with two objectives and heads the top configs, a single
objective draws none, failures are counted."""

from __future__ import annotations

import re

import matplotlib.image
import optuna
from optuna.trial import TrialState

from moe_vlm_sweep.export.report import failure_counts, write_report


def test_a_two_objective_study_gets_its_pareto_front(tmp_path):
    study = optuna.create_study(directions=["maximize", "minimize"], sampler=optuna.samplers.RandomSampler(seed=0))
    study.set_user_attr("objective_metrics", ["mfu", "peak_memory_gib"])
    for i in range(10):
        trial = study.ask()
        mbs = trial.suggest_categorical("batch.mbs", [1, 2, 4])
        trial.suggest_categorical("vision", ["trainable", "frozen"])
        if i == 4:
            trial.set_user_attr("failure_class", "oom")
            study.tell(trial, state=TrialState.PRUNED)
            continue
        trial.set_user_attr("failure_class", "ok")
        study.tell(trial, [0.1 * mbs + 0.01 * i, 2.0 * mbs])
    page = write_report(study, tmp_path, top_k=3, links=["moe-vlm-sweep ui"]).read_text()
    for png in ("history.png", "importances.png", "pareto.png", "outcomes.png"):
        assert matplotlib.image.imread(tmp_path / png).std() > 0.05, f"{png} is blank"
    assert page.count("data:image/png;base64,") == 4
    assert "<th>mfu</th><th>peak_memory_gib</th>" in page and "no best trial was profiled" in page
    assert failure_counts(study) == {"ok": 9, "oom": 1}
    top = page[page.index("<h2>Top configs</h2>") : page.index("<h2>Outcomes</h2>")]
    listed = [int(n) for n in re.findall(r"<td>#(\d+)</td>", top)]
    front = {t.number for t in study.best_trials}
    assert len(listed) == 3 and set(listed[: len(front)]) <= front, (listed, front)  # the Pareto front first


def test_a_single_objective_study_gets_no_pareto_front(tmp_path):
    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.RandomSampler(seed=0))
    study.set_user_attr("objective_metrics", ["mfu"])
    for _ in range(4):
        trial = study.ask()
        trial.set_user_attr("failure_class", "ok")
        study.tell(trial, 0.1 * trial.suggest_categorical("batch.mbs", [1, 2, 4]))
    page = write_report(study, tmp_path).read_text()
    assert "Pareto" not in page and not (tmp_path / "pareto.png").exists()
    top = page[page.index("<h2>Top configs</h2>") : page.index("<h2>Outcomes</h2>")]
    assert re.findall(r"<td>#(\d+)</td>", top)[0] == str(study.best_trial.number)
