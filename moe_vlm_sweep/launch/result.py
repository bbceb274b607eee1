"""RunResult: what the launcher concludes about one run, from the worker's files and the exit status."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from moe_vlm_sweep.launch.run_dir import RESULT_FILE, write_json_atomic

STATUSES = ("ok", "oom", "invalid", "crash", "timeout", "nan", "pruned")


@dataclass(kw_only=True)
class RunResult:
    status: str
    """``ok``, a failure class (oom | invalid | crash | timeout | nan), or ``pruned`` (a sweep stopped it early)."""
    reason: str = ""
    run_dir: str | None = None
    returncode: int | None = None
    wall_s: float = 0.0
    metrics: dict[str, Any] = field(default_factory=dict)
    failure: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"status={self.status!r} must be one of {', '.join(STATUSES)}")

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def write(self, run_dir: Path) -> None:
        write_json_atomic(run_dir / RESULT_FILE, asdict(self))

    @classmethod
    def read(cls, run_dir: Path) -> RunResult:
        return cls(**json.loads((run_dir / RESULT_FILE).read_text()))
