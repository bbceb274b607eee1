"""Confirmation re-runs: before a best config is exported, re-run the top trials and keep the one that holds.

One measurement per config ranks noise as much as configs when they are close, so each of the top ``top_k``
completed trials is re-run ``repeats`` times with its exact overrides, on the path of ``moe-vlm-sweep run``
(compose -> make_plan -> new run dir -> launch), each repeat in a fresh run directory under
``<sweep_dir>/confirm/``. Repeats go round-robin over the candidates (A1 B1 C1 A2 B2 C2), so a drift of the
machine spreads over all of them instead of penalizing the last. The winner is the candidate whose median over
its repeats is best on the study's first objective; a candidate with any failed repeat cannot win. The step-time
CV across the repeats' median step times is reported against :data:`CV_TARGET`; it does not pick the winner.
Everything lands in ``<sweep_dir>/best/confirm.json``.

A confirmation is as resumable as the sweep: a repeat that an interrupted confirmation finished successfully
(its ``result.json`` written, the same plan) is read back, not re-run, and a time budget (a Slurm
allocation, a reserved machine's hours) starts no repeat that the trial it repeats says would overrun it. An incomplete confirmation writes no
``confirm.json`` and names no winner; the same command goes on from where it stopped.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from moe_vlm_sweep.export.best import ExportError, ranked, realism_of
from moe_vlm_sweep.launch.local import launch
from moe_vlm_sweep.launch.result import RunResult
from moe_vlm_sweep.launch.run_dir import RESULT_FILE, new_run_dir, prepare, write_json_atomic
from moe_vlm_sweep.launch.status import RunStatus
from moe_vlm_sweep.plan.compose import compose_plan
from moe_vlm_sweep.plan.plan import RunPlan
from moe_vlm_sweep.sweep.budget import TimeBudget, wall_seconds
from moe_vlm_sweep.sweep.spec import ObjectiveConf
from moe_vlm_sweep.sweep.trial import INVALID_ERRORS, outcome_of_result

CV_TARGET = 0.02
CONFIRM_FILE = "confirm.json"


@dataclass(kw_only=True)
class Repeat:
    """One re-run of a candidate: its objective values and step times, or why it failed."""

    status: RunStatus
    """``ok`` or the failure class of the run (invalid | oom | crash | timeout | nan | realism)."""
    reason: str = ""
    run_dir: str | None = None
    values: list[float] | None = None
    step_time_median_s: float | None = None
    step_time_cv: float | None = None
    """The run's own CV over its measured steps (metrics.json ``step_time_s.cv``)."""

    def __post_init__(self) -> None:
        self.status = RunStatus(self.status)

    @property
    def ok(self) -> bool:
        return self.status == RunStatus.OK


@dataclass(kw_only=True)
class Candidate:
    rank: int
    """The trial's rank in the study before confirmation."""
    trial: FrozenTrial
    repeats: list[Repeat] = field(default_factory=list)

    @property
    def overrides(self) -> list[str]:
        return list(self.trial.user_attrs.get("overrides", []))

    @property
    def ok(self) -> bool:
        return bool(self.repeats) and all(r.ok for r in self.repeats)

    @property
    def median_values(self) -> list[float] | None:
        """Per objective, the median over the repeats; None unless every repeat succeeded."""
        if not self.ok:
            return None
        return [statistics.median(vs) for vs in zip(*(r.values for r in self.repeats))]

    @property
    def step_time_cv(self) -> float | None:
        """pstdev / mean of the successful repeats' median step times; None with fewer than two."""
        times = [t for r in self.repeats if r.ok and (t := r.step_time_median_s) is not None]
        return statistics.pstdev(times) / statistics.fmean(times) if len(times) >= 2 else None

    @property
    def meets_cv_target(self) -> bool:
        return self.ok and self.step_time_cv is not None and self.step_time_cv <= CV_TARGET


