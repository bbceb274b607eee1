"""Every benchmark script imports (they import each other as top-level modules from benchmarks/)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.mark.parametrize("name", sorted(p.stem for p in BENCHMARKS.glob("*.py")))
def test_benchmark_imports(name):
    code = f"import sys; sys.path.insert(0, {str(BENCHMARKS)!r}); import {name}"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.slow
def test_compare_configs_runs_a_tiny_config_and_writes_its_table(tmp_path):
    """The script every GPU result goes through, end to end on the CPU: one real run, its row in the JSON."""
    out = tmp_path / "compare.json"
    proc = subprocess.run(
        [
            sys.executable,
            "compare_configs.py",
            "--outputs",
            str(tmp_path / "runs"),
            "--out",
            str(out),
            "--common",
            "model=tiny hardware=cpu train.steps=2 train.profile_steps=0",
            "--config",
            "mbs1=batch.mbs=1",
        ],
        cwd=BENCHMARKS,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    (row,) = result["runs"]
    assert row["status"] == "ok" and row["graphed_layers"] == 0 and row["loss"]["values"][-1] > 0
    assert result["table"].splitlines()[2].startswith("mbs1 | ok | ")
