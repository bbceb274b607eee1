"""The one-way flow: each stage imports only earlier ones, the worker never imports the sweep stack, and only
tracking code imports mlflow."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "moe_vlm_sweep"
STAGES = ("config", "plan", "launch", "data", "model", "train", "metrics", "tracking", "sweep", "export", "cli")
"""The package's folders (and top-level modules) in the order data flows: Hydra config -> validated plan -> launched
run (the worker trains on ``data`` a ``model`` it builds) -> metrics -> tracking -> sweep -> export; ``cli`` is the
entry point over all of them. A module may import its own stage and earlier ones only."""
CONTRACTS = {
    "moe_vlm_sweep.metrics.schema",
    "moe_vlm_sweep.launch.status",
    "moe_vlm_sweep.provenance",
    "moe_vlm_sweep.console",
}
"""Modules any stage may import because they import nothing but the first stage's codec and each other: the result
files' schema, which the worker writes and every later stage reads, the one run-status vocabulary, the version
and git facts every run records, and where a user's output lines and log records go (console.py)."""
CONTRACT_DEPENDENCIES = CONTRACTS | {"moe_vlm_sweep.config.codec"}
"""What a contract may import: the one dataclass codec (config/codec.py, standard library only) and contracts."""


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


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _project_imports(path: Path) -> set[str]:
    """Every module of the package that ``path`` imports, at the top or inside a function."""
    here = _module_name(path).split(".")
    if path.name != "__init__.py":
        here = here[:-1]
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*here[: len(here) - node.level + 1], *([base] if base else [])])
            names.add(base)
            if _stage(base) is None:  # ``from moe_vlm_sweep import train``: the names are the modules
                names |= {f"{base}.{a.name}" for a in node.names}
    return {n for n in names if n == PACKAGE or n.startswith(PACKAGE + ".") or n.split(".")[0] == "hydra_plugins"}


def _stage(module: str) -> int | None:
    parts = module.split(".")
    return STAGES.index(parts[1]) if len(parts) > 1 and parts[1] in STAGES else None


def upward_imports(sources: list[Path]) -> list[str]:
    """``importer -> imported`` for every import of a later stage (or of the Hydra plugin) by the package."""
    found = []
    for path in sources:
        importer = _module_name(path)
        own = _stage(importer)
        for imported in sorted(_project_imports(path)):
            if imported.split(".")[0] == "hydra_plugins":
                found.append(f"{importer} -> {imported} (the plugin is the outermost layer)")
            elif imported not in CONTRACTS and own is not None:
                theirs = _stage(imported)
                if theirs is not None and theirs > own:
                    found.append(f"{importer} -> {imported} ({STAGES[own]} before {STAGES[theirs]})")
    return found


def test_every_module_has_a_stage():
    """A new folder or top-level module must be placed in the order, or the upward check would skip it."""
    modules = {_module_name(p) for p in ROOT.glob(f"{PACKAGE}/**/*.py")} - {PACKAGE}
    unplaced = sorted(m for m in modules if _stage(m) is None and m not in CONTRACTS)
    assert not unplaced, f"add to STAGES or CONTRACTS: {unplaced}"


def test_contracts_import_no_stage():
    for module in CONTRACTS:
        path = ROOT / (module.replace(".", "/") + ".py")
        assert _project_imports(path) <= CONTRACT_DEPENDENCIES, (module, _project_imports(path))


def test_no_stage_imports_a_later_one():
    found = upward_imports(sorted(ROOT.glob(f"{PACKAGE}/**/*.py")))
    assert not found, "\n".join(found)


def test_an_upward_import_is_found(tmp_path, monkeypatch):
    """The walk sees lazy (in-function) and relative imports too: the two forms an upward import hides in."""
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    model = tmp_path / PACKAGE / "model"
    model.mkdir(parents=True)
    (model / "build.py").write_text(
        "def build():\n    from moe_vlm_sweep.train.cpu_compat import apply\n\nfrom ..sweep import study\n"
    )
    (model / "flops.py").write_text("from moe_vlm_sweep.metrics.schema import Metrics\nfrom . import build\n")
    assert upward_imports([model / "build.py", model / "flops.py"]) == [
        "moe_vlm_sweep.model.build -> moe_vlm_sweep.sweep (model before sweep)",
        "moe_vlm_sweep.model.build -> moe_vlm_sweep.train.cpu_compat (model before train)",
    ]
