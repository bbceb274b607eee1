"""What a person watching a sweep reads: the running trial's steps, one line per trial, then a table of the best
trials."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from optuna.trial import FrozenTrial

from moe_vlm_sweep.console import say
from moe_vlm_sweep.sweep.trial import CONTENDED_ATTR, is_contended


def _fmt(value: float) -> str:
    return f"{value:.4g}"


def config_text(sampled: dict[str, Any]) -> str:
    """A trial's searched knobs as one line (``batch.mbs=2 recompute=none``)."""
    return " ".join(f"{k}={v}" for k, v in sampled.items())


def time_left(seconds_per_trial: Sequence[float], remaining: int) -> str:
    """`` | about 12 min left`` at this process's pace so far (other workers of the study make it shorter)."""
    if not seconds_per_trial or remaining <= 0:
        return ""
    left = sum(seconds_per_trial) / len(seconds_per_trial) * remaining
    return f" | about {left / 60:.0f} min left" if left >= 90 else f" | about {left:.0f} s left"


class StepTail:
    """Echoes the step lines (``[step ...]``) the running trial's worker writes to its ``worker.log`` onto the
    sweep's console, from a daemon thread: the run directory is the task's (``<time>-job<number>-*`` under
    ``runs_dir``), made after this starts."""

    def __init__(self, runs_dir: Path, number: int, interval_s: float = 2.0):
        self.runs_dir, self.number, self.interval_s = runs_dir, number, interval_s
        self.began, self.offset = time.time() - 1, 0
        self.log: Path | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._follow, name=f"steps-{number}", daemon=True)

    def _find(self) -> Path | None:
        found = [d for d in self.runs_dir.glob(f"*-job{self.number}-*") if d.stat().st_mtime >= self.began]
        return max(found, key=lambda d: d.stat().st_mtime) / "worker.log" if found else None

    def _echo(self) -> None:
        self.log = self.log or self._find()
        if self.log is None or not self.log.exists():
            return
        with open(self.log, "rb") as handle:
            handle.seek(self.offset)
            chunk = handle.read()
        complete = chunk[: chunk.rfind(b"\n") + 1]
        self.offset += len(complete)
        for line in complete.decode(errors="replace").splitlines():
            if line.startswith("[step "):
                say(f"  trial #{self.number} {line}")

    def _follow(self) -> None:
        while not self._stop.wait(self.interval_s):
            with contextlib.suppress(OSError):
                self._echo()

    def __enter__(self) -> StepTail:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        with contextlib.suppress(OSError):
            self._echo()  # the steps of the last interval


def trial_line(
    *,
    done: int,
    total: int,
    number: int,
    sampled: dict[str, Any],
    failure_class: str,
    values: Sequence[float] | None,
    reason: str,
    metric_names: Sequence[str],
    best: FrozenTrial | None,
    proposed_as: str = "",
    left: str = "",
    contended: str | None = None,
) -> str:
    config = config_text(sampled) or "(no searched knobs)"
    if proposed_as:
        config += f" ({proposed_as})"
    if values is not None:
        result = "ok " + " ".join(f"{n}={_fmt(v)}" for n, v in zip(metric_names, values))
        if contended:
            result += f" CONTENDED (measured beside {contended})"
    else:
        first = reason.strip().splitlines()[-1] if reason.strip() else ""
        result = f"{failure_class.upper()}" + (f" ({first[:160]})" if first else "")
    line = f"[trial {done}/{total}] #{number} {config} -> {result}"
    if best is not None:
        line += f" | best #{best.number} " + " ".join(f"{n}={_fmt(v)}" for n, v in zip(metric_names, best.values))
    return line + left


def table(trials: Sequence[FrozenTrial], metric_names: Sequence[str], *, realism: str | None) -> str:
    """The top trials, best first, with the values and the searched knobs of each."""
    if not trials:
        return "no successful trial yet"
    rows = [["rank", "trial", *metric_names, "config"]]
    for rank, trial in enumerate(trials, 1):
        config = " ".join(f"{k}={v}" for k, v in trial.params.items())
        mark = "*" if is_contended(trial) else ""
        rows.append([f"{rank}{mark}", f"#{trial.number}", *(_fmt(v) for v in trial.values), config])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r[:-1], widths)) + "  " + r[-1] for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    shared = [t for t in trials if is_contended(t)]
    if shared:
        lines.append(
            "* measured beside another process on its GPUs or cores (ranked after every uncontended trial): "
            + "; ".join(f"#{t.number}: {t.user_attrs[CONTENDED_ATTR]}" for t in shared)
        )
    if realism:
        lines.append(f"data realism of these results: {realism}")
    return "\n".join(lines)
