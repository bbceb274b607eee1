"""The ask/tell loop: one trial at a time per sweep process, any number of processes per study.

Per trial: ask -> sample the space -> compose the trial's config and validate it like ``check`` (invalid: told
as pruned, never launched) -> claim the config (a duplicate is told as failed, never launched, and the next trial
walks one knob out from the best) -> open the MLflow child run -> launch through Hydra's launcher -> classify the
RunResult -> tell Optuna -> close the child run -> print the progress line. On start, trials a killed sweep left
RUNNING are failed (or re-queued once) and MLflow is reconciled with the study.

Apps other than moe-vlm-sweep (e.g. Hydra's shared test suites) get the same loop with a generic trial: no
validation, no MLflow, the task's return value is the objective.
"""

from __future__ import annotations

import contextlib
import logging
import random
import shlex
import signal
import time
import warnings
from pathlib import Path
from typing import Any

import optuna
import sqlalchemy.exc
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.plugins import Plugins
from hydra.errors import HydraException
from hydra.plugins.launcher import Launcher
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException
from optuna.trial import TrialState

from moe_vlm_sweep.console import say
from moe_vlm_sweep.export.finish import SweepEnd, best_trial
from moe_vlm_sweep.launch import slurm
from moe_vlm_sweep.launch.status import RunStatus
from moe_vlm_sweep.launch.stop import Interrupted, raise_if_stopped, received, stoppable
from moe_vlm_sweep.sweep import early_stop, ledger, preflight, progress
from moe_vlm_sweep.sweep.budget import TimeBudget, wall_seconds
from moe_vlm_sweep.sweep.devices import held as devices_held
from moe_vlm_sweep.sweep.space import Space, fixed_overrides
from moe_vlm_sweep.sweep.spec import SweepConf, SweepError, SweepSpecError, load_spec
from moe_vlm_sweep.sweep.study import (
    StorageError,
    exploring,
    neighbor_of_best,
    open_study,
    storage_problem,
    storage_url,
    study_name,
)
from moe_vlm_sweep.sweep.trial import (
    CONTENDED_ATTR,
    INVALID_ERRORS,
    Outcome,
    is_rejected_submission,
    is_run_config,
    outcome_of_lost_job,
    outcome_of_result,
    outcome_of_value,
    plan_trial,
    run_overrides,
)

MAX_DUPLICATES_IN_A_ROW = 25
EXPLORER_SEED_OFFSET = 1_000_003
_LAUNCH_FAILURES = (RunStatus.OOM, RunStatus.CRASH, RunStatus.TIMEOUT, RunStatus.NAN)
_TELL_STATE = {"pruned": TrialState.PRUNED, "fail": TrialState.FAIL}
EXIT_INVALID = 2
EXIT_STOPPED = 1

logger = logging.getLogger(__name__)


def _exit_code(otherwise: int) -> int:
    """A sweep a signal stopped exits 128 + the signal, whatever error ended it after (a caller such as a Slurm
    job script tells a stop from a failure by it)."""
    stop = received()
    return otherwise if stop is None else 128 + stop


def _key(override: str) -> str:
    return override.lstrip("+~").split("=", 1)[0]