@dataclass(kw_only=True)
class Confirmation:
    study_name: str
    objective_metrics: list[str]
    directions: list[str]
    data_realism: str | None
    repeats: int
    candidates: list[Candidate]
    stopped: str = ""
    """Why the re-runs stopped before all were done (the time budget); empty when complete."""

    @property
    def complete(self) -> bool:
        return not self.stopped

    @property
    def winner(self) -> Candidate | None:
        """Best median of the first objective among candidates whose every repeat succeeded; ties keep the
        study's order. None until the confirmation is complete."""
        held = [(m, c) for c in self.candidates if c.ok and (m := c.median_values) is not None] if self.complete else []
        if not held:
            return None
        sign = -1.0 if self.directions[0] == "maximize" else 1.0
        return min(held, key=lambda mc: (sign * mc[0][0], mc[1].rank))[1]

    def to_dict(self) -> dict[str, Any]:
        winner = self.winner
        return {
            "study": self.study_name,
            "objective_metrics": self.objective_metrics,
            "directions": self.directions,
            "data_realism": self.data_realism,
            "repeats": self.repeats,
            "cv_target": CV_TARGET,
            "winner": winner.trial.number if winner else None,
            "candidates": [
                {
                    "rank": c.rank,
                    "trial": c.trial.number,
                    "overrides": c.overrides,
                    "original_values": list(c.trial.values),
                    "ok": c.ok,
                    "holds": c is winner,
                    "median_values": c.median_values,
                    "step_time_cv_across_repeats": c.step_time_cv,
                    "meets_cv_target": c.meets_cv_target,
                    "repeats": [asdict(r) for r in c.repeats],
                }
                for c in self.candidates
            ],
        }


def objective_of(study: optuna.Study) -> ObjectiveConf:
    """The sweep objective the study was created with (its ``objective_metrics`` and directions)."""
    metrics = study.user_attrs.get("objective_metrics")
    if not metrics:
        raise ExportError(
            f"study {study.study_name} has no objective_metrics (not made by a moe-vlm-sweep "
            "sweep): cannot tell which metric to confirm"
        )
    directions = [d.name.lower() for d in study.directions]
    objective = ObjectiveConf(metric=metrics[0], direction=directions[0], peak_memory=len(metrics) > 1)
    if objective.metrics != list(metrics) or objective.directions != directions:
        raise ExportError(
            f"study {study.study_name}: objectives {metrics} ({directions}) are not a sweep "
            "objective this version can re-measure"
        )
    return objective


def _repeat(result: RunResult, objective: ObjectiveConf, realism: str | None) -> Repeat:
    outcome, metrics = outcome_of_result(result, objective), result.metrics
    if not outcome.ok or metrics is None:
        return Repeat(status=outcome.failure_class, reason=outcome.reason, run_dir=result.run_dir)
    measured = metrics.data_realism
    if realism is not None and measured != realism:
        return Repeat(
            status=RunStatus.REALISM,
            run_dir=result.run_dir,
            reason=f"measured data_realism {measured} differs from the study's {realism}",
        )
    return Repeat(
        status=RunStatus.OK,
        run_dir=result.run_dir,
        values=outcome.values,
        step_time_median_s=metrics.step_time_s.median,
        step_time_cv=metrics.step_time_s.cv,
    )


def _line(index: int, repeats: int, candidate: Candidate, repeat: Repeat, reused: bool) -> str:
    if repeat.ok:
        got = " ".join(f"{v:.4g}" for v in repeat.values or [])
    else:
        last = repeat.reason.strip().splitlines()[-1][:160] if repeat.reason.strip() else ""
        got = repeat.status.upper() + (f" ({last})" if last else "")
    return f"[confirm {index}/{repeats}] trial #{candidate.trial.number} -> {got}" + (
        " (finished by an earlier confirmation)" if reused else ""
    )


def _finished(confirm_dir: Path, number: int, index: int, plan: RunPlan) -> RunResult | None:
    """Repeat ``index`` of trial ``number`` as an earlier, interrupted confirmation measured it, if it succeeded
    under this very plan: ``result.json`` is written last, and ``plan.json`` must equal the plan this code makes
    (the resolved config included, so a run under another commit's defaults is not reused). A failed repeat
    runs again: the next attempt may run on another machine, and one OOM must not block the candidate for good."""
    for run_dir in sorted((confirm_dir / "runs").glob(f"*-t{number}-r{index}-*")):
        if not (run_dir / RESULT_FILE).exists():
            continue
        try:
            result, ran = RunResult.read(run_dir), RunPlan.read(run_dir / "plan.json")
        except (OSError, ValueError):  # unreadable or of another version: run it again
            continue
        if result.ok and ran == plan:
            return result
    return None


