"""The typed ``sweep`` node: what a space file (``conf/sweep/<space>.yaml``) may say.

The space file composes under the ``sweep`` key (``sweep=cpu_demo``), so every field here is overridable on the
command line (``sweep.n_trials=20 sweep.seed=3``). The node is checked once, when the sweep starts, with
messages that name the knob; the search space itself (``params``) is parsed by ``moe_vlm_sweep.sweep.space``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from moe_vlm_sweep.config.typed import to_typed


class SweepSpecError(ValueError):
    """The ``sweep`` node or its search space is malformed; the message names the knob and the rule."""


class SweepError(RuntimeError):
    """The sweep stops on purpose (failure budget spent, mixed data realism, space exhausted); says why."""


@dataclass(kw_only=True)
class ObjectiveConf:
    metric: str = "mfu"
    """A numeric field of metrics.json (dotted for nested ones), e.g. ``mfu`` or
    ``effective_tokens_per_s_per_gpu``."""
    direction: str = "maximize"
    peak_memory: bool = False
    """True: a second objective, ``peak_memory_gib`` minimized (a Pareto front instead of one winner)."""

    def __post_init__(self) -> None:
        if self.direction not in ("maximize", "minimize"):
            raise SweepSpecError(f"sweep.objective.direction={self.direction!r} must be maximize or minimize")

    @property
    def metrics(self) -> list[str]:
        return [self.metric, *(["peak_memory_gib"] if self.peak_memory else [])]

    @property
    def directions(self) -> list[str]:
        return [self.direction, *(["minimize"] if self.peak_memory else [])]


@dataclass(kw_only=True)
class ResumeConf:
    stale: str = "retry"
    """What happens to a trial a killed sweep left RUNNING whose run did not finish: ``retry`` (re-run once with
    the same params; the interrupted trial then no longer counts) or ``fail`` (counted, never re-run). A run
    that finished (its result in the run directory) is kept either way."""
    heartbeat_s: float = 30.0
    """How often a running trial records that its sweep process is alive."""
    stale_after_s: float = 600.0
    """A trial owned by another host whose heartbeat is older than this is stale. Trials owned by this host
    are stale as soon as their sweep process is gone, so a resume right after kill -9 needs no waiting."""

    def __post_init__(self) -> None:
        if self.stale not in ("fail", "retry"):
            raise SweepSpecError(f"sweep.resume.stale={self.stale!r} must be fail or retry")
        if self.heartbeat_s <= 0 or self.stale_after_s <= self.heartbeat_s:
            raise SweepSpecError(
                f"sweep.resume.stale_after_s={self.stale_after_s} must exceed "
                f"sweep.resume.heartbeat_s={self.heartbeat_s} > 0"
            )


@dataclass(kw_only=True)
class EarlyStopConf:
    """Stop measuring a trial that is already clearly worse than the study's best (``sweep/early_stop.py``)."""

    enabled: bool = True
    min_steps: int = 3
    """Measured steps a trial runs before it may be stopped: never on one noisy step."""
    margin: float = 0.10
    """Stopped when even its best measured step so far is worse than the best trial's value by more than this
    fraction (a step's noise only slows it, so its best step is the trial's most favourable estimate)."""

    def __post_init__(self) -> None:
        if self.min_steps < 2:
            raise SweepSpecError(f"sweep.early_stop.min_steps={self.min_steps} must be >= 2: one step is noise")
        if not 0.0 < self.margin < 1.0:
            raise SweepSpecError(f"sweep.early_stop.margin={self.margin} must be in (0, 1)")


