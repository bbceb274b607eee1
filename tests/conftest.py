from __future__ import annotations

import json
from pathlib import Path

import pytest

from moe_vlm_sweep.cli import main


def run_in(outputs: Path, *overrides: str) -> tuple[int, Path | None]:
    """Run `moe-vlm-sweep run OVERRIDES` in-process with outputs under ``outputs``; return (exit code, run dir)."""
    code = main(["run", *overrides, f"outputs_dir={outputs}"])
    runs = sorted((outputs / "runs").glob("*")) if (outputs / "runs").exists() else []
    return code, (runs[-1] if runs else None)


@pytest.fixture
def run_cli(tmp_path, capsys):
    """``run_in`` under tmp_path, echoing the CLI's output into the test's report."""

    def _run(*overrides: str) -> tuple[int, Path | None]:
        result = run_in(tmp_path, *overrides)
        print(capsys.readouterr().out)
        return result

    return _run


def read_json(path: Path) -> dict:
    return json.loads(path.read_text())
