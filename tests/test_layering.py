"""The one-way flow: the worker never imports the sweep stack, and only tracking code imports mlflow."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_only_tracking_imports_mlflow():
    sources = [*ROOT.glob("moe_vlm_sweep/**/*.py"), *ROOT.glob("hydra_plugins/**/*.py")]
    importers = {p.relative_to(ROOT).as_posix() for p in sources if "mlflow" in _imports(p)}
    assert importers and all(p.startswith("moe_vlm_sweep/tracking/") for p in importers), importers


def test_worker_import_closure_has_no_sweep_stack():
    code = (
        "import sys; import moe_vlm_sweep.train.worker, moe_vlm_sweep.train.loop, moe_vlm_sweep.model.build, "
        "moe_vlm_sweep.data, moe_vlm_sweep.train.cpu_compat; "
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('optuna', 'mlflow', 'hydra')); "
        "assert not bad, bad"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
