"""The end of a sweep: the top trials' table, their confirmation re-runs and the verification of the winner, the
export, the HTML report and the MLflow parent run's close.

It lives with the export because that is what it produces; the sweeper plugin (``hydra_plugins/``) only says when
a sweep ends and hands over what it holds (the study, the Hydra-backed compose -> plan function, the time budget,
the tracker). Nothing here imports the plugin.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import optuna
from optuna.trial import FrozenTrial, TrialState

from moe_vlm_sweep.config.compose import exports_dir
from moe_vlm_sweep.console import say
from moe_vlm_sweep.export.best import ExportError, confirmed_export, export, ranked, realism_of
from moe_vlm_sweep.export.recipes import chosen, note
from moe_vlm_sweep.plan.plan import RunPlan
from moe_vlm_sweep.sweep import ledger, progress
from moe_vlm_sweep.sweep.budget import TimeBudget
from moe_vlm_sweep.sweep.spec import SweepConf

if TYPE_CHECKING:
    from moe_vlm_sweep.tracking.mlflow_sink import SweepTracker


def best_trial(study: optuna.Study) -> FrozenTrial | None:
    """The study's best trial as the export ranks them (every objective, data realism kept apart)."""
    top = ranked(study)
    return top[0] if top else None


@dataclass(kw_only=True)
class SweepEnd:
    """What the end of one sweep needs from the sweeper that ran it."""

    study: optuna.Study
    spec: SweepConf
    sweep_dir: Path | None
    """``<outputs_dir>/sweeps/<study>``; None for an app that is not moe-vlm-sweep's run (no export)."""
    outputs_dir: str | None
    """Where the export's experiment config goes (``<outputs_dir>/conf``); None with ``sweep_dir``."""
    plan: Callable[[list[str]], tuple[RunPlan, str]]
    """Overrides -> validated plan and its config as YAML, composed as the sweep composed its trials (the re-runs use it)."""
    budget: TimeBudget
    tracker: SweepTracker | None = None
    project: bool = True
    """Whether the sweep ran moe-vlm-sweep's own run config (then it confirms, exports and reports)."""

    def finish(self, status: str = "FINISHED", confirm: bool = False) -> list[FrozenTrial]:
        """Print the top trials and export them; a sweep that ran to the end first confirms them
        (``sweep.confirm`` re-runs each) and exports the one that held, or nothing if none did. A confirmation
        runs the re-runs the time budget holds and leaves the rest to the next run of the same command, and the
        best is exported unconfirmed meanwhile; an unconfirmed export never replaces an earlier confirmed one."""
        study, spec, sweep_dir = self.study, self.spec, self.sweep_dir
        top = ranked(study)[: spec.top_k]
        realism = realism_of(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)))
        say(progress.table(top, spec.objective.metrics, realism=realism))
        mixed = note(study, chosen(study))
        if mixed:
            say(mixed)
        if self.project and top and sweep_dir is not None and self.outputs_dir is not None:
            held = self.confirm() if confirm and spec.confirm else None
            try:
                kept, unreadable = (confirmed_export(sweep_dir) if held is None else None), None
            except ExportError as exc:
                kept, unreadable = None, exc
            if held is False:
                say("confirmation: no candidate held (each had a failed re-run); nothing exported")
            elif unreadable is not None:
                say(f"best: not exported: {unreadable}")
            elif kept is not None:
                say(
                    f"best: trial #{kept} stays exported (it held in an earlier confirmation); this run's "
                    f"unconfirmed best is #{top[0].number}"
                )
            else:
                exported = export(
                    study,
                    sweep_dir=sweep_dir,
                    conf_dir=exports_dir(self.outputs_dir),
                    top_k=spec.top_k,
                    confirmed=held,
                )
                unconfirmed = " (unconfirmed)" if held is None and spec.confirm else ""
                say(
                    f"best: trial #{exported[0].trial.number}{unconfirmed}; re-run it with: {exported[0].command}\n"
                    f"  overrides and commands of the top {len(exported)}: {sweep_dir / 'best'}"
                )
            self.report()
        if self.tracker is not None and not ledger.in_flight(
            study.get_trials(deepcopy=False), spec.resume.stale_after_s
        ):
            self.tracker.close_sweep(status)
        return top

    def confirm(self) -> FrozenTrial | Literal[False] | None:
        """The trial that held in ``sweep.confirm`` re-runs of the top ones, False if none held, or None if the
        time budget stopped the re-runs (the next run of the same command reuses those that finished)."""
        from moe_vlm_sweep.export.confirm import confirm, table

        spec = self.spec
        assert self.sweep_dir is not None  # finish() confirms only a sweep with a folder
        say(f"confirm: re-running the top {spec.top_k} trial(s) {spec.confirm} time(s) each")
        confirmation = confirm(
            self.study,
            sweep_dir=self.sweep_dir,
            top_k=spec.top_k,
            repeats=spec.confirm,
            progress=say,
            plan=self.plan,
            budget=self.budget,
        )
        if not confirmation.complete:
            say(f"confirmation: postponed: {confirmation.stopped}")
            return None
        say(table(confirmation))
        winner = confirmation.winner
        if self.tracker is not None:
            self.tracker.log_sweep(
                params={}, tags={"moe_vlm_sweep.confirmed_trial": str(winner.trial.number) if winner else "none"}
            )
        if winner and spec.verify:
            self.verify(winner.trial)
        return winner.trial if winner else False

    def verify(self, winner: FrozenTrial) -> None:
        """The confirmed winner against the study's first trial, same seeds and batches (``export/verify.py``):
        printed, written to ``<sweep_dir>/verify/verify.json`` and tagged on the MLflow parent run."""
        from moe_vlm_sweep.export.verify import VerifyError, verify

        study, spec, budget = self.study, self.spec, self.budget
        assert self.sweep_dir is not None
        first = min(
            (t for t in study.get_trials(deepcopy=False) if t.user_attrs.get("overrides")), key=lambda t: t.number
        )
        verdict_tags: dict[str, Any]
        if first.number == winner.number:
            verdict_tags = {"moe_vlm_sweep.verify": "baseline"}
            say(f"verify: the winner is the study's first trial #{first.number}: nothing to compare")
        elif not budget.allows(3 * budget.slowest):
            verdict_tags = {"moe_vlm_sweep.verify": "postponed"}
            say(
                f"verify: postponed: {budget.why_not('its three runs', 3 * budget.slowest, 'three trials')}"
                f"; run it later: moe-vlm-sweep verify {study.study_name}"
            )
        else:
            say(
                f"verify: trial #{winner.number} against the study's first trial #{first.number} "
                f"({spec.verify_steps} steps each; sweep.verify=false skips)"
            )
            try:
                verdict = verify(
                    winner.user_attrs["overrides"],
                    first.user_attrs["overrides"],
                    steps=spec.verify_steps,
                    out_dir=self.sweep_dir / "verify",
                    plan=self.plan,
                    progress=say,
                )
            except VerifyError as exc:
                say(f"verify: ERROR: {exc}")
                verdict_tags = {"moe_vlm_sweep.verify": "error"}
            else:
                say(verdict.summary())
                verdict_tags = {
                    "moe_vlm_sweep.verify": verdict.status,
                    "moe_vlm_sweep.verify_max_loss_deviation": verdict.loss and verdict.loss.max_deviation,
                    "moe_vlm_sweep.verify_max_deviation_step": verdict.loss and verdict.loss.max_deviation_step,
                    **{
                        f"moe_vlm_sweep.verify_{name.replace(' ', '_')}_worst_ratio": check.worst_ratio
                        for name, check in verdict.curves().items()
                    },
                    "moe_vlm_sweep.verify_trials": f"#{winner.number} vs #{first.number}",
                }
        if self.tracker is not None:
            self.tracker.log_sweep(params={}, tags={k: v for k, v in verdict_tags.items() if v is not None})

    def report(self) -> None:
        """The HTML report (``moe-vlm-sweep report``) under the sweep's folder and on the MLflow parent run."""
        from moe_vlm_sweep.export.report import REPORT_DIR, write_report

        assert self.sweep_dir is not None
        out = self.sweep_dir / REPORT_DIR
        try:
            path = write_report(self.study, out, links=[f"moe-vlm-sweep ui --outputs {self.outputs_dir}"])
            if self.tracker is not None:
                self.tracker.log_sweep_files(out, REPORT_DIR)
        except Exception as exc:
            say(
                f"warning: the report could not be written ({type(exc).__name__}: {exc}); "
                f"moe-vlm-sweep report {self.study.study_name} tries again"
            )
            return
        say(f"report: {path}")
