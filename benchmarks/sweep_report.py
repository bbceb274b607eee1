"""Commit a sweep's results: its Optuna trials (CSV), its MLflow runs (JSON) and a markdown table of the best.

For plots and a page to read, ``moe-vlm-sweep report`` (``moe_vlm_sweep/export/report.py``); this script writes
the plain files a results folder commits, and the confirmed winner against a baseline.

Reads the study and the MLflow store the sweep wrote under ``--outputs`` (as brought back from the GPU machine).
The table's numbers come from the trials' MLflow metrics (the trial's metrics.json, as logged), so the markdown
says what MLflow says. With ``--baseline FILE:NAME`` (a ``compare_configs.py`` JSON measured on the same machine as
``--confirm FILE``, a ``best/confirm.json``) or ``--baseline trial:N`` (a trial of the study, such as the first of
its ``first_trials``), it adds the confirmed winner's re-run median against that baseline.

    python benchmarks/sweep_report.py --outputs /tmp/out/outputs --out-dir benchmarks/results/h200_single_small \\
        --baseline benchmarks/results/h200_baseline_gbs32.json:baseline_fsdp_mbs8 --confirm .../best/confirm.json
"""

from __future__ import annotations

import argparse
import json
from datetime import UTC, datetime
from pathlib import Path

import optuna

from moe_vlm_sweep.export.report import failure_counts
from moe_vlm_sweep.sweep.study import open_storage
from moe_vlm_sweep.tracking.mlflow_sink import default_uri, export_study_runs

COLUMNS = ("rank", "trial", "mfu_%", "eff_tok/s/gpu", "step_ms", "cv_%", "mem_gib", "graphed", "recipe", "config")


def recipe_of(trial: optuna.trial.FrozenTrial) -> str:
    """The trial's recipe fingerprint (``config/recipe.py``); a trial recorded before fingerprints gets one
    computed from its overrides under today's config groups, marked ``*``."""
    if "recipe" in trial.user_attrs:
        return trial.user_attrs["recipe"]
    from moe_vlm_sweep.config.compose import compose_run_config
    from moe_vlm_sweep.config.recipe import fingerprint

    try:
        return fingerprint(compose_run_config(list(trial.user_attrs.get("overrides", [])))) + "*"
    except ValueError:
        return "?"


def _study(outputs: Path, name: str | None) -> optuna.Study:
    names = [p.name for p in sorted((outputs / "sweeps").iterdir()) if (p / "optuna.db").exists()]
    if name is None:
        if len(names) != 1:
            raise SystemExit(f"--study is required: {outputs / 'sweeps'} holds {names}")
        name = names[0]
    return optuna.load_study(
        study_name=name, storage=open_storage(f"sqlite:///{(outputs / 'sweeps' / name / 'optuna.db').resolve()}")
    )


def table(study: optuna.Study, runs: list[dict], top: int) -> str:
    children = {int(r["tags"]["moe_vlm_sweep.trial"]): r for r in runs if "moe_vlm_sweep.trial" in r["tags"]}
    done = [
        t for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)) if t.number in children
    ]
    sign = -1 if study.directions[0] == optuna.study.StudyDirection.MAXIMIZE else 1
    done.sort(key=lambda t: sign * t.values[0])
    lines = [" | ".join(COLUMNS), " | ".join("---" for _ in COLUMNS)]
    recipes = [recipe_of(t) for t in done[:top]]
    for rank, (trial, recipe) in enumerate(zip(done[:top], recipes), 1):
        m = children[trial.number]["metrics"]
        config = " ".join(f"{k}={v}" for k, v in trial.params.items())
        lines.append(
            " | ".join(
                [
                    str(rank),
                    f"#{trial.number}",
                    f"{m['mfu'] * 100:.2f}",
                    f"{m['effective_tokens_per_s_per_gpu']:.0f}",
                    f"{m['step_time_s.median'] * 1e3:.1f}",
                    f"{m['step_time_s.cv'] * 100:.1f}",
                    f"{m['peak_memory_gib']:.1f}",
                    str(int(m.get("graphed_layers", 0))),
                    recipe,
                    config,
                ]
            )
        )
    if len(set(recipes)) > 1:
        lines.append(
            f"\nThese trials train {len(set(recipes))} different recipes (the recipe column; * computed from "
            "the trial's overrides): the ranking compares speed and what is trained at once."
        )
    return "\n".join(lines)


def outcomes(study: optuna.Study) -> str:
    return ", ".join(f"{n} {c}" for c, n in sorted(failure_counts(study).items()))


