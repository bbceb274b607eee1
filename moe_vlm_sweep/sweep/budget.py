"""A sweep process's wall-clock budget (``sweep.time_budget_s``): the end of a Slurm allocation or a reservation.

A trial killed at the allocation's end is time spent for nothing, so no trial starts that the slowest trial seen
(the study's finished ones, then this process's) says would overrun the budget, and no confirmation re-run that
the trial it repeats says would; the next run resumes the study and the confirmation.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

from optuna.trial import FrozenTrial


class TimeBudget:
    def __init__(self, seconds: float | None, knob: str = "sweep.time_budget_s"):
        self.deadline = None if seconds is None else time.monotonic() + seconds
        self.knob = knob
        """What set the budget, for messages."""
        self.slowest = 0.0
        """Wall seconds of the slowest trial seen (0 before the first)."""

    @contextlib.contextmanager
    def timing(self) -> Iterator[None]:
        began = time.monotonic()
        try:
            yield
        finally:
            self.saw(time.monotonic() - began)

    def saw(self, seconds: float) -> None:
        """A trial's wall time: this process's, or a finished one of the study when it resumes."""
        self.slowest = max(self.slowest, seconds)

    def left(self) -> float:
        return float("inf") if self.deadline is None else self.deadline - time.monotonic()

    def allows(self, seconds: float | None = None) -> bool:
        """Whether ``seconds`` more (by default one trial as slow as the slowest so far) end within the budget."""
        return (self.slowest if seconds is None else seconds) <= self.left()

    def why_not(self, what: str, seconds: float | None = None, basis: str | None = None) -> str:
        need, basis = (self.slowest, "the slowest trial so far") if seconds is None else (seconds, basis)
        return (
            f"{what} would need about {need:.0f} s ({basis}) and {max(self.left(), 0):.0f} s of "
            f"{self.knob} are left; the same command resumes the study"
        )


def wall_seconds(trial: FrozenTrial) -> float | None:
    """How long a finished, launched trial took in the study's records (None for one never launched)."""
    if not (trial.user_attrs.get("run_dir") and trial.datetime_start and trial.datetime_complete):
        return None
    return (trial.datetime_complete - trial.datetime_start).total_seconds()
