"""What a person watching a sweep reads: one line per trial, then a table of the best trials."""

from __future__ import annotations

from typing import Any, Optional, Sequence

from optuna.trial import FrozenTrial


def _fmt(value: float) -> str:
    return f"{value:.4g}"


def trial_line(*, done: int, total: int, number: int, sampled: dict[str, Any], failure_class: str,
               values: Optional[Sequence[float]], reason: str, metric_names: Sequence[str],
               best: Optional[FrozenTrial], proposed_as: str = "") -> str:
    config = " ".join(f"{k}={v}" for k, v in sampled.items()) or "(no searched knobs)"
    if proposed_as:
        config += f" ({proposed_as})"
    if values is not None:
        result = "ok " + " ".join(f"{n}={_fmt(v)}" for n, v in zip(metric_names, values))
    else:
        first = reason.strip().splitlines()[-1] if reason.strip() else ""
        result = f"{failure_class.upper()}" + (f" ({first[:160]})" if first else "")
    line = f"[trial {done}/{total}] #{number} {config} -> {result}"
    if best is not None:
        line += f" | best #{best.number} " + " ".join(f"{n}={_fmt(v)}" for n, v in zip(metric_names, best.values))
    return line


def table(trials: Sequence[FrozenTrial], metric_names: Sequence[str], *, realism: Optional[str]) -> str:
    """The top trials, best first, with the values and the searched knobs of each."""
    if not trials:
        return "no successful trial yet"
    rows = [["rank", "trial", *metric_names, "config"]]
    for rank, trial in enumerate(trials, 1):
        config = " ".join(f"{k}={v}" for k, v in trial.params.items())
        rows.append([str(rank), f"#{trial.number}", *(_fmt(v) for v in trial.values), config])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r[:-1], widths)) + "  " + r[-1] for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    if realism:
        lines.append(f"data realism of these results: {realism}")
    return "\n".join(lines)
