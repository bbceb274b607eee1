"""The product as a user gets it: a wheel installed into a fresh virtualenv outside the checkout, driven from an
empty folder, writes nothing into its installed package or into the checkout.

The wheel is built from a copy of the tracked files (a build in place would leave ``build/`` and ``*.egg-info``
in the checkout) and installed without its dependencies; the new environment reaches the ones this interpreter
already has through a ``.pth`` file, which adds their folder but not the ``.pth`` files in it, so this
checkout's editable install stays out of sight and the package imported is the wheel's.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FAST_TRAIN = ["train.warmup_steps=1", "train.steps=2", "train.profile_steps=0"]


def _tracked() -> list[str]:
    return subprocess.run(
        ["git", "-C", str(ROOT), "ls-files"], capture_output=True, text=True, check=True
    ).stdout.splitlines()


def _snapshot(root: Path, skip: tuple[Path, ...] = ()) -> dict[str, tuple[int, int]]:
    """Every file under ``root`` (but the ``skip`` folders) with its size and modification time."""
    found = {}
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if Path(folder, d) not in skip]
        for name in files:
            path = Path(folder, name)
            stat = path.lstat()
            found[str(path.relative_to(root))] = (stat.st_size, stat.st_mtime_ns)
    return found


def _changed(before: dict, after: dict) -> list[str]:
    return sorted(k for k in after.keys() | before.keys() if before.get(k) != after.get(k))


def _build_wheel(tmp_path: Path) -> Path:
    source = tmp_path / "source"
    for name in _tracked():
        if (ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path / "dist"),
            str(source),
        ],
        check=True,
        timeout=300,
    )
    (wheel,) = (tmp_path / "dist").glob("moe_vlm_sweep-*.whl")
    return wheel


def _venv(tmp_path: Path, wheel: Path) -> tuple[Path, Path]:
    """(bin folder, site-packages) of a new virtualenv holding only the wheel, its dependencies reachable."""
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True, symlinks=True)
    python = env_dir / "bin" / "python"
    site = Path(
        subprocess.run(
            [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    (site / "_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run(
        [python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)], check=True, timeout=300
    )
    return env_dir / "bin", site


@pytest.mark.slow
def test_the_wheel_runs_from_an_empty_folder_and_writes_nowhere_else(tmp_path):
    wheel = _build_wheel(tmp_path)
    names = zipfile.ZipFile(wheel).namelist()
    shipped = sorted(n for n in _tracked() if n.startswith("moe_vlm_sweep/conf/") and n.endswith(".yaml"))
    assert shipped and [n for n in shipped if n not in names] == []
    assert "hydra_plugins/moe_vlm_sweep_sweeper/_impl.py" in names

    bin_dir, site = _venv(tmp_path, wheel)
    work = tmp_path / "work"
    work.mkdir()
    team = tmp_path / "team_conf" / "model"
    team.mkdir(parents=True)
    (team / "team_moe.yaml").write_text("defaults:\n  - tiny\n  - _self_\nname: team_moe\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MOE_VLM_SWEEP_CONF")}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env['PATH']}", PYTHONUNBUFFERED="1")

    def tool(*args: str, timeout: float = 600) -> str:
        proc = subprocess.run(
            [str(bin_dir / "moe-vlm-sweep"), *args], cwd=work, env=env, capture_output=True, text=True, timeout=timeout
        )
        assert proc.returncode == 0, f"{args}: exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
        return proc.stdout

    where = subprocess.run(
        [bin_dir / "python", "-c", "import moe_vlm_sweep; print(moe_vlm_sweep.__file__)"],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert Path(where.strip()).is_relative_to(site), where

    skip = tuple(p for p in (ROOT / ".git", Path(sys.prefix)) if p.is_relative_to(ROOT))
    installed, checkout = _snapshot(site), _snapshot(ROOT, skip)

    for command in ("check", "run", "best", "ui"):
        assert "usage" in tool(command, "--help").lower()
    assert "valid" in tool("check", "model=tiny")
    assert "valid" in tool("check", "--config-dir", str(team.parent), "model=team_moe")
    tool("run", "model=tiny", *FAST_TRAIN)
    tool("run", "-m", "sweep=cpu_demo", "sweep.n_trials=2")
    (experiment,) = re.findall(r"moe-vlm-sweep run \+experiment=(cpu_demo-\w+_best)\n", tool("best"))
    assert (work / "outputs" / "conf" / "experiment" / f"{experiment}.yaml").is_file()
    tool("run", f"+experiment={experiment}")

    assert _changed(installed, _snapshot(site)) == [], "files written inside the installed package"
    assert _changed(checkout, _snapshot(ROOT, skip)) == [], "files written inside the checkout"
