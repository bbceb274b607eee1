"""The lines a user reads as the product's output: the worker's step line and result summary, the sweep's trial
lines, tables and ``best:``/``report:`` lines, the commands' answers and their ``error: ...`` lines. They go
through :func:`say` so there is one place that decides where output goes. Everything else (warnings, diagnostics)
goes through :mod:`logging`: Hydra configures it for a sweep (``hydra.hydra_logging``/``hydra.job_logging``), and
:func:`configure_logging` does for the plain processes (the worker, the commands, the launcher script)."""

from __future__ import annotations

import logging
import sys

PACKAGE_LOGGERS = ("moe_vlm_sweep", "hydra_plugins")
"""Ours log at INFO; the libraries underneath (megatron-core, torch, MLflow) stay at WARNING so their INFO chatter
does not bury a trial's log."""


def say(line: str, *, err: bool = False) -> None:
    """Write ``line`` to stdout (stderr with ``err``), flushed at once so it interleaves in order with a child
    process's output in the same log and reaches a person watching a long run as it happens."""
    print(line, file=sys.stderr if err else sys.stdout, flush=True)


def help_summary(doc: str | None) -> str:
    """A command's ``--help`` description: its module docstring's first paragraph on one line (argparse wraps
    it again), so a first sentence that runs over two lines is not cut off."""
    return " ".join((doc or "").split("\n\n", 1)[0].split())


def configure_logging(prefix: str = "") -> None:
    """One stderr handler for a process Hydra does not configure; ``force`` replaces what a forked warm host left
    behind, so each trial's records reach its own log. ``prefix`` names the process in a shared log."""
    logging.basicConfig(level=logging.WARNING, format=f"{prefix}%(levelname)s %(name)s: %(message)s", force=True)
    for name in PACKAGE_LOGGERS:
        logging.getLogger(name).setLevel(logging.INFO)
