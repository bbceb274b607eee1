"""Stop measuring a loser early: a trial's measured steps go to Optuna as intermediate values while it runs,
and a trial already clearly worse than the study's best is stopped and told to Optuna as PRUNED.

The worker appends each measured step to ``progress.jsonl`` (its time and the throughput fields of
``metrics.json`` for that step); the launcher calls :class:`EarlyStop` about once a second while the worker runs.
The rule (``sweep.early_stop``): after at least ``min_steps`` measured steps, even the trial's *best* step so far
is worse than the best finished trial's objective by more than ``margin``. Noise on a step only slows it, so the
best step is the trial's most favourable estimate, and one slow step can never stop a trial. Single-objective
sweeps only (Optuna keeps no intermediate values for several objectives), and only for an objective the
progress lines carry (throughput, MFU/HFU; not ``peak_memory_gib``).

The launcher reads the rule through :func:`active`: the sweeper sets it around a trial with :func:`watching`,
and the trial's task (in the sweep's process, with Hydra's basic launcher) passes it to ``launch``.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import math
from collections.abc import Callable, Iterator
from pathlib import Path

import optuna
from optuna.trial import TrialState

from moe_vlm_sweep.launch.run_dir import PROGRESS_FILE
from moe_vlm_sweep.sweep.spec import SweepConf

Watch = Callable[[Path], str | None]
_active: contextvars.ContextVar[Watch | None] = contextvars.ContextVar("early_stop", default=None)


def active() -> Watch | None:
    return _active.get()


@contextlib.contextmanager
def watching(watch: Watch | None) -> Iterator[None]:
    token = _active.set(watch)
    try:
        yield
    finally:
        _active.reset(token)


def read_progress(run_dir: Path) -> list[dict]:
    """The measured steps so far; a line being written (no newline yet) is left for the next read."""
    try:
        text = (run_dir / PROGRESS_FILE).read_text()
    except OSError:
        return []
    return [json.loads(line) for line in text.splitlines(keepends=True) if line.endswith("\n")]


class EarlyStop:
    """The rule for one trial, against the best finished trial when it started."""

    def __init__(
        self,
        *,
        trial: optuna.Trial,
        metric: str,
        maximize: bool,
        best: tuple[int, float] | None,
        min_steps: int,
        margin: float,
    ):
        self.trial, self.metric, self.maximize, self.best = trial, metric, maximize, best
        self.min_steps, self.margin, self.reported = min_steps, margin, 0

    @classmethod
    def for_trial(cls, study: optuna.Study, trial: optuna.Trial, spec: SweepConf) -> EarlyStop | None:
        if not spec.early_stop.enabled or len(spec.objective.metrics) != 1:
            return None
        maximize = spec.objective.directions[0] == "maximize"
        done = [
            t
            for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
            if t.values and math.isfinite(t.values[0])
        ]
        top = (max if maximize else min)(done, key=lambda t: t.values[0], default=None)
        return cls(
            trial=trial,
            metric=spec.objective.metrics[0],
            maximize=maximize,
            best=(top.number, top.values[0]) if top else None,
            min_steps=spec.early_stop.min_steps,
            margin=spec.early_stop.margin,
        )

    def verdict(self, values: list[float]) -> str | None:
        """Why the trial stops, or None: the rule on the objective's per-step values."""
        if self.best is None or len(values) < self.min_steps:
            return None
        number, best = self.best
        favourable = max(values) if self.maximize else min(values)
        bound = best * (1 - self.margin) if self.maximize else best * (1 + self.margin)
        worse = favourable < bound if self.maximize else favourable > bound
        if not worse:
            return None
        return (
            f"stopped early after {len(values)} measured steps: its best step's {self.metric}={favourable:.4g} "
            f"is more than {self.margin:.0%} {'below' if self.maximize else 'above'} best trial "
            f"#{number}'s {best:.4g} (sweep.early_stop)"
        )

    def __call__(self, run_dir: Path) -> str | None:
        steps = read_progress(run_dir)
        values = [float(s[self.metric]) for s in steps if isinstance(s.get(self.metric), (int, float))]
        for step in range(self.reported, len(values)):  # the running median, as metrics.json will rank it
            ordered = sorted(values[: step + 1])
            middle = len(ordered) // 2
            median = ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2
            self.trial.report(median, step + 1)
        self.reported = len(values)
        return self.verdict(values)
