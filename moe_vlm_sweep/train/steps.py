"""How many steps a run measures: ``train.steps``, or fewer once the step times are steady.

A trial's measured steps are what a sweep pays for; once their coefficient of variation (CV) is at or below
``train.target_cv``, more steps move the median by less than the noise and only cost GPU time. So with
``train.target_cv`` set, measuring stops after the first step at which the CV of all the steps so far is at or below
it, never before ``train.min_steps`` (a CV of two or three steps says little), and never past ``train.steps``
(the ceiling). Without it, a run measures exactly ``train.steps``. The steps after them (the profile steps, and a
census step that had no warm-up step to take) still run.

Every rank must stop at the same step (a rank that stops alone hangs the others in a collective), so each step's
time is the slowest rank's, agreed by one all-reduce of one number after the step's clock has stopped: that is also
how ``metrics.json`` counts a step's time. ``metrics.json``'s ``step_time_s`` says how many steps were measured and
why measuring stopped.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Iterator
from enum import StrEnum

import torch
import torch.distributed as dist

from moe_vlm_sweep.config.schema import TrainConf


class StopReason(StrEnum):
    STEPS = "steps"
    """``train.steps`` measured (the fixed count, or the ceiling before the CV reached its target)."""
    TARGET_CV = "target_cv"
    """The CV of the measured steps reached ``train.target_cv`` after at least ``train.min_steps``."""


def cv(times: list[float]) -> float:
    """Coefficient of variation of step times: population std / mean (0 for fewer than two steps)."""
    if len(times) < 2:
        return 0.0
    mean = statistics.fmean(times)
    return statistics.pstdev(times) / mean if mean else 0.0


class MeasuredSteps:
    """Consulted after each measured step; ``schedule`` drops the measured steps left once it says stop."""

    def __init__(self, train: TrainConf, device: str):
        self.steps, self.min_steps, self.target_cv = train.steps, train.min_steps, train.target_cv
        self.device = device
        self.times: list[float] = []
        self.stop: StopReason | None = None

    def record(self, seconds: float) -> None:
        """One measured step's time on this rank; decides (the same way on every rank) whether to go on."""
        self.times.append(self._slowest_rank(seconds))
        if len(self.times) >= self.steps:
            self.stop = StopReason.STEPS
        elif self.target_cv is not None and len(self.times) >= self.min_steps and cv(self.times) <= self.target_cv:
            self.stop = StopReason.TARGET_CV

    def schedule(self, phases: Iterable[str]) -> Iterator[str]:
        """``phases`` without the measured steps after the stop (read lazily: the stop is decided as steps run)."""
        for phase in phases:
            if phase != "measured" or self.stop is None:
                yield phase

    def _slowest_rank(self, seconds: float) -> float:
        if self.target_cv is None or not dist.is_initialized() or dist.get_world_size() == 1:
            return seconds  # a fixed count needs no agreement
        value = torch.tensor([seconds], dtype=torch.float64, device="cuda" if self.device == "cuda" else "cpu")
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return float(value)
