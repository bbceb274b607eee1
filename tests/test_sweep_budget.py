"""sweep.time_budget_s's arithmetic: the slowest trial seen decides whether another one starts."""

from __future__ import annotations

import time

import pytest

from moe_vlm_sweep.sweep.budget import TimeBudget
from moe_vlm_sweep.sweep.spec import SweepSpecError, load_spec


def test_no_budget_always_allows():
    budget = TimeBudget(None)
    budget.saw(1e9)
    assert budget.allows() and budget.allows(1e12)


def test_the_slowest_trial_decides():
    budget = TimeBudget(100.0)
    assert budget.allows()  # nothing seen yet: the first trial always starts
    with budget.timing():
        time.sleep(0.05)
    budget.saw(0.01)
    assert 0.05 <= budget.slowest < 1
    budget.saw(40.0)
    assert budget.allows() and budget.allows(99.0) and not budget.allows(101.0)
    assert budget.why_not("another trial").startswith("another trial would need about 40 s (the slowest trial so far)")
    budget.saw(120.0)
    assert not budget.allows()
    assert "about 30 s (2 short re-runs)" in budget.why_not("confirmation", 30.0, "2 short re-runs")


def test_a_non_positive_budget_is_refused():
    with pytest.raises(SweepSpecError, match=r"sweep.time_budget_s=0.0 must be > 0"):
        load_spec({"time_budget_s": 0})