def confirm(
    study: optuna.Study,
    *,
    sweep_dir: Path,
    top_k: int,
    repeats: int,
    progress: Callable[[str], None] | None = None,
    plan: Callable[[list[str]], tuple[RunPlan, str]] = compose_plan,
    budget: TimeBudget | None = None,
    recipe: str | None = None,
) -> Confirmation:
    """Re-run the top ``top_k`` trials ``repeats`` times each, write ``best/confirm.json``, return the record.

    Mixed data realism and a study without a known objective are refused before anything runs. ``progress``
    (e.g. ``print``) gets a line per repeat: a confirmation costs top_k * repeats runs. ``plan`` composes and
    validates a trial's overrides; the sweeper passes its own (Hydra is already initialized inside a sweep).
    Repeats an interrupted confirmation finished are reused; with a ``budget``, a repeat that would overrun it
    stops the confirmation, incomplete (nothing written). Candidates are of one recipe: ``recipe``, else the
    baseline's (``export/recipes.py``).
    """
    if repeats < 1:
        raise ExportError(f"repeats={repeats}: confirmation needs at least one re-run per candidate")
    objective = objective_of(study)
    realism = realism_of(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)))
    candidates = [Candidate(rank=rank, trial=trial) for rank, trial in enumerate(ranked(study, recipe)[:top_k], 1)]
    plans: dict[int, tuple[RunPlan, str]] = {}
    invalid: dict[int, str] = {}
    for candidate in candidates:
        try:
            plans[candidate.trial.number] = plan(candidate.overrides)
        except INVALID_ERRORS as exc:
            invalid[candidate.trial.number] = str(exc)
    record = partial(
        Confirmation,
        study_name=study.study_name,
        objective_metrics=objective.metrics,
        directions=objective.directions,
        data_realism=realism,
        repeats=repeats,
        candidates=candidates,
    )
    for index in range(1, repeats + 1):
        for candidate in candidates:
            number = candidate.trial.number
            reused = None
            if number in invalid:
                repeat = Repeat(status=RunStatus.INVALID, reason=invalid[number])
            elif reused := _finished(sweep_dir / "confirm", number, index, plans[number][0]):
                repeat = _repeat(reused, objective, realism)
            elif budget is not None and not budget.allows(need := wall_seconds(candidate.trial) or budget.slowest):
                return record(
                    stopped=budget.why_not(f"re-run {index} of trial #{number}", need, "the trial's own time")
                )
            else:
                run_plan, resolved_yaml = plans[number]
                run_dir = new_run_dir(sweep_dir / "confirm", prefix=f"t{number}-r{index}")
                prepare(run_dir, run_plan, resolved_yaml)
                repeat = _repeat(launch(run_plan, run_dir), objective, realism)
            candidate.repeats.append(repeat)
            if progress is not None:
                progress(_line(index, repeats, candidate, repeat, reused is not None))
    confirmation = record()
    out = sweep_dir / "best"
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out / CONFIRM_FILE, confirmation.to_dict())
    return confirmation


def table(confirmation: Confirmation) -> str:
    """Per candidate: the original value, each repeat's, their median and the step-time CV across repeats."""

    def fmt(value: float | None) -> str:
        return "-" if value is None else f"{value:.4g}"

    winner = confirmation.winner
    rows = [
        [
            "trial",
            f"original {confirmation.objective_metrics[0]}",
            "repeats",
            "median",
            f"step-time CV (target <= {CV_TARGET:.0%})",
            "",
        ]
    ]
    for c in confirmation.candidates:
        median, cv = c.median_values, c.step_time_cv
        rows.append(
            [
                f"#{c.trial.number}",
                fmt(c.trial.values[0]),
                ", ".join(fmt(r.values[0]) if r.ok and r.values else r.status.upper() for r in c.repeats),
                fmt(median[0] if median else None),
                "-" if cv is None else f"{cv:.2%}" + ("" if cv <= CV_TARGET else " (over target)"),
                "<- holds" if c is winner else "",
            ]
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)
