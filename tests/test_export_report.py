"""The report's page and plots from a real Optuna study (its numbers here are the test's, not a measurement):
every plot is drawn and non-blank, the Pareto front appears with two objectives, failures are counted."""

from __future__ import annotations

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
