"""RunResult: what the launcher concludes about one run, from the worker's files and the exit status.

``result.json`` holds it, written last; the worker's own ``metrics.json`` or ``failure.json`` ride inside it as
the typed :class:`Metrics` / :class:`Failure`, so every consumer reads fields, never string keys.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moe_vlm_sweep.config.codec import DecodeError, from_dict, to_dict
from moe_vlm_sweep.launch.run_dir import RESULT_FILE, write_json_atomic
from moe_vlm_sweep.launch.status import RUN_STATUSES, RunStatus
from moe_vlm_sweep.metrics.schema import Failure, Metrics

STATUSES = RUN_STATUSES


@dataclass(kw_only=True)
class RunResult:
    status: RunStatus
    """``ok``, a failure class (oom | invalid | crash | timeout | nan), or ``pruned`` (a sweep stopped it early)."""
    reason: str = ""
    run_dir: str | None = None
    returncode: int | None = None
    wall_s: float = 0.0
    metrics: Metrics | None = None
    """The run's ``metrics.json``: set exactly when ``status`` is ``ok``."""
    failure: Failure | None = None
    """The run's ``failure.json``, where the worker wrote one."""

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"status={self.status!r} must be one of {', '.join(STATUSES)}")
        self.status = RunStatus(self.status)
        if self.ok and self.metrics is None:
            raise ValueError("status=ok needs the run's metrics")

    @property
    def ok(self) -> bool:
        return self.status == RunStatus.OK

    def write(self, run_dir: Path) -> None:
        write_json_atomic(run_dir / RESULT_FILE, to_dict(self))

    @classmethod
    def read(cls, run_dir: Path) -> RunResult:
        """``result.json`` of ``run_dir``; raises FileNotFoundError without one, DecodeError for one that does not
        fit (``{}`` for an absent metrics or failure, as earlier versions wrote it, reads as None)."""
        path = Path(run_dir) / RESULT_FILE
        data: dict[str, Any] = json.loads(path.read_text())
        for key in ("metrics", "failure"):
            if data.get(key) == {}:
                data[key] = None
        try:
            return from_dict(cls, data, where=str(path))
        except DecodeError:
            raise
        except ValueError as exc:
            raise DecodeError(f"{path}: {exc}") from None
