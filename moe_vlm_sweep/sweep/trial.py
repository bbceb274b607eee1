"""One trial of a moe-vlm-sweep sweep, on the same path as ``moe-vlm-sweep run``.

compose (Hydra did it) -> drop the ``sweep``/``hydra`` nodes -> ``plan/compose.py: plan_of`` ->
``new_run_dir``/``prepare`` -> ``launch`` -> RunResult. The sweeper calls :func:`plan_trial` before it hands a
config to the launcher, so an invalid one never costs a job (or a cluster queue slot); the task function calls
it again on the launcher's side to get the plan it runs. Nothing here validates on its own.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from moe_vlm_sweep.config.schema import RunConfig
from moe_vlm_sweep.launch.result import RunResult
from moe_vlm_sweep.launch.status import RunStatus
from moe_vlm_sweep.metrics.schema import Metrics
from moe_vlm_sweep.plan.compose import INVALID_ERRORS as INVALID_ERRORS  # the sweeper catches invalid trials by it
from moe_vlm_sweep.plan.compose import plan_of
from moe_vlm_sweep.plan.plan import RunPlan
from moe_vlm_sweep.sweep.spec import ObjectiveConf, SweepSpecError

_CONTROL_KEYS = ("sweep", "hydra")


def _override_key(override: str) -> str:
    return override.lstrip("+~").split("=", 1)[0].strip()


def run_overrides(overrides: Sequence[str]) -> list[str]:
    """The overrides that shape the RunConfig (what ``moe-vlm-sweep run`` needs to rebuild it): the sweep's own
    settings (``sweep=...``, ``sweep.*``) and Hydra's (``hydra.*``, ``hydra/...``) are dropped."""
    kept = []
    for override in overrides:
        key = _override_key(override)
        if key in _CONTROL_KEYS or key.startswith(("sweep.", "hydra.", "hydra/")):
            continue
        kept.append(override)
    return kept


def is_run_config(cfg: DictConfig) -> bool:
    """True for this project's app; other Hydra apps get the generic trial (a returned number)."""
    return OmegaConf.get_type(cfg) is RunConfig


def run_node(cfg: DictConfig) -> DictConfig:
    """A copy of ``cfg`` without the sweep's and Hydra's nodes: exactly what ``moe-vlm-sweep run`` composes."""
    node = copy.deepcopy(cfg)
    with open_dict(node):
        for key in _CONTROL_KEYS:
            node.pop(key, None)
    return node


def plan_trial(cfg: DictConfig, overrides: Sequence[str]) -> tuple[RunPlan, str]:
    """Validate a composed trial config the way ``check`` does; raises one of INVALID_ERRORS with every reason."""
    return plan_of(run_node(cfg), run_overrides(overrides))


def metric_value(metrics: Metrics, name: str) -> Any:
    """The field of ``metrics`` a dotted objective name points at (``step_time_s.median``,
    ``flops_per_step.total.model``); None where there is none."""
    value: Any = metrics
    for part in name.split("."):
        if dataclasses.is_dataclass(value) and part in {f.name for f in dataclasses.fields(value)}:
            value = getattr(value, part)
        elif isinstance(value, Mapping) and part in value:
            value = value[part]
        else:
            return None
    return value


@dataclass(kw_only=True)
class Outcome:
    """What the sweeper tells Optuna and MLflow about one trial."""

    state: str
    """complete | pruned (infeasible: the sampler learns to avoid it) | fail (the sampler ignores it)"""
    failure_class: RunStatus
    """ok, the run's failure class, or the sweep's own: duplicate | interrupted | surplus"""
    values: list[float] | None = None
    reason: str = ""
    metrics: Metrics | None = None
    run_dir: str | None = None

    def __post_init__(self) -> None:
        self.failure_class = RunStatus(self.failure_class)

    @property
    def ok(self) -> bool:
        return self.state == "complete"

    @property
    def contention(self) -> str | None:
        """Who shared the trial's devices while it measured (``metrics.json``'s ``contention``), or None."""
        if self.metrics is None or not self.metrics.contended:
            return None
        from moe_vlm_sweep.train.contention import describe

        return describe(self.metrics.contention.processes if self.metrics.contention else []) or "contended"


CONTENDED_ATTR = "contended"
"""The user attr (and MLflow tag suffix) of a trial measured beside another process: its value names them.
``metrics.json``'s flag of the same name; ``best`` ranks such trials after the uncontended ones."""


def is_contended(trial: Any) -> bool:
    """True for a trial (Optuna's FrozenTrial) that measured beside another process."""
    return bool(trial.user_attrs.get(CONTENDED_ATTR))


