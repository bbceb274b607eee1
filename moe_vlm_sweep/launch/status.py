"""How a run or a sweep trial ended: the one vocabulary of ``failure.json``, ``result.json``, the sweep's Optuna
user attributes (``failure_class``), MLflow's tags and the confirmation record.

A ``StrEnum``, so each member is the very string those stores hold (``RunStatus.OOM == "oom"``) and values
written before the enum existed still read back.
"""

from __future__ import annotations

import enum


class RunStatus(enum.StrEnum):
    OK = "ok"
    """The run finished and wrote ``metrics.json``."""
    OOM = "oom"
    """Out of device memory: a property of the config (the sampler steers away from it)."""
    INVALID = "invalid"
    """The config breaks a rule (the planner's or the worker's preflight): nothing was measured."""
    CRASH = "crash"
    """Any other exception, a signal, or a worker that exited without a result."""
    TIMEOUT = "timeout"
    """No result within ``train.timeout_s`` (or the scheduler's time limit)."""
    NAN = "nan"
    """The loss or the objective was not finite."""
    PRUNED = "pruned"
    """A sweep's early stop ended the run (``sweep/early_stop.py``)."""
    DUPLICATE = "duplicate"
    """A sweep trial that repeats an earlier trial's config: never launched."""
    INTERRUPTED = "interrupted"
    """A sweep trial cut short by a stopped sweep (Ctrl-C, SIGTERM, a killed job): re-run on resume."""
    SURPLUS = "surplus"
    """A sweep trial asked for after the study was already full: never launched."""
    REALISM = "realism"
    """A confirmation re-run measured another data realism than the study ranks."""


WORKER_FAILURES = (RunStatus.OOM, RunStatus.INVALID, RunStatus.CRASH, RunStatus.TIMEOUT, RunStatus.NAN)
"""The classes the worker itself writes into ``failure.json``."""
RUN_STATUSES = (RunStatus.OK, *WORKER_FAILURES, RunStatus.PRUNED)
"""What the launcher concludes about one run (``result.json``); the rest belong to the sweep and the export."""
