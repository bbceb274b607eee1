"""A sweep process's wall-clock budget (``sweep.time_budget_s``): the end of a Slurm allocation or a GPU lease.

A trial killed at the allocation's end is time spent for nothing, so no trial starts that the slowest trial seen
(the study's finished ones, then this process's) says would overrun the budget; the next run resumes the study.
"""

from __future__ import annotations

import contextlib
import time
from typing import Iterator, Optional


class TimeBudget:
    def __init__(self, seconds: Optional[float]):
        self.deadline = None if seconds is None else time.monotonic() + seconds
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

    def allows(self, runs: int = 1) -> bool:
        """Whether ``runs`` more trials, each as slow as the slowest so far, end within the budget."""
        return runs * self.slowest <= self.left()

    def why_not(self, what: str, runs: int = 1) -> str:
        return (f"{what} would need about {runs * self.slowest:.0f} s ({runs} x the slowest trial so far, "
                f"{self.slowest:.0f} s) and {max(self.left(), 0):.0f} s of sweep.time_budget_s are left; "
                "the same command resumes the study")