def baseline_mfu(baseline: str, runs: list[dict]) -> tuple[str, float, str]:
    """``FILE:NAME`` (a compare_configs.py row) or ``trial:N`` (a trial of this study, e.g. its first_trials), with
    when it was measured, since a ratio across machines or runs hours apart is not a side-by-side one."""
    if baseline.startswith("trial:"):
        number = baseline.removeprefix("trial:")
        run = next((r for r in runs if r["tags"].get("moe_vlm_sweep.trial") == number), None)
        if run is None or "mfu" not in run["metrics"]:
            raise SystemExit(f"--baseline {baseline}: trial #{number} has no MFU in the study's MLflow runs")
        when = datetime.fromtimestamp(run["start_time"] / 1e3, UTC).strftime("%Y-%m-%d %H:%M UTC")
        return f"trial #{number}", run["metrics"]["mfu"], when
    path, _, name = baseline.rpartition(":")
    document = json.loads(Path(path).read_text())
    rows = {r["config"]: r for r in document["runs"]}
    if rows.get(name, {}).get("status") != "ok":
        raise SystemExit(f"--baseline {baseline}: no successful row {name!r} in {path}")
    return f"`{name}`", rows[name]["mfu"], str(document.get("date", "?"))


def _run_dir_time(run_dir: str) -> str:
    """A run folder's name starts with its local start time, YYYYMMDD-HHMMSS (launch/run_dir.py)."""
    stamp = Path(run_dir).name[:15]
    return f"{stamp[:4]}-{stamp[4:6]}-{stamp[6:8]} {stamp[9:11]}:{stamp[11:13]} (the machine's local time)"


def versus_baseline(baseline: tuple[str, float, str], confirm_file: Path) -> str:
    """The confirmed winner's re-run median MFU against the baseline's MFU, each with when it was measured."""
    confirmation = json.loads(confirm_file.read_text())
    if confirmation["objective_metrics"][0] != "mfu":
        raise SystemExit(f"{confirm_file}: the confirmed objective is {confirmation['objective_metrics'][0]}, not mfu")
    winner = next((c for c in confirmation["candidates"] if c["holds"]), None)
    if winner is None:
        return "Confirmation: no candidate held (each had a failed re-run)."
    (name, base, when), best = baseline, winner["median_values"][0]
    reran = sorted(_run_dir_time(r["run_dir"]) for r in winner["repeats"] if r.get("run_dir"))
    cvs = ", ".join(
        f"#{c['trial']} {c['step_time_cv_across_repeats']:.1%}"
        for c in confirmation["candidates"]
        if c["step_time_cv_across_repeats"] is not None
    )
    return "\n".join(
        [
            "config | measured | MFU (%) | ratio",
            "--- | --- | --- | ---",
            f"baseline {name} | {when} | {base * 100:.2f} | 1.00",
            f"trial #{winner['trial']} as swept | in the study | {winner['original_values'][0] * 100:.2f} | "
            f"{winner['original_values'][0] / base:.2f}",
            f"trial #{winner['trial']} (median of {len(winner['repeats'])} re-runs) | {reran[0] if reran else '?'} | "
            f"{best * 100:.2f} | {best / base:.2f}",
            "",
            f"Step-time CV across each candidate's re-runs (target <= {confirmation['cv_target']:.0%}): {cvs}.",
        ]
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--outputs", type=Path, required=True, help="the sweep's outputs folder")
    parser.add_argument("--study", help="study name (default: the only one under OUTPUTS/sweeps)")
    parser.add_argument("--experiment", default="moe-vlm-sweep", help="MLflow experiment (tracking.experiment)")
    parser.add_argument("--out-dir", type=Path, required=True)
    parser.add_argument("--top", type=int, default=5)
    parser.add_argument(
        "--baseline",
        metavar="FILE:NAME|trial:N",
        help="the baseline: a compare_configs JSON and row, or a trial of the study",
    )
    parser.add_argument("--confirm", type=Path, help="the confirm.json measured on the same machine as --baseline")
    args = parser.parse_args()
    study = _study(args.outputs, args.study)
    runs = export_study_runs(
        tracking_uri=default_uri(args.outputs), experiment=args.experiment, study_name=study.study_name
    )
    args.out_dir.mkdir(parents=True, exist_ok=True)
    study.trials_dataframe(
        attrs=("number", "state", "values", "params", "user_attrs", "datetime_start", "duration")
    ).to_csv(args.out_dir / "trials.csv", index=False)
    (args.out_dir / "mlflow_runs.json").write_text(json.dumps(runs, indent=2, default=str) + "\n")
    report = [
        f"# Study `{study.study_name}`",
        "",
        f"{len(study.trials)} trials: {outcomes(study)}. Objective: "
        f"{study.user_attrs.get('objective_metrics')} ({study.directions[0].name.lower()}); "
        f"data realism {study.user_attrs.get('data_realism')}.",
        "",
        table(study, runs, args.top),
    ]
    if args.baseline and args.confirm:
        report += [
            "",
            "Confirmed best against the baseline (a ratio is side by side only when both were measured in one run):",
            "",
            versus_baseline(baseline_mfu(args.baseline, runs), args.confirm),
        ]
    (args.out_dir / "report.md").write_text("\n".join(report) + "\n")
    print("\n".join(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