@dataclass(kw_only=True)
class SweepConf:
    n_trials: int = 8
    """Finished trials the study should hold, counted across every run and worker of the sweep."""
    seed: int = 0
    """Seeds the sampler. A worker joining a study with trials draws from seed + their count, and concurrent
    workers should get distinct seeds (e.g. ``sweep.seed=$SLURM_ARRAY_TASK_ID``)."""
    study_name: str | None = None
    """None: ``<space>-<hash of params, fixed overrides and objective>``, so re-running a command resumes."""
    storage: str | None = None
    """Optuna storage URL; None: SQLite under the sweep directory. ``postgresql://...`` for many workers."""
    sampler: str = "tpe"
    objective: ObjectiveConf = field(default_factory=ObjectiveConf)
    fixed: Any = None
    """Hydra overrides applied to every trial, override key -> value (``{model: tiny, train.steps: 3}``); part of
    the study identity. A mapping, so a space that extends another lists only the entries it adds or changes.
    Untyped with no default mapping, so that a space still in the old list form composes and reaches the check
    below, which names ``sweep.fixed``; a mapping node would fail inside Hydra's merge with no key named."""
    params: dict[str, Any] = field(default_factory=dict)
    """The search space: knob -> distribution (see ``moe_vlm_sweep.sweep.space``)."""
    first_trials: list[dict[str, Any]] = field(default_factory=list)
    """Configs measured before any sampling, in order, each once per study (param -> value; a param left out is
    sampled): the reliable FSDP reference first, then hand-tuned recipes, so the search starts from what a
    person would run and the report's baseline is a trial of the same study."""
    failure_budget: int = 5
    """Launched trials failing in a row (oom, crash, timeout, nan) that end the sweep."""
    top_k: int = 3
    """Trials in the final table and the export."""
    confirm: int = 0
    """Re-runs of each of the ``top_k`` trials when the sweep ends (as ``best --confirm N``): the exported best is
    the one whose median holds. 0: export the single-measurement ranking."""
    time_budget_s: float | None = None
    """Wall-clock seconds this sweep process may run (the end of its Slurm allocation or machine reservation): it starts
    no trial, and no confirmation, that its slowest trial so far says would overrun them, and stops cleanly;
    the same command resumes. None: no limit."""
    resume: ResumeConf = field(default_factory=ResumeConf)
    allow_recipe_changes: list[str] = field(default_factory=list)
    """Params (or recipe fields, or their groups) the search may vary although they change what is trained
    (``vision``, ``batch.gbs``, ``cuda_graph`` for scopes that drop tokens): without them a space that varies
    a recipe field fails at start (``sweep/recipe.py``), and with them each recipe is ranked separately. Not
    part of the study's name: it permits trials, it does not change them."""
    verify: bool = True
    """After a confirmation, ``moe-vlm-sweep verify`` trains the winner and the study's first trial on the same
    batches and compares their loss and gradient-norm curves (``export/verify.py``); false skips it."""
    verify_steps: int = 30
    """Steps of each of verify's three runs (the reference, its re-split twin, the winner)."""
    early_stop: EarlyStopConf = field(default_factory=EarlyStopConf)
    warm_host: bool = True
    """Fork each trial from a warm trial host that imported torch and megatron-core once
    (``launch/warm_host.py``) instead of starting a fresh interpreter: trials after the first start within about a
    second. Each trial is still a process (group) of its own that a signal to the sweep ends (130/143) and whose
    finished result a resumed sweep adopts. Not under Slurm (``hydra/launcher=submitit_slurm``): there each trial is
    a job of its own, in a fresh process, so a host would pay its imports for that one trial and put one more
    process between Slurm's signals and the trial; trials run fresh. Not part of the study's name."""

    def __post_init__(self) -> None:
        if self.n_trials < 1:
            raise SweepSpecError(f"sweep.n_trials={self.n_trials} must be >= 1")
        if self.sampler not in ("tpe", "random"):
            raise SweepSpecError(f"sweep.sampler={self.sampler!r} must be tpe or random")
        if self.failure_budget < 1:
            raise SweepSpecError(f"sweep.failure_budget={self.failure_budget} must be >= 1")
        if self.top_k < 1:
            raise SweepSpecError(f"sweep.top_k={self.top_k} must be >= 1")
        if self.confirm < 0:
            raise SweepSpecError(f"sweep.confirm={self.confirm} must be >= 0")
        if self.verify_steps < 2:
            raise SweepSpecError(f"sweep.verify_steps={self.verify_steps} must be >= 2")
        if self.time_budget_s is not None and self.time_budget_s <= 0:
            raise SweepSpecError(f"sweep.time_budget_s={self.time_budget_s} must be > 0 (or null: no limit)")
        self.fixed = {} if self.fixed is None else self.fixed
        if not isinstance(self.fixed, dict):
            raise SweepSpecError(
                f"sweep.fixed must map override keys to values ({{model: tiny, train.steps: 3}}), "
                f"not {type(self.fixed).__name__} {self.fixed!r}"
            )
        for key, value in self.fixed.items():
            if isinstance(value, dict):
                raise SweepSpecError(
                    f"sweep.fixed.{key} is a mapping; an override's value is a scalar or a list, "
                    f"so write dotted keys ({key}.<field>: value)"
                )


def load_spec(node: DictConfig | dict | None) -> SweepConf:
    """Typed SweepConf from the composed ``sweep`` node (None: all defaults, for apps without a space file)."""

    def wrap(exc: OmegaConfBaseException) -> SweepSpecError:
        return SweepSpecError(f"sweep: {exc}".replace("full_key: ", "full_key: sweep."))

    try:
        merged = OmegaConf.merge(OmegaConf.structured(SweepConf), node if node is not None else {})
    except OmegaConfBaseException as exc:
        cause = exc.__cause__ or exc.__context__
        raise (cause if isinstance(cause, SweepSpecError) else wrap(exc)) from None
    return to_typed(merged, own_error=SweepSpecError, wrap=wrap)