class SweeperImpl(Sweeper):
    # Hydra's base class declares these Optional until setup(), which sets all three before any other method runs.
    config: DictConfig
    hydra_context: HydraContext
    launcher: Launcher

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config, self.hydra_context = config, hydra_context
        self.launcher = Plugins.instance().instantiate_launcher(
            config=config, hydra_context=hydra_context, task_function=task_function
        )
        self.project = is_run_config(config)
        self.tracker: Any = None
        self.stop_reason: str | None = None
        """Set by a trial whose outcome must end the sweep (mixed data realism); the loop raises it."""
        self.budget = TimeBudget(None)
        self.current: optuna.Trial | None = None
        """The trial this process runs now, for an interrupting signal to mark."""
        self.study: optuna.Study | None = None
        self.spec: SweepConf | None = None
        self.storage: str | None = None
        self.trial_seconds: list[float] = []
        """Wall seconds of each trial this process launched, for the time-left estimate."""

    # --- setup of one sweep -------------------------------------------------------------------------------

    @staticmethod
    def job_overrides(spec: SweepConf, arguments: list[str]) -> list[str]:
        """Every trial's base overrides: the space's fixed ones, then the command line (which wins)."""
        for parsed in OverridesParser.create().parse_overrides(arguments):
            if parsed.is_sweep_override():
                raise SweepError(
                    f"{parsed.input_line!r}: with this sweeper, searched knobs belong in the space "
                    "(sweep.params), not in a,b lists on the command line"
                )
        given = {_key(a) for a in arguments}
        return [*(f for f in fixed_overrides(spec.fixed) if _key(f) not in given), *arguments]

    def _sweep_dir(self, name: str) -> Path | None:
        """Where the study (and the export) of a moe-vlm-sweep sweep lives: stable, so a re-run resumes. Other
        apps get an in-memory study unless sweep.storage is set, like Hydra's own Optuna sweeper."""
        return Path(self.config.outputs_dir) / "sweeps" / name if self.project else None

    def _open_tracker(self, name: str, url: str | None) -> Any:
        from moe_vlm_sweep.provenance import provenance_tags
        from moe_vlm_sweep.tracking import mlflow_sink

        tracking = self.config.tracking
        uri = tracking.tracking_uri or mlflow_sink.default_uri(self.config.outputs_dir)
        tracker = mlflow_sink.SweepTracker(
            tracking_uri=uri,
            experiment=tracking.experiment,
            study_name=name,
            artifact_root=mlflow_sink.default_artifact_root(self.config.outputs_dir),
            static_tags=provenance_tags(mlflow_sink.TAG),
        )
        tracker.log_sweep(params={}, tags={"moe_vlm_sweep.optuna_storage": str(url)})
        return tracker

    def _lost_study(self, name: str) -> str | None:
        """Why a new study must not be created under ``name``: MLflow already holds trials of it."""
        from moe_vlm_sweep.tracking import mlflow_sink

        tracking = self.config.tracking
        uri = tracking.tracking_uri or mlflow_sink.default_uri(self.config.outputs_dir)
        found = mlflow_sink.recorded_trials(tracking_uri=uri, experiment=tracking.experiment, study_name=name)
        return f"MLflow ({uri}) holds {found} trial run(s) of it" if found else None

    def _check_slurm_job(self, base: list[str]) -> None:
        """Before anything is submitted: the Slurm job must hold the runs' process group and timeout."""
        cfg = self.hydra_context.config_loader.load_sweep_config(self.config, list(base))
        problems = slurm.job_problems(
            self.config.hydra.launcher,
            nproc_per_node=cfg.launcher.nproc_per_node,
            nnodes=cfg.launcher.nnodes,
            timeout_s=cfg.train.timeout_s,
        )
        if problems:  # invalid input: exit 2 with the knobs and the rules, no traceback (SystemExit passes Hydra)
            say("error: the Slurm job (hydra.launcher) cannot hold this sweep's runs: " + "; ".join(problems), err=True)
            raise SystemExit(2)

    # --- resume -------------------------------------------------------------------------------------------

    def _adopt(self, study: optuna.Study, trial: optuna.trial.FrozenTrial, spec: SweepConf) -> bool:
        """Tell the result a killed sweep's trial left in its run directory (its worker finished); False if none."""
        found = ledger.finished_run(trial, Path(self.config.outputs_dir) / "runs") if self.project else None
        if found is None:
            return False
        outcome = outcome_of_result(found, spec.objective)
        try:
            self._tell(study, optuna.trial.Trial(study, trial._trial_id), outcome)
        except (RuntimeError, ValueError):
            return True  # another worker adopted it first
        say(
            f"resume: trial #{trial.number} was left RUNNING by a sweep that is gone, but its run finished "
            f"({outcome.failure_class}, {found.run_dir}); its result is kept"
        )
        return True

    def _recover(self, study: optuna.Study, spec: SweepConf) -> None:
        for trial in ledger.stale_trials(study, spec.resume.stale_after_s):
            if self._adopt(study, trial, spec):
                continue
            try:
                study.tell(trial.number, state=TrialState.FAIL)
            except (RuntimeError, ValueError):
                continue  # another worker recovered it first
            study.set_user_attr(f"interrupted.{trial.number}", f"left RUNNING by {trial.user_attrs.get('worker')}")
            retry = (
                spec.resume.stale == "retry"
                and "retry_of" not in trial.user_attrs
                and trial.user_attrs.get("claim") == "launch"
            )
            if retry:
                study.enqueue_trial(trial.params, user_attrs={"retry_of": trial.number}, skip_if_exists=False)
            say(
                f"resume: trial #{trial.number} was left RUNNING by a sweep that is gone; marked failed "
                f"(interrupted){', re-queued once' if retry else ''}"
            )
        if spec.resume.stale == "retry":
            for trial in ledger.unretried_interrupts(study.get_trials(deepcopy=False)):
                # A second signal ended the sweep between marking the trial and queuing it again.
                study.enqueue_trial(trial.params, user_attrs={"retry_of": trial.number}, skip_if_exists=False)
                say(f"resume: trial #{trial.number} was interrupted and not yet queued again; re-queued once")
        for trial in ledger.unqueued_unclaimed(study.get_trials(deepcopy=False)):
            # Stopped before it claimed its enqueued params: nothing ran, so they are queued again for a new trial.
            carried: dict[str, Any] = {
                k: trial.user_attrs[k] for k in ("retry_of", "proposed_as") if k in trial.user_attrs
            }
            study.enqueue_trial(
                trial.system_attrs["fixed_params"],
                user_attrs={**carried, "requeue_of": trial.number},
                skip_if_exists=False,
            )
            say(f"resume: trial #{trial.number} was stopped before it claimed its config; re-queued")
        if self.tracker is not None:
            finished = study.get_trials(deepcopy=False, states=ledger.FINISHED)
            interrupted = {k for k in study.user_attrs if k.startswith("interrupted.")}
            fixed = self.tracker.reconcile(finished, lambda t: self._describe(t, interrupted))
            if fixed:
                say(f"resume: closed or added {fixed} MLflow child run(s) so MLflow matches the study")

    @staticmethod
    def _describe(trial: optuna.trial.FrozenTrial, interrupted: set) -> tuple[str, dict, dict]:
        if f"interrupted.{trial.number}" in interrupted:
            failure_class = RunStatus.INTERRUPTED
        else:
            failure_class = trial.user_attrs.get(
                "failure_class", {TrialState.COMPLETE: RunStatus.OK}.get(trial.state, RunStatus.CRASH)
            )
        tags = {
            f"moe_vlm_sweep.{k}": trial.user_attrs[k]
            for k in ("reason", "data_realism", "hardware", "recipe", CONTENDED_ATTR)
            if k in trial.user_attrs
        }
        return failure_class, {"sampled": trial.params, "overrides": trial.user_attrs.get("overrides", [])}, tags

    # --- one trial ----------------------------------------------------------------------------------------

    def _validate(self, overrides: list[str]) -> Any:
        """(plan, None) for a launchable config, (None, reason) for an invalid one."""
        try:
            cfg = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
            return plan_trial(cfg, overrides)[0], None
        except (*INVALID_ERRORS, HydraException, OmegaConfBaseException) as exc:
            return None, str(exc)

    def _run(self, study: optuna.Study, trial: optuna.Trial, spec: SweepConf, overrides: list[str]) -> Outcome:
        plan, reason = self._validate(overrides) if self.project else (None, None)
        if reason is not None:
            return Outcome(state="pruned", failure_class=RunStatus.INVALID, reason=reason)
        problem = plan and self._realism_problem(
            study, plan.run_config.data.realism, f"trial #{trial.number} samples data.realism"
        )
        if problem:
            self.stop_reason = problem
            return Outcome(state="fail", failure_class=RunStatus.INVALID, reason=problem)
        raise_if_stopped()
        owner = ledger.claim(study, trial, trial.params)
        if owner is not None:
            # Told as failed, not pruned: the config is not bad, and TPE must not learn that it is (it ignores fails).
            return Outcome(state="fail", failure_class=RunStatus.DUPLICATE, reason=f"same config as trial #{owner}")
        if plan is not None and plan.recipe:
            trial.set_user_attr("recipe", plan.recipe["fingerprint"])
            trial.set_user_attr("recipe_differs", plan.recipe["differs"])
        if self.tracker is not None:
            assert plan is not None  # the tracker exists only in a project sweep, which validated the plan above
            tags = {
                "moe_vlm_sweep.data_realism": plan.run_config.data.realism,
                "moe_vlm_sweep.hardware": plan.run_config.hardware.name,
                "moe_vlm_sweep.recipe": plan.recipe["fingerprint"],
            }
            run_id = self.tracker.start_trial(
                trial.number, params=plan.config, tags=tags, label=progress.config_text(trial.params)
            )
            trial.set_user_attr("mlflow_run_id", run_id)
        on_host = self.project and not slurm.is_submitit(self.config.hydra.launcher)
        gpus = plan.run_config.launcher.nproc_per_node if plan and plan.device == "cuda" else 0
        devices = (
            devices_held(gpus=gpus, say=lambda line: logger.info("[trial #%d] %s", trial.number, line))
            if on_host
            else contextlib.nullcontext("")
        )
        tail = (
            progress.StepTail(Path(self.config.outputs_dir) / "runs", trial.number)
            if on_host
            else contextlib.nullcontext()
        )
        watch = early_stop.EarlyStop.for_trial(study, trial, spec) if self.project else None
        beat = ledger.Heartbeat(trial, spec.resume.heartbeat_s, spec.resume.stale_after_s)
        with beat, early_stop.watching(beat.guard(watch)), devices as holding, tail:
            if holding:
                trial.set_user_attr("devices", holding)
            try:
                raise_if_stopped()
                job = self.launcher.launch([overrides], initial_job_idx=trial.number)[0]
            except Exception as exc:
                if is_rejected_submission(exc):
                    self.stop_reason = f"the scheduler refused trial #{trial.number}'s job: {exc}"
                    return Outcome(state="fail", failure_class=RunStatus.CRASH, reason=self.stop_reason)
                return outcome_of_lost_job(exc)
        if beat.lost is not None:  # its worker was stopped, or finished unseen: another host may run it again
            return Outcome(state="fail", failure_class=RunStatus.INTERRUPTED, reason=beat.lost)
        try:
            value = job.return_value
        except Exception as exc:  # the task raised: the sweep goes on, the trial is a crash
            return Outcome(state="fail", failure_class=RunStatus.CRASH, reason=f"{type(exc).__name__}: {exc}")
        if not self.project:
            return outcome_of_value(value, len(spec.objective.directions))
        outcome = outcome_of_result(value, spec.objective)
        realism = outcome.metrics.data_realism if outcome.metrics else None
        problem = outcome.ok and self._realism_problem(study, realism, f"trial #{trial.number} measured data_realism")
        if problem:
            self.stop_reason = problem
            outcome.state, outcome.reason, outcome.values = "fail", problem, None
            outcome.failure_class = RunStatus.INVALID
        elif outcome.ok and "data_realism" not in study.user_attrs:
            study.set_user_attr("data_realism", realism)
        return outcome

    @staticmethod
    def _realism_problem(study: optuna.Study, realism: str | None, what: str) -> str | None:
        known = study.user_attrs.get("data_realism")
        if known is None or realism == known:
            return None
        return (
            f"{what}={realism}, but study {study.study_name} ranks {known} results; a study never mixes data "
            "realism: fix data= in sweep.fixed or use a new sweep.study_name"
        )

    def _tell(self, study: optuna.Study, trial: optuna.Trial, outcome: Outcome) -> None:
        attrs = {
            "failure_class": outcome.failure_class,
            "reason": outcome.reason[-4000:],
            "run_dir": outcome.run_dir,
            "data_realism": outcome.metrics.data_realism if outcome.metrics else None,
            "hardware": outcome.metrics.hardware if outcome.metrics else None,
            CONTENDED_ATTR: outcome.contention,
        }
        for key, value in attrs.items():
            if value:
                trial.set_user_attr(key, value)
        if outcome.ok:
            study.tell(trial, values=outcome.values)
        else:
            study.tell(trial, state=_TELL_STATE[outcome.state])
        if self.tracker is not None:
            run_id = trial.user_attrs.get("mlflow_run_id")
            if run_id is None:
                run_id = self.tracker.start_trial(trial.number, params={"sampled": trial.params}, tags={})
            tags = {f"moe_vlm_sweep.{k}": v for k, v in attrs.items() if v and k != "failure_class"}
            problem = self.tracker.finish_trial(
                run_id, failure_class=outcome.failure_class, tags=tags, metrics=outcome.metrics, run_dir=outcome.run_dir
            )
            if problem:
                logger.warning(
                    "trial #%d's MLflow run could not be logged whole (%s); it is marked FAILED there, and the "
                    "study keeps the trial's result",
                    trial.number,
                    problem,
                )

    def _tell_unless_finished(self, study: optuna.Study, trial: optuna.Trial, outcome: Outcome) -> None:
        """:meth:`_tell`, unless another host already finished the trial: it does once this worker's heartbeat
        stopped for ``sweep.resume.stale_after_s`` (the claim was lost), and its verdict stands. Optuna then
        refuses the attributes (UpdateFinishedTrialError) or the tell (ValueError); any other error is raised."""
        try:
            self._tell(study, trial, outcome)
        except (optuna.exceptions.UpdateFinishedTrialError, ValueError) as exc:
            stored = next(t for t in study.get_trials(deepcopy=False) if t.number == trial.number)
            if stored.state not in ledger.FINISHED:
                raise
            logger.warning(
                "trial #%d was already %s by another host (its claim was lost), so its %s outcome is not told: %s",
                trial.number,
                stored.state.name,
                outcome.failure_class,
                exc,
            )

    # --- the loop -----------------------------------------------------------------------------------------

    def _parse(self, spec: SweepConf, base: list[str]) -> tuple[Space, list]:
        """The space and first trials, checked; a space that varies the recipe without its opt-in exits 2."""
        space = Space.parse(spec.params, fixed_keys=[_key(o) for o in run_overrides(base)])
        first = [space.point(values, f"sweep.first_trials[{i}]") for i, values in enumerate(spec.first_trials)]
        if self.project:
            from moe_vlm_sweep.config.compose import CONF_DIR
            from moe_vlm_sweep.sweep.recipe import check_recipe

            try:
                allowed = check_recipe(space, spec.allow_recipe_changes, CONF_DIR)
            except SweepSpecError as exc:
                say(f"error: {exc}", err=True)
                raise SystemExit(2) from None
            for key, fields in allowed.items():
                logger.info(
                    "sweep.params.%s may change the recipe (%s; allowed by sweep.allow_recipe_changes): each "
                    "recipe is ranked separately",
                    key,
                    ", ".join(fields),
                )
        return space, first

    def sweep(self, arguments: list[str]) -> Any:
        """The sweep, with what stops it said in one line: a bad space or storage exits 2, a deliberate stop 1,
        SIGINT/SIGTERM 130/143 after marking the running trial interrupted (the same command resumes). A signal
        whose exception a finalizer swallowed (``launch/stop.py``) still exits 130/143: at the next safe point,
        or at the end if the sweep finished first."""
        if not self.project:
            return self._sweep(arguments)
        with stoppable():  # the handlers stay for the clean-up below, so that a second signal still ends it at once
            try:
                result = self._sweep(arguments)
            except Interrupted as stop:
                self._interrupted(stop)
                raise SystemExit(128 + stop.signum) from None
            except (SweepSpecError, StorageError) as exc:
                say(f"error: {exc}", err=True)
                raise SystemExit(_exit_code(EXIT_INVALID)) from None
            except SweepError as exc:
                say(f"error: {exc}", err=True)
                raise SystemExit(_exit_code(EXIT_STOPPED)) from None
            except (sqlalchemy.exc.SQLAlchemyError, optuna.exceptions.StorageInternalError) as exc:
                url = self.storage or ""
                say(f"error: {storage_problem(exc.__cause__ or exc, url)}", err=True)
                raise SystemExit(_exit_code(EXIT_INVALID)) from None
            late = received()
            if late is not None:
                say(f"sweep: {signal.Signals(late).name} came as the sweep ended; every result is kept", err=True)
                raise SystemExit(128 + late)
            return result

    def _resume_command(self) -> str:
        return shlex.join(["moe-vlm-sweep", "run", "-m", *self.config.hydra.overrides.task])

    def _interrupted(self, stop: Interrupted) -> None:
        """Mark the running trial interrupted and queue it again, close its MLflow run and the parent as KILLED,
        and say how to resume. Storage calls here may fail (the signal can come from a storage outage); what is
        left RUNNING is then recovered by the next run."""
        trial, study, spec = self.current, self.study, self.spec
        where = ""
        try:
            finished = trial is not None and ledger.finished_run(trial, Path(self.config.outputs_dir) / "runs")
            # the worker wrote its result before the signal: keep it (a trial exists only once the spec is loaded)
            if finished and trial is not None and study is not None and spec is not None:
                self._tell(study, trial, outcome_of_result(finished, spec.objective))
                where = f"; trial #{trial.number} had finished and is kept"
            elif trial is not None and study is not None:
                self._tell(
                    study,
                    trial,
                    Outcome(
                        state="fail", failure_class=RunStatus.INTERRUPTED, reason=f"the sweep was stopped by {stop}"
                    ),
                )
                where = f"; trial #{trial.number} marked interrupted"
                if trial.user_attrs.get("claim") == "launch" and "retry_of" not in trial.user_attrs:
                    study.enqueue_trial(trial.params, user_attrs={"retry_of": trial.number}, skip_if_exists=False)
                    where += " and queued to run again"
            if self.tracker is not None:
                self.tracker.close_sweep("KILLED")
        except Exception as exc:
            where += f" (could not record it all: {type(exc).__name__}; the next run recovers it)"
        say(f"sweep: stopped by {stop}{where}. Resume with: {self._resume_command()}", err=True)

    def _sweep(self, arguments: list[str]) -> Any:
        spec = self.spec = load_spec(self.config.get("sweep"))
        self.budget = TimeBudget(spec.time_budget_s)
        base = self.job_overrides(spec, list(arguments))
        if self.project and slurm.is_submitit(self.config.hydra.launcher):
            self._check_slurm_job(base)
        space, first = self._parse(spec, base)
        if self.project:
            preflight.check_objective(spec.objective)
            preflight.check_space(
                lambda o: self.hydra_context.config_loader.load_sweep_config(self.config, o), space, base, first
            )
        choices = self.config.hydra.runtime.choices
        name = study_name(choices.get("sweep") or "sweep", spec, run_overrides(base))
        sweep_dir = self._sweep_dir(name)
        url = self.storage = storage_url(spec, sweep_dir)
        study = self.study = open_study(
            name=name, url=url, spec=spec, lost=(lambda: self._lost_study(name)) if self.project else None
        )
        study.set_user_attr("objective_metrics", spec.objective.metrics)
        with warnings.catch_warnings():  # experimental in Optuna; it is how optuna-dashboard names the objectives
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            study.set_metric_names(spec.objective.metrics)
        self.tracker = self._open_tracker(name, url) if self.project else None
        where = url or "in memory (set sweep.storage to keep it)"
        say(
            f"sweep: study {name} ({spec.n_trials} trials, {' and '.join(spec.objective.directions)} "
            f"{' and '.join(spec.objective.metrics)})\n  optuna storage: {where}"
            + (f"\n  mlflow: {self.tracker.tracking_uri} (moe-vlm-sweep ui)" if self.tracker else "")
        )
        self._recover(study, spec)
        if len(ledger.counted(study.get_trials(deepcopy=False))) < spec.n_trials:
            for point in first:  # skip_if_exists: once per study, across resumes and workers
                study.enqueue_trial(point, skip_if_exists=True)
        for seconds in filter(None, map(wall_seconds, study.get_trials(deepcopy=False, states=ledger.FINISHED))):
            self.budget.saw(seconds)
        failures_in_a_row = duplicates_in_a_row = 0
        # Its own seed stream: TPE's random start draws from seed + len(trials), which the explorer must not replay.
        explorer_seed = EXPLORER_SEED_OFFSET + spec.seed + len(study.get_trials(deepcopy=False))
        explorer, walker = optuna.samplers.RandomSampler(seed=explorer_seed), random.Random(explorer_seed)
        while True:
            raise_if_stopped()
            trials = study.get_trials(deepcopy=False)
            done = len(ledger.counted(trials))
            if done + len(ledger.in_flight(trials, spec.resume.stale_after_s)) >= spec.n_trials:
                break
            if not self.budget.allows():
                say(f"sweep: stopping at {done}/{spec.n_trials} trials: {self.budget.why_not('another trial')}")
                return self._finish(study, spec, sweep_dir)
            with exploring(study, explorer, now=duplicates_in_a_row > 0):
                trial = self.current = study.ask()
                ledger.own(trial)
                if ledger.is_surplus(
                    study.get_trials(deepcopy=False), trial.number, spec.n_trials, spec.resume.stale_after_s
                ):
                    trial.set_user_attr("claim", RunStatus.SURPLUS)
                    self._tell(
                        study,
                        trial,
                        Outcome(
                            state="fail",
                            failure_class=RunStatus.SURPLUS,
                            reason="the study was full when this trial was asked",
                        ),
                    )
                    self.current = None
                    break
                sampled = space.suggest(trial)
            overrides = [*base, *Space.overrides(sampled)]
            trial.set_user_attr("overrides", run_overrides(overrides))
            began = time.monotonic()
            with self.budget.timing():
                outcome = self._run(study, trial, spec, overrides)
            if outcome.run_dir:
                self.trial_seconds.append(time.monotonic() - began)
            self._tell_unless_finished(study, trial, outcome)
            self.current = None
            duplicates_in_a_row = duplicates_in_a_row + 1 if outcome.failure_class == RunStatus.DUPLICATE else 0
            proposal = duplicates_in_a_row and neighbor_of_best(study, space, walker)
            if proposal:  # the next ask takes it; the explorer fills in any param it leaves out
                study.enqueue_trial(proposal[1], user_attrs={"proposed_as": f"one knob from best trial #{proposal[0]}"})
            failures_in_a_row = (
                failures_in_a_row + 1
                if outcome.failure_class in _LAUNCH_FAILURES
                else 0
                if outcome.ok
                else failures_in_a_row
            )
            best = best_trial(study)
            done_now = len(ledger.counted(study.get_trials(deepcopy=False)))
            if self.tracker is not None and best is not None and outcome.ok:
                self.tracker.log_best(done_now, dict(zip(spec.objective.metrics, best.values)))
            say(
                progress.trial_line(
                    done=done_now,
                    total=spec.n_trials,
                    number=trial.number,
                    sampled=sampled,
                    failure_class=outcome.failure_class,
                    values=outcome.values,
                    reason=outcome.reason,
                    metric_names=spec.objective.metrics,
                    best=best,
                    proposed_as=trial.user_attrs.get("proposed_as", ""),
                    left=progress.time_left(self.trial_seconds, spec.n_trials - done_now),
                    contended=outcome.contention,
                )
            )
            if self.stop_reason:
                self._finish(study, spec, sweep_dir, status="FAILED")
                raise SweepError(self.stop_reason)
            if failures_in_a_row >= spec.failure_budget:
                self._finish(study, spec, sweep_dir, status="FAILED")
                raise SweepError(
                    f"stopping: the last {failures_in_a_row} launched trials all failed "
                    f"(sweep.failure_budget={spec.failure_budget}); see their worker.log files, "
                    "fix the space or raise sweep.failure_budget"
                )
            if duplicates_in_a_row >= MAX_DUPLICATES_IN_A_ROW:
                self._finish(study, spec, sweep_dir)
                raise SweepError(
                    f"stopping: {duplicates_in_a_row} samples in a row repeated tried configs; the "
                    f"space looks exhausted before sweep.n_trials={spec.n_trials}"
                )
        return self._finish(study, spec, sweep_dir, confirm=True)

    def _finish(
        self,
        study: optuna.Study,
        spec: SweepConf,
        sweep_dir: Path | None,
        status: str = "FINISHED",
        confirm: bool = False,
    ) -> Any:
        """The sweep's end (table, confirmation, export, report, MLflow close): ``export/finish.py``."""

        def plan(overrides: list[str]) -> Any:
            return plan_trial(self.hydra_context.config_loader.load_sweep_config(self.config, overrides), overrides)

        end = SweepEnd(
            study=study,
            spec=spec,
            sweep_dir=sweep_dir,
            outputs_dir=self.config.outputs_dir if self.project else None,
            plan=plan,
            budget=self.budget,
            tracker=self.tracker,
            project=self.project,
        )
        return end.finish(status=status, confirm=confirm)
