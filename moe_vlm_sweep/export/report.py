"""``moe-vlm-sweep report [STUDY]``: one self-contained HTML page (and its PNGs) of what a sweep found.

Optuna's own plots (optimization history, parameter importances, the Pareto front when there are two
objectives), the top configs, what the failed trials failed of, and where the best trials spend their step
(``metrics.json``'s component split), with the commands that open the study in MLflow and optuna-dashboard. The
page embeds its images, so it can be mailed or committed alone; the same files become artifacts of the sweep's
MLflow parent run (``report/``). Matplotlib draws off-screen (Agg): no display is needed.
"""

from __future__ import annotations

import argparse
import base64
import html
import warnings
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path

import optuna
from optuna.trial import FrozenTrial, TrialState

from moe_vlm_sweep.console import help_summary, say
from moe_vlm_sweep.export.best import ExportError, ranked
from moe_vlm_sweep.launch.status import RunStatus
from moe_vlm_sweep.metrics.schema import read_metrics
from moe_vlm_sweep.sweep.study import StorageError
from moe_vlm_sweep.sweep.trial import CONTENDED_ATTR, is_contended

REPORT_DIR = "report"


def failure_counts(study: optuna.Study) -> Counter:
    """Trials per outcome (``ok`` or a failure class), as the sweep recorded them."""
    return Counter(t.user_attrs.get("failure_class", t.state.name.lower()) for t in study.get_trials(deepcopy=False))


def _metric_names(study: optuna.Study) -> list[str]:
    return (
        study.metric_names
        or study.user_attrs.get("objective_metrics")
        or [f"objective {i}" for i in range(len(study.directions))]
    )


def _component_shares(trial: FrozenTrial) -> dict[str, float] | None:
    run_dir = trial.user_attrs.get("run_dir")
    try:
        split = read_metrics(Path(run_dir)).component_split if run_dir else None
    except (OSError, ValueError):
        return None
    return split.shares if split else None


def _save(axes, path: Path) -> Path:
    figure = axes.figure if hasattr(axes, "figure") else axes.flat[0].figure
    figure.set_size_inches(8, 4.5)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    import matplotlib.pyplot as plt

    plt.close(figure)
    return path