# OOM and invalid are properties of the config (the sampler should steer away); crash, timeout and NaN may be
# the machine or the step count, so they are failures Optuna does not learn from. A trial stopped early
# (``sweep/early_stop.py``) is pruned, as Optuna's own pruners report it.
_STATE_OF = {
    RunStatus.OOM: "pruned",
    RunStatus.INVALID: "pruned",
    RunStatus.CRASH: "fail",
    RunStatus.TIMEOUT: "fail",
    RunStatus.NAN: "fail",
    RunStatus.PRUNED: "pruned",
}


def outcome_of_result(result: RunResult, objective: ObjectiveConf) -> Outcome:
    metrics = result.metrics
    if not result.ok or metrics is None:
        return Outcome(
            state=_STATE_OF[result.status], failure_class=result.status, reason=result.reason, run_dir=result.run_dir
        )
    values = []
    for name in objective.metrics:
        value = metric_value(metrics, name)
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            numeric = sorted(
                f.name
                for f in dataclasses.fields(metrics)
                if isinstance(getattr(metrics, f.name), (int, float)) and not isinstance(getattr(metrics, f.name), bool)
            )
            raise SweepSpecError(
                f"sweep.objective.metric={name!r} is not a numeric field of metrics.json "
                f"(numeric fields: {', '.join(numeric)})"
            )
        if not math.isfinite(value):
            return Outcome(
                state="fail",
                failure_class=RunStatus.NAN,
                reason=f"{name}={value} is not finite",
                metrics=metrics,
                run_dir=result.run_dir,
            )
        values.append(float(value))
    return Outcome(state="complete", failure_class=RunStatus.OK, values=values, metrics=metrics, run_dir=result.run_dir)


_LOST_JOB_STATES = {"TIMEOUT": RunStatus.TIMEOUT, "OUT_OF_MEMORY": RunStatus.OOM}
_STREAM_TAIL = 1500
_SUBMITIT_TIME_LIMIT = "Job not requeued because: timed-out"
"""What submitit's job raises when Slurm's time-limit signal came and it did not requeue the job (``timed-out too
many times``, ``timed-out and not checkpointable``): the job ran past its limit, a timeout."""


def outcome_of_lost_job(exc: Exception) -> Outcome:
    """The launcher itself raised: Hydra's submitit launcher re-raises what ``job.results()`` does when the
    scheduler cancelled, preempted or timed the job out, or its node died. The trial fails with the scheduler's
    state (submitit names it, e.g. ``state: TIMEOUT``) and the sweep goes on. The reason keeps submitit's header
    whole and only the end of the job's error stream, so a long log cannot push the state out of it."""
    head, _, stream = f"{type(exc).__name__}: {exc}".partition("Error stream produced:")
    failure_class = next((c for state, c in _LOST_JOB_STATES.items() if f"state: {state}" in head), RunStatus.CRASH)
    if _SUBMITIT_TIME_LIMIT in str(exc):  # submitit ended the job at Slurm's time-limit signal, not requeued
        failure_class = RunStatus.TIMEOUT
    tail = f"\nerror stream (end): {stream.strip()[-_STREAM_TAIL:]}" if stream.strip() else ""
    return Outcome(
        state=_STATE_OF[failure_class],
        failure_class=failure_class,
        reason=f"the launcher lost the job: {head.strip()}{tail}",
    )


def is_rejected_submission(exc: Exception) -> bool:
    """sbatch refused the job (QOS or partition limits, a controller timeout): every next trial's job would be
    refused too, so the sweep stops instead of spending its trials (submitit's ``FailedSubmissionError``, matched
    by name: the sweep does not depend on submitit)."""
    return any(cls.__name__ == "FailedSubmissionError" for cls in type(exc).__mro__)


def outcome_of_value(value: Any, n_objectives: int) -> Outcome:
    """The generic trial (any Hydra app): the task returns a number, or one per objective."""
    values = list(value) if isinstance(value, (list, tuple)) else [value]
    try:
        floats = [float(v) for v in values]
    except (TypeError, ValueError):
        return Outcome(state="fail", failure_class=RunStatus.CRASH, reason=f"the task returned {value!r}, not a number")
    if len(floats) != n_objectives or not all(math.isfinite(v) for v in floats):
        return Outcome(
            state="fail",
            failure_class=RunStatus.NAN if len(floats) == n_objectives else RunStatus.CRASH,
            reason=f"the task returned {value!r}; expected {n_objectives} finite number(s)",
        )
    return Outcome(state="complete", failure_class=RunStatus.OK, values=floats)
