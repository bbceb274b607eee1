from __future__ import annotations

import json
from pathlib import Path

import pytest

from moe_vlm_sweep.cli import main


@pytest.fixture
def run_cli(tmp_path, capsys):
    """Run `moe-vlm-sweep run OVERRIDES` in-process with outputs under tmp_path; return (exit code, run dir)."""

    def _run(*overrides: str) -> tuple[int, Path | None]:
        code = main(["run", *overrides, f"outputs_dir={tmp_path}"])
        out = capsys.readouterr().out
        print(out)
        runs = sorted((tmp_path / "runs").glob("*")) if (tmp_path / "runs").exists() else []
        return code, (runs[-1] if runs else None)

    return _run


def read_json(path: Path) -> dict:
    return json.loads(path.read_text())