def plots(study: optuna.Study, out: Path, top: Sequence[FrozenTrial]) -> dict[str, Path | str]:
    """Title -> PNG written under ``out``, or -> why it could not be drawn (too few trials, say)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import optuna.visualization.matplotlib as ov

    names = _metric_names(study)
    first: Callable[[FrozenTrial], float] = lambda t: t.values[0]  # noqa: E731
    drawn: dict[str, Path | str] = {}

    def draw(title: str, file: str, make: Callable[[], object]) -> None:
        try:
            with warnings.catch_warnings():  # the plots are marked experimental; their output is what we want
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                warnings.filterwarnings("ignore", message="PedAnovaImportanceEvaluator computes")  # see sign
                drawn[title] = _save(make(), out / file)
        except (ValueError, RuntimeError, ZeroDivisionError) as exc:
            drawn[title] = f"not drawn: {exc}"

    complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    draw(
        "Optimization history",
        "history.png",
        lambda: ov.plot_optimization_history(
            study, target=first if len(study.directions) > 1 else None, target_name=names[0]
        ),
    )  # one objective: with its best-so-far line
    # Optuna's default evaluator (PED-ANOVA) ranks knobs by how they reach low values: a maximized objective is
    # handed over negated, so the importances are about reaching the best trials.
    sign = -1.0 if study.directions[0] == optuna.study.StudyDirection.MAXIMIZE else 1.0
    if len(complete) >= 2 and any(t.params for t in complete):
        draw(
            "Parameter importances",
            "importances.png",
            lambda: ov.plot_param_importances(
                study,
                target=lambda t: sign * t.values[0],
                target_name=f"{names[0]} ({study.directions[0].name.lower()}d)",
            ),
        )
    else:
        drawn["Parameter importances"] = "not drawn: needs two completed trials with searched knobs"
    if len(study.directions) == 2:
        draw("Pareto front", "pareto.png", lambda: ov.plot_pareto_front(study, target_names=names))
    counts = failure_counts(study)

    def outcomes():
        _fig, ax = plt.subplots()
        ax.bar(
            list(counts), list(counts.values()), color=["tab:green" if c == RunStatus.OK else "tab:red" for c in counts]
        )
        ax.set_ylabel("trials")
        ax.set_title("Outcome of every trial")
        return ax

    draw("Outcomes", "outcomes.png", outcomes)
    shares = {f"#{t.number}": s for t in top if (s := _component_shares(t))}
    if shares:

        def split():
            _fig, ax = plt.subplots()
            phases = sorted({p for s in shares.values() for p in s})
            bottom = [0.0] * len(shares)
            for phase in phases:
                values = [s.get(phase, 0.0) for s in shares.values()]
                ax.bar(list(shares), values, bottom=bottom, label=phase)
                bottom = [b + v for b, v in zip(bottom, values)]
            ax.set_ylabel("share of the profiled step")
            ax.set_title("Where the best trials spend their step")
            ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1, 0.5))
            return ax

        draw("Component split of the best trials", "components.png", split)
    else:
        drawn["Component split of the best trials"] = "not drawn: no best trial was profiled (train.profile_steps=0)"
    return drawn


def _table(rows: list[list[str]]) -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in rows[0])
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in rows[1:])
    return f"<table><tr>{head}</tr>{body}</table>"


def write_report(study: optuna.Study, out: Path, *, top_k: int = 5, links: Sequence[str] = ()) -> Path:
    """Write ``out/index.html`` and its PNGs; return the HTML's path."""
    out.mkdir(parents=True, exist_ok=True)
    names = _metric_names(study)
    top = ranked(study)[:top_k]
    rows = [["rank", "trial", *names, "config", "contended (ranked after the uncontended)"]]
    rows += [
        [
            str(i),
            f"#{t.number}",
            *(f"{v:.4g}" for v in t.values),
            " ".join(f"{k}={v}" for k, v in t.params.items()),
            f"yes: {t.user_attrs[CONTENDED_ATTR]}" if is_contended(t) else "no",
        ]
        for i, t in enumerate(top, 1)
    ]
    counts = failure_counts(study)
    sections = [
        f"<h1>Study {html.escape(study.study_name)}</h1>",
        f"<p>{len(study.trials)} trials; objective {html.escape(' and '.join(names))} "
        f"({' and '.join(d.name.lower() for d in study.directions)}); data realism "
        f"{html.escape(str(study.user_attrs.get('data_realism')))}.</p>",
        "<h2>Top configs</h2>",
        _table(rows) if top else "<p>No successful trial yet.</p>",
        "<h2>Outcomes</h2>",
        _table([["outcome", "trials"], *([c, str(n)] for c, n in counts.most_common())]),
    ]
    for title, drawn in plots(study, out, top).items():
        sections.append(f"<h2>{html.escape(title)}</h2>")
        if isinstance(drawn, Path):
            data = base64.b64encode(drawn.read_bytes()).decode()
            sections.append(f'<img alt="{html.escape(title)}" src="data:image/png;base64,{data}">')
        else:
            sections.append(f"<p>{html.escape(drawn)}</p>")
    if links:
        sections += [
            "<h2>Open it</h2>",
            "<ul>" + "".join(f"<li><code>{html.escape(link)}</code></li>" for link in links) + "</ul>",
        ]
    page = (
        "<!doctype html><meta charset='utf-8'><title>" + html.escape(study.study_name) + "</title><style>"
        "body{font-family:sans-serif;max-width:1000px;margin:auto}table{border-collapse:collapse}"
        "td,th{border:1px solid #ccc;padding:2px 6px;font-size:13px}img{max-width:100%}</style>" + "\n".join(sections)
    )
    path = out / "index.html"
    path.write_text(page)
    return path


def main(argv: Sequence[str]) -> int:
    from moe_vlm_sweep.export.study_args import add_study_arguments, load_study
    from moe_vlm_sweep.tracking.mlflow_sink import default_uri, log_report

    parser = argparse.ArgumentParser(prog="moe-vlm-sweep report", description=help_summary(__doc__))
    add_study_arguments(parser)
    parser.add_argument("--top", type=int, default=5, help="trials in the top configs table (default: 5)")
    parser.add_argument("--experiment", default="moe-vlm-sweep", help="MLflow experiment (tracking.experiment)")
    parser.add_argument("--out", help="folder for index.html and the PNGs (default: OUTPUTS/sweeps/STUDY/report)")
    args = parser.parse_args(list(argv))
    outputs = Path(args.outputs)
    try:
        name, storage, study = load_study(outputs, args.study, args.storage)
    except (ExportError, StorageError) as exc:
        say(f"error: {exc}", err=True)
        return 2
    links = [
        f"moe-vlm-sweep ui --outputs {outputs}   # MLflow: the study's parent run and a child per trial",
        f"optuna-dashboard {storage}   # Optuna's own view of the study",
    ]
    out = Path(args.out) if args.out else outputs / "sweeps" / name / REPORT_DIR
    path = write_report(study, out, top_k=args.top, links=links)
    logged = log_report(tracking_uri=default_uri(outputs), experiment=args.experiment, study_name=name, folder=out)
    say(f"report: {path}" + (f"\n  also the artifacts {REPORT_DIR}/ of MLflow run {logged}" if logged else ""))
    return 0
