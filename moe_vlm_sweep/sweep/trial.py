"""One trial of a moe-vlm-sweep sweep, on the same path as ``moe-vlm-sweep run``.

compose (Hydra did it) -> drop the ``sweep``/``hydra`` nodes -> ``to_run_config`` -> ``make_plan`` ->
``new_run_dir``/``prepare`` -> ``launch`` -> RunResult. The sweeper calls :func:`plan_trial` before it hands a
config to the launcher, so an invalid one never costs a job (or a cluster queue slot); the task function calls
it again on the launcher's side to get the plan it runs. Nothing here validates on its own.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from moe_vlm_sweep.config.compose import CompositionError, to_run_config
from moe_vlm_sweep.config.schema import ConfigFieldError, RunConfig
from moe_vlm_sweep.launch.result import RunResult
from moe_vlm_sweep.plan.plan import RunPlan, make_plan
from moe_vlm_sweep.plan.rules import ConfigError
from moe_vlm_sweep.sweep.spec import ObjectiveConf, SweepSpecError

INVALID_ERRORS = (CompositionError, ConfigFieldError, ConfigError)
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
    node = run_node(cfg)
    return make_plan(to_run_config(node), run_overrides(overrides)), OmegaConf.to_yaml(node)


def metric_value(metrics: dict[str, Any], name: str) -> Any:
    value: Any = metrics
    for part in name.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


@dataclass(kw_only=True)
class Outcome:
    """What the sweeper tells Optuna and MLflow about one trial."""

    state: str
    """complete | pruned (infeasible: the sampler learns to avoid it) | fail (the sampler ignores it)"""
    failure_class: str
    """ok | invalid | oom | crash | timeout | nan | pruned (stopped early) | duplicate | interrupted"""
    values: list[float] | None = None
    reason: str = ""
    metrics: dict[str, Any] = field(default_factory=dict)
    run_dir: str | None = None

    @property
    def ok(self) -> bool:
        return self.state == "complete"

    @property
    def contention(self) -> str | None:
        """Who shared the trial's devices while it measured (``metrics.json``'s ``contention``), or None."""
        if not self.metrics.get(CONTENDED_ATTR):
            return None
        from moe_vlm_sweep.train.contention import describe

        return describe((self.metrics.get("contention") or {}).get("processes", [])) or "contended"


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
    "oom": "pruned",
    "invalid": "pruned",
    "crash": "fail",
    "timeout": "fail",
    "nan": "fail",
    "pruned": "pruned",
}


def outcome_of_result(result: RunResult, objective: ObjectiveConf) -> Outcome:
    if not result.ok:
        return Outcome(
            state=_STATE_OF[result.status], failure_class=result.status, reason=result.reason, run_dir=result.run_dir
        )
    values = []
    for name in objective.metrics:
        value = metric_value(result.metrics, name)
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            numeric = sorted(k for k, v in result.metrics.items() if isinstance(v, (int, float)))
            raise SweepSpecError(
                f"sweep.objective.metric={name!r} is not a numeric field of metrics.json "
                f"(numeric fields: {', '.join(numeric)})"
            )
        if not math.isfinite(value):
            return Outcome(
                state="fail",
                failure_class="nan",
                reason=f"{name}={value} is not finite",
                metrics=result.metrics,
                run_dir=result.run_dir,
            )
        values.append(float(value))
    return Outcome(state="complete", failure_class="ok", values=values, metrics=result.metrics, run_dir=result.run_dir)


_LOST_JOB_STATES = {"TIMEOUT": "timeout", "OUT_OF_MEMORY": "oom"}
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
    failure_class = next((c for state, c in _LOST_JOB_STATES.items() if f"state: {state}" in head), "crash")
    if _SUBMITIT_TIME_LIMIT in str(exc):  # submitit ended the job at Slurm's time-limit signal, not requeued
        failure_class = "timeout"
    tail = f"\nerror stream (end): {stream.strip()[-_STREAM_TAIL:]}" if stream.strip() else ""
    return Outcome(
        state=_STATE_OF[failure_class],
        failure_class=failure_class,
        reason=f"the launcher lost the job: {head.strip()}{tail}",
    )


def is_refused_submission(exc: Exception) -> bool:
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
        return Outcome(state="fail", failure_class="crash", reason=f"the task returned {value!r}, not a number")
    if len(floats) != n_objectives or not all(math.isfinite(v) for v in floats):
        return Outcome(
            state="fail",
            failure_class="nan" if len(floats) == n_objectives else "crash",
            reason=f"the task returned {value!r}; expected {n_objectives} finite number(s)",
        )
    return Outcome(state="complete", failure_class="ok", values=floats)
