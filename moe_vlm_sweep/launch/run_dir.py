"""The run directory: everything needed to read, trust and replay one run.

Layout: ``config.yaml`` (resolved), ``overrides.yaml``, ``plan.json``, ``command.sh`` (the exact re-run command),
``worker.log``, ``progress.jsonl`` (each measured step as it ends), then ``metrics.json`` or ``failure.json`` from
the worker and ``result.json`` from the launcher.
``result.json`` is written last and atomically: a directory without it is an interrupted run, never a result.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import shlex
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from moe_vlm_sweep.plan.plan import RunPlan

RESULT_FILE = "result.json"
PROGRESS_FILE = "progress.jsonl"
"""One JSON line per measured step as it ends (rank 0): what a sweep's early stop reads while the run goes on."""
WORKER_LOG = "worker.log"


def new_run_dir(outputs_dir: str | Path, prefix: str = "run") -> Path:
    """A fresh, unique directory, so no file of an earlier run can be mistaken for this one's."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = Path(outputs_dir) / "runs" / f"{stamp}-{prefix}-{secrets.token_hex(3)}"
    path.mkdir(parents=True, exist_ok=False)
    return path


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_json_atomic(path: Path, data: Any) -> None:
    write_atomic(path, json.dumps(data, indent=2, sort_keys=False) + "\n")


def rerun_command(overrides: Sequence[str]) -> str:
    return shlex.join(["moe-vlm-sweep", "run", *overrides])


def overrides_yaml(overrides: Sequence[str]) -> str:
    """``overrides.yaml``: the overrides as a YAML list, as Hydra's own ``.hydra/overrides.yaml``, one per line
    (no folding) so it reads like the command; any quotes or spaces inside an override survive a load."""
    return yaml.safe_dump(list(overrides), default_flow_style=False, width=math.inf)


def prepare(run_dir: Path, plan: RunPlan, resolved_yaml: str) -> None:
    write_atomic(run_dir / "config.yaml", resolved_yaml)
    write_atomic(run_dir / "overrides.yaml", overrides_yaml(plan.overrides))
    plan.write(run_dir / "plan.json")
    write_atomic(
        run_dir / "command.sh", "#!/bin/sh\n# Re-runs this exact config.\n" + rerun_command(plan.overrides) + "\n"
    )
